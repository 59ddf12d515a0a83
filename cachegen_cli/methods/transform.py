"""Format version 2: the transform (method 2) and lossless (method 3) codecs.

Encoding, on the whole cache (statistics are taken over every token, so the
tables are shared by all chunks and cost almost nothing next to the payload):

  method 2: [rotate] -> per-coordinate mean and per-(layer, K/V) RMS -> step =
            relative step x RMS -> levels -> direct or token-delta symbols per
            channel -> counts -> 4-bit-coded tables -> range-coded streams
  method 3: split each word into its top byte (coded) and low byte(s) (raw)

Chunks keep version 1's stream layout (chunk x layer x K/V x channel group), so a
chunk still decodes on its own given the file's header; the first ``sink_tokens``
tokens (attention sinks, with values far larger than the rest) are stored
verbatim in the header and quantized as zeros.

Files are encoded and decoded a slab (a run of whole chunks) at a time, so memory stays
bounded by a slab whatever the cache's size: the statistics need the whole cache, so the
encoder makes passes over its source (per-coordinate sums, level ranges, symbol counts,
then the coding itself), recomputing each slab's levels unless the cache is one slab;
the decoder needs only the header's tables, and each chunk decodes on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numba
import numpy as np
import torch

from ..format import container
from . import rope as rope_methods
from .calibration import Calibration, CalibrationError
from .config import ALLOCATION_MAX_STEP, ALLOCATION_STRENGTH, MIN_STEP, TransformConfig
from ..format.container import Chunk, FileHeader
from ..errors import ConfigError, SizeError
from ..kernels import cpu as cpu_kernels
from ..kernels import cpu_transform as k2
from ..kernels import fixed_rotation as fixed_kernels
from ..kernels import rope as rope_kernels
from ..kernels.coding_params import max_stream_bytes
from ..kernels.tables import SYMBOL_COST
from ..kernels.transform import MODE_DELTA, MODE_DIRECT, TRANSFORM_QMAX
from ..storage.kvio import KVCache, SlabBuffers, TensorSource
from ..format.params import ITEMSIZE, METHOD_LOSSLESS, METHOD_TRANSFORM, Params, bf16_values
from ..format.params import check_level_range, expand_shared

_WORDS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float64 values as torch rounds them (to float32, then to bfloat16,
    each to nearest even), in numpy: torch's conversions cost milliseconds of overhead here,
    on the encoder's one host step between two GPU stages.  Values are not NaN."""
    u = np.ascontiguousarray(values, np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _source_words(data: torch.Tensor) -> np.ndarray:
    """The cache's raw words [L, 2, T, C] (uint16 or uint32)."""
    w = data.contiguous().view(_WORDS[data.dtype]).numpy()
    return w.view(np.uint16 if w.dtype == np.int16 else np.uint32)


@dataclass
class EncodedV2:
    header: FileHeader
    chunks: list[Chunk]


#: Whether a rotated file is written with the fixed-point rotation (flags bit 3: integer
#: products, exact in any order, so a BLAS or cuBLAS computes it) rather than flags bit 0's
#: float64 sums in order.  Readers take both; the older form is kept writable for the
#: golden files that pin it (scripts/make_golden.py).
FIXED_ROTATION = True


def make_header_v2(cache: KVCache, cfg: TransformConfig, chunk_tokens: int, params: Params, sink: int,
                   fixed_rotation: bool = True) -> FileHeader:
    rotated = params.calibration != bytes(32)
    return FileHeader(
        num_tokens=cache.num_tokens, num_layers=cache.num_layers, num_channels=cache.num_channels,
        chunk_tokens=chunk_tokens, num_chunks=-(-cache.num_tokens // chunk_tokens),
        group=container.choose_group_v2(chunk_tokens, cache.num_channels), dtype=cache.dtype_name,
        layout=cache.layout, bins=np.zeros((cache.num_layers, 2), np.int32), descriptor=cache.descriptor(),
        method=params.method, cdf_coding=container.CDF_CODING_SHARED, version=container.FORMAT_VERSION_2,
        flags=((container.FLAG_ROTATED if rotated else 0) | (container.FLAG_REFINED if params.refine_tokens else 0)
               | (container.FLAG_ROPE if params.rope is not None else 0)
               | (container.FLAG_FIXED_ROTATION if rotated and fixed_rotation else 0)),
        sink_tokens=sink, params=params)


def tables_from_stats(stats: np.ndarray, allow_delta: bool, T: int):
    """(modes, lo, alphabet) [L, 2, C] from level_stats' output."""
    L, _, C, _ = stats.shape
    mn, mx, ab, dmn, dmx, dab = (stats[..., i] for i in range(6))
    modes = np.full((L, 2, C), MODE_DIRECT, np.uint8)
    lo = mn.copy()
    alphabet = mx - mn + 1
    if allow_delta:
        # Delta pays when it shrinks the symbols' total magnitude (a cheap, integer
        # proxy for their entropy) and its range fits the table's int8 lo.
        use = (dab < ab) & (dmn >= -TRANSFORM_QMAX) & (dmx <= TRANSFORM_QMAX)
        modes[use] = MODE_DELTA
        lo = np.where(use, dmn, mn)
        alphabet = np.where(use, dmx - dmn + 1, alphabet)
    if T == 0:
        lo[:] = 0
        alphabet[:] = 1
    return modes, lo.astype(np.int64), alphabet.astype(np.int64)


def _chunks(h: FileHeader, lengths, payload, offsets, raw: np.ndarray | None, ref: np.ndarray | None = None) -> list[Chunk]:
    """Chunks from the streams; ``raw``: the lossless low bytes [L, 2, T, C, nraw];
    ``ref``: the refinement indices [L, 2, R, C] of the last R tokens."""
    L, ct = h.num_layers, h.chunk_tokens
    per = h.streams_per_chunk
    lengths = lengths.reshape(h.num_chunks, L, 2, h.groups)
    out = []
    empty = np.empty(0, np.uint8)
    r0 = h.refine_start
    for k in range(h.num_chunks):
        t0, t1 = k * ct, min(h.num_tokens, (k + 1) * ct)
        body = empty if raw is None else np.ascontiguousarray(raw[:, :, t0:t1]).reshape(-1)
        if ref is not None and t1 > r0:
            part = ref[:, :, max(t0, r0) - r0 : t1 - r0]
            body = pack_refinement_bits(part, h.params.refine_bits)
        out.append(Chunk(k, t0, t1 - t0, body, empty, lengths[k], payload[offsets[k * per] : offsets[(k + 1) * per]]))
    return out


def allocate(rel: np.ndarray, rms: np.ndarray, sensitivity: np.ndarray) -> np.ndarray:
    """Relative steps [L, 2] scaled by the planes' allocation factors.

    A plane's expected damage is about sensitivity x (step x rms)^2 and its size about
    -log2(step) bits per value, so the smallest file at a given total damage has
    step_i ~ (rms_i^2 s_i)^(-1/2); the codec goes ``ALLOCATION_STRENGTH`` of the way
    (the sensitivities come from other caches: an estimate).  The factors have a
    geometric mean of 1 over the planes with any spread, so the mean log step (about the
    size) stays that of ``rel``.  Steps stay within [MIN_STEP, max(ALLOCATION_MAX_STEP, rel)].
    The logarithms and exponentials are kernels/allocation.py's, the GPU encoder's bits too."""
    rel = np.ascontiguousarray(np.broadcast_to(np.asarray(rel, np.float64), np.shape(rms)))
    out = np.empty(rel.shape, np.float64)
    k2.allocate_steps(rel.reshape(-1), np.ascontiguousarray(rms, np.float64).reshape(-1),
                      np.ascontiguousarray(sensitivity, np.float64).reshape(-1), float(ALLOCATION_STRENGTH),
                      float(MIN_STEP), float(ALLOCATION_MAX_STEP), out.reshape(-1))
    return out


def step_params(sums: np.ndarray, sumsq: np.ndarray, n: int, rel: np.ndarray, sensitivity: np.ndarray | None = None,
                rms_sums: tuple[np.ndarray, np.ndarray] | None = None):
    """(offset bits, offsets, step bits, steps) from transform_stats' sums over n tokens;
    ``sensitivity`` [L, 2] (a calibration's) scales the relative steps ``rel`` (:func:`allocate`).
    ``rms_sums``: the (sums, sumsq) the RMS comes from when they are not the coded values' (keys
    coded without RoPE: the step is relative to the keys as the model has them, so that a preset
    means the same error with and without RoPE removal; removing it moves key energy into the
    channel means, which would shrink a step relative to the residuals).  Their value planes
    are the coded values' sums (the encoders read the keys alone a second time)."""
    L, _, C = sums.shape
    offsets_bits = np.empty((L, 2, C), np.uint16)
    m = np.empty((L, 2, C), np.float64)
    rms = np.empty((L, 2), np.float64)
    # A mean beyond bfloat16's largest finite value (a float32 channel near float32's top)
    # would round to an Inf offset, which readers refuse: the largest one it is.  The RMS is
    # of the residuals around the stored (rounded) means: sum (v - m)^2 = sumsq - 2 m sum + n m^2.
    if rms_sums is not None:
        k2.plane_offsets_rms(np.ascontiguousarray(rms_sums[0], np.float64), np.ascontiguousarray(rms_sums[1], np.float64),
                             int(n), BF16_MAX, offsets_bits, m, rms)
        rms = rms.copy()
    k2.plane_offsets_rms(np.ascontiguousarray(sums, np.float64), np.ascontiguousarray(sumsq, np.float64), int(n),
                         BF16_MAX, offsets_bits, m, rms if rms_sums is None else np.empty((L, 2), np.float64))
    return _steps_of(offsets_bits, m, rms, rel, sensitivity)


def rotated_step_params(sums: np.ndarray, sumsq: np.ndarray, n: int, rint: np.ndarray, rel: np.ndarray,
                        sensitivity: np.ndarray | None = None,
                        rms_sums: tuple[np.ndarray, np.ndarray] | None = None):
    """step_params of fixed-point rotated values from the statistics of the rows before the
    rotation (since 2026-12-07; before, from the rotated values' own sums: the same bfloat16
    offsets and steps on every golden file and sample cache tried): sums / sumsq [L, 2, C] of
    the unrotated inputs (keys without their RoPE when it is removed) over n tokens, rint the
    encoder's blocks (fixed_rotation.fixed_matrix(rot, False), float64 [L, 2, H, D, D]).  The
    offsets are the bfloat16 of the rotated means (cpu_transform.input_means32 through
    fixed_rotation.offset_sums); the RMS is the plane's, around them
    (cpu_transform.rotated_offsets_rms).  ``rms_sums`` (keys coded without RoPE): the key planes'
    RMS from the keys as they are, as step_params (their value entries are not read)."""
    L, _, C = sums.shape
    means = np.empty((L, 2, C), np.float32)
    k2.input_means32(np.ascontiguousarray(sums, np.float64), int(n), means)
    mu = np.empty((L, 2, C), np.float64)
    fixed_kernels.offset_sums(means, np.ascontiguousarray(rint, np.float64), mu)
    offsets_bits = np.empty((L, 2, C), np.uint16)
    m = np.empty((L, 2, C), np.float64)
    rms = np.empty((L, 2), np.float64)
    k2.rotated_offsets_rms(mu, np.ascontiguousarray(sumsq, np.float64), int(n), BF16_MAX, offsets_bits, m, rms)
    if rms_sums is not None:
        key_rms = np.empty((L, 2), np.float64)
        k2.plane_offsets_rms(np.ascontiguousarray(rms_sums[0], np.float64),
                             np.ascontiguousarray(rms_sums[1], np.float64), int(n), BF16_MAX,
                             np.empty((L, 2, C), np.uint16), np.empty((L, 2, C), np.float64), key_rms)
        rms[:, 0] = key_rms[:, 0]
    return _steps_of(offsets_bits, m, rms, rel, sensitivity)


def _steps_of(offsets_bits, m, rms, rel, sensitivity):
    """step_params' steps from the planes' RMS (allocated by ``sensitivity`` when given)."""
    if sensitivity is not None:
        rel = allocate(rel, rms, sensitivity)
    step = rel * rms
    # A plane with no spread (all values equal to their means) gets any positive step: 1.
    step = np.where(step > 1e-30, step, 1.0)
    steps_bits = _bf16_bits(np.minimum(step, 3.0e38))
    return offsets_bits, m, steps_bits, bf16_values(steps_bits)


def encode_v2(cache: KVCache, cfg: TransformConfig, chunk_tokens: int,
              calibration: Calibration | None = None, plane_tables: bool = False) -> EncodedV2:
    """Encode a whole cache with method 2 or 3 on the CPU; returns the header and the chunks
    (pipeline.codec.encode_v2 picks this or the GPU's).  ``plane_tables`` (lossless only): one
    table per (layer, K/V) plane instead of one per channel (see _SlabEncoder)."""
    h, slabs = encode_v2_slabs(TensorSource(cache), cfg, chunk_tokens, calibration, plane_tables=plane_tables)
    return EncodedV2(h, [chunk for slab in slabs for chunk in slab])


#: The file paths' slab: tokens whose float32 copy is about this size (a handful of chunks of a
#: Llama-8B-sized cache: enough planes for every core, and the per-slab temporaries — float32
#: copy, levels, symbols, coded planes — stay a few hundred MB whatever the cache's size).
V2_SLAB_BYTES = 128 << 20


#: A rotated single-slab cache keeps its rotated rows (float64) between the statistics and
#: quantization passes up to this size; past it each pass rotates them again.
ROTATED_CACHE_BYTES = 1 << 30
_NO_ROTATION = np.zeros((0, 0, 0, 0, 0), np.float32)


def slab_chunks_count(num_layers: int, num_channels: int, chunk_tokens: int, slab_bytes: int | None = None) -> int:
    """Whole chunks per slab: about ``slab_bytes`` (default V2_SLAB_BYTES) of float32, at least one chunk."""
    slab_bytes = V2_SLAB_BYTES if slab_bytes is None else slab_bytes
    return max(1, slab_bytes // max(chunk_tokens * num_layers * 2 * num_channels * 4, 1))


def encode_v2_slabs(source, cfg: TransformConfig, chunk_tokens: int, calibration: Calibration | None = None,
                    slab_tokens: int | None = None,
                    plane_tables: bool = False) -> tuple[FileHeader, Iterator[list[Chunk]]]:
    """Encode the cache of ``source`` (kvio.TensorSource or kvio.SafetensorsSource) on the CPU,
    slab by slab: returns the header — its tables come from passes over the whole cache, run
    here — and an iterator over the slabs' chunks, each slab coded as it is asked for.
    ``slab_tokens``: tokens per slab, rounded down to whole chunks (at least one); None: the
    whole cache as one slab, whose levels are then computed once.  The bytes do not depend on
    the slab size."""
    T = source.cache.num_tokens
    step = T if slab_tokens is None else max(chunk_tokens, slab_tokens // chunk_tokens * chunk_tokens)
    bounds = [(t0, min(T, t0 + step)) for t0 in range(0, T, max(step, 1))]
    enc = _SlabEncoder(source, cfg, chunk_tokens, calibration, bounds, plane_tables)
    return enc.header, enc.chunks()


def _empty_level_stats(L: int, C: int) -> np.ndarray:
    """level_stats of no tokens (what it starts every channel from)."""
    stats = np.zeros((L, 2, C, 6), np.int64)
    stats[..., 0] = stats[..., 3] = 1 << 40
    stats[..., 1] = stats[..., 4] = -(1 << 40)
    return stats


class _SlabEncoder:
    """The passes of encode_v2_slabs.  Transform: a slab's levels are recomputed by each pass
    from the source, unless the cache is one slab (then they are kept).  Lossless: every pass
    reads the words themselves (a fused kernel per pass: level ranges, symbol counts, then
    symbols and low bytes), the single slab's words kept.

    ``plane_tables`` (lossless only; the small-cache fallback of pipeline/codec.py, never the
    GPU's encoder): every channel of a (layer, K/V) plane codes with the one table of its first
    channel, over the plane's whole range and counts.  A few tokens give each channel a table
    of its own range (4 bytes or more) for a symbol or two; one table per plane costs one byte
    per channel instead (the format's "same table" entry)."""

    def __init__(self, source, cfg: TransformConfig, chunk_tokens: int, calibration: Calibration | None,
                 bounds: list[tuple[int, int]], plane_tables: bool = False) -> None:
        cache = source.cache
        if plane_tables and cfg.method != "lossless":
            raise ConfigError("plane_tables applies to the lossless method only")
        self.plane_tables = plane_tables
        self.source, self.cfg, self.ct, self.bounds = source, cfg, chunk_tokens, bounds
        self.L, self.T, self.C = cache.num_layers, cache.num_tokens, cache.num_channels
        self.single = len(bounds) == 1
        self.kept = None  # the single slab's (levels, refinement) (transform) or words (lossless)
        self.kept_values = None  # transform: the single slab's _values while the passes before the header run
        self.kept_inputs = None  # transform: the single slab's _inputs, while the statistics of them are made
        self.keep_inputs = False
        self.lossless = cfg.method == "lossless"
        # With several slabs, every pass reuses the same slab-sized buffers (never a single
        # slab's: its arrays are kept from pass to pass).
        self.buf = None if self.single else SlabBuffers()
        check = source.finite_check()
        self.rope = None  # the RoPE removed from the keys (_prepare_transform)
        self.fixed = None  # the fixed-point rotation's blocks (torch: int8 digit blocks, or float64), when used
        if self.lossless:
            self.nraw = ITEMSIZE[cache.dtype_name] - 1
            params, sink = self._prepare_lossless(check), 0
        else:
            params, sink = self._prepare_transform(check, calibration)
        self._tables(params)
        self.header = make_header_v2(cache, cfg, chunk_tokens, params, sink, self.fixed is not None)

    # ---- levels of one slab

    def _empty(self, name: str, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype) if self.buf is None else self.buf.get(name, shape, dtype)

    def _block(self, t0: int, t1: int, check=None) -> torch.Tensor:
        block = self.source.read(t0, t1, self.buf)
        if check is not None:
            check.add(block)
        return block

    def _words(self, t0: int, t1: int, check=None) -> np.ndarray:
        """Lossless: the slab's words."""
        if self.kept is not None:
            return self.kept
        words = _source_words(self._block(t0, t1, check))
        if self.single:
            self.kept = words
        return words

    def _values(self, t0: int, t1: int, check=None):
        """Transform: (src, shift, rot) of a slab for the kernels' _fill_rows: its bits (bfloat16:
        shift 16; float32: shift 0; float16 through torch's float32 conversion) with the
        rotation, or, when the single slab is rotated and its float64 rows fit in
        ROTATED_CACHE_BYTES, those rows, rotated once for both passes over them."""
        if self.kept_values is not None:
            return self.kept_values
        src, shift = self._inputs(t0, t1, check)
        rot = self.rot
        if self.fixed is not None:
            # The rows rotated by integer products (kernels/fixed_rotation), as float32 values.
            # In place where the float32 rows are this encoder's own buffer (widened, converted or
            # turned here; a float32 cache's rows may be the caller's tensor): no fresh pages.
            own = self.rope is not None or self.source.cache.dtype_name != "float32"
            src, shift, rot = fixed_rotate(self, src, shift, own), 0, _NO_ROTATION
        elif self.single and rot.size and src.size * 8 <= ROTATED_CACHE_BYTES:
            y = np.empty(src.shape, np.float64)
            k2.rotate_rows(src, shift, rot, y)
            src, shift, rot = y, 0, _NO_ROTATION
        if self.single:
            self.kept_values = (src, shift, rot)
        return src, shift, rot

    def _inputs(self, t0: int, t1: int, check=None):
        """Transform: (src, shift) of a slab's rows before any rotation, for the kernels'
        _fill_rows: its bits, with the keys turned back by their RoPE when it is removed (float32
        then).  A single slab's are kept between the fixed-point rotation's statistics pass
        (rotated_step_params) and the quantization's (_values' rotation)."""
        if self.kept_inputs is not None:
            return self.kept_inputs
        src, shift = self._bits(self._block(t0, t1, check))
        if self.rope is not None:
            # The keys without their RoPE (float32, kernels/rope.turn_keys), the values widened.
            x = self._empty("unturned", tuple(src.shape), np.float32)
            if shift == 16:
                rope_kernels.widen_bf16(src, x.view(np.uint32))
            else:
                x.view(np.uint32)[...] = src
            rope_kernels.turn_keys(x, self.rope.inv_freq, self.rope, t0, self.sink, False)
            src, shift = x.view(np.uint32), 0
        if self.single and self.keep_inputs:
            self.kept_inputs = (src, shift)
        return src, shift

    def _bits(self, block: torch.Tensor, name: str = "x"):
        """(src, shift) of a block for the kernels' _fill_rows: its bits (bfloat16: shift 16;
        float32: shift 0; float16 through torch's float32 conversion, into buffer ``name``)."""
        if block.dtype == torch.bfloat16:
            return block.contiguous().view(torch.int16).numpy().view(np.uint16), 16
        if block.dtype == torch.float32:
            return block.contiguous().view(torch.int32).numpy().view(np.uint32), 0
        x = self._empty(name, tuple(block.shape), np.float32)
        torch.from_numpy(x).copy_(block)  # torch's conversion, on every core
        return x.view(np.uint32), 0

    def _source_bits(self, t0: int, t1: int):
        """(src, shift) of a slab as the model has it (for the RMS of keys coded without RoPE)."""
        return self._bits(self.source.read(t0, t1, None), "x_source")

    def _quantize(self, t0: int, t1: int):
        """Transform: (levels, refinement indices of the slab's refined tokens or None, level
        statistics of the slab)."""
        L, C, T = self.L, self.C, self.T
        Ts = t1 - t0
        src, shift, rot = self._values(t0, t1)
        q = self._empty("q", (L, 2, Ts, C), np.int16)
        r0 = T - self.R
        first = max(r0 - t0, 0)
        refined = self.R and t1 > r0
        ref = np.empty((L, 2, Ts - first if refined else 0, C), np.uint8)
        K = -(-Ts // self.ct)
        # Parts of a plane coded by separate jobs: enough jobs for every thread.
        parts = min(K, max(1, -(-numba.get_num_threads() // (2 * L))))
        part = np.empty((parts, L, 2, C, 6), np.int64)
        k2.quantize_stats(src, shift, rot, min(max(self.sink - t0, 0), Ts), self.m32, self.steps, TRANSFORM_QMAX,
                          float(self.cfg.rounding), first, self.bits, self.ct, q, ref, part)
        stats = part[0]
        if parts > 1:
            stats = stats.copy()
            stats[..., [0, 3]] = part[..., [0, 3]].min(axis=0)
            stats[..., [1, 4]] = part[..., [1, 4]].max(axis=0)
            stats[..., [2, 5]] = part[..., [2, 5]].sum(axis=0)
        return q, ref if refined else None, stats

    def _levels(self, t0: int, t1: int):
        """Transform: (levels, refinement indices or None) of a slab."""
        if self.kept is not None:
            return self.kept
        return self._quantize(t0, t1)[:2]

    # ---- the passes before the header

    def _prepare_lossless(self, check) -> Params:
        L, C = self.L, self.C
        stats = _empty_level_stats(L, C)
        part = np.empty_like(stats)
        for t0, t1 in self.bounds:
            k2.lossless_stats(self._words(t0, t1, check), self.nraw, part)
            k2.merge_level_stats(stats, part)
        if check is not None:
            check.raise_if_bad()
        modes, lo, alphabet = tables_from_stats(stats, False, self.T)
        if self.plane_tables and self.T:  # one range per plane: the union of its channels'
            top = (lo + alphabet - 1).max(axis=2, keepdims=True)
            lo = np.broadcast_to(lo.min(axis=2, keepdims=True), lo.shape).copy()
            alphabet = np.broadcast_to(top, alphabet.shape) - lo + 1
        return Params(METHOD_LOSSLESS, modes, lo, alphabet, np.zeros((L, 2, C, 1), np.uint8))

    def _prepare_transform(self, check, calibration: Calibration | None):
        cfg, L, T, C = self.cfg, self.L, self.T, self.C
        self.sink = sink = min(cfg.sink_tokens, T)
        self.rot, digest = encoder_rotation(calibration, L, C)
        if self.rot.size and FIXED_ROTATION:
            # int8 digit blocks where torch multiplies int8 matrices (the same bits, several times faster)
            self.fixed = fixed_kernels.fixed_matrix_kept(self.rot, digest, False, fixed_kernels.int8_products())
        self.rope = rope_methods.resolve(self.source.cache, cfg, calibration)
        s1, s2, b1, b2 = (np.zeros((L, 2, C), np.float64) for _ in range(4))
        r1, r2, rb1, rb2 = (np.zeros((L, 2, C), np.float64) for _ in range(4))
        # The fixed-point rotation's offsets and steps come from the rows before it
        # (rotated_step_params), so that the GPU's encoder has them beside its product.
        inputs = self.fixed is not None
        self.keep_inputs = inputs
        for t0, t1 in self.bounds:
            if inputs:
                src, shift = self._inputs(t0, t1, check)
                k2.transform_stats_carry(src, _NO_ROTATION, sink, t0, T, s1, s2, b1, b2, shift)
            else:
                src, shift, rot = self._values(t0, t1, check)
                k2.transform_stats_carry(src, rot, sink, t0, T, s1, s2, b1, b2, shift)
            if self.rope is not None:  # the keys as the model has them (step_params' rms_sums)
                osrc, oshift = self._source_bits(t0, t1)
                k2.transform_stats_carry(osrc[:, :1], _NO_ROTATION, sink, t0, T, r1, r2, rb1, rb2, oshift)
        if check is not None:
            check.raise_if_bad()
        if self.rope is not None:
            r1[:, 1], r2[:, 1] = s1[:, 1], s2[:, 1]  # the values' RMS: their coded sums'
        if inputs:
            rint = fixed_kernels.fixed_matrix_kept(self.rot, digest, False).numpy()
            offsets_bits, m, steps_bits, self.steps = rotated_step_params(
                s1, s2, T - sink, rint, cfg.steps_table(L), plane_sensitivity(cfg, calibration),
                None if self.rope is None else (r1, r2))
        else:
            offsets_bits, m, steps_bits, self.steps = step_params(s1, s2, T - sink, cfg.steps_table(L),
                                                                  plane_sensitivity(cfg, calibration),
                                                                  None if self.rope is None else (r1, r2))
        if self.rot.size:  # the reader's rule: a writer must not write what it rejects (as the GPU's writer)
            from ..format.params import check_rotated_range

            check_rotated_range(steps_bits, offsets_bits)
        self.m32 = m.astype(np.float32)
        self.R, self.bits = refine_plan(cfg, T, sink)
        stats = _empty_level_stats(L, C)
        for t0, t1 in self.bounds:
            q, ref, part = self._quantize(t0, t1)
            k2.merge_level_stats(stats, part)
            if self.single:
                self.kept = (q, ref)
        self.kept_values = self.kept_inputs = None
        modes, lo, alphabet = tables_from_stats(stats, cfg.token_delta, T)
        sink_bytes = (sink_words(self.source.cache, sink) if isinstance(self.source, TensorSource)
                      else _sink_bytes(self.source.read(0, sink), sink))
        params = Params(METHOD_TRANSFORM, modes, lo, alphabet, np.zeros((L, 2, C, 1), np.uint8), digest,
                        steps_bits, offsets_bits, sink_bytes, refine_tokens=self.R, refine_bits=self.bits,
                        rope=self.rope)
        return params, sink

    def _tables(self, params: Params) -> None:
        """Symbol counts over the cache -> tables, shared where that pays -> coder tables."""
        L, C, ct = self.L, self.C, self.ct
        modes, lo, alphabet = params.modes, params.lo, params.alphabet
        width = int(alphabet.max(initial=1))
        counts = np.zeros((L, 2, C, width), np.int64)
        for t0, t1 in self.bounds:
            if self.lossless:
                k2.lossless_counts(self._words(t0, t1), self.nraw, lo, counts)
            else:
                k2.count_symbols(self._levels(t0, t1)[0], modes, lo, ct, counts)
        if self.plane_tables:  # every channel gets the plane's counts, so the same table
            counts = np.ascontiguousarray(np.broadcast_to(counts.sum(axis=2, keepdims=True), counts.shape))
        codes = np.empty((L, 2, C, width), np.uint8)
        cum = np.empty((L, 2, C, width + 1), np.int32)
        k2.build_tables(counts, alphabet, codes, cum)
        shared = np.zeros((L, 2, C), np.bool_)
        if self.plane_tables and self.T:
            shared[:, :, 1:] = True  # the format lets any later channel of the plane refer to the first
        else:
            # Neighbouring channels often have near-identical statistics (after a rotation they are
            # ordered by variance): a channel that codes about as well with the previous table
            # sends a one-byte reference instead of its own table.
            k2.share_tables(counts, lo, alphabet, modes, cum, SYMBOL_COST, shared, np.empty((L, 2, C), np.int64))
        if shared.any():
            # A sharing channel codes its levels with the shared table's mode (the same) and lo.
            modes, lo, alphabet, codes, cum = expand_shared(shared, modes, lo, alphabet, codes, cum)
        self.tab = np.empty((L, 2, C, width), np.uint32)
        lut = np.empty((L, 2, C, cpu_kernels.LUT_SIZE), np.uint8)
        k2.coder_tables(cum, alphabet, self.tab, lut)
        self.width = width
        params.codes, params.shared, params.modes, params.lo, params.alphabet = codes, shared, modes, lo, alphabet

    # ---- the coding pass

    def chunks(self) -> Iterator[list[Chunk]]:
        h = self.header
        p = h.params
        L, C, ct, G = self.L, self.C, self.ct, h.group
        tab = self.tab.reshape(L, 2, C * self.width)
        for t0, t1 in self.bounds:
            if self.lossless:
                words = self._words(t0, t1)
                extra = np.empty(words.size * self.nraw, np.uint8)  # the low bytes, in chunk order
            else:
                q, extra = self._levels(t0, t1)
            self.kept = None  # a single slab's arrays go with its chunks
            K = -(-(t1 - t0) // ct)
            lengths = np.empty((K, L, 2, h.groups), np.int32)
            plane_bytes = np.empty(K * L * 2, np.int64)
            # One row per plane, big enough for its worst case; only the bytes written are touched.
            planes = self._empty("planes", (K * L * 2, h.groups * max_stream_bytes(ct * G)), np.uint8)
            if self.lossless:
                k2.encode_word_planes(words, self.nraw, p.lo, tab, ct, G, extra, lengths, plane_bytes, planes)
                del words
            else:
                k2.encode_level_planes(q, p.modes, p.lo, tab, ct, G, lengths, plane_bytes, planes)
                del q
            plane_offsets = np.zeros(K * L * 2 + 1, np.int64)
            np.cumsum(plane_bytes, out=plane_offsets[1:])
            payload = np.empty(int(plane_offsets[-1]), np.uint8)
            cpu_kernels.pack_streams(planes, plane_bytes, plane_offsets, payload)
            del planes
            lengths = lengths.reshape(-1)
            offsets = np.zeros(lengths.size + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            yield _slab_chunks(h, t0, t1, lengths, payload, offsets, extra if self.lossless else None,
                               None if self.lossless else extra)


def fixed_rotate(enc: "_SlabEncoder", src: np.ndarray, shift: int, own: bool) -> np.ndarray:
    """A slab's rows rotated by the fixed-point rotation (kernels/fixed_rotation): float32
    values' bits [L, 2, Ts, C] (uint32).  src, shift: the slab's bits as _fill_rows takes them;
    ``own``: float32 rows (shift 0) are a buffer of the encoder's, which may be overwritten
    (rotate_rows reads each plane before it writes it)."""
    L, _, Ts, C = src.shape
    if shift == 16:
        x = src  # the bfloat16 words, widened row by row in fixed_rows_bf16
        own = False
    else:
        x = src.view(np.float32)
    y = x if own else enc._empty("fixed_y", (L, 2, Ts, C), np.float32)
    fixed_kernels.rotate_rows(x, enc.fixed, 0, y)
    return y.view(np.uint32)


def _sink_bytes(block: torch.Tensor, sink: int) -> np.ndarray:
    """sink_words of a block holding the first ``sink`` tokens."""
    L, _, _, C = block.shape
    if sink == 0:  # (an empty tensor's strides cannot be viewed as bytes)
        return np.zeros((L, 2, 0, C, block.element_size()), np.uint8)
    words = block[:, :, :sink].contiguous().view(torch.uint8).numpy()
    return words.reshape(L, 2, sink, C, block.element_size()).copy()


def _slab_chunks(h: FileHeader, t0: int, t1: int, lengths, payload, offsets, raw: np.ndarray | None = None,
                 ref: np.ndarray | None = None) -> list[Chunk]:
    """The chunks of the slab of tokens [t0, t1) (whole chunks from chunk t0 / chunk_tokens) from
    its streams; ``raw``: the lossless low bytes in chunk order (kernels' encode_word_planes);
    ``ref``: the refinement indices [L, 2, n, C] of the slab's refined tokens (its last n)."""
    L, C, ct = h.num_layers, h.num_channels, h.chunk_tokens
    per = h.streams_per_chunk
    K = -(-(t1 - t0) // ct)
    lengths = lengths.reshape(K, L, 2, h.groups)
    nraw = h.raw_bytes_per_value
    r0 = max(h.refine_start, t0)
    empty = np.empty(0, np.uint8)
    out = []
    for k in range(K):
        a, b = t0 + k * ct, min(t1, t0 + (k + 1) * ct)
        body = empty
        if raw is not None:
            o = k * L * 2 * ct * C * nraw
            body = raw[o : o + L * 2 * (b - a) * C * nraw]
        if ref is not None and b > r0:
            body = pack_refinement_bits(ref[:, :, max(a, r0) - r0 : b - r0], h.params.refine_bits)
        out.append(Chunk(t0 // ct + k, a, b - a, body, empty, lengths[k],
                         payload[offsets[k * per] : offsets[(k + 1) * per]]))
    return out


def pack_refinement_bits(ref: np.ndarray, bits: int) -> np.ndarray:
    """params.pack_refinement's bytes, packed by a parallel kernel."""
    v = np.ascontiguousarray(ref, np.uint8).reshape(-1)
    out = np.empty(-(-(v.size * bits) // 8), np.uint8)
    k2.pack_bits(v, bits, out)
    return out


def unpack_refinement_bits(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    """params.unpack_refinement, unpacked by a parallel kernel: ``count`` indices; the padding
    bits must be zero."""
    raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    n = count * bits
    if raw.size * 8 < n:
        raise SizeError("a refinement section is shorter than its indices")
    if raw[-(-n // 8) :].any() or (n % 8 and raw[n // 8] >> (n % 8)):
        raise SizeError("nonzero padding bits after a refinement section")
    out = np.empty(count, np.uint8)
    k2.unpack_bits(raw, bits, out)
    return out


def encoder_rotation(calibration: Calibration | None, L: int, C: int) -> tuple[np.ndarray, bytes]:
    """(rotation [L, 2, H, D, D] or [0, 0, 0, 0, 0], the Params block's calibration hash) for encoding."""
    if calibration is None:
        return np.zeros((0, 0, 0, 0, 0), np.float32), bytes(32)
    calibration.check_shape(L, C)
    return calibration.rotation, calibration.sha256


def refine_plan(cfg: TransformConfig, T: int, sink: int) -> tuple[int, int]:
    """(refined tokens, bits): the config's last ``recent_tokens`` tokens past the sink tokens."""
    R = min(cfg.recent_tokens, T - sink) if cfg.recent_bits else 0
    return (R, cfg.recent_bits) if R > 0 else (0, 0)


def gather_refinement(h: FileHeader, chunks: list[Chunk]) -> np.ndarray:
    """The refinement indices [L, 2, R, C] of a refined file's last R tokens, from the chunks' raw sections."""
    L, C = h.num_layers, h.num_channels
    p = h.params
    parts = []
    for c in chunks:
        n = h.refined_in(c.first_token, c.token_count)
        if n:
            parts.append(unpack_refinement_bits(c.scales, L * 2 * n * C, p.refine_bits).reshape(L, 2, n, C))
    if not parts:
        return np.zeros((L, 2, 0, C), np.uint8)
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def plane_sensitivity(cfg: TransformConfig, calibration: Calibration | None) -> np.ndarray | None:
    """The sensitivities the steps follow: the calibration's, unless the config says "none"."""
    if calibration is None or cfg.allocation == "none":
        return None
    return calibration.sensitivity


def sink_words(cache: KVCache, sink: int) -> np.ndarray:
    """The first ``sink`` tokens' raw words as bytes [L, 2, S, C, itemsize] (the Params block's sink)."""
    L, C = cache.num_layers, cache.num_channels
    if sink == 0:  # (an empty tensor's strides, e.g. of a 0-token cache read from a file, cannot be viewed as bytes)
        return np.zeros((L, 2, 0, C, ITEMSIZE[cache.dtype_name]), np.uint8)
    words = cache.data[:, :, :sink].contiguous().cpu().view(torch.uint8).numpy()
    return words.reshape(L, 2, sink, C, ITEMSIZE[cache.dtype_name]).copy()


def gather_streams(chunks: list[Chunk]):
    """Every stream's length, start and bytes, chunks back to back: (lengths, offsets, payload)."""
    lengths = (np.concatenate([c.lengths.reshape(-1) for c in chunks]).astype(np.int32)
               if chunks else np.empty(0, np.int32))
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.concatenate([c.payload for c in chunks]) if chunks else np.empty(0, np.uint8)
    return lengths, offsets, payload


def gather_raw(h: FileHeader, chunks: list[Chunk]) -> np.ndarray:
    """The lossless method's raw low bytes of every chunk: [L, 2, T, C, nraw]."""
    L, C, nraw = h.num_layers, h.num_channels, h.raw_bytes_per_value
    if not chunks:
        return np.empty((L, 2, 0, C, nraw), np.uint8)
    return np.concatenate([c.scales.reshape(L, 2, c.token_count, C, nraw) for c in chunks], axis=2)


def check_calibration(h: FileHeader, calibration: Calibration | None) -> np.ndarray:
    """The rotation a file needs ([L, 2, H, D, D] blocks, [0, 0, 0, 0, 0] when none), checked
    against its SHA-256."""
    p = h.params
    L, C = h.num_layers, h.num_channels
    rot = np.zeros((0, 0, 0, 0, 0), np.float32)
    if h.rotated:
        if calibration is None:
            what = f"this file was encoded with calibration {p.calibration.hex()[:16]}…; pass that calibration file"
            raise CalibrationError(what, cli=f"{what} (--calibration)")
        calibration.check_shape(L, C)
        if calibration.sha256 != p.calibration:
            raise CalibrationError(
                f"the calibration file ({calibration.sha256.hex()[:16]}…) is not the one this file was encoded "
                f"with ({p.calibration.hex()[:16]}…)")
        rot = calibration.rotation
    return rot


def decode_v2(h: FileHeader, chunks: list[Chunk], dtype: torch.dtype,
              calibration: Calibration | None = None) -> torch.Tensor:
    """Decode all chunks of a version-2 file into [L, 2, T, C] of ``dtype`` on the CPU
    (pipeline.codec.decode_v2 picks this or the GPU's)."""
    dec = V2SlabDecoder(h, calibration)
    words = dec.empty(h.num_tokens)
    per = slab_chunks_count(h.num_layers, h.num_channels, h.chunk_tokens)
    for first in range(0, len(chunks), per):
        batch = chunks[first : first + per]
        dec.decode_into(batch, words, batch[0].first_token)
    return dec.as_tensor(words)


class V2SlabDecoder:
    """Decodes a version-2 file on the CPU a run of whole chunks at a time: the header's tables
    become coder tables once, then every chunk decodes on its own (token deltas restart at
    each chunk, the refinement indices are in each chunk's raw section, the sink tokens in the
    header).  The calibration is checked here, before anything is decoded."""

    def __init__(self, h: FileHeader, calibration: Calibration | None = None) -> None:
        p = h.params
        L, C = h.num_layers, h.num_channels
        self.h = h
        rot = check_calibration(h, calibration)
        # The inverse rotation reads R by columns: transposed once, it runs like the encoder's.
        self.rot_t = rot
        if rot.size and not h.fixed_rotation:
            self.rot_t = np.empty_like(rot)
            k2.transpose_planes(rot, self.rot_t)
        cum = np.empty((L, 2, C, p.width + 1), np.int32)
        k2.cum_from_table_codes(p.codes, p.alphabet, cum)
        tab = np.empty((L, 2, C, p.width), np.uint32)
        lut = np.empty((L, 2, C, cpu_kernels.LUT_SIZE), np.uint8)
        k2.coder_tables(cum, p.alphabet, tab, lut)
        self.cum, self.lut = cum.reshape(L, 2, -1), lut.reshape(L, 2, -1)
        self.itemsize = ITEMSIZE[h.dtype]
        self.word = np.uint16 if self.itemsize == 2 else np.uint32
        self.buf = SlabBuffers()
        self.sink = None
        self.fixed_t = None  # the fixed-point rotation's transposed blocks (torch: int8 digit blocks, or float64), flags bit 3
        if h.method == METHOD_TRANSFORM:
            self.offsets = bf16_values(p.offsets).astype(np.float32)
            self.steps = bf16_values(p.steps)
            if h.fixed_rotation:
                # The levels q' decode alone (step 1, offset 0: exact), then the integer product
                # and the offsets carried through it (kernels/fixed_rotation).
                self.unit_offsets, self.unit_steps = np.zeros_like(self.offsets), np.ones_like(self.steps)
                rint_t = fixed_kernels.fixed_matrix_kept(rot, p.calibration, True)
                self.fixed_b = np.empty((L, 2, C), np.float64)
                fixed_kernels.offset_sums(self.offsets, rint_t.numpy(), self.fixed_b)
                self.fixed_t = (fixed_kernels.fixed_matrix_kept(rot, p.calibration, True, True)
                                if fixed_kernels.int8_products() else rint_t)
                self.rot_t = _NO_ROTATION
            if h.sink_tokens:
                self.sink = np.ascontiguousarray(p.sink).reshape(-1).view(self.word).reshape(L, 2, h.sink_tokens, C)

    def empty(self, tokens: int, reuse: bool = False) -> np.ndarray:
        """Words [L, 2, tokens, C] to decode into; ``reuse``: the same memory every call."""
        shape = (self.h.num_layers, 2, tokens, self.h.num_channels)
        return self.buf.get("out", shape, self.word) if reuse else np.empty(shape, self.word)

    def as_tensor(self, words: np.ndarray) -> torch.Tensor:
        from ..storage.kvio import DTYPE_BY_NAME

        signed = words.view(np.int16 if self.itemsize == 2 else np.int32)
        return torch.from_numpy(signed).view(DTYPE_BY_NAME[self.h.dtype])

    def _store(self, tmp: np.ndarray, sink: int, out: np.ndarray, t_out: int, Ts: int) -> None:
        """out[:, :, t_out + t] = tmp[:, :, t] in the source dtype, saturating, for sink <= t < Ts."""
        if self.h.dtype == "float16":  # torch's float32 -> float16 rounding, saturating
            np.clip(tmp, -65504.0, 65504.0, out=tmp)
            dst = torch.from_numpy(out.view(np.int16)[:, :, t_out + sink : t_out + Ts]).view(torch.float16)
            dst.copy_(torch.from_numpy(tmp[:, :, sink:]))
        else:
            rope_kernels.store_values(tmp, sink, out, t_out, rope_kernels.KIND_BFLOAT16 if self.h.dtype == "bfloat16"
                                      else rope_kernels.KIND_FLOAT32)

    def decode_into(self, chunks: list[Chunk], out: np.ndarray, t_out: int) -> None:
        """Decode consecutive whole chunks into out[:, :, t_out : t_out + their tokens]; ``out``:
        the source dtype's words (uint16 / uint32) [L, 2, >= t_out + tokens, C]."""
        if not chunks:
            return
        h, p = self.h, self.h.params
        L, C, ct = h.num_layers, h.num_channels, h.chunk_tokens
        T0 = chunks[0].first_token
        Ts = sum(c.token_count for c in chunks)
        lengths, offsets, payload = gather_streams(chunks)
        K = (Ts + ct - 1) // ct
        seen = self.buf.get("seen", (K * L * 2, 2), np.int32)  # each plane's smallest and largest level
        args = (payload, offsets, lengths, self.cum, self.lut, ct, h.group, Ts, p.modes, p.lo, seen)
        if h.method == METHOD_LOSSLESS:
            # The chunks' raw sections back to back are the low bytes in chunk order.
            raw = (chunks[0].scales.reshape(-1) if len(chunks) == 1
                   else np.concatenate([c.scales.reshape(-1) for c in chunks]))
            k2.decode_lossless_planes(*args, raw, h.raw_bytes_per_value, out, t_out)
            check_level_range(int(seen[:, 0].min()), int(seen[:, 1].max()), h.method)
            return
        ref = gather_refinement(h, chunks)
        sink = min(max(h.sink_tokens - T0, 0), Ts)
        first_refined = max(h.refine_start - T0, 0)
        fixed = self.fixed_t is not None
        if fixed:  # the levels q' alone (step 1, offset 0: exact), rotated back below
            args += (_NO_ROTATION, sink, self.unit_offsets, self.unit_steps, first_refined, p.refine_bits, ref)
        else:
            args += (self.rot_t, sink, self.offsets, self.steps, first_refined, p.refine_bits, ref)
        if fixed and p.rope is None and h.dtype == "bfloat16":
            # x' straight to bfloat16 words (the rounding of _store, in the same pass)
            tmp = self.buf.get("f32", (L, 2, Ts, C), np.float32)
            k2.decode_transform_planes(*args, tmp, 0, False)
            fixed_kernels.unrotate_values(tmp, self.fixed_t, self.steps, self.fixed_b, sink, out, t_out,
                                           first_refined)
        elif fixed or p.rope is not None:
            # float32 values (x' through the fixed-point rotation; the keys turned back by their
            # RoPE), then the source dtype, saturating
            tmp = self.buf.get("f32", (L, 2, Ts, C), np.float32)
            k2.decode_transform_planes(*args, tmp, 0, False)
            if fixed:
                fixed_kernels.unrotate_values(tmp, self.fixed_t, self.steps, self.fixed_b, sink, tmp, None,
                                               first_refined)
            if p.rope is not None:
                rope_kernels.turn_keys(tmp, p.rope.inv_freq, p.rope, T0, h.sink_tokens, True)
            self._store(tmp, sink, out, t_out, Ts)
        elif h.dtype == "bfloat16":
            k2.decode_transform_planes(*args, out, t_out, True)
        elif h.dtype == "float32":
            k2.decode_transform_planes(*args, out.view(np.float32), t_out, False)
        else:  # float16: torch's float32 -> float16 rounding
            tmp = self.buf.get("f32", (L, 2, Ts, C), np.float32)
            k2.decode_transform_planes(*args, tmp, 0, False)
            dst = torch.from_numpy(out.view(np.int16)[:, :, t_out : t_out + Ts]).view(torch.float16)
            dst.copy_(torch.from_numpy(tmp))
        check_level_range(int(seen[:, 0].min()), int(seen[:, 1].max()), h.method)
        if sink:
            out[:, :, t_out : t_out + sink] = self.sink[:, :, T0 : T0 + sink]
