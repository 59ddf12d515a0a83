"""The CPU-only fast paths (cpu.encode_planes / cpu.decode_planes and their helpers)
against the reference kernels, which run the shared device functions stage by stage
(the CUDA kernels run the same functions): same scales, codes, stream bytes and symbols,
on realistic and edge-case data, and on arbitrary (corrupt) stream bytes."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cachegen_cli.pipeline import codec
from cachegen_cli.methods.config import QuantizationConfig, QuantizationSpec
from cachegen_cli.kernels import cpu
from cachegen_cli.kernels.cdf import codes_to_cum, counts_to_codes
from cachegen_cli.kernels.coding_params import PROB_TOTAL, max_stream_bytes
from cachegen_cli.storage.kvio import from_tensors

from conftest import realistic_kv


# ---------------------------------------------------------------- helpers


def _reference_encode(x: np.ndarray, maxq: np.ndarray, ct: int, group: int, width: int):
    """The stage-by-stage reference kernels on float32 x [L, 2, T, C]."""
    L, _, T, C = x.shape
    K = -(-T // ct)
    scales = np.empty((L, 2, T), np.uint16)
    symbols = np.empty((L, 2, T, C), np.uint8)
    cpu.quantize(np.ascontiguousarray(x), maxq, scales, symbols)
    counts = np.empty((K, L, 2, C, width), np.int32)
    cpu.histogram(symbols, ct, counts)
    codes = np.empty((K, L, 2, C, width), np.uint8)
    cum = np.empty((K, L, 2, C, width + 1), np.int32)
    cpu.build_cdf(counts, maxq, codes, cum)
    n = K * L * 2 * (-(-C // group))
    slots = np.empty((n, max_stream_bytes(ct * group)), np.uint8)
    lengths = np.empty(n, np.int32)
    cpu.encode_streams(symbols, cum, ct, group, slots, lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.empty(int(offsets[-1]), np.uint8)
    cpu.pack_streams(slots, lengths, offsets, payload)
    return scales, symbols, codes, cum, lengths, offsets, payload


def _fast_encode(words: np.ndarray, shift: int, maxq: np.ndarray, ct: int, group: int, width: int, t_first=0, T=None):
    L, _, _, C = words.shape
    T = words.shape[2] - t_first if T is None else T
    K = -(-T // ct)
    groups = -(-C // group)
    scales = np.empty((L, 2, T), np.uint16)
    codes = np.empty((K, L, 2, C, width), np.uint8)
    lengths = np.empty((K, L, 2, groups), np.int32)
    plane_bytes = np.empty(K * L * 2, np.int64)
    planes = np.empty((K * L * 2, groups * max_stream_bytes(ct * group)), np.uint8)
    cpu.encode_planes(words, shift, t_first, T, maxq, ct, group, scales, codes, lengths, plane_bytes, planes)
    payload = np.concatenate([planes[j, : plane_bytes[j]] for j in range(K * L * 2)]) if K else np.empty(0, np.uint8)
    assert plane_bytes.sum() == lengths.sum()
    return scales, codes, lengths.reshape(-1), payload


def _reference_decode(payload, offsets, lengths, codes, maxq, ct, group, scales, C):
    K, L = codes.shape[:2]
    T = scales.shape[2]
    cum = np.empty(codes.shape[:-1] + (codes.shape[-1] + 1,), np.int32)
    cpu.cum_from_codes(codes, maxq, cum)
    symbols = np.empty((L, 2, T, C), np.uint8)
    cpu.decode_streams(payload, offsets, lengths, cum, maxq, ct, group, symbols)
    out = np.empty((L, 2, T, C), np.float32)
    cpu.dequantize(symbols, scales, maxq, out)
    return symbols, out


def _bf16_words(x32: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _check_roundtrip(x32: np.ndarray, maxq: np.ndarray, ct: int, group: int, bf16: bool):
    """Encode x (float32 [L, 2, T, C]; rounded to bfloat16 first when bf16) both ways and
    decode both ways; everything must agree bit for bit."""
    L, _, T, C = x32.shape
    width = int(2 * maxq.max() + 1)
    if bf16:
        words = _bf16_words(x32)
        x32 = (words.astype(np.uint32) << 16).view(np.float32)
        shift = 16
    else:
        words = np.ascontiguousarray(x32).view(np.uint32)
        shift = 0
    scales, symbols, codes, cum, lengths, offsets, payload = _reference_encode(x32, maxq, ct, group, width)
    f_scales, f_codes, f_lengths, f_payload = _fast_encode(words, shift, maxq, ct, group, width)
    np.testing.assert_array_equal(f_scales, scales)
    np.testing.assert_array_equal(f_codes, codes)
    np.testing.assert_array_equal(f_lengths, lengths)
    np.testing.assert_array_equal(f_payload, payload)

    ref_symbols, ref_out = _reference_decode(payload, offsets, lengths, codes, maxq, ct, group, scales, C)
    np.testing.assert_array_equal(ref_symbols, symbols)
    out = np.full((L, 2, T, C), np.nan, np.float32)
    cpu.decode_planes(payload, offsets, lengths, codes, maxq, ct, group, scales, out, 0, False)
    np.testing.assert_array_equal(out.view(np.uint32), ref_out.view(np.uint32))
    out16 = np.zeros((L, 2, T, C), np.uint16)
    cpu.decode_planes(payload, offsets, lengths, codes, maxq, ct, group, scales, out16, 0, True)
    np.testing.assert_array_equal(out16, _bf16_words(ref_out))


def _maxq(L: int, kbins, vbins) -> np.ndarray:
    return np.array([[(kbins - 1) // 2, (vbins - 1) // 2]] * L, np.int32)


# ---------------------------------------------------------------- whole-plane round trips


@pytest.mark.parametrize("chunk_tokens", [1, 255, 256, 257])
@pytest.mark.parametrize("bf16", [True, False])
def test_realistic_chunk_sizes(chunk_tokens, bf16):
    # C = 20 with group 4 (256 / 257 tokens: group 3 or 4): full groups in lock step and a
    # remainder; tokens not a multiple of the chunk size
    kv = realistic_kv(layers=2, tokens=600, heads=4, head_dim=5, dtype=torch.float32, seed=chunk_tokens)
    x = kv.reshape(2, 2, 600, 20).numpy()
    group = max(1, min(20, 1024 // chunk_tokens))
    _check_roundtrip(x, _maxq(2, 32, 16), chunk_tokens, group, bf16)


@pytest.mark.parametrize("bins", [(3, 4), (16, 17), (32, 33), (255, 254), (255, 255)])
@pytest.mark.parametrize("group", [1, 3, 4, 7, 16])
def test_bins_and_groups(bins, group):
    kv = realistic_kv(layers=2, tokens=70, heads=3, head_dim=7, dtype=torch.float32, seed=sum(bins) + group)
    x = kv.reshape(2, 2, 70, 21).numpy()
    _check_roundtrip(x, _maxq(2, *bins), 32, group, bf16=True)
    _check_roundtrip(x, _maxq(2, *bins), 32, group, bf16=False)


def test_edge_values():
    rng = np.random.default_rng(7)
    L, T, C = 2, 300, 24
    x = rng.standard_normal((L, 2, T, C)).astype(np.float32)
    x[0, 0, :, 3] = 0  # an all-zero channel
    x[0, 1, :, 5] = 1.5  # constant channels
    x[1, 0, :, :] = -0.25
    x[1, 1, 7, :] = 0  # all-zero tokens (scale 0)
    x[1, 1, 8, :] = -0.0
    x[0, 1, 9, :] = np.float32(3.0e38) * np.sign(rng.standard_normal(C)).astype(np.float32)  # scale beyond bf16 max
    x[0, 1, 10, :] = np.float32(1e-40)  # subnormals
    x[0, 1, 11, :4] = [1e-45, -1e-45, 0, -0.0]
    x[1, 1, 12, :] = rng.standard_normal(C).astype(np.float32) * np.float32(2.0**-130)
    for bf16 in (True, False):
        for ct in (1, 255, 256, 257):
            _check_roundtrip(x, _maxq(L, 32, 16), ct, max(1, min(C, 1024 // ct)), bf16)
            _check_roundtrip(x, _maxq(L, 255, 3), ct, max(1, min(C, 1024 // ct)), bf16)


@pytest.mark.parametrize("bins", [16, 17, 32, 255])
def test_values_on_rounding_boundaries(bins):
    """Values whose level x * maxq / scale sits exactly on, or one float32 step either side
    of, a half-integer: where the rounding of quantize_value is decided."""
    m = (bins - 1) // 2
    rng = np.random.default_rng(bins)
    T, C = 64, 64
    x = np.empty((1, 2, T, C), np.float32)
    for kv in range(2):
        for t in range(T):
            scale = np.float32(rng.uniform(0.01, 100.0))
            # the stored scale is the abs-max rounded up to a bfloat16; make the row's max that value
            bits = int(np.array([scale], np.float32).view(np.uint32)[0])
            sbits = (bits >> 16) + (1 if bits & 0xFFFF else 0)
            s = np.array([sbits << 16], np.uint32).view(np.float32)[0]
            inv = np.float32(np.float64(m) / np.float64(s))
            k = rng.integers(0, m, C).astype(np.float64) + 0.5
            target = (k / np.float64(inv)).astype(np.float32)
            nudge = rng.integers(-1, 2, C)
            row = np.where(nudge > 0, np.nextafter(target, np.float32(np.inf)),
                           np.where(nudge < 0, np.nextafter(target, np.float32(0)), target)).astype(np.float32)
            row = np.minimum(row, s) * np.where(rng.random(C) < 0.5, -1, 1).astype(np.float32)
            row[0] = s
            x[0, kv, t] = row
    _check_roundtrip(x, np.array([[m, m]], np.int32), 16, 4, bf16=False)
    _check_roundtrip(x, np.array([[m, m]], np.int32), 16, 4, bf16=True)


def test_slab_inside_a_longer_cache():
    """encode_planes on tokens [t_first, t_first + T) of a longer array, as the codec calls it."""
    kv = realistic_kv(layers=2, tokens=90, heads=2, head_dim=6, dtype=torch.bfloat16, seed=3)
    words = kv.reshape(2, 2, 90, 12).view(torch.int16).numpy().view(np.uint16)
    maxq = _maxq(2, 32, 16)
    full = _fast_encode(words[:, :, 30:70].copy(), 16, maxq, 8, 4, 31)
    sub = _fast_encode(words, 16, maxq, 8, 4, 31, t_first=30, T=40)
    for a, b in zip(full, sub):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- the decoder on arbitrary bytes


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ct, group", [(1, 16), (255, 4), (256, 4), (257, 3)])
def test_decoder_on_arbitrary_bytes(seed, ct, group):
    """Random codes and random stream bytes (not what any encoder writes, including streams
    cut short or at their length bound): the fast decoder still gives the reference's symbols."""
    rng = np.random.default_rng(seed * 1000 + ct)
    L, T, C = 2, ct * 2 + 5, 14
    maxq = _maxq(L, 255 if seed == 2 else 32, 3 if seed == 1 else 16)
    width = int(2 * maxq.max() + 1)
    K = -(-T // ct)
    codes = rng.integers(0, 16, (K, L, 2, C, width)).astype(np.uint8)
    codes[0, 0, 0, 0] = 0  # a channel with no information
    codes[..., width - 1 :] = 0
    for l in range(L):
        for kv in range(2):
            codes[:, l, kv, :, 2 * maxq[l, kv] + 1 :] = 0
    groups = -(-C // group)
    n = K * L * 2 * groups
    lengths = np.empty(n, np.int32)
    for s in range(n):
        k = s // (L * 2 * groups)
        tk = min(T, (k + 1) * ct) - k * ct
        width_g = min(group, C - (s % groups) * group)
        bound = max_stream_bytes(tk * width_g)
        lengths[s] = rng.choice([0, 1, 3, rng.integers(0, bound + 1), bound])
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = rng.integers(0, 256, int(offsets[-1])).astype(np.uint8)
    payload[: payload.size // 3] = 0xFF
    scales = rng.integers(0, 0x7F80, (L, 2, T)).astype(np.uint16)
    ref_symbols, ref_out = _reference_decode(payload, offsets, lengths, codes, maxq, ct, group, scales, C)
    out = np.empty((L, 2, T, C), np.float32)
    cpu.decode_planes(payload, offsets, lengths, codes, maxq, ct, group, scales, out, 0, False)
    np.testing.assert_array_equal(out.view(np.uint32), ref_out.view(np.uint32))


# ---------------------------------------------------------------- CDF helpers


def test_codes_and_cum_helpers():
    rng = np.random.default_rng(11)
    for trial in range(3000):
        alphabet = int(rng.choice([3, 15, 17, 31, 33, 127, 255]))
        width = alphabet + int(rng.integers(0, 3))
        counts = np.zeros(width, np.int32)
        kind = trial % 5
        if kind == 0:
            counts[:alphabet] = rng.integers(0, 5, alphabet)
        elif kind == 1:
            counts[int(rng.integers(alphabet))] = int(rng.integers(1, 16385))
        elif kind == 2:
            counts[:alphabet] = rng.geometric(0.3, alphabet) * rng.integers(0, 2, alphabet)
        elif kind == 3:
            counts[:alphabet] = rng.integers(0, 16385, alphabet)
        counts[alphabet:] = rng.integers(0, 9, width - alphabet)  # ignored past the alphabet
        ref_codes = np.full(width, 99, np.uint8)
        counts_to_codes(counts, alphabet, ref_codes)
        codes = np.full(width, 77, np.uint8)
        cpu.fast_codes(counts, alphabet, codes, np.empty(14, np.int64))
        np.testing.assert_array_equal(codes, ref_codes)
        if trial % 3 == 0:
            codes[:alphabet] = rng.integers(0, 16, alphabet)
        ref_cum = np.zeros(width + 3, np.int32)
        codes_to_cum(codes, alphabet, ref_cum)
        cum = np.full(width + 3, -1, np.int32)
        cpu.fast_cum(codes, alphabet, cum, np.empty(16, np.int64))
        np.testing.assert_array_equal(cum, ref_cum)
        assert cum[alphabet] == PROB_TOTAL and (np.diff(cum[: alphabet + 1]) >= 1).all()
        lut = np.full(cpu.LUT_SIZE, 255, np.uint8)
        cpu.build_lut(cum, alphabet, lut)
        q = np.arange(cpu.LUT_SIZE) << cpu.LUT_SHIFT
        np.testing.assert_array_equal(lut, np.searchsorted(cum[: alphabet + 1], q, side="right") - 1)


# ---------------------------------------------------------------- the codec's CPU path


def _reference_kernels():
    """The cpu module's stage-by-stage kernels under another name: the codec then takes
    its generic path instead of the fused one."""
    return types.SimpleNamespace(**{k: getattr(cpu, k) for k in (
        "quantize", "dequantize", "histogram", "build_cdf", "cum_from_codes", "encode_streams",
        "pack_streams", "decode_streams")})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("chunk_tokens", [1, 255, 256, 257])
def test_codec_fast_path_matches_generic_path(dtype, chunk_tokens):
    kv = realistic_kv(layers=2, tokens=520, heads=3, head_dim=4, dtype=dtype, seed=chunk_tokens)
    spec = (QuantizationSpec(0, 1, 32), QuantizationSpec(1, None, 16))
    cache = from_tensors(kv)
    h = codec.make_header(cache, QuantizationConfig(spec, (QuantizationSpec(0, None, 255),)), chunk_tokens)
    x = cache.data.to(torch.float32).numpy()
    generic = codec.encode_slab(h, x, 0, _reference_kernels())
    fast = codec.encode_slab(h, x, 0)
    assert len(generic) == len(fast)
    for a, b in zip(generic, fast):
        assert (a.index, a.first_token, a.token_count) == (b.index, b.first_token, b.token_count)
        for name in ("scales", "codes", "lengths", "payload"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(codec.decode_slab(h, fast), codec.decode_slab(h, generic, _reference_kernels()))


# ---------------------------------------------------------------- format version 2


@pytest.mark.parametrize("rotated", [0, 1, 3])
@pytest.mark.parametrize("threshold", [0.5, 0.7])
def test_v2_quantize_stats_matches_reference(rotated, threshold):
    """cpu_transform.quantize_stats (bits in, branch-free levels, fused refinement and level
    statistics, in parts) against transform_quantize + transform_refine + level_stats, with
    values far past the clamp, exact zeros and ties."""
    from cachegen_cli.kernels import cpu_transform as k2

    rng = np.random.default_rng(7)
    L, T, C, ct, sink, bits = 2, 45, 24, 8, 3, 2
    x = (rng.standard_normal((L, 2, T, C)) * rng.choice([0.01, 1.0, 500.0], (L, 2, T, C))).astype(np.float32)
    x[0, 0, 5] = 0.0
    x[1, 1, 7, :4] = [0.25, -0.25, 0.75, -1e30]
    x = torch.from_numpy(x).to(torch.bfloat16)
    xf = x.float().numpy()
    src = x.view(torch.int16).numpy().view(np.uint16)
    rot = np.zeros((0, 0, 0, 0, 0), np.float32)
    if rotated:  # ``rotated`` diagonal blocks per (layer, K/V)
        D = C // rotated
        rot = np.stack([np.linalg.qr(rng.standard_normal((D, D)))[0] for _ in range(2 * L * rotated)]).astype(np.float32)
        rot = rot.reshape(L, 2, rotated, D, D)
    offsets = (rng.standard_normal((L, 2, C)) * 0.1).astype(np.float32)
    steps = np.array([[0.5, 0.125], [0.01, 2.0]])
    t_ref = 30
    q = np.empty((L, 2, T, C), np.int16)
    ref = np.empty((L, 2, T - t_ref, C), np.uint8)
    k2.transform_quantize(xf, rot, sink, offsets, steps, 127, threshold, t_ref, bits, q)
    k2.transform_refine(xf, rot, t_ref, offsets, steps, q, bits, ref)
    stats = np.empty((L, 2, C, 6), np.int64)
    k2.level_stats(q, ct, stats)
    for parts in (1, 3):
        q2 = np.empty_like(q)
        ref2 = np.empty_like(ref)
        part = np.empty((parts, L, 2, C, 6), np.int64)
        k2.quantize_stats(src, 16, rot, sink, offsets, steps, 127, threshold, t_ref, bits, ct, q2, ref2, part)
        assert np.array_equal(q2, q) and np.array_equal(ref2, ref)
        for i, f in enumerate((np.min, np.max, np.sum, np.min, np.max, np.sum)):
            assert np.array_equal(f(part[..., i], axis=0), stats[..., i])
    if rotated:  # the rows rotated once and kept give the same levels
        y = np.empty((L, 2, T, C))
        k2.rotate_rows(src, 16, rot, y)
        q3 = np.empty_like(q)
        k2.quantize_stats(y, 0, np.zeros((0, 0, 0, 0, 0), np.float32), sink, offsets, steps, 127, threshold, t_ref,
                          bits, ct, q3, np.empty_like(ref), np.empty((1, L, 2, C, 6), np.int64))
        assert np.array_equal(q3, q)


@pytest.mark.parametrize("blocks", [1, 2])
def test_v2_decode_planes_match_reference(blocks, monkeypatch):
    """decode_transform_planes (streams -> levels -> values in one job, the inverse rotation
    through the transposed matrix) against decode_table_streams + symbols_to_levels +
    transform_dequantize, rotated (flags bit 0's float64 sums: the files written before the
    fixed-point rotation) and refined."""
    import cachegen_cli as cg
    from cachegen_cli.methods import transform as transform_codec
    from cachegen_cli.methods.calibration import fit
    from cachegen_cli.kernels import cpu_transform as k2

    monkeypatch.setattr(transform_codec, "FIXED_ROTATION", False)

    kv = realistic_kv(layers=2, tokens=70)
    cal = fit([kv.reshape(2, 2, 70, -1)], blocks=blocks)
    blob = cg.encode(kv, quality="high", calibration=cal, chunk_tokens=16, device="cpu")
    f, _ = codec.open_input(blob)
    h, _, offsets, size = codec.read_header_and_index(f)
    chunks = list(codec.iter_chunks(f, h, offsets, size))
    p = h.params
    L, C, T = h.num_layers, h.num_channels, h.num_tokens
    cum = np.empty((L, 2, C, p.width + 1), np.int32)
    k2.cum_from_table_codes(p.codes, p.alphabet, cum)
    lengths, offs, payload = transform_codec.gather_streams(chunks)
    sym = np.empty((L, 2, T, C), np.uint8)
    k2.decode_table_streams(payload, offs, lengths, cum, p.width, h.chunk_tokens, h.group, sym)
    q = np.empty((L, 2, T, C), np.int16)
    k2.symbols_to_levels(sym, p.modes, p.lo, h.chunk_tokens, q)
    out = np.zeros((L, 2, T, C), np.float32)
    ref = transform_codec.gather_refinement(h, chunks)
    from cachegen_cli.format.params import bf16_values
    k2.transform_dequantize(q, cal.rotation, h.sink_tokens, bf16_values(p.offsets).astype(np.float32),
                            bf16_values(p.steps), h.refine_start, p.refine_bits, ref, out)
    dec = transform_codec.V2SlabDecoder(h, cal)
    f32 = np.zeros((L, 2, T, C), np.float32)
    seen = np.empty((-(-T // h.chunk_tokens) * L * 2, 2), np.int32)
    k2.decode_transform_planes(payload, offs, lengths, dec.cum, dec.lut, h.chunk_tokens, h.group, T, p.modes, p.lo,
                               seen, dec.rot_t, h.sink_tokens, dec.offsets, dec.steps, h.refine_start, p.refine_bits, ref,
                               f32, 0, False)
    S = h.sink_tokens
    assert np.array_equal(f32[:, :, S:].view(np.uint32), out[:, :, S:].view(np.uint32))
    assert seen[:, 0].min() == q.min() and seen[:, 1].max() == q.max()
