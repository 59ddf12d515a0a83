"""Format version 2 resident on the GPU: a cache tensor on the device -> the whole .cgen
file in a uint8 device tensor, and back, through kernels/cuda_pipeline.py.  The bytes are
the CPU's (methods/transform.encode_v2); decoding gives the CPU's values and makes every
check of docs/format.md's reader rules.

Encoding runs the stages of the CPU path as device kernels

  [statistics -> steps]  ->  levels + per-chunk level statistics  ->  table choice  ->
  histogram  ->  codes and CDFs  ->  table sharing  ->  range coding  ->  the file's sections

with one host synchronisation whatever the cache's size, at the end, for the file's size
(one more with the finiteness check that builds the cache, storage/kvio.check_finite: one
kernel, one flag per layer back; one more for keys coded without their RoPE, whose steps the
host makes from the sums).  The steps and offsets are made on the device from the
per-coordinate sums, a calibration's allocation included (kernels/cuda_pipeline.plane_steps,
with kernels/allocation.py's logarithms and exponentials: the CPU's bits).  The records are
placed on the device too (kernels/cuda_pipeline.layout_records: positions from the streams'
sizes; write_frame: chunk headers, index, trailer; put_file_crcs), in a buffer as large as
the largest file the sizes allow, of which the file is then copied out.

Decoding parses the header, descriptor, Params block and index on the host (only those
bytes are copied), gathers the 40-byte chunk headers, decodes and dequantizes on the device, and copies back one small table of check results; when a check
fails, the CPU reader reruns on the file so that the error is exactly the CPU's.

Covered: methods 2 (transform, refinement, sink tokens, token deltas, a calibration's
rotation) and 3 (lossless).  A rotation is one more kernel on each side (rotate_blocks: the
rotated float64 rows, which the statistics and levels kernels then read as their value
words; on decoding the float32 values, rotated back).  Under numba's CUDA
simulator the same code runs on CPU tensors (the kernels get numpy views): that is how
``make test`` checks that both devices write the same bytes.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import OrderedDict

import numpy as np
import torch

from ..format import container
from ..methods.config import TransformConfig
from ..format.container import FileHeader
from ..errors import FormatError
from ..kernels.coding_params import PROB_BITS, max_stream_bytes
from ..kernels.tables import SYMBOL_COST
from ..kernels.transform import STATS_BLOCK
from ..storage.kvio import EXPONENT_WORDS, DTYPE_BY_NAME, KVCache, check_finite
from ..format.params import ITEMSIZE, METHOD_LOSSLESS, METHOD_TRANSFORM, bf16_values
from ..methods import rope as rope_methods
from . import staging

_FMT = {"float32": 0, "bfloat16": 1, "float16": 2}
_TORCH_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a word of n bytes
_LOCK = threading.RLock()  # the cached constants below are shared between calls
_COST: dict = {}
_HEAD_DTYPE = np.dtype([("magic", "S4"), ("index", "<u4"), ("first_token", "<u4"), ("token_count", "<u4"),
                        ("raw_size", "<u4"), ("cdf_size", "<u4"), ("lengths_size", "<u4"), ("payload_size", "<u4"),
                        ("reserved", "<u4"), ("crc", "<u4")])


#: Set by benchmarks to a callable taking a stage name: called after each stage's launches,
#: so CUDA events can time the stages (pipeline/lmcache_device.STAGE_HOOK's convention).
STAGE_HOOK = None


def _mark(name: str) -> None:
    if STAGE_HOOK is not None:
        STAGE_HOOK(name)


def _k():
    from ..kernels import cuda_pipeline

    return cuda_pipeline


def _k1():
    from ..kernels import cuda as cuda_kernels

    return cuda_kernels


def _real_gpu() -> bool:
    from numba import config

    return bool(torch.cuda.is_available()) and not config.ENABLE_CUDASIM


def device() -> torch.device:
    """Where the pipeline's tensors live: the GPU, or the CPU under numba's simulator."""
    return torch.device("cuda") if _real_gpu() else torch.device("cpu")


_VIEWS: "OrderedDict[tuple, object]" = OrderedDict()


def _nb(t: torch.Tensor):
    """What a kernel takes for a tensor: a numba view of a CUDA tensor (no sync), a numpy view
    of a CPU tensor (simulator).

    Making a numba view costs tens of microseconds of Python, and with ~80 arrays per call
    that host time is the GPU's too while it waits for launches; the views are cached by
    what they describe (address, shape, strides, dtype) and hold no reference to the tensor,
    so a cached view is exactly a view of whichever live tensor has that description (torch's
    caching allocator hands the same blocks back call after call).  Hence the rule: a tensor a
    kernel gets must be named (alive) until its launch is queued, never a temporary made in the
    argument list (tests/test_device_pipeline.py checks this file for such calls)."""
    if not t.is_cuda:
        return t.numpy()
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
    view = _VIEWS.get(key)
    if view is None:
        from numba import cuda

        view = cuda.from_cuda_array_interface(t.__cuda_array_interface__, owner=None, sync=False)
        _VIEWS[key] = view
        if len(_VIEWS) > 1024:
            _VIEWS.popitem(last=False)
    return view


#: Device copies of the last rotations used ((digest, device, transposed, fixed) -> tensor): a full
#: Llama-sized rotation is 268 MB, whose upload (and, for decoding, transpose) would cost more
#: than the rest of a call.
_ROTATIONS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
ROTATIONS_KEPT = 2


def _device_rotation(rot: np.ndarray, digest: bytes, dev: torch.device, transposed: bool,
                     fixed: bool = False) -> torch.Tensor:
    """rot ([L, 2, H, D, D] blocks) on ``dev``, each block transposed when ``transposed``; with
    ``fixed``, the fixed-point rotation's integers instead (kernels/fixed_rotation.fixed_matrix,
    float64)."""
    key = (digest, str(dev), transposed, fixed)
    t = _ROTATIONS.get(key)
    if t is None:
        if fixed:
            from ..kernels.fixed_rotation import fixed_matrix_kept

            t = fixed_matrix_kept(rot, digest, transposed).to(dev)
        else:
            t = torch.from_numpy(rot).to(dev)
            if transposed:
                t = t.transpose(-1, -2).contiguous()
        _ROTATIONS[key] = t
        while len(_ROTATIONS) > ROTATIONS_KEPT:
            _ROTATIONS.popitem(last=False)
    _ROTATIONS.move_to_end(key)
    return t


def _matmul_digits(rot: np.ndarray, digest: bytes, dev: torch.device, transposed: bool):
    """The fixed-point rotation's int8 digits on ``dev`` (kernels/fixed_rotation_matmul.
    rotation_digits) and, for the decoder's transposed blocks, their column sums; None when the
    matrix-unit kernels do not run here (no Triton, a block too small, CACHEGEN_ROTATION_MATMUL=0):
    the caller takes the float64 product instead (the same bits)."""
    from ..kernels import fixed_rotation_matmul as fm

    if not fm.runs_on(dev) or not fm.supports(int(rot.shape[3])):
        return None
    key = (digest, str(dev), transposed, "digits")
    t = _ROTATIONS.get(key)
    if t is None:
        rint = _device_rotation(rot, digest, dev, transposed, fixed=True)
        t = (fm.rotation_digits(rint), fm.column_sums(rint) if transposed else None)
        _ROTATIONS[key] = t
        while len(_ROTATIONS) > 2 * ROTATIONS_KEPT:
            _ROTATIONS.popitem(last=False)
    _ROTATIONS.move_to_end(key)
    return t


def _rope_angles(rope, t_first: int, T: int, dev: torch.device):
    """fixed_rotation_matmul.RopeAngles of ``rope`` (format.params.Rope) for the rows t_first ..
    T - 1, made on ``dev`` (cuda_pipeline.rope_angles)."""
    from ..kernels import fixed_rotation_matmul as fm

    n = T - t_first
    shape = (rope.inv_freq.shape[0], n, rope.rotary_dim // 2)
    freq_d = _to_device(np.ascontiguousarray(rope.inv_freq, np.float64), dev)
    sin_d = _empty(shape, torch.float64, dev)
    cos_d = _empty(shape, torch.float64, dev)
    _k().rope_angles(_nb(freq_d), rope, t_first, n, _nb(sin_d), _nb(cos_d))
    return fm.RopeAngles(sin_d, cos_d, rope.style, rope.head_dim, rope.rotary_dim)


def supports(cfg: TransformConfig, calibration) -> bool:
    """True when this pipeline encodes with ``cfg`` and ``calibration``: every quality, with or
    without a calibration (lossless with one is the caller's error)."""
    return not (cfg.method == "lossless" and calibration is not None)


def _cost(dev: torch.device) -> torch.Tensor:
    key = str(dev)
    t = _COST.get(key)
    if t is None:
        t = _COST[key] = torch.from_numpy(SYMBOL_COST).to(dev)
    return t


def _empty(shape, dtype, dev):
    return torch.empty(shape, dtype=dtype, device=dev)


def _int64_view(t: torch.Tensor, C: int):
    """t [..., C] (one byte per value) viewed as int64 words [..., C / 8], or a placeholder
    when C is not a multiple of 8."""
    if C % 8 == 0 and t.numel():
        return t.view(torch.int64)
    return torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=t.device)


def _to_device(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A host array on ``dev``, its copy queued without stalling the host (pipeline/staging)."""
    return staging.to_device(a, dev)


def _upload(parts: list[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    """Small host int64 arrays to the device in one copy."""
    return staging.upload_int64(parts, dev)


def _upload_arrays(parts: list[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    """Host arrays of any dtypes to the device in one copy, as views of their shapes."""
    return staging.upload_arrays(parts, dev)


# ---------------------------------------------------------------- encoding


def encode(cache: KVCache, cfg: TransformConfig, chunk_tokens: int, calibration=None,
           checked: bool = True, copy_out: bool = True) -> tuple[torch.Tensor, int]:
    """The .cgen file of ``cache`` (format version 2; rotated by ``calibration``'s rotation when
    one is given) as a uint8 tensor on the device, and its payload bytes (the streams).
    ``checked=False``: the cache's values were not checked finite (kvio.from_tensors(check=
    False)); the pipeline then checks them in its first pass over the values, and raises
    kvio.check_finite's error.  ``copy_out=False``: the file as a view of the larger buffer it
    was written in (no device copy), for a caller that copies it to the host at once."""
    with _LOCK:
        return _encode(cache, cfg, chunk_tokens, calibration, checked, copy_out)


#: Whether the fixed-point product makes the levels itself (CACHEGEN_PRODUCT_LEVELS=0 / 1 overrides):
#: off, as measured on an H100 on 2026-12-07 (docs/benchmarks.md, "2026-12-07 (evening)"): the
#: statistics it then waits for cost more than the levels pass it saves.
PRODUCT_LEVELS = False


#: The second stream of each GPU (torch's streams are made without the legacy default stream's
#: implicit ordering, so work on it runs beside the pipeline's; the events order it, so calls
#: from several threads may share it: their side work then runs one after another).
_SIDE_STREAMS: dict = {}


def _side_stream(dev: torch.device):
    """(torch stream, numba stream) of ``dev``'s second stream (_SIDE_STREAMS)."""
    from numba import cuda

    key = dev.index if dev.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(key)
    if side is None:
        stream = torch.cuda.Stream(dev)
        side = _SIDE_STREAMS[key] = (stream, cuda.external_stream(stream.cuda_stream))
    return side


def _input_sums(jobs: list, sink: int, dev: torch.device, side: bool = True):
    """(sums, done): for each job (values [L, 2 or 1, T, C] as raw words or float32, their
    itemsize and format, P: 2 for both planes, 1 for the keys alone), the sums and sums of
    squares of tokens sink.. (cuda_pipeline.transform_stats: sums [2, L, 2, C] each, a keys-alone
    job's value entries left unwritten), on a second stream on a GPU (``done``: the event the
    caller's stream waits for before reading them; the inputs must stay allocated until then),
    inline otherwise or without ``side`` (``done`` None)."""
    k = _k()
    stream = 0
    if side and dev.type == "cuda":
        side = _side_stream(dev)
        side[0].wait_stream(torch.cuda.current_stream(dev))  # the values are on the device
        stream = side[1]
    else:
        side = None
    out = []
    for src, itemsize, fmt, P in jobs:
        L, _, T, C = src.shape
        V = k.lanes(C, itemsize, k.WIDTH["levels"])
        w = src.view(torch.int16 if itemsize == 2 else torch.int32).view(_TORCH_WORD[V * itemsize])
        part = _empty((2, L, P, -(-T // STATS_BLOCK), C), torch.float64, dev)
        sums = _empty((2, L, 2, C), torch.float64, dev)
        k.transform_stats(_nb(w), itemsize, fmt, sink, _nb(part[0]), _nb(part[1]), _nb(sums[0]), _nb(sums[1]),
                          stream=stream)
        if side is not None:
            for t in (src, part, sums):
                t.record_stream(side[0])  # their blocks go back to the allocator only after this work
        out.append(sums)
    if side is None:
        return out, None
    done = torch.cuda.Event()
    done.record(side[0])
    return out, done


def _raw_key_sums(words: torch.Tensor, itemsize: int, dt: str, sink: int, dev: torch.device):
    """(sums, done): the key planes' sums and sums of squares of the cache as it is (sums [2, L,
    2, C]: the values' entries left for the caller), on a second stream on a GPU (``done``: the
    event the caller's stream waits for before reading them), inline otherwise (``done`` None)."""
    (sums,), done = _input_sums([(words, itemsize, _FMT[dt], 1)], sink, dev)
    return sums, done


def _nonfinite(cache: KVCache) -> None:
    """Raise check_finite's error for a cache whose pass found a NaN or an Inf."""
    check_finite(cache.data)
    raise FormatError("internal error: a non-finite value was flagged but not found")  # pragma: no cover


def _encode(cache: KVCache, cfg: TransformConfig, chunk_tokens: int, calibration,
            checked: bool, copy_out: bool = True) -> tuple[torch.Tensor, int]:
    from ..methods import transform as tc
    from ..format.params import check_rotated_range

    k = _k()
    dev = device()
    x = cache.data.to(dev).contiguous()
    L, _, T, C = x.shape
    ct = chunk_tokens
    K = -(-T // ct)
    G = container.choose_group_v2(ct, C)
    groups = -(-C // G)
    per = L * 2 * groups
    n = K * per
    dt = cache.dtype_name
    itemsize = ITEMSIZE[dt]
    words = x.view(torch.int16 if itemsize == 2 else torch.int32)
    lossless = cfg.method == "lossless"
    _mark("start")
    q = _empty((L, 2, T, C), torch.uint8 if lossless else torch.int8, dev)
    V = k.lanes(C, itemsize, k.WIDTH["levels"])  # channels per thread of the token-walking kernels
    wv = words.view(_TORCH_WORD[V * itemsize])
    qv = q.view(_TORCH_WORD[V])
    stats = _empty((L, 2, K, C, 6), torch.int32, dev)
    sink = R = bits = 0
    nraw = 0
    digest = bytes(32)
    rope = None
    if not checked and not lossless and x.dtype == torch.float16:
        check_finite(x)  # the kernels read float16's all-ones exponent as a finite power of two
        checked = True
    # [layers with a NaN or an Inf (lossless), a sum not finite, a sink token not finite]
    bad = torch.zeros(L + 2, dtype=torch.int32, device=dev)
    step_bits_d = None
    if lossless:
        nraw = itemsize - 1
        k.split_levels(_nb(wv), itemsize, 8 * nraw, ct, _nb(qv), _nb(stats), 0 if checked else EXPONENT_WORDS[x.dtype][1],
                       _nb(bad[:L]))
        _mark("levels")
        method, allow_delta, fixed = METHOD_LOSSLESS, False, b""
        ref = torch.zeros((1, 1, 1, 1), dtype=torch.uint8, device=dev)
    else:
        sink = min(cfg.sink_tokens, T)
        rot_h, digest = tc.encoder_rotation(calibration, L, C)
        rope = rope_methods.resolve(cache, cfg, calibration)
        vitem, fmt = itemsize, _FMT[dt]
        x32 = None
        fixed_rot = bool(rot_h.size) and tc.FIXED_ROTATION
        digits = _matmul_digits(rot_h, digest, dev, False) if fixed_rot else None
        # The matrix units' rotation turns the keys back in the pass that finds its rows' exponents
        # (fixed_rotation_matmul.rotate_rows).
        from ..kernels import fixed_rotation_matmul as fm

        rope_in_pass = rope is not None and digits is not None and fm.turns(rope.head_dim)
        # The keys' own sums (their step and the finiteness check) read only the cache: queued
        # first, on a second stream, they overlap the turning pass and the product below (with
        # the RoPE turned in the product's pass, the pass of the rows' sums makes them)
        rope_sums, rope_done = (_raw_key_sums(words, itemsize, dt, sink, dev) if rope is not None and not rope_in_pass
                                else (None, None))
        # The fixed-point rotation's offsets and steps come from the rows before it
        # (methods/transform.rotated_step_params): their sums are made on the second stream,
        # beside the product, from the values it reads (keys turned back by their RoPE).
        in_sums = in_done = None
        if rope is not None and not rope_in_pass:
            # The keys without their RoPE (float32) replace the cache's words as the kernels' values;
            # the step still comes from the keys as they are (rms_sums below).
            if fm.runs_on(dev) and fm.turns(rope.head_dim) and T > sink:  # one pass from the cache's words (Triton)
                x32 = _empty((L, 2, T, C), torch.float32, dev)
                x32[:, :, :sink] = x[:, :, :sink]  # (read by no kernel, but never garbage)
                src = (words if x.dtype == torch.bfloat16 else x if x.dtype == torch.float32
                       else x.to(torch.float32))  # torch's conversion (exact), as the CPU's
                angles = _rope_angles(rope, sink, T, dev)
                fm.turn_rows(src, angles, sink, x32, False)
                del src, angles
            else:
                x32 = x.to(torch.float32, copy=True)  # torch's conversion (exact), as the CPU's
                freq_d = _to_device(np.ascontiguousarray(rope.inv_freq, np.float64), dev)
                k.turn_keys(_nb(x32), _nb(freq_d), rope, 0, sink, False)
            vitem, fmt = 4, _FMT["float32"]
            V = k.lanes(C, 4, k.WIDTH["levels"])
            wv = x32.view(torch.int32).view(_TORCH_WORD[V * 4])
            qv = q.view(_TORCH_WORD[V])
            _mark("keys without RoPE")
        R, bits = tc.refine_plan(cfg, T, sink)
        ref = _empty((L, 2, max(R, 1), C), torch.uint8, dev)
        # The steps on the device (kernels/cuda_pipeline.plane_steps, the CPU's arithmetic, a
        # calibration's allocation included; keys without their RoPE take their RMS from the keys
        # as they are, rope_sums): nothing waits for them; their bits are copied into the Params
        # block on the device (after the coder).
        m_d = _empty((L, 2, C), torch.float32, dev)
        steps_d = _empty((L, 2), torch.float64, dev)
        step_bits_d = _empty((L * 2 * (C + 1),), torch.int32, dev)  # steps', then offsets' bfloat16 bits
        # Named, not temporaries: a numba view holds no reference, and a tensor freed before
        # the launch is queued can be handed to the next allocation (here the scratch), so
        # the kernel would read one through the other (seen on the H200: rel and the scratch
        # of a 16-channel cache shared a block, and the steps came out wrong).
        sens = tc.plane_sensitivity(cfg, calibration)
        rel_d, sens_d = _upload_arrays([np.asarray(cfg.steps_table(L), np.float64),
                                        np.zeros(0) if sens is None else np.asarray(sens, np.float64)], dev)
        if sens is None:
            sens_d = None
        resid_d = _empty((L, 2, C), torch.float64, dev)
        scratch_d = _empty((4, 2 * L), torch.float64, dev)
        rms_bits_d = rms_offs_d = None
        if rope is not None:  # the keys' own offsets: computed for their RMS, not stored
            rms_bits_d = _empty((L, 2, C), torch.int32, dev)
            rms_offs_d = _empty((L, 2, C), torch.float32, dev)
        rotated = None
        if fixed_rot:
            means_d = _empty((L, 2, C), torch.float32, dev)
            mu_d = _empty((L, 2, C), torch.float64, dev)
            rotated = (_nb(_device_rotation(rot_h, digest, dev, False, fixed=True)), _nb(means_d), _nb(mu_d))
        held = []  # the sums the steps' launch reads, kept to the end of the call

        def statistics():
            """The sums the steps come from: [2, L, 2, C], or with a RoPE [4, L, 2, C] (then the
            keys' own sums in 2 and 3)."""
            nonlocal rope_sums
            if in_sums is not None:  # the rows' sums before the rotation
                if in_done is not None:
                    torch.cuda.current_stream(dev).wait_event(in_done)  # on the device: the host goes on
                sums = in_sums[-1]
                if rope_in_pass:  # the keys turned back, the values' from the cache's words (and
                    sums[:, :, 1] = in_sums[0][:, :, 1]  # the keys' own, for their step: rope_sums)
                    rope_sums = in_sums[0]
            else:
                sums = _empty((2, L, 2, C), torch.float64, dev)
                part = _empty((2, L, 2, -(-T // STATS_BLOCK), C), torch.float64, dev)
                k.transform_stats(_nb(wv), vitem, fmt, sink, _nb(part[0]), _nb(part[1]), _nb(sums[0]),
                                  _nb(sums[1]))
                del part
            if rope is not None:
                # The keys' own sums, for their step (and the finiteness check); the values' RMS from
                # their coded sums (methods/transform.step_params).
                if rope_done is not None:
                    torch.cuda.current_stream(dev).wait_event(rope_done)  # on the device: the host goes on
                rope_sums[:, :, 1] = sums[:, :, 1]
                sums = torch.cat([sums, rope_sums])
            _mark("statistics")
            return sums

        def make_steps(sums):
            held.append(sums)
            rms_sums = None if rope is None else (_nb(sums[2]), _nb(sums[3]), _nb(rms_bits_d), _nb(rms_offs_d))
            k.plane_steps(_nb(sums[0]), _nb(sums[1]), T - sink, tc.BF16_MAX, _nb(rel_d),
                          _nb(step_bits_d[2 * L :].view(L, 2, C)), _nb(m_d), _nb(step_bits_d[: 2 * L].view(L, 2)),
                          _nb(steps_d), _nb(resid_d), _nb(scratch_d), _nb(bad[L : L + 1]),
                          allocation=None if sens_d is None else (_nb(sens_d), tc.ALLOCATION_STRENGTH, tc.MIN_STEP,
                                                                  tc.ALLOCATION_MAX_STEP),
                          rms_sums=rms_sums, rotated=rotated)
            _mark("steps (device)")

        # With PRODUCT_LEVELS the product makes the levels of the chunks without refined tokens
        # itself (rotate_rows' levels: int8 levels written in place of float32 values; fix_levels
        # then decides the few float32 does not and makes their statistics), once the steps are
        # queued before it; else the input sums run beside the product and quantize_levels reads
        # its values.  The same bytes either way.
        k_lev = (T - R) // ct if R else K  # the chunks before the first with a refined token
        fused = (digits is not None and int(rot_h.shape[3]) <= fm.RESIDENT_BLOCK and k_lev > 0
                 and os.environ.get("CACHEGEN_PRODUCT_LEVELS", "1" if PRODUCT_LEVELS else "0") != "0")
        if fixed_rot:
            # The rows rotated by integer products (kernels/fixed_rotation; the product on cuBLAS,
            # exact): float32 values replace the cache's words, as the CPU's fixed_rotate.
            from ..kernels.fixed_rotation import block_product

            if x32 is None:
                # a bfloat16 cache's own words (widened exactly in the kernel), else float32 values
                x32 = (words if x.dtype == torch.bfloat16 else x if x.dtype == torch.float32
                       else x.to(torch.float32))  # torch's conversion, as the CPU's
            y = _empty((L, 2, T, C), torch.float32, dev)
            y[:, :, :sink].zero_()  # the sink tokens' rows: read by no kernel, but never garbage
            x32 = x32.contiguous()
            x32_item, x32_fmt = (2, _FMT["bfloat16"]) if x32.dtype == torch.int16 else (4, _FMT["float32"])
            if rope_in_pass:
                # the cache's words (the values', and the keys' own sums for their step) and the
                # keys turned back (float32, the product's rows), once the pass before it is queued
                keys_t = _empty((L, 1, T, C), torch.float32, dev)
                jobs = [(x32, x32_item, x32_fmt, 2), (keys_t, 4, _FMT["float32"], 1)]
            else:
                keys_t = None
                jobs = [(x32, x32_item, x32_fmt, 2)]

            early = None
            if fused and rope_in_pass:
                # the cache's words' sums need no earlier pass: on the second stream from the
                # start, beside the keys' turning pass (the turned keys' sums follow it)
                early = _input_sums(jobs[:1], sink, dev)

            def queue_sums():
                # beside the product, or (fused) before it, with the steps the product reads
                nonlocal in_sums, in_done
                if in_sums is None:
                    if early is not None:
                        later, _ = _input_sums(jobs[1:], sink, dev, side=False)
                        in_sums, in_done = early[0] + later, early[1]
                    else:
                        in_sums, in_done = _input_sums(jobs, sink, dev, side=not fused)
                    if fused:
                        make_steps(statistics())

            levels = None
            if fused:
                levels = (q, m_d, steps_d, float(cfg.rounding), k_lev * ct)
            if digits is not None:
                # rows, integer product and values in one pass on the matrix units (the keys turned
                # back by their RoPE in the pass before it)
                angles = _rope_angles(rope, sink, T, dev) if rope_in_pass else None
                fm.rotate_rows(x32, digits[0], sink, y, rope=angles, keys=keys_t, ready=queue_sums, levels=levels)
                queue_sums()  # (no rows past the sink: no product, and sums of nothing)
                del angles
            else:
                queue_sums()
                Xr = _empty((L, 2, T - sink, C), torch.float64, dev)
                er = _empty((L, 2, T - sink), torch.int32, dev)
                k.fixed_rows(_nb(x32), sink, _nb(Xr), _nb(er))
                rint = _device_rotation(rot_h, digest, dev, False, fixed=True)
                Yr = block_product(Xr, rint)
                del Xr
                k.fixed_rows_out(_nb(Yr), _nb(er), sink, _nb(y))
                del Yr
            del x32
            vitem, fmt = 4, _FMT["float32"]
            V = k.lanes(C, 4, k.WIDTH["levels"])
            wv = y.view(torch.int32).view(_TORCH_WORD[V * 4])
            qv = q.view(_TORCH_WORD[V])
            _mark("fixed-point rotation")
        elif rot_h.size:
            # The rotated rows (float64) replace the cache's words as the kernels' values.
            if x32 is None:
                x32 = x if x.dtype == torch.float32 else x.to(torch.float32)  # torch's conversion, as the CPU's
            y = _empty((L, 2, T, C), torch.float64, dev)
            k.rotate_blocks(_nb(x32), _nb(_device_rotation(rot_h, digest, dev, False)), sink, _nb(y))
            del x32
            vitem, fmt = 8, k.FMT_FLOAT64
            V = 1
            wv = y.view(torch.int64)
            qv = q.view(_TORCH_WORD[V])
            _mark("rotation")
        if not fused:
            make_steps(statistics())
        in_sums = keys_t = jobs = early = None
        if not checked and sink:
            # the sink tokens, stored as they are: not in the sums (a sum not finite flags the rest)
            bad[L + 1 :].copy_((~torch.isfinite(x[:, :, :sink])).any().reshape(1))
        fixed = None  # the Params block's steps and offsets: made on the device
        if fused:  # (eight levels a thread: the pass reads one byte a value)
            k.fix_levels(_nb(q.view(_TORCH_WORD[k.lanes(C, 1, k.WIDTH["levels"])])), _nb(y), sink, _nb(m_d),
                         _nb(steps_d), float(cfg.rounding), ct, k_lev, _nb(stats))
        if not fused or k_lev < K:
            k.quantize_levels(_nb(wv), vitem, fmt, sink, _nb(m_d), _nb(steps_d), float(cfg.rounding), T - R, bits,
                              ct, _nb(qv), _nb(ref), _nb(stats), k_first=k_lev if fused else 0)
        method, allow_delta = METHOD_TRANSFORM, cfg.token_delta
        _mark("levels")
        if rot_h.size or rope is not None:
            wv = words.view(_TORCH_WORD[k.lanes(C, itemsize, k.WIDTH["levels"]) * itemsize])  # the raw sections' words
            y = x32 = None
    modes = _empty((L, 2, C), torch.uint8, dev)
    lo = _empty((L, 2, C), torch.int32, dev)
    alphabet = _empty((L, 2, C), torch.int32, dev)
    k.choose_tables(_nb(stats), allow_delta, T, _nb(modes), _nb(lo), _nb(alphabet))
    lob = _empty((2, L, 2, C), torch.uint8, dev)  # [own lo, lo coded with]: symbol bytes
    dmb = _empty((L, 2, C), torch.uint8, dev)
    k.symbol_bytes(_nb(lo), _nb(modes), _nb(lob[0]), _nb(dmb))
    counts = torch.zeros((L, 2, C, 256), dtype=torch.int32, device=dev)
    Vh = k.lanes(C, 1, k.WIDTH["histogram"])
    k.histogram(_nb(q.view(_TORCH_WORD[Vh])), _nb(lob[0]), _nb(dmb), ct, _nb(counts))
    codes = _empty((L, 2, C, 256), torch.uint8, dev)
    cum = _empty((L, 2, C, 257), torch.int32, dev)
    k.build_tables(_nb(counts), _nb(alphabet), _nb(codes), _nb(cum))
    shared = _empty((L, 2, C), torch.uint8, dev)
    refc = _empty((L, 2, C), torch.int32, dev)
    k.share_tables(_nb(counts), _nb(lo), _nb(alphabet), _nb(modes), _nb(cum), _nb(_cost(dev)), _nb(shared), _nb(refc))
    _mark("tables")
    tab = _empty((L, 2, C, 257), torch.int32, dev)
    lo_eff = _empty((L, 2, C), torch.int32, dev)
    alphabet_eff = _empty((L, 2, C), torch.int32, dev)
    lut_unused = _empty((1, 1, 1, 1), torch.uint8, dev)  # named: see plane_steps' call
    k.coder_tables(_nb(cum), _nb(refc), _nb(lo), _nb(alphabet), _nb(tab), _nb(lo_eff), _nb(alphabet_eff),
                   _nb(lut_unused))
    k.symbol_bytes(_nb(lo_eff), _nb(modes), _nb(lob[1]), _nb(dmb))
    slots = _empty((n, -(-max_stream_bytes(ct * G) // 8) * 8), torch.uint8, dev)  # rows of whole words
    lengths = _empty((n,), torch.int32, dev)
    k.encode_streams(_nb(q), _nb(_int64_view(q, C)), _nb(lob[1]), _nb(dmb), _nb(_int64_view(lob[1], C)),
                     _nb(_int64_view(dmb, C)), _nb(tab), ct, G, _nb(slots), _nb(lengths))
    # The levels and the coder's tables are read by no later kernel: their blocks go back to the
    # allocator (stream-ordered) before the file's buffer below is taken, so the call's peak is
    # the cache + the stream slots + that buffer.
    del q, qv, tab, counts, cum
    _mark("range coding")
    incl = torch.cumsum(lengths, 0, dtype=torch.int64)
    entry = torch.where(shared.bool(), 1, 3 + (alphabet + 1) // 2).reshape(-1).to(torch.int64)
    tincl = torch.cumsum(entry, 0)
    excl = incl - lengths
    texcl = tincl - entry

    # The layout: header | descriptor | Params | records | index | trailer.  What does not
    # depend on the streams' sizes is made here; the records' places, the frame (chunk headers,
    # index, trailer, params_size) and the CRC-32s are made on the device from the sizes it
    # has (kernels/cuda_pipeline.layout_records), so that the host waits once, at the end, for
    # the file's size: nothing here waits for the coder.
    desc = json.dumps(cache.descriptor(), separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode("utf-8")
    sink_bytes = 2 * L * sink * C * itemsize
    refine = (struct.pack("<IB", R, bits) if R else b"") + (b"" if lossless or rope is None else rope.pack())
    flags = ((container.FLAG_REFINED if R else 0) | (container.FLAG_ROTATED if digest != bytes(32) else 0)
             | (container.FLAG_ROPE if not lossless and rope is not None else 0)
             | (container.FLAG_FIXED_ROTATION if digest != bytes(32) and tc.FIXED_ROTATION else 0))
    params_at = 64 + len(desc)
    fixed_len = len(fixed) if fixed is not None else 32 + 4 * L + 4 * L * C  # digest, steps, offsets
    tables_at = params_at + fixed_len + sink_bytes + len(refine)
    raw = raw_sizes(L, C, T, ct, nraw, R, bits)
    raw_first = np.concatenate([[0], np.cumsum(raw)]).astype(np.int64)
    fixed_size = fixed_len + sink_bytes + len(refine)
    hb = container.CHUNK_HEADER.size
    tail_bytes = 12 + 8 * K + container.TRAILER.size
    # The largest file these sizes allow: every table entry at its largest, every stream at
    # max_stream_bytes (the buffer's end past the real file is never read).
    params_max = fixed_size + L * 2 * C * (3 + 257 // 2)
    payload_max = n * max_stream_bytes(ct * G)
    total_max = params_at + params_max + int(raw.sum()) + K * (hb + 2 * per) + payload_max + tail_bytes
    head60 = container.FILE_HEADER_V2.pack(
        container.MAGIC, container.FORMAT_VERSION_2, container.FILE_HEADER_V2.size, len(desc), T, L, C, ct, K, G,
        container.DTYPE_CODES[dt], container.LAYOUT_CODES[cache.layout], method, PROB_BITS,
        container.CDF_CODING_SHARED, flags, 0, sink, 0, 0)[:-4]  # params_size: write_frame
    head_bytes = head60 + bytes(4) + desc + (fixed if fixed is not None else digest)
    # the host's bytes in place by one kernel: header .. fixed Params (or its digest), the
    # refinement record
    host = np.frombuffer(head_bytes + refine, np.uint8)
    src_first = np.array([0, len(head_bytes), len(head_bytes) + len(refine)], np.int64)
    dst_at = np.array([0, params_at + fixed_len + sink_bytes], np.int64)
    raw_d, raw_first_d, host_d, src_first_d, dst_at_d = _upload_arrays([raw, raw_first, host, src_first, dst_at], dev)
    lay = _empty((k.layout_size(K),), torch.int64, dev)
    k.layout_records(_nb(incl), _nb(tincl), _nb(raw_d), per, hb, fixed_size, params_at, tail_bytes, _nb(lay))
    rec_at_d, rec_sizes_d, raw_at_d, lengths_at_d, payload_at_d = (lay[i * K : (i + 1) * K] for i in range(5))
    seg_first_d = lay[6 * K : 7 * K + 1]
    scalars = lay[7 * K + 1 :]
    out = _empty((total_max,), torch.uint8, dev)
    out_nb = _nb(out)
    k.write_tables(out_nb, tables_at, _nb(texcl), _nb(shared), _nb(modes), _nb(lo), _nb(alphabet), _nb(codes))
    k.write_streams(out_nb, _nb(out[: total_max // 4 * 4].view(torch.int32)), _nb(payload_at_d), _nb(lengths_at_d),
                    _nb(lengths), _nb(excl), per, _nb(slots), _nb(slots.view(torch.int32)))
    del slots  # (stream-ordered: its block may serve a later allocation once the copy has run)
    k.write_raw(out_nb, _nb(raw_at_d), _nb(raw_first_d), ct, T - R, bits, _nb(ref), _nb(wv), itemsize, nraw,
                int(raw_first[-1]))
    k.scatter_bytes(out_nb, _nb(host_d), _nb(src_first_d), _nb(dst_at_d), int(src_first[-1]))
    if fixed is None:  # the steps' and offsets' bfloat16 bits, as the device made them
        o = params_at + 32
        out[o : o + 2 * step_bits_d.numel()] = step_bits_d.to(torch.int16).view(torch.uint8)
    if sink:
        o = params_at + fixed_len
        out[o : o + sink_bytes] = x[:, :, :sink].contiguous().view(torch.uint8).reshape(-1)
    k.write_frame(out_nb, _nb(lay), _nb(raw_d), per, ct, T, container.CHUNK_MAGIC, container.INDEX_MAGIC,
                  container.TRAILER_MAGIC, 48)
    _mark("layout (device)")
    k1 = _k1()
    crc = torch.zeros(K, dtype=torch.int64, device=dev)
    words = _words64(out)
    k1.crc32_chunks(out_nb, words, _nb(rec_at_d), _nb(rec_sizes_d), _nb(seg_first_d), _nb(crc),
                    _segments_max(K, hb + 2 * per + raw, payload_max))
    k1.put_crcs(out_nb, _nb(rec_at_d), _nb(crc))
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    k.put_file_crcs(out_nb, words, _nb(lay), K, len(desc), params_max, _nb(acc))
    _mark("CRC-32s")
    back = [scalars[k.LAY_TOTAL : k.LAY_TOTAL + 1], scalars[k.LAY_PAYLOAD : k.LAY_PAYLOAD + 1], bad.to(torch.int64)]
    range_checked = fixed is None and rot_h.size
    if range_checked:
        back.append(_rotated_range_exceeded(step_bits_d, L, C))
    back_h = torch.cat(back).to("cpu", non_blocking=dev.type == "cuda")
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()  # the one wait of a call: the file's size
    back_h = back_h.numpy()
    if back_h[2 : L + 4].any():
        _nonfinite(cache)
    if range_checked and back_h[L + 4]:  # (after the work: an error path) the host's check says which plane
        sb = step_bits_d.cpu().numpy().astype("<u2")
        check_rotated_range(sb[: 2 * L].reshape(L, 2), sb[2 * L :].reshape(L, 2, C))
        raise FormatError("internal error: the device's rotated-range check and the host's disagree")  # pragma: no cover
    total, payload_total = int(back_h[0]), int(back_h[1])
    _mark("size to the host (sync)")
    return (out[:total].clone() if copy_out else out[:total]), payload_total


def _rotated_range_exceeded(step_bits: torch.Tensor, L: int, C: int) -> torch.Tensor:
    """int64 [1]: 1 when format.params.check_rotated_range would refuse the steps' and offsets'
    bfloat16 bits (int32 [2 L + 2 L C], steps first), on the device: 128 x step + the largest
    |offset| of a plane past float32's range (the same float64 arithmetic, NaN compares false)."""
    from ..format.params import FLOAT32_MAX

    vals = ((step_bits & 0xFFFF) << 16).view(torch.float32).to(torch.float64)
    top = 128.0 * vals[: 2 * L] + vals[2 * L :].abs().reshape(L * 2, C).amax(-1)
    return (top > FLOAT32_MAX).any().to(torch.int64).reshape(1)


def _segments_max(K: int, fixed_sizes: np.ndarray, payload_max: int) -> int:
    """An upper bound on crc32_chunks' segments for K records (wherever they start) of
    fixed_sizes[k] + payload bytes each (payloads summing to <= payload_max): 2 a record, plus
    one per CHUNK_CRC_SEGMENT of body and one for each record's partial segment."""
    seg = _k1().CHUNK_CRC_SEGMENT
    body = int(np.sum(fixed_sizes)) + payload_max
    return 3 * K + -(-body // seg) + 1


def raw_sizes(L: int, C: int, T: int, ct: int, nraw: int, refine_tokens: int, bits: int) -> np.ndarray:
    """Bytes of each chunk's raw section (FileHeader.section_sizes' first value, for all
    chunks at once): the lossless low bytes, or the refined tokens' packed indices."""
    t0 = np.arange(-(-T // ct), dtype=np.int64) * ct
    tk = np.minimum(ct, T - t0)
    if nraw:
        return 2 * L * tk * C * nraw
    if refine_tokens:
        refined = np.maximum(0, t0 + tk - np.maximum(t0, T - refine_tokens))
        return -(-(2 * L * refined * C * bits) // 8)
    return np.zeros(t0.size, np.int64)


def _words64(t: torch.Tensor):
    """The first len // 8 bytes of a uint8 tensor as int64 words (aligned), or None."""
    n = int(t.numel()) // 8 * 8
    if n == 0 or t.data_ptr() % 8:
        return None
    return _nb(t[:n].view(torch.int64))


# ---------------------------------------------------------------- decoding


def read_header(blob: torch.Tensor) -> tuple[FileHeader, list[int], int]:
    """(header, chunk offsets, file size) of the .cgen file in a uint8 device tensor: only the
    header, descriptor, Params block and index are copied to the host, and a version-2 Params
    block's tables are only walked (the decoder reads them on the device)."""
    from .lmcache_device import _DeviceReader

    reader = _DeviceReader(blob)
    size = reader.size
    # the Params block's CRC-32 is summed on the device (_decode), not on the host
    h, header_end = container.read_file_header(reader, size, defer_tables=True, defer_crc=True)
    offsets = container.read_index(reader, h, header_end, size)
    if offsets:
        _DeviceReader.note_header_end(offsets[0])
    return h, offsets, size


def decodable(h: FileHeader) -> bool:
    """True when this pipeline decodes a file with this header (read by read_header)."""
    return (h.version == container.FORMAT_VERSION_2 and h.num_chunks > 0
            and h.params.table_starts is not None)


def decode(blob: torch.Tensor, h: FileHeader, offsets: list[int], size: int, calibration=None) -> torch.Tensor:
    """The [L, 2, T, C] cache of the .cgen file in ``blob`` (a uint8 device tensor) whose
    header and index were parsed (read_header): on the device, in the file's dtype; a rotated
    file needs its ``calibration`` (checked first).  Raises the CPU reader's error when a
    check fails."""
    from ..methods.transform import check_calibration

    rot = check_calibration(h, calibration)
    with _LOCK:
        if not rot.size:
            rot_t = None
        else:
            rot_t = _device_rotation(rot, h.params.calibration, blob.device, True, fixed=h.fixed_rotation)
        digits = (_matmul_digits(rot, h.params.calibration, blob.device, True)
                  if rot.size and h.fixed_rotation else None)
        out, failed = _decode(blob, h, offsets, size, rot_t, digits)
    if failed:
        _raise_cpu_error(blob, calibration)
    return out


#: The CPU reader, ``(stream, device="cpu")``, that _raise_cpu_error reruns: pipeline.codec's
#: decode_from_stream, set by pipeline.codec (which dispatches to this module, so this module
#: does not import it).
CPU_READER = None


def _raise_cpu_error(blob: torch.Tensor, calibration=None) -> None:
    """Rerun the CPU reader on the file to raise its exact error for the first bad chunk."""
    CPU_READER(container.BufferReader(blob.cpu().numpy().tobytes()), device="cpu", calibration=calibration)
    raise FormatError("the file is corrupted (a chunk failed a check on the GPU)")


def _decode(blob: torch.Tensor, h: FileHeader, offsets_l: list[int], size: int,
            rot_t: torch.Tensor | None, digits=None) -> tuple[torch.Tensor, bool]:

    k = _k()
    k1 = _k1()
    dev = blob.device
    p = h.params
    L, T, C, K = h.num_layers, h.num_tokens, h.num_channels, h.num_chunks
    ct, G = h.chunk_tokens, h.group
    groups = h.groups
    per = h.streams_per_chunk
    n = K * per
    dtype = DTYPE_BY_NAME[h.dtype]
    _mark("start")
    # First what the range decoder needs, so its launch is queued as early as the host can:
    # where each chunk's lengths and payload are (the records' sizes come from the index: they
    # are contiguous up to it), the tables' entries; one copy to the device.  The chunk
    # headers, sizes and padding are checked after the launch, while the device decodes
    # (every kernel stays inside the file whatever they hold: starts and lengths are clamped).
    offsets = np.asarray(offsets_l, np.int64)
    hb = container.CHUNK_HEADER.size
    kk = np.arange(K, dtype=np.int64)
    tks = np.minimum(ct, T - kk * ct)
    refined = h.flags & container.FLAG_REFINED
    bits = p.refine_bits if refined else 0
    raw = raw_sizes(L, C, T, ct, h.raw_bytes_per_value, p.refine_tokens if refined else 0, bits)
    raw_at = offsets + hb
    lengths_at = raw_at + raw
    payload_at = lengths_at + 2 * per
    lossless = h.method == METHOD_LOSSLESS
    host_parts = [lengths_at, payload_at, p.table_starts, p.table_source]
    if not lossless:
        # bfloat16 bits << 16 are their float32 values (exactly)
        host_parts += [(np.asarray(p.offsets, np.uint32) << 16).view(np.float32),
                       np.asarray(bf16_values(p.steps), np.float64)]
    up = _upload_arrays(host_parts, dev)
    lengths_at_d, payload_at_d, starts_d, source_d = up[:4]
    _mark("chunk positions (host)")
    # stream lengths and starts, from the lengths sections
    lens = _empty((n,), torch.int64, dev)
    starts = _empty((n,), torch.int64, dev)
    lens_c = _empty((n,), torch.int64, dev)
    k.stream_starts(_nb(blob), _nb(lengths_at_d), _nb(payload_at_d), per, _nb(lens), _nb(starts), _nb(lens_c))
    by_chunk = lens.view(K, per)
    # the tables, read and checked on the device straight from the Params block
    tab = _empty((L, 2, C, 257), torch.int32, dev)
    lut = _empty((L, 2, C, k.LUT_SIZE), torch.uint8, dev)
    modes_d = _empty((L, 2, C), torch.uint8, dev)
    lo_eff = _empty((L, 2, C), torch.int32, dev)
    alphabet_eff = _empty((L, 2, C), torch.int32, dev)
    tables_bad = torch.zeros(2, dtype=torch.int64, device=dev)  # [a table breaks a rule, a level leaves the range]
    k.read_tables(_nb(blob), h.params_at, _nb(starts_d), _nb(source_d), h.method == METHOD_TRANSFORM, _nb(tab),
                  _nb(lut), _nb(modes_d), _nb(lo_eff), _nb(alphabet_eff), _nb(tables_bad[:1]))
    _mark("lengths + tables")
    sym = _empty((L, 2, T, C), torch.uint8, dev)
    blob_nb = _nb(blob)
    k.decode_streams(blob_nb, _words64(blob), _nb(starts), _nb(lens_c), _nb(tab), _nb(lut), ct, G, _nb(sym),
                     _nb(_int64_view(sym, C)))
    # The checks' host side, while the device decodes: the records' sizes, the CRC segments,
    # where each refined chunk's padding bits are (the last byte of its raw section), the
    # chunk headers' bytes gathered on the device.
    index_offset = size - container.TRAILER.size - (12 + 8 * K)
    ends = np.append(offsets[1:], index_offset)
    rec_sizes = ends - offsets
    payload = rec_sizes - (hb + raw + 2 * per)
    if not ((payload >= 0) & (payload <= per * (2 * tks * G + 8)) & (ends <= index_offset)).all():
        return None, True  # (the kernels queued read inside the file; nothing else is launched)
    seg_first = k1.chunk_crc_segments(offsets, rec_sizes)
    r0 = h.refine_start
    used = (L * 2 * np.maximum(0, kk * ct + tks - np.maximum(kk * ct, r0)) * C * max(bits, 1)) % 8
    pad_mask = np.where((raw > 0) & (used > 0) & (h.method == METHOD_TRANSFORM), (0xFF << used) & 0xFF, 0)
    pad_at = raw_at + np.maximum(raw - 1, 0)
    head_at = (offsets[:, None] + np.arange(hb, dtype=np.int64)[None, :]).reshape(-1)
    (offsets_d, rec_sizes_d, raw_at_d, seg_first_d, pad_mask_d, pad_at_d, tks_d, head_at_d) = _upload(
        [offsets, rec_sizes, raw_at, seg_first, pad_mask, pad_at, tks, head_at], dev)
    head_bytes_d = blob[head_at_d]
    _mark("range decoding")
    nraw = h.raw_bytes_per_value
    rotated = rot_t is not None
    rope = None if lossless else p.rope
    # the levels q' as int16 words 256 q' - 1 for the matrix units' product (half the bytes of
    # float32 levels, written once and read once)
    level_words = rotated and h.fixed_rotation and digits is not None
    if lossless or level_words or (dtype == torch.bfloat16 and not rotated and rope is None):
        words = _empty((L, 2, T, C), torch.int16 if level_words or ITEMSIZE[h.dtype] == 2 else torch.int32, dev)
    else:
        # float32 bits; float16 files are cast after, rotated ones rotated back first
        words = _empty((L, 2, T, C), torch.int32, dev)
    out_bytes = words.element_size()
    V = k.lanes(C, out_bytes, k.WIDTH["values"])  # channels per thread
    S = h.sink_tokens
    if lossless:
        offsets_f = torch.zeros((1, 1, 1), dtype=torch.float32, device=dev)
        steps_f = torch.zeros((1, 1), dtype=torch.float64, device=dev)
    else:
        offsets_f, steps_f = up[4:6]
    fixed = rotated and h.fixed_rotation
    if fixed:
        # the levels q' alone (step 1, offset 0: exact), for the integer product below
        file_offsets, file_steps = offsets_f, steps_f
        offsets_f = torch.zeros_like(file_offsets)
        steps_f = torch.ones_like(file_steps)
    k.dequantize(_nb(sym.view(_TORCH_WORD[V])), _nb(modes_d), _nb(lo_eff), ct, not lossless, S, _nb(offsets_f),
                 _nb(steps_f), r0, bits, blob_nb, _nb(raw_at_d), nraw, out_bytes,
                 _nb(words.view(_TORCH_WORD[V * out_bytes])), _nb(tables_bad[1:]), levels=level_words)
    if lossless:
        data = words.view(dtype)
    elif rotated or rope is not None:
        data = words.view(torch.float32)
        keys_turned = False
        if fixed:
            # x' = sat32(A s 2^-14 + b), A = q' Rint^T exact (kernels/fixed_rotation): on the
            # matrix units in one pass (fixed_rotation_matmul), else cuBLAS's float64 product
            b_d = _empty((L, 2, C), torch.float64, dev)
            k.offset_sums(_nb(file_offsets), _nb(rot_t), _nb(b_d))
            from ..kernels import fixed_rotation_matmul as fm

            # keys coded without their RoPE: their float32 values apart, turned forward into the
            # words by the pass after the product (the values' words straight from the product)
            keys_apart = (rope is not None and digits is not None and fm.turns(rope.head_dim) and T > S)
            direct = dtype == torch.bfloat16 and (rope is None or keys_apart)  # bfloat16 words out, saturating
            data = _empty((L, 2, T, C), torch.int16 if direct else torch.float32, dev)
            if digits is not None:
                keys = _empty((L, 1, T, C), torch.float32, dev) if keys_apart else None
                fm.unrotate_values(words, digits[0], digits[1], file_steps, b_d, S, data, keys=keys)
                del words
                if keys_apart:
                    angles = _rope_angles(rope, S, T, dev)
                    fm.turn_rows(keys, angles, S, data, True)
                    del keys, angles
                    keys_turned = True
            else:
                from ..kernels.fixed_rotation import block_product

                Qr = words.view(torch.float32)[:, :, S:].to(torch.float64)  # q', exact
                del words
                Ar = block_product(Qr, rot_t)
                del Qr
                k.fixed_values(_nb(Ar), _nb(file_steps), _nb(b_d), S, _nb(data))
                del Ar
            if direct:
                data = data.view(torch.bfloat16)
        elif rotated:
            # x = z R^T, block by block: the same product with each block transposed
            data = _empty((L, 2, T, C), torch.float32, dev)
            k.rotate_blocks(_nb(words.view(torch.float32)), _nb(rot_t), S, _nb(data))
            del words
        if rope is not None and not keys_turned:  # the keys turned forward by their RoPE (float32, saturating)
            from ..kernels import fixed_rotation_matmul as fm

            if fm.runs_on(dev) and fm.turns(rope.head_dim) and T > S and data.dtype == torch.float32:
                # one pass to the words (Triton): bfloat16 ones straight from it
                direct = dtype == torch.bfloat16
                out = _empty((L, 2, T, C), torch.int16 if direct else torch.float32, dev)
                angles = _rope_angles(rope, S, T, dev)
                fm.turn_rows(data, angles, S, out, True)
                del angles
                data = out.view(torch.bfloat16) if direct else out
            else:
                freq_d = _to_device(np.ascontiguousarray(rope.inv_freq, np.float64), dev)
                k.turn_keys(_nb(data), _nb(freq_d), rope, 0, S, True)
        if dtype != data.dtype:
            if rope is not None or fixed:  # saturating: a turned pair can reach past the dtype's largest value
                lim = float(torch.finfo(dtype).max)
                data.clamp_(-lim, lim)
            data = data.to(dtype)  # round to nearest even, as the CPU's rows
    elif dtype == torch.bfloat16:
        data = words.view(torch.bfloat16)
    else:
        data = words.view(torch.float32)
        if dtype != torch.float32:
            data = data.to(dtype)
    if S:
        sink = _to_device(np.ascontiguousarray(p.sink).reshape(-1), dev).view(dtype).reshape(L, 2, S, C)
        data[:, :, :S] = sink
    _mark("levels + values")
    # the checks of the reader's rules that need the chunks' bytes, in one copy back
    crc = torch.zeros(K + 2, dtype=torch.int64, device=dev)  # the chunks', then the header's (and scratch)
    k1.crc32_chunks(blob_nb, _words64(blob), _nb(offsets_d), _nb(rec_sizes_d), _nb(seg_first_d), _nb(crc[:K]),
                    int(seg_first[-1]))
    header_crc, head_crc, params_size = h.deferred_crc
    k.span_crc(blob_nb, _words64(blob), h.params_at, params_size, head_crc, _nb(crc[K + 1 :]), _nb(crc[K : K + 1]))
    bound = 2 * tks_d * G + 8
    checks = torch.cat([torch.stack([
        crc[:K],
        by_chunk.sum(dim=1),
        (by_chunk > bound[:, None]).any(dim=1).to(torch.int64),
        (blob[pad_at_d].to(torch.int64) & pad_mask_d),
    ]).reshape(-1), tables_bad, crc[K : K + 1], head_bytes_d.to(torch.int64)]).cpu().numpy()
    _mark("CRC-32s + checks (sync)")
    flags = checks[4 * K : 4 * K + 2]
    header_ok = int(checks[4 * K + 2]) == header_crc
    heads = np.frombuffer(checks[4 * K + 3 :].astype(np.uint8).tobytes(), _HEAD_DTYPE)
    checks = checks[: 4 * K].reshape(4, K)
    heads_ok = bool(((heads["magic"] == container.CHUNK_MAGIC) & (heads["index"] == kk)
                     & (heads["first_token"] == kk * ct) & (heads["token_count"] == tks) & (heads["raw_size"] == raw)
                     & (heads["cdf_size"] == 0) & (heads["lengths_size"] == 2 * per)
                     & (heads["payload_size"] == payload) & (heads["reserved"] == 0)).all())
    failed = bool(not heads_ok or (checks[0] != heads["crc"]).any() or (checks[1] != payload).any() or checks[2].any()
                  or checks[3].any() or flags.any() or not header_ok)
    return data, failed
