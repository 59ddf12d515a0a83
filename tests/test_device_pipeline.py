"""The device-resident pipeline of format version 2 (cachegen_cli/pipeline/transform_resident.py and
kernels/cuda_pipeline.py) against the CPU codec: the same bytes, the same decoded values,
the CPU reader's errors.

Without a GPU these run under numba's CUDA simulator (conftest sets NUMBA_ENABLE_CUDASIM=1)
on CPU tensors: inputs stay tiny.  On a GPU machine run them for real with
NUMBA_ENABLE_CUDASIM=0 (then the tensors live on the GPU).
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.pipeline import codec, transform_resident
from cachegen_cli.format import container
from cachegen_cli.storage import kvio
from cachegen_cli.methods.config import TransformConfig, resolve_quantization
from cachegen_cli.errors import CacheGenError, ChecksumError, SizeError

from cachegen_cli.kernels import cuda_pipeline
from cachegen_cli.kernels.cuda import cuda
from conftest import per_layer, realistic_kv

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "smollm2_pydoc_520.safetensors"


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _device_bytes(kv, quality=None, chunk_tokens=8, quantization=None, layout="auto", calibration=None,
                  rope=None) -> bytes:
    cache = kvio.from_tensors(kv, layout, None)
    cfg = quantization or resolve_quantization(cache.num_layers, quality=quality)
    if rope is not None:
        cache.rope = rope
        cfg = dataclasses.replace(cfg, rope_keys=True)
    out, payload = transform_resident.encode(cache, cfg, chunk_tokens, calibration)
    assert 0 <= payload < out.numel()
    return out.cpu().numpy().tobytes()


def _device_decode(blob: bytes, calibration=None) -> torch.Tensor:
    dev = transform_resident.device()
    t = torch.from_numpy(np.frombuffer(blob, np.uint8).copy()).to(dev)
    h, offsets, size = transform_resident.read_header(t)
    assert transform_resident.decodable(h)
    return transform_resident.decode(t, h, offsets, size, calibration).cpu()


def _check(kv, quality=None, chunk_tokens=8, quantization=None, calibration=None, rope=None):
    cpu = cg.encode(kv, quality=quality, quantization=quantization, chunk_tokens=chunk_tokens, device="cpu",
                    calibration=calibration, rope=rope)
    assert _device_bytes(kv, quality, chunk_tokens, quantization, calibration=calibration, rope=rope) == cpu
    want = cg.decode(cpu, device="cpu", calibration=calibration)["kv"]
    got = _device_decode(cpu, calibration).reshape(want.shape)
    assert got.dtype == want.dtype and torch.equal(_words(got), _words(want))
    return cpu


@pytest.mark.parametrize("dtype, quality, blocks, head_dim", [
    (torch.bfloat16, "balanced", 1, 8), (torch.bfloat16, "high", 2, 8), (torch.float16, "small", 2, 8),
    (torch.float32, "balanced", 1, 5), (torch.bfloat16, "small", 2, 20),
    # blocks the matrix-unit kernels take (kernels/fixed_rotation_matmul: Triton's interpreter here)
    (torch.bfloat16, "high", 2, 32), (torch.bfloat16, "balanced", 1, 32), (torch.float16, "small", 2, 64),
    (torch.float32, "high", 1, 48),
    (torch.bfloat16, "high", 1, 128),  # one block of 256: the streaming kernels
])
def test_rotated_same_bytes_and_values_as_the_cpu(dtype, quality, blocks, head_dim, monkeypatch):
    """A calibration's rotation (one full block, or one per head; blocks wider than the
    kernel's tiles and sizes that are not multiples of them): the device's rotated rows,
    statistics, levels and inverse rotation give the CPU's bytes and values; blocks of 32 to 128
    channels through the matrix-unit kernels (kernels/fixed_rotation_matmul), the others through
    the float64 product."""
    from cachegen_cli.kernels import fixed_rotation_matmul as fm
    from cachegen_cli.methods import calibration as calib

    block = 2 * head_dim // blocks
    calls = []
    for name in ("rotate_rows", "unrotate_values"):
        real = getattr(fm, name)
        monkeypatch.setattr(fm, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name), _real(*a, **kw))[1])

    sample = realistic_kv(layers=2, tokens=30, heads=2, head_dim=head_dim, dtype=torch.float32, seed=11)
    cal = calib.fit([sample.reshape(2, 2, 30, 2 * head_dim)], blocks=blocks)
    assert cal.blocks == blocks
    kv = realistic_kv(layers=2, tokens=21, heads=2, head_dim=head_dim, dtype=dtype, seed=4)
    blob = _check(kv, quality, chunk_tokens=8, calibration=cal)
    h, _, _, _ = codec.read_header_and_index(codec.open_input(blob)[0])
    assert h.rotated and h.params.calibration == cal.sha256
    matmul = block % 32 == 0 and fm.runs_on(transform_resident.device())
    assert fm.supports(block) == (block % 32 == 0)
    assert sorted(set(calls)) == (["rotate_rows", "unrotate_values"] if matmul else [])


@pytest.mark.parametrize("dtype, quality, style, rotary_dim, blocks, head_dim", [
    (torch.bfloat16, "balanced", "half", 8, 0, 8), (torch.float16, "high", "interleaved", 4, 0, 8),
    (torch.float32, "small", "half", 6, 0, 8), (torch.bfloat16, "balanced", "interleaved", 8, 2, 8),
    # blocks the matrix-unit kernels take: the keys turned inside their passes
    (torch.bfloat16, "balanced", "half", 32, 2, 32),  # a block per head
    (torch.bfloat16, "high", "interleaved", 24, 1, 32),  # one block of two heads, part of each turned
    (torch.float16, "small", "half", 64, 2, 64),
    (torch.float32, "balanced", "half", 64, 4, 64),  # blocks of half a head
])
def test_keys_without_rope_same_bytes_and_values_as_the_cpu(dtype, quality, style, rotary_dim, blocks, head_dim,
                                                            monkeypatch):
    """Flags bit 2 (kernels/rope.py over dmul_rn on the device), alone and with a per-head
    rotation; positions far from 0, so the angles' reduction is exercised.  With blocks of 32
    channels or more the keys are turned by fixed_rotation_matmul's turning pass (encoding, in
    rotate_rows' call; decoding, after the product)."""
    from cachegen_cli.kernels import fixed_rotation_matmul as fm
    from cachegen_cli.methods import calibration as calib
    from cachegen_cli.methods import rope

    turned = []
    real_rotate, real_turn = fm.rotate_rows, fm.turn_rows
    monkeypatch.setattr(fm, "rotate_rows", lambda *a, **kw: (
        turned.append(("rotate_rows", kw.get("rope") is not None)), real_rotate(*a, **kw))[1])
    monkeypatch.setattr(fm, "turn_rows", lambda *a, **kw: (turned.append(("turn_rows", a[4])), real_turn(*a, **kw))[1])
    C = 2 * head_dim
    cal = None
    if blocks:
        sample = realistic_kv(layers=2, tokens=30, heads=2, head_dim=head_dim, dtype=torch.float32, seed=11)
        cal = calib.fit([sample.reshape(2, 2, 30, C)], blocks=blocks)
    kv = realistic_kv(layers=2, tokens=21, heads=2, head_dim=head_dim, dtype=dtype, seed=4)
    r = rope.from_theta(10000.0, head_dim, rotary_dim, style, position_start=123457)
    blob = _check(kv, quality, chunk_tokens=8, calibration=cal, rope=r)
    h, _, _, _ = codec.read_header_and_index(codec.open_input(blob)[0])
    assert h.flags & container.FLAG_ROPE
    block = C // max(blocks, 1)
    if blocks and fm.supports(block) and fm.runs_on(transform_resident.device()):
        assert ("rotate_rows", True) in turned and ("turn_rows", True) in turned  # back encoding, forward decoding


@pytest.mark.parametrize("dtype, quality, rope_dim, head_dim, tokens, recent", [
    (torch.bfloat16, "high", 0, 32, 21, 6),  # refined last tokens: their chunks from the product's values
    (torch.float16, "small", 32, 32, 21, 0),  # keys turned in the product's pass; every chunk's levels from it
    (torch.float32, "balanced", 0, 64, 1, 6),  # every token a sink token: no product
])
def test_the_products_levels_give_the_same_bytes(dtype, quality, rope_dim, head_dim, tokens, recent, monkeypatch):
    """CACHEGEN_PRODUCT_LEVELS=1 (rotate_rows' levels, then cuda_pipeline.fix_levels): the
    CPU's bytes and values, as without it."""
    from cachegen_cli.kernels import fixed_rotation_matmul as fm
    from cachegen_cli.methods import calibration as calib
    from cachegen_cli.methods import rope

    monkeypatch.setenv("CACHEGEN_PRODUCT_LEVELS", "1")
    fixed = []
    real = cuda_pipeline.fix_levels
    monkeypatch.setattr(cuda_pipeline, "fix_levels", lambda *a, **kw: (fixed.append(a[7]), real(*a, **kw))[1])
    C = 2 * head_dim
    sample = realistic_kv(layers=2, tokens=30, heads=2, head_dim=head_dim, dtype=torch.float32, seed=11)
    cal = calib.fit([sample.reshape(2, 2, 30, C)], blocks=2)
    kv = realistic_kv(layers=2, tokens=tokens, heads=2, head_dim=head_dim, dtype=dtype, seed=4)
    r = rope.from_theta(10000.0, head_dim, rope_dim, "half", position_start=77) if rope_dim else None
    cfg = dataclasses.replace(resolve_quantization(2, quality=quality), recent_tokens=recent)
    _check(kv, quantization=cfg, chunk_tokens=8, calibration=cal, rope=r)
    if fm.runs_on(transform_resident.device()):
        assert fixed and fixed[0] > 0, "the product made the levels of the chunks before the refined ones"


@pytest.mark.parametrize("quality, dtype", [
    ("balanced", torch.bfloat16), ("lossless", torch.bfloat16), ("high", torch.float16), ("small", torch.float32),
    ("lossless", torch.float32), ("lossless", torch.float16),
])
def test_same_bytes_and_values_as_the_cpu(quality, dtype):
    kv = realistic_kv(layers=2, tokens=23, heads=2, head_dim=8, dtype=dtype, seed=3)
    blob = _check(kv, quality, chunk_tokens=8)
    if quality == "lossless":
        assert torch.equal(_words(_device_decode(blob).reshape(kv.shape)), _words(kv))


@pytest.mark.parametrize("head_dim, dtype, quality", [
    (5, torch.bfloat16, "balanced"), (6, torch.bfloat16, "high"), (6, torch.float32, "lossless"),
    (3, torch.float32, "small"),
])
def test_channels_not_a_multiple_of_eight(head_dim, dtype, quality):
    """The coder's byte-at-a-time path (the word path needs C and the group to be multiples of
    8) and every width of the token-walking kernels' words: 1, 2 or 4 channels per thread."""
    kv = realistic_kv(layers=1, tokens=13, heads=1, head_dim=head_dim, dtype=dtype, seed=5)
    _check(kv, quality, chunk_tokens=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_layers_kernel(dtype):
    """kernels/cuda_pipeline.nonfinite_layers (what check_finite runs on a CUDA cache) flags
    exactly the layers that hold a NaN or an Inf, at any position within a word."""
    from cachegen_cli.kernels import cuda_pipeline as k

    kv = realistic_kv(layers=4, tokens=5, heads=1, head_dim=8, dtype=dtype, seed=6).reshape(4, -1).clone()
    kv[1, 3] = float("nan")
    kv[3, kv.shape[1] - 1] = float("-inf")
    kv[2, 0] = torch.finfo(dtype).max  # the largest finite value is not flagged
    view, mask = kvio.EXPONENT_WORDS[dtype]
    for word in (view, torch.int64):
        words = kv.view(view).view(word)
        flags = np.zeros(4, np.uint8)
        k.nonfinite_layers(words.reshape(-1).numpy(), words.shape[1], mask, kv.element_size(), flags)
        assert flags.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("chunk_tokens, tokens", [(1, 5), (64, 9)])
def test_one_token_chunks_and_a_single_short_chunk(chunk_tokens, tokens):
    kv = realistic_kv(layers=1, tokens=tokens, heads=1, head_dim=8, dtype=torch.bfloat16, seed=tokens)
    _check(kv, "balanced", chunk_tokens=chunk_tokens)


def test_zero_planes_sinks_everywhere_and_refinement_across_chunks():
    kv = realistic_kv(layers=2, tokens=20, heads=1, head_dim=8, dtype=torch.bfloat16, seed=9)
    kv[1, 0] = 0  # a plane whose values all equal their offsets
    cfg = TransformConfig("transform", (0.4,), (0.6,), sink_tokens=2, recent_tokens=7, recent_bits=3)
    _check(kv, quantization=cfg, chunk_tokens=4)  # the refined tokens 13..19 straddle two chunks
    cfg = TransformConfig("transform", (0.5,), (0.5,), sink_tokens=20)
    _check(kv, quantization=cfg, chunk_tokens=8)


def test_shared_tables_and_token_deltas_are_exercised():
    kv = realistic_kv(layers=1, tokens=40, heads=2, head_dim=8, dtype=torch.bfloat16, seed=1)
    blob = _check(kv, "small", chunk_tokens=16)
    reader, _ = codec.open_input(blob)
    h, _, _, _ = codec.read_header_and_index(reader)
    assert h.params.shared.any() and (h.params.modes == 1).any()


def test_per_layer_input():
    kv = realistic_kv(layers=2, tokens=9, heads=2, head_dim=4, dtype=torch.bfloat16, seed=2)
    tensors = per_layer(kv)
    cpu = cg.encode(tensors, quality="balanced", chunk_tokens=4, device="cpu")
    assert _device_bytes(tensors, "balanced", 4) == cpu


def _recrc_chunk(blob: bytearray, offset: int) -> None:
    """Recompute the CRC of the chunk record at offset (so a mutation reaches past it)."""
    head = container.CHUNK_HEADER.unpack_from(blob, offset)
    size = container.CHUNK_HEADER.size + sum(head[4:8])
    body = bytes(blob[offset + container.CHUNK_HEADER.size : offset + size])
    crc = zlib.crc32(bytes(blob[offset : offset + 36]) + body) & 0xFFFFFFFF
    struct.pack_into("<I", blob, offset + 36, crc)


def test_corruption_gives_the_cpu_readers_errors():
    kv = realistic_kv(layers=1, tokens=12, heads=1, head_dim=5, dtype=torch.bfloat16, seed=4)
    # 3 refined tokens x 2 planes x 5 channels x 1 bit = 30 bits: the section has 2 padding bits
    cfg = TransformConfig("transform", (0.5,), (0.5,), recent_tokens=3, recent_bits=1)
    blob = cg.encode(kv, quantization=cfg, chunk_tokens=8, device="cpu")
    bad = bytearray(blob)
    bad[len(blob) - 40] ^= 0x10  # a byte of the last chunk (its CRC no longer matches)
    with pytest.raises(ChecksumError):
        _device_decode(bytes(bad))
    reader, _ = codec.open_input(blob)
    _, _, offsets, _ = codec.read_header_and_index(reader)
    last = offsets[-1]
    raw_size = container.CHUNK_HEADER.unpack_from(blob, last)[4]
    assert raw_size == 4
    bad = bytearray(blob)
    bad[last + container.CHUNK_HEADER.size + raw_size - 1] |= 0x80  # a padding bit, with a valid CRC
    _recrc_chunk(bad, last)
    with pytest.raises(SizeError, match="padding"):
        _device_decode(bytes(bad))


@cuda.jit
def _fast_levels(y, off, step, thr, out):
    i = cuda.grid(1)
    if i < y.shape[0]:
        out[i] = cuda_pipeline._fast_level(np.float64(y[i]), off[i], step[i], 1.0 / step[i], thr[i])


def test_fast_level_is_step_level():
    """The quantize kernel's level from the step's reciprocal (_fast_level) equals the
    correctly rounded division's (transform.step_level) also at every decision point: values
    on a level, on a midpoint, just either side of the threshold, huge, tiny, zero."""
    from cachegen_cli.kernels.transform import TRANSFORM_QMAX, step_level

    rng = np.random.default_rng(0)
    steps = np.array([0.0078125, 0.01171875, 0.3359375, 1.0, 3.0, 96.0], np.float64)  # bfloat16 values
    cases = []
    for step in steps:
        for thr in (0.5, 0.55, 0.75):
            off = np.float32(rng.normal())
            for kq in range(-130, 131, 7):
                for frac in (0.0, thr, -thr, 0.5, 1e-12, -1e-12):
                    y = np.float32(off + (kq + frac) * step)
                    for dy in (0.0, np.spacing(y), -np.spacing(y)):
                        cases.append((np.float32(y + dy), off, step, thr))
            for y in rng.normal(size=40).astype(np.float32) * np.float32(step * 50):
                cases.append((y, off, step, thr))
            cases += [(np.float32(3e38), off, step, thr), (np.float32(-3e38), off, step, thr), (off, off, step, thr)]
    y, off, step, thr = (np.array(c) for c in zip(*cases))
    y, off = y.astype(np.float32), off.astype(np.float32)
    out = np.zeros(len(cases), np.int64)
    _fast_levels[(len(cases) + 127) // 128, 128](y, off, step, thr, out)
    want = [step_level(np.float64(a), b, c, TRANSFORM_QMAX, d) for a, b, c, d in zip(y, off, step, thr)]
    assert out.tolist() == want


def _decision_point_cases(seed: int, per_case: int):
    """y, off, step, thr: values on, and a few float32 steps either side of, every kind of
    decision point of a level (integers, n +- threshold, the clamp, zero) and random ones,
    over bfloat16-valued steps from tiny to huge and several thresholds."""
    from cachegen_cli.kernels.transform import TRANSFORM_QMAX

    rng = np.random.default_rng(seed)
    steps = np.array([2.0 ** -40, 0.0078125, 0.01171875, 0.3359375, 1.0, 3.0, 96.0, 2.0 ** 50], np.float64)
    ys, offs, sts, thrs = [], [], [], []
    for step in steps:
        for thr in (0.5, 0.55, 0.6, 0.75, 0.9):
            off = np.float32(rng.normal() * step * 10)
            kq = rng.integers(-TRANSFORM_QMAX - 3, TRANSFORM_QMAX + 4, per_case)
            frac = rng.choice([0.0, thr, -thr, 1.0 - thr, 0.5, 1e-7, -1e-7], per_case)
            base = (off + (kq + frac) * step).astype(np.float32)
            ulps = rng.integers(-40, 41, per_case).astype(np.float32)
            y = (base + ulps * np.spacing(base)).astype(np.float32)
            y = np.concatenate([y, (rng.normal(size=per_case) * step * 60).astype(np.float32),
                                np.array([off, 3e38, -3e38, 0.0], np.float32)])
            ys.append(y)
            offs.append(np.full(y.shape, off, np.float32))
            sts.append(np.full(y.shape, step))
            thrs.append(np.full(y.shape, thr))
    return (np.concatenate(ys), np.concatenate(offs), np.concatenate(sts), np.concatenate(thrs))


def test_fast_level32_decides_only_what_step_level_decides():
    """The float32 first try of the quantize kernel (transform.fast_level32), run by numba on
    the CPU (the same IEEE float32 operations as the device: no product is followed by a sum,
    so nothing contracts): wherever it says it decided, its level is step_level's; near the
    decision points it declines, and on random values it nearly never does."""
    from numba import njit

    from cachegen_cli.kernels.transform import TRANSFORM_QMAX, fast_level32, step_level

    @njit(cache=False)
    def both(y, off, step, thr, got, decided, want):
        for i in range(y.shape[0]):
            q, ok = fast_level32(y[i], off[i], np.float32(1.0 / step[i]), np.float32(thr[i]))
            got[i] = q
            decided[i] = ok
            want[i] = step_level(np.float64(y[i]), np.float64(off[i]), step[i], TRANSFORM_QMAX, thr[i])

    y, off, step, thr = _decision_point_cases(1, 20000)
    got, want = np.zeros(len(y), np.int64), np.zeros(len(y), np.int64)
    decided = np.zeros(len(y), np.bool_)
    both(y, off, step, thr, got, decided, want)
    assert np.array_equal(got[decided], want[decided])
    assert 0.2 < decided.mean() < 0.999  # the near cases are declined, the others decided
    rand = np.random.default_rng(2).normal(size=200000).astype(np.float32) * np.float32(3.0)
    r_got, r_want = np.zeros(len(rand), np.int64), np.zeros(len(rand), np.int64)
    r_dec = np.zeros(len(rand), np.bool_)
    both(rand, np.full(len(rand), np.float32(0.1)), np.full(len(rand), 0.0625), np.full(len(rand), 0.55),
         r_got, r_dec, r_want)
    assert np.array_equal(r_got[r_dec], r_want[r_dec])
    assert r_dec.mean() > 0.999
    # a real cache's bfloat16 values at the steps of its levels: almost never declined
    real = kvio.read_safetensors(SAMPLE).data.float().numpy().reshape(-1)
    for step in (0.0078125, 0.03125, 0.125):
        n = len(real)
        s_got, s_want, s_dec = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.bool_)
        both(real, np.full(n, np.float32(0.013)), np.full(n, step), np.full(n, 0.55), s_got, s_dec, s_want)
        assert np.array_equal(s_got[s_dec], s_want[s_dec])
        assert s_dec.mean() > 1 - 1e-4, step


@cuda.jit
def _levels32_then64(y, off, step, thr, out):
    i = cuda.grid(1)
    if i < y.shape[0]:
        q, ok = cuda_pipeline.fast_level32(y[i], off[i], np.float32(1.0 / step[i]), np.float32(thr[i]))
        if not ok:
            q = cuda_pipeline._fast_level(np.float64(y[i]), off[i], step[i], 1.0 / step[i], thr[i])
        out[i] = q


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the simulator's +-3e38 x 1/step: inf, clamped
def test_quantize_kernel_level_is_step_level_at_decision_points():
    """The quantize kernel's whole level computation (fast_level32, else _fast_level) on the
    device equals step_level at and around every decision point."""
    from cachegen_cli.kernels.transform import TRANSFORM_QMAX, step_level

    y, off, step, thr = _decision_point_cases(3, 40 if cuda_pipeline.SIM else 4000)
    out = np.zeros(len(y), np.int64)
    _levels32_then64[(len(y) + 127) // 128, 128](y, off, step, thr, out)
    want = [step_level(np.float64(a), np.float64(b), c, TRANSFORM_QMAX, d) for a, b, c, d in zip(y, off, step, thr)]
    assert out.tolist() == want


@cuda.jit
def _code_one_stream(symbols, entries, out, length):
    out32 = out.view(np.uint32)
    low = np.int64(0)
    rng = np.int64(0xFFFFFFFF)
    n = 0
    acc = np.int64(0)
    p = np.int64(-1)
    f = 0
    for i in range(symbols.shape[0]):
        low, rng, n, acc, p, f = cuda_pipeline._code_symbol(low, rng, n, acc, p, f, out, out32,
                                                            np.int64(entries[symbols[i]]))
    if p >= 0:
        n, acc, p, f = cuda_pipeline._emit(out32, n, acc, p, f, 0)
    for i in range(n & ~3, n):
        out[i] = (acc >> (8 * (i & 3))) & 0xFF
    length[0] = cuda_pipeline.flush_stream(low, rng, n, out)


@pytest.mark.parametrize("seed", range(4))
def test_device_coder_holds_bytes_back_exactly(seed):
    """The device encoder keeps its last byte and the 0xFF bytes after it in registers
    (_emit, _carry) instead of walking back over written bytes on a carry, and writes whole
    words (_put): the same bytes as range_coder.encode_stream, on streams made to carry often
    and to emit long 0xFF runs (one symbol of probability ~1, rare symbols at the top of the
    range)."""
    from cachegen_cli.kernels import range_coder
    from cachegen_cli.kernels.coding_params import PROB_TOTAL, max_stream_bytes

    rng = np.random.default_rng(seed)
    freq = np.array([PROB_TOTAL - 40, 8, 8, 8, 8, 8], np.int64) if seed % 2 else rng.integers(1, 4000, 7)
    freq = freq * PROB_TOTAL // freq.sum()
    freq[0] += PROB_TOTAL - freq.sum()
    cum = np.concatenate([[0], np.cumsum(freq)]).astype(np.int64)
    p = freq / freq.sum()
    symbols = rng.choice(len(freq), size=3000, p=p if seed % 4 < 2 else p[::-1] / p.sum()).astype(np.uint8)
    if seed == 3:  # runs of the top symbol: the low end climbs and carries
        symbols[::3] = len(freq) - 1
    entries = (cum[:-1] | (freq << 16)).astype(np.int64)
    entries[entries >= 1 << 31] -= 1 << 32
    out = np.zeros(-(-max_stream_bytes(symbols.size) // 8) * 8, np.uint8)
    length = np.zeros(1, np.int64)
    _code_one_stream[1, 1](symbols, entries.astype(np.int32), out, length)
    want = np.zeros_like(out)
    n = range_coder.encode_stream(symbols.reshape(1, -1), 0, 1, 0, symbols.size, cum.reshape(1, -1), 0, 0, want)
    assert int(length[0]) == n and out[:n].tobytes() == want[:n].tobytes()


@cuda.jit
def _replay(ops, out, length):
    out32 = out.view(np.uint32)
    n = 0
    acc = np.int64(0)
    p = np.int64(-1)
    f = 0
    for i in range(ops.shape[0]):
        if ops[i] < 0:
            n, acc, p, f = cuda_pipeline._carry(out, out32, n, acc, p, f)
        else:
            n, acc, p, f = cuda_pipeline._emit(out32, n, acc, p, f, np.int64(ops[i]))
    if p >= 0:
        n, acc, p, f = cuda_pipeline._emit(out32, n, acc, p, f, 0)
    for i in range(n & ~3, n):
        out[i] = (acc >> (8 * (i & 3))) & 0xFF
    length[0] = n


@pytest.mark.parametrize("seed", range(3))
def test_held_back_bytes_and_carries(seed):
    """_emit / _carry against range_coder._add_carry on bytes in memory, over sequences rich in
    0xFF bytes and carries: carries into a run of 0xFF, into a held-back 0xFF first byte
    (through the word being filled and the words written: _add_carry_words), twice in a row,
    before any byte."""
    from cachegen_cli.kernels import range_coder

    rng = np.random.default_rng(seed)
    ops = rng.choice([-1, 0xFF, 0xFE, 0x00, 0x7F], size=4000, p=[0.25, 0.45, 0.15, 0.1, 0.05]).astype(np.int64)
    ops[:3] = [-1, 0xFF, -1]  # a carry before any byte, then into a first byte of 0xFF
    want = np.zeros(ops.size, np.uint8)
    n = 0
    for op in ops:
        if op < 0:
            range_coder._add_carry(want, n)
        else:
            want[n] = op
            n += 1
    out = np.zeros(-(-ops.size // 8) * 8, np.uint8)
    length = np.zeros(1, np.int64)
    _replay[1, 1](ops, out, length)
    assert int(length[0]) == n and out[:n].tobytes() == want[:n].tobytes()


def test_levels_past_the_range_fail_on_the_device_as_on_the_cpu():
    """A file whose token deltas sum past the levels' range (docs/format.md; CRCs valid) is
    flagged by the device's dequantize kernel, and the CPU reader's SizeError is raised."""
    from test_hardening import _ramp, _shift_delta_tables

    blob = cg.encode(_ramp(), quality="high", chunk_tokens=64, device="cpu")
    assert torch.equal(_device_decode(_shift_delta_tables(blob, 0)).reshape(-1).view(torch.int16),
                       cg.decode(blob, device="cpu")["kv"].reshape(-1).view(torch.int16))
    with pytest.raises(SizeError, match="outside"):
        _device_decode(_shift_delta_tables(blob, 10))


def test_rotated_range_is_refused_by_both_writers():
    """A rotated file whose largest level x step + offset passes float32's range would decode to
    Inf - Inf: readers reject it (docs/format.md), so both writers refuse to write it."""
    from cachegen_cli.methods import calibration as calib

    kv = torch.randn(1, 2, 12, 1, 4, generator=torch.Generator().manual_seed(3)) * 1e37  # finite, step ~ 5e36
    cal = calib.fit([realistic_kv(layers=1, tokens=20, heads=1, head_dim=4, seed=2).reshape(1, 2, 20, 4)])
    with pytest.raises(SizeError, match="float32's range"):
        cg.encode(kv, quality="balanced", calibration=cal, chunk_tokens=4, device="cpu")
    with pytest.raises(SizeError, match="float32's range"):
        _device_bytes(kv, "balanced", 4, calibration=cal)


@pytest.mark.parametrize("quality, dtype, where, value", [
    ("balanced", torch.bfloat16, "token", float("nan")), ("high", torch.float16, "token", float("inf")),
    ("small", torch.float32, "sink", float("-inf")), ("lossless", torch.bfloat16, "token", float("nan")),
    ("lossless", torch.float32, "token", float("inf")), ("balanced", torch.bfloat16, "sink", float("nan")),
])
def test_unchecked_cache_gets_the_finiteness_error_from_the_pipelines_own_pass(quality, dtype, where, value):
    """encode_to_device leaves kvio.check_finite to the pipeline (kvio.from_tensors(check=False)):
    its statistics (sums not finite) or lossless level pass (exponent bits) and a look at the
    sink tokens raise check_finite's own error, naming the layer; a finite cache, its bytes."""
    from cachegen_cli.errors import NonFiniteError

    kv = realistic_kv(layers=3, tokens=12, heads=1, head_dim=8, dtype=dtype, seed=8)
    cfg = resolve_quantization(3, quality=quality)
    assert cfg.method == "lossless" or cfg.sink_tokens >= 1
    cache = kvio.from_tensors(kv, "auto", None, check=False)
    assert transform_resident.encode(cache, cfg, 8, checked=False)[0].cpu().numpy().tobytes() == \
        cg.encode(kv, quality=quality, chunk_tokens=8, device="cpu")
    bad = kv.clone()
    bad[2, 1, 0 if where == "sink" else 9, 0, 5] = value
    with pytest.raises(NonFiniteError) as want:
        kvio.check_finite(kvio.from_tensors(bad, "auto", None, check=False).data)
    assert "layer 2" in str(want.value)
    with pytest.raises(NonFiniteError) as got:
        transform_resident.encode(kvio.from_tensors(bad, "auto", None, check=False), cfg, 8, checked=False)
    assert str(got.value) == str(want.value)


def test_header_crc_checked_on_the_device():
    """read_header leaves the Params block's CRC-32 to the device (defer_crc): a flipped bit in
    a table entry the parser accepts, or in a step, still gives the CPU reader's ChecksumError;
    a flip that breaks the parse gives the ChecksumError too (the CRC comes first, as on the CPU)."""
    kv = realistic_kv(layers=2, tokens=12, heads=1, head_dim=8, dtype=torch.bfloat16, seed=2)
    blob = cg.encode(kv, quality="balanced", chunk_tokens=8, device="cpu")
    h, _, _, _ = codec.read_header_and_index(codec.open_input(blob)[0])
    t = transform_resident.device()
    hd, _, _ = transform_resident.read_header(torch.from_numpy(np.frombuffer(blob, np.uint8).copy()).to(t))
    crc, head_crc, params_size = hd.deferred_crc
    assert zlib.crc32(blob[64 : 64 + h.params_at - 64 + params_size], zlib.crc32(blob[:60])) == crc
    assert zlib.crc32(blob[64 : h.params_at], zlib.crc32(blob[:60])) == head_crc
    ends = h.params_at + params_size
    for at in (h.params_at + 32 + 1, ends - 1, h.params_at + 32 + 4 * 2 + 3):  # a step, the last table byte, an offset
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(ChecksumError):
            cg.decode(bytes(bad), device="cpu")
        with pytest.raises(ChecksumError):
            _device_decode(bytes(bad))
    assert torch.equal(_words(_device_decode(blob).reshape(kv.shape)), _words(cg.decode(blob, device="cpu")["kv"]))


@pytest.mark.parametrize("C, n, allocated", [(5, 7, False), (129, 300, True), (520, 4096, False), (300, 1, True),
                                          (64, 0, False), (16, 50, True)])
def test_plane_steps_kernel_is_step_params(C, n, allocated):
    """kernels/cuda_pipeline.plane_steps (the steps on the device) gives methods/transform.
    step_params' bits, also where the channel sum takes numpy's pairwise stack (C > 128), for
    a mean past bfloat16's range, a plane without spread and no tokens, and with a calibration's
    sensitivities (the allocation's logarithms and exponentials: kernels/allocation.py); a sum
    that is not finite is flagged."""
    from cachegen_cli.methods import transform as tc

    rng = np.random.default_rng(C + n)
    L = 3 if allocated else 2
    mean = rng.standard_t(3, size=(L, 2, C)) * 10.0
    sums = mean * n + rng.normal(size=mean.shape)
    sumsq = mean ** 2 * n + np.abs(rng.normal(size=mean.shape)) * max(n, 1)
    sums[0, 0, 0] = 1e300
    sums[1, 1] = 0.0
    sumsq[1, 1] = 0.0
    rel = rng.random((L, 2))
    sens = np.exp(rng.normal(size=(L, 2)) * 3) if allocated else None
    want = tc.step_params(sums, sumsq, n, rel, sens)
    obits = np.zeros((L, 2, C), np.int32)
    offs = np.zeros((L, 2, C), np.float32)
    sbits = np.zeros((L, 2), np.int32)
    steps = np.zeros((L, 2), np.float64)
    bad = np.zeros(1, np.int32)
    alloc = (sens, tc.ALLOCATION_STRENGTH, tc.MIN_STEP, tc.ALLOCATION_MAX_STEP) if allocated else None
    cuda_pipeline.plane_steps(sums, sumsq, n, tc.BF16_MAX, rel, obits, offs, sbits, steps, np.zeros((L, 2, C)),
                              np.zeros((4, 2 * L)), bad, allocation=alloc)
    assert np.array_equal(obits.astype(np.uint16), want[0]) and np.array_equal(offs, want[1].astype(np.float32))
    assert np.array_equal(sbits.astype(np.uint16), want[2]) and np.array_equal(steps.view(np.int64), want[3].view(np.int64))
    if allocated and n > 1:
        assert len(set(want[3].reshape(-1).tolist())) > 2, "the allocation gave the planes different steps"
    assert bad[0] == 0
    sums[1, 0, C - 1] = np.inf
    cuda_pipeline.plane_steps(sums, sumsq, n, tc.BF16_MAX, rel, obits, offs, sbits, steps, np.zeros((L, 2, C)),
                              np.zeros((4, 2 * L)), bad, allocation=alloc)
    assert bad[0] == 1


def test_plane_steps_kernel_takes_the_rms_of_other_sums():
    """plane_steps' rms_sums (keys coded without their RoPE: the step relative to the keys as
    they are) gives step_params' bits with rms_sums; a sum among them that is not finite is
    flagged."""
    from cachegen_cli.methods import transform as tc

    rng = np.random.default_rng(3)
    L, C, n = 2, 130, 77
    sums, sumsq, r1, r2 = (rng.normal(size=(L, 2, C)) * n for _ in range(4))
    sumsq, r2 = np.abs(sumsq) * 9, np.abs(r2) * 4
    rel = rng.random((L, 2))
    want = tc.step_params(sums, sumsq, n, rel, None, (r1, r2))
    assert not np.array_equal(want[2], tc.step_params(sums, sumsq, n, rel)[2])
    out = [np.zeros((L, 2, C), np.int32), np.zeros((L, 2, C), np.float32), np.zeros((L, 2), np.int32),
           np.zeros((L, 2), np.float64)]
    bad = np.zeros(1, np.int32)
    scratch = (np.zeros((L, 2, C), np.int32), np.zeros((L, 2, C), np.float32))
    cuda_pipeline.plane_steps(sums, sumsq, n, tc.BF16_MAX, rel, *out, np.zeros((L, 2, C)), np.zeros((4, 2 * L)),
                              bad, rms_sums=(r1, r2, *scratch))
    assert np.array_equal(out[0].astype(np.uint16), want[0]) and np.array_equal(out[1], want[1].astype(np.float32))
    assert np.array_equal(out[2].astype(np.uint16), want[2]) and np.array_equal(out[3], want[3])
    assert bad[0] == 0
    r2[1, 0, 5] = np.nan
    cuda_pipeline.plane_steps(sums, sumsq, n, tc.BF16_MAX, rel, *out, np.zeros((L, 2, C)), np.zeros((4, 2 * L)),
                              bad, rms_sums=(r1, r2, *scratch))
    assert bad[0] == 1


def test_no_kernel_gets_a_temporary_tensor():
    """transform_resident._nb's views hold no reference: a tensor made inside a launch's
    argument list is freed before the launch and its block can go to the next allocation (on
    the H200 the steps kernel once read its relative steps through its scratch).  Only cached
    or named tensors (and views of named ones) may be passed."""
    import inspect
    import re

    src = inspect.getsource(transform_resident)
    bad = re.findall(r"_nb\((?:_empty|_to_device|_upload|torch\.(?:empty|zeros|from_numpy|tensor))\(", src)
    assert bad == []


@pytest.mark.parametrize("field, value", [(1, 5), (3, 7), (7, 1), (8, 1)])
def test_a_wrong_chunk_header_field_gives_the_cpu_readers_error(field, value):
    """The chunk headers are checked after the device decoded (their sizes come from the index):
    a field that disagrees (index, token count, payload size, reserved), with a valid CRC, still
    gets exactly the CPU reader's error."""
    kv = realistic_kv(layers=1, tokens=12, heads=1, head_dim=5, dtype=torch.bfloat16, seed=5)
    blob = cg.encode(kv, quality="balanced", chunk_tokens=8, device="cpu")
    reader, _ = codec.open_input(blob)
    _, _, offsets, _ = codec.read_header_and_index(reader)
    bad = bytearray(blob)
    fields = list(container.CHUNK_HEADER.unpack_from(blob, offsets[0]))
    fields[field] = value
    container.CHUNK_HEADER.pack_into(bad, offsets[0], *fields)
    _recrc_chunk(bad, offsets[0])
    with pytest.raises(CacheGenError) as cpu_error:
        cg.decode(bytes(bad), device="cpu")
    with pytest.raises(type(cpu_error.value)) as device_error:
        _device_decode(bytes(bad))
    assert str(device_error.value) == str(cpu_error.value)


# lossless: the simulator codes it in seconds (balanced's bytes are pinned by the in-memory tests
# above; what is new here is the files' reading and writing)
@pytest.mark.parametrize("quality, dtype, layout", [("lossless", torch.bfloat16, "stacked"),
                                                    ("lossless", torch.float16, "per-layer")])
def test_file_paths_on_the_device_write_the_cpus_files(tmp_path, quality, dtype, layout):
    """api.encode_file / decode_file on the device (the input read into the page-locked "input"
    buffer and checked by the pipeline's own pass, the decoded cache written from the "output"
    buffer; pageable memory under the simulator): the CPU's .cgen and safetensors bytes; a NaN
    in the file gets the CPU's error, naming the layer, and leaves no output."""
    from safetensors.torch import save_file

    from cachegen_cli.errors import NonFiniteError

    kv = realistic_kv(layers=2, tokens=66, heads=1, head_dim=8, dtype=dtype, seed=3)  # > SMALL_CACHE_TOKENS
    tensors = {"kv": kv} if layout == "stacked" else per_layer(kv)
    src = tmp_path / "c.safetensors"
    save_file(tensors, str(src))
    out = {}
    for dev in ("cpu", "cuda"):
        summary = cg.api.encode_file(src, tmp_path / f"{dev}.cgen", device=dev, quality=quality, chunk_tokens=33)
        assert summary.header.num_tokens == 66 and summary.file_bytes == (tmp_path / f"{dev}.cgen").stat().st_size
        cg.api.decode_file(tmp_path / f"{dev}.cgen", tmp_path / f"{dev}.decoded.safetensors", device=dev)
        out[dev] = ((tmp_path / f"{dev}.cgen").read_bytes(), (tmp_path / f"{dev}.decoded.safetensors").read_bytes())
    assert out["cuda"] == out["cpu"]
    bad = {k: v.clone() for k, v in tensors.items()}
    flat = bad[sorted(bad)[-1]].view(-1)  # the last layer's values
    flat[flat.numel() // 2] = float("nan")
    save_file(bad, str(src))
    errors = []
    for dev in ("cpu", "cuda"):
        with pytest.raises(NonFiniteError) as got:
            cg.api.encode_file(src, tmp_path / "bad.cgen", device=dev, quality=quality, chunk_tokens=33, force=True)
        errors.append(str(got.value))
    assert errors[0] == errors[1] and "layer 1" in errors[0]
    assert not (tmp_path / "bad.cgen").exists()


def test_file_encode_on_the_device_checks_values_in_its_own_pass(tmp_path):
    """A transform quality read from a file on the device: the NaN found by the pipeline's
    statistics pass, with the CPU's words."""
    from safetensors.torch import save_file

    from cachegen_cli.errors import NonFiniteError

    kv = realistic_kv(layers=2, tokens=66, heads=1, head_dim=8, dtype=torch.bfloat16, seed=4)
    kv[1, 0, 40, 0, 3] = float("inf")
    save_file({"kv": kv}, str(tmp_path / "c.safetensors"))
    errors = []
    for dev in ("cpu", "cuda"):
        with pytest.raises(NonFiniteError) as got:
            cg.api.encode_file(tmp_path / "c.safetensors", tmp_path / "c.cgen", device=dev, quality="balanced")
        errors.append(str(got.value))
    assert errors[0] == errors[1] and "layer 1" in errors[0]


def test_a_version_2_file_without_chunks_decodes_to_a_file_on_the_device(tmp_path):
    """The device's file decoder only walks a file's tables (they are read on the device); a
    version-2 file of no tokens has no chunks for the device and is decoded on the CPU, which
    reads the tables: the CPU's output bytes."""
    from cachegen_cli import api

    kv = torch.zeros(2, 2, 0, 1, 8, dtype=torch.bfloat16)
    buf = codec.ByteCollector()
    codec.encode_to_stream(kvio.from_tensors(kv, "auto", None), buf, resolve_quantization(2, quality="balanced"), 16,
                           device="cpu", fallback=False)
    data = buf.getvalue()
    assert struct.unpack_from("<H", data, 8)[0] == container.FORMAT_VERSION_2
    (tmp_path / "z.cgen").write_bytes(data)
    for dev in ("cuda", "cpu"):
        api.decode_file(tmp_path / "z.cgen", tmp_path / f"{dev}.safetensors", device=dev)
    assert (tmp_path / "cuda.safetensors").read_bytes() == (tmp_path / "cpu.safetensors").read_bytes()


@pytest.mark.parametrize("head_dim, kv_index, value", [
    (8, 1, float("inf")),  # blocks the numba fixed-point rows take
    (32, 1, float("nan")),  # blocks the matrix-unit kernels take (Triton's interpreter here)
    (32, 0, float("-inf")),
])
def test_unchecked_calibrated_cache_gets_the_finiteness_error(head_dim, kv_index, value, monkeypatch):
    """With a per-head rotation the sums come from the rotated rows: a NaN or an Inf in a row
    must still reach them (the pipeline's only finiteness check for encode_to_device), so the
    encoder raises check_finite's error naming the layer, never writes a file."""
    from cachegen_cli.errors import NonFiniteError
    from cachegen_cli.kernels import fixed_rotation_matmul as fm
    from cachegen_cli.methods import calibration as calib

    products = []
    real_rotate = fm.rotate_rows
    monkeypatch.setattr(fm, "rotate_rows", lambda *a, **kw: (products.append(1), real_rotate(*a, **kw))[1])

    C = 2 * head_dim
    sample = realistic_kv(layers=2, tokens=30, heads=2, head_dim=head_dim, dtype=torch.float32, seed=11)
    cal = calib.fit([sample.reshape(2, 2, 30, C)], blocks=2)
    kv = realistic_kv(layers=2, tokens=12, heads=2, head_dim=head_dim, dtype=torch.bfloat16, seed=8)
    cfg = resolve_quantization(2, quality="balanced")
    bad = kv.clone()
    bad[1, kv_index, 9, 1, 3] = value
    with pytest.raises(NonFiniteError, match="layer 1"):
        transform_resident.encode(kvio.from_tensors(bad, "auto", None, check=False), cfg, 8, cal, checked=False)
    if fm.runs_on(transform_resident.device()):
        assert bool(products) == fm.supports(head_dim)  # the path the case is meant for


@pytest.mark.parametrize("seed", range(3))
def test_write_streams_copies_words_and_edge_bytes(seed):
    """write_streams copies each stream's whole 4-byte words of the file as words made of two
    shifted slot words, and the bytes at its ends one by one: streams of 0 to 40 bytes at every
    alignment, back to back, with their u16 lengths, against numpy; the bytes around them are
    left as they were."""
    rng = np.random.default_rng(seed)
    per, K = 5, 3
    n = per * K
    row = 48  # slot rows of whole words, up to 40 bytes used
    lengths = rng.integers(0, 41, n).astype(np.int32)
    lengths[:4] = [0, 1, 3, 40]
    slots = rng.integers(0, 256, (n, row)).astype(np.uint8)
    excl = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    lengths_at = np.zeros(K, np.int64)
    payload_at = np.zeros(K, np.int64)
    at = int(rng.integers(0, 4))
    for k in range(K):  # a chunk's lengths, its streams, then a gap of a few bytes
        lengths_at[k] = at
        payload_at[k] = at + 2 * per
        at = payload_at[k] + int(lengths[k * per : (k + 1) * per].sum()) + int(rng.integers(1, 6))
    size = -(-(at + 5) // 4) * 4
    fill = rng.integers(0, 256, size).astype(np.uint8)
    want = fill.copy()
    for s in range(n):
        k = s // per
        want[lengths_at[k] + 2 * (s % per) : lengths_at[k] + 2 * (s % per) + 2] = [lengths[s] & 0xFF, lengths[s] >> 8]
        o = payload_at[k] + excl[s] - excl[k * per]
        want[o : o + lengths[s]] = slots[s, : lengths[s]]
    out = cuda.to_device(fill)  # one buffer, two views (a host array would be copied for each)
    slots_d = cuda.to_device(slots)
    cuda_pipeline.write_streams(out, out.view(np.int32), payload_at, lengths_at, lengths, excl, per, slots_d,
                                slots_d.view(np.int32))
    assert out.copy_to_host().tobytes() == want.tobytes()


@pytest.mark.parametrize("V", [1, 2, 4])
def test_histogram_counts_as_numpy(V):
    """histogram's counts equal numpy's count of every token's symbol (level - lo, or the token
    delta's level - previous - lo, mod 256; a chunk's first token against 0): levels with long
    runs (which a kernel adding runs would get wrong at a chunk's end), short ones and none,
    chunks of 5 tokens and a short last one, channels direct and delta."""
    rng = np.random.default_rng(V)
    L, T, C, ct = 1, 23, 32, 5
    levels = rng.integers(-3, 4, (L, 2, T, C)).astype(np.int8)
    levels[:, :, :, :8] = levels[:, :, :1, :8]  # constant channels: one run a chunk
    levels[:, :, 10:, 8:12] = 7  # runs that start mid-chunk and cross chunk ends
    levels[:, :, :, 12:16] = rng.integers(-128, 128, (L, 2, T, 4)).astype(np.int8)  # rarely a run
    lo = rng.integers(-4, 1, (L, 2, C)).astype(np.int64)
    delta = rng.integers(0, 2, (L, 2, C)).astype(bool)
    lob = (lo & 0xFF).astype(np.uint8)
    dmb = np.where(delta, 0xFF, 0).astype(np.uint8)
    u = levels.astype(np.int64) & 0xFF
    prev = np.zeros_like(u)
    prev[:, :, 1:] = u[:, :, :-1]
    prev[:, :, ::ct] = 0  # each chunk's first token codes its level
    sym = (u - np.where(delta[:, :, None, :], prev, 0) - lo[:, :, None, :]) & 0xFF
    want = np.zeros((L, 2, C, 256), np.int32)
    for l in range(L):
        for kv in range(2):
            for c in range(C):
                want[l, kv, c] = np.bincount(sym[l, kv, :, c], minlength=256)
    q = levels.view(np.uint8).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[V]).reshape(L, 2, T, C // V)
    counts = np.zeros((L, 2, C, 256), np.int32)
    cuda_pipeline.histogram(q, lob, dmb, ct, counts)
    assert (counts == want).all()
