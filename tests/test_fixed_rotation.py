"""The fixed-point rotation (format version 2, flags bit 3; kernels/fixed_rotation.py): exact
integer products whatever computes them, the reader's rules, hostile calibrations."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.errors import CacheGenError
from cachegen_cli.format import container
from cachegen_cli.kernels import fixed_rotation as fr
from cachegen_cli.methods import calibration as calib
from cachegen_cli.methods import transform as transform_methods


def _int_product(X: np.ndarray, rint: np.ndarray) -> np.ndarray:
    """X [L, 2, T, C] @ block-diagonal rint [L, 2, H, D, D] in int64 (the definition)."""
    L, K, T, C = X.shape
    H, D = rint.shape[2], rint.shape[3]
    Xi = X.astype(np.int64).reshape(L, K, T, H, D)
    return np.einsum("lkthd,lkhde->lkthe", Xi, rint.astype(np.int64)).reshape(L, K, T, C)


@pytest.mark.parametrize("blocks", [1, 4])
def test_block_product_is_the_exact_integer_product_at_the_bounds(blocks):
    """Integers as large as the writer makes them (|X| = 2^20, |Rint| = 2^14) and a column of all
    maxima: float64 BLAS gives the int64 product exactly (every partial sum below 2^53)."""
    g = np.random.default_rng(0)
    C = 64
    D = C // blocks
    X = g.integers(-(1 << fr.X_BITS), (1 << fr.X_BITS) + 1, size=(2, 2, 33, C)).astype(np.float64)
    X[0, 0, 0] = 1 << fr.X_BITS
    rint = g.integers(-(1 << fr.R_BITS), (1 << fr.R_BITS) + 1, size=(2, 2, blocks, D, D)).astype(np.float64)
    rint[0, 0, 0, :, 0] = 1 << fr.R_BITS
    Y = fr.block_product(torch.from_numpy(X), torch.from_numpy(rint)).numpy()
    assert np.array_equal(Y.astype(np.int64), _int_product(X, rint))
    assert np.abs(Y).max() > 2.0 ** 35  # far past what float32 (2^24) would hold exactly


def test_fixed_matrix_rounds_ties_to_even_and_clamps():
    rot = np.array([0.5 / 2 ** 14, 1.5 / 2 ** 14, -2.5 / 2 ** 14, 1.0, -1.25, 3.0], np.float32).reshape(1, 1, 1, 1, 6)
    got = fr.fixed_matrix(rot.reshape(1, 1, 1, 1, 6).repeat(6, axis=3)[:, :, :, :, :], False)[0, 0, 0, 0]
    assert got.tolist() == [0.0, 2.0, -2.0, 2.0 ** 14, -(2.0 ** 14), 2.0 ** 14]


def test_encoder_rows_follow_the_documented_integers():
    """fixed_rows / fixed_rows_out against the numbers docs/format.md gives for cachegen's
    encoder: X = round(x 2^(20 - e)) with max |x| < 2^e, y = float32(X Rint 2^(e - 34));
    a row of zeros, a subnormal row and a tie included."""
    g = np.random.default_rng(1)
    x = g.standard_normal((1, 2, 5, 8)).astype(np.float32)
    x[0, 0, 1] = 0.0
    x[0, 0, 2] = np.float32(1e-40)  # subnormal
    x[0, 1, 0, :2] = [1.0, 2.0 ** -21]  # 2^-21 x 2^(20 - 1) = 0.5: a tie, rounded to 0
    X = np.empty((1, 2, 5, 8), np.float64)
    e = np.empty((1, 2, 5), np.int32)
    fr.fixed_rows(x, 0, X, e)
    for kv in range(2):
        for t in range(5):
            top = float(np.abs(x[0, kv, t].astype(np.float64)).max())
            assert top < 2.0 ** e[0, kv, t]
            if top >= 2.0 ** -126:  # a normal float32: the tightest such power (subnormals: e = -126)
                assert top >= 2.0 ** (e[0, kv, t] - 1)
            want = np.rint(x[0, kv, t].astype(np.float64) * 2.0 ** (fr.X_BITS - int(e[0, kv, t])))
            assert np.array_equal(X[0, kv, t], want)
    assert X[0, 1, 0, 1] == 0.0 and np.abs(X).max() <= 2 ** fr.X_BITS
    rot = calib.fit([torch.from_numpy(g.standard_normal((1, 2, 40, 8)).astype(np.float32))]).rotation
    rint = fr.fixed_matrix(rot.reshape(1, 2, 1, 8, 8), False)
    Y = fr.block_product(torch.from_numpy(X), torch.from_numpy(rint)).numpy()
    y = np.empty_like(x)
    fr.fixed_rows_out(Y, e, 0, y)
    want = (_int_product(X, rint).astype(np.float64) * np.exp2(e[..., None] - 34.0)).astype(np.float32)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))


def _rotated_file(fixed: bool) -> tuple[bytes, calib.Calibration]:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 2, 24, 2, 4, generator=g) * torch.linspace(0.2, 4, 8).view(2, 4)).to(torch.bfloat16)
    cal = calib.fit([x.reshape(2, 2, 24, 8).float()])
    old = transform_methods.FIXED_ROTATION
    transform_methods.FIXED_ROTATION = fixed
    try:
        return cg.encode(x, quality="high", calibration=cal, chunk_tokens=8, device="cpu"), cal
    finally:
        transform_methods.FIXED_ROTATION = old


def _with_flags(blob: bytes, flags: int) -> bytes:
    """The file with header byte 47 (flags) replaced and the header CRC-32 recomputed."""
    raw = bytearray(blob)
    raw[47] = flags
    h = container.read_file_header(container.BufferReader(blob))[0]
    desc_size = struct.unpack_from("<I", raw, 12)[0]
    params_size = struct.unpack_from("<I", raw, 48)[0]
    crc = zlib.crc32(bytes(raw[:60]) + bytes(raw[64 : 64 + desc_size + params_size]))
    struct.pack_into("<I", raw, 60, crc)
    assert h.num_layers == 2
    return bytes(raw)


def test_writers_set_flags_bit_3_and_both_forms_decode_close():
    fixed, cal = _rotated_file(True)
    older, _ = _rotated_file(False)
    hf = container.read_file_header(container.BufferReader(fixed))[0]
    ho = container.read_file_header(container.BufferReader(older))[0]
    assert hf.flags & container.FLAG_FIXED_ROTATION and hf.rotated
    assert not ho.flags & container.FLAG_FIXED_ROTATION and ho.rotated
    a = cg.decode(fixed, calibration=cal, device="cpu")["kv"].float()
    b = cg.decode(older, calibration=cal, device="cpu")["kv"].float()
    assert torch.isfinite(a).all()
    # the same levels almost everywhere: the two arithmetics differ by far less than a step
    assert (a - b).abs().max() < 0.1 * b.abs().max()


def test_reader_rejects_bit_3_without_bit_0():
    blob, cal = _rotated_file(True)
    h = container.read_file_header(container.BufferReader(blob))[0]
    assert h.flags == container.FLAG_ROTATED | container.FLAG_REFINED | container.FLAG_FIXED_ROTATION
    # bit 3 alone on an unrotated file: the header says a fixed-point rotation of nothing
    plain = cg.encode(torch.zeros(2, 2, 8, 2, 4, dtype=torch.bfloat16) + 1, quality="balanced", chunk_tokens=8,
                      device="cpu")
    bad = _with_flags(plain, container.read_file_header(container.BufferReader(plain))[0].flags | 8)
    with pytest.raises(CacheGenError, match="bit 3"):
        cg.decode(bad, device="cpu")


def test_a_calibration_with_entries_past_one_still_decodes_finite():
    """A Calibration built in Python is not checked for orthonormality: entries of 3 are clamped to
    2^14 in the integers, so the sums keep their bounds and no value comes out Inf or NaN."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 2, 16, 2, 4, generator=g) * 1000).to(torch.bfloat16)
    rot = np.full((2, 2, 8, 8), 3.0, np.float32)
    cal = calib.Calibration(rot, {"format": "cachegen-calibration", "version": "1"})
    blob = cg.encode(x, quality="small", calibration=cal, chunk_tokens=8, device="cpu")
    out = cg.decode(blob, calibration=cal, device="cpu")["kv"]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_pipeline_near_the_top_of_the_range_as_the_cpu(dtype):
    """Channels whose means sit near the top of bfloat16, through a rotation: the device
    pipeline (the CUDA simulator here; tests/test_device_pipeline.py runs on the GPU) writes the
    CPU's bytes and decodes the CPU's values, bfloat16 words rounded (and saturated, would they
    pass the top) in its values kernel."""
    from test_device_pipeline import _check

    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 2, 12, 2, 4, generator=g)
    x[:, :, :, 0, :2] = 3.0e38  # two channels whose means are near the top: rotated, they add up past it
    x = x.to(dtype)
    rot = np.zeros((1, 2, 8, 8), np.float32)
    rot[:, :] = np.linalg.qr(np.random.default_rng(2).standard_normal((8, 8)))[0].astype(np.float32)
    cal = calib.Calibration(rot, {"format": "cachegen-calibration", "version": "1"})
    blob = _check(x, "small", chunk_tokens=4, calibration=cal)
    out = cg.decode(blob, calibration=cal, device="cpu")["kv"]
    assert torch.isfinite(out).all()


def test_stats_names_the_fixed_point_rotation(tmp_path):
    from cachegen_cli.model.stats import file_stats

    fixed, _ = _rotated_file(True)
    older, _ = _rotated_file(False)
    (tmp_path / "a.cgen").write_bytes(fixed)
    (tmp_path / "b.cgen").write_bytes(older)
    assert file_stats(tmp_path / "a.cgen")["method"] == "transform + rotation (fixed-point)"
    assert file_stats(tmp_path / "b.cgen")["method"] == "transform + rotation"


def test_fixed_values_bf16_is_fixed_values_then_store_values():
    """The decoder's fused pass (x' straight to bfloat16 words) gives the bits of the two passes
    it replaces, on ordinary values, ties, and values past bfloat16's largest finite one (kept
    at it, not rounded to an infinity)."""
    from cachegen_cli.kernels import rope as rope_kernels

    rng = np.random.default_rng(11)
    L, K, n, C, t_first, t_out = 2, 2, 7, 12, 3, 5
    A = np.round(rng.standard_normal((L, K, n, C)) * 2.0 ** rng.integers(0, 40, (L, K, n, C)))
    steps = np.ldexp(1.0, rng.integers(-20, 4, (L, K))).astype(np.float64)
    b = rng.standard_normal((L, K, C)) * 3.0
    b[0, 0, :4] = [3.3961e38, -3.3961e38, 3.39e38, 1.0e39]  # past bfloat16's largest finite value (~3.3895e38)
    A[0, 0, :, :4] = 0.0
    A[1, 1, 0, 0] = 2.0 ** fr.R_BITS * 1.00390625  # (1 + 2^-8) x 2^R_BITS: a tie at bfloat16's precision
    steps[1, 1] = 1.0
    b[1, 1, 0] = 0.0
    f32 = np.zeros((L, K, t_first + n, C), np.float32)
    fr.fixed_values(A, steps, b, t_first, f32)
    want = np.zeros((L, K, t_out + t_first + n, C), np.uint16)
    rope_kernels.store_values(f32, t_first, want[:, :, t_out:], 0, rope_kernels.KIND_BFLOAT16)
    got = np.zeros_like(want)
    fr.fixed_values_bf16(A, steps, b, t_first, got, t_out)
    np.testing.assert_array_equal(got, want)
    assert not ((got & 0x7FFF) == 0x7F80).any()  # no infinity
    assert got[1, 1, t_out + t_first, 0] == 0x3F80  # the tie went to the even neighbour, 1.0


# ---- the CPU's product in int8 digits (torch._int_mm): the float64 product's bits


needs_int8 = pytest.mark.skipif(not fr.int8_products(), reason="this torch has no CPU int8 matrix product")


def test_digit_blocks_rebuild_the_integers_at_the_bounds():
    g = np.random.default_rng(21)
    rint = g.integers(-(1 << fr.R_BITS), (1 << fr.R_BITS) + 1, size=(1, 2, 2, 8, 8)).astype(np.float64)
    rint[0, 0, 0, 0, :4] = [1 << fr.R_BITS, -(1 << fr.R_BITS), 128, -129]
    d = fr.digit_blocks(torch.from_numpy(rint)).numpy().astype(np.int64)
    assert d.shape == (1, 2, 2, 8, 16)
    assert np.array_equal(d[..., :8] + 256 * d[..., 8:], rint.astype(np.int64))
    assert np.abs(d[..., 8:]).max() <= 64


def _rotation(L, H, D, seed):
    q = np.linalg.qr(np.random.default_rng(seed).standard_normal((L * 2 * H, D, D)))[0]
    return q.reshape(L, 2, H, D, D).astype(np.float32)


@needs_int8
@pytest.mark.parametrize("H, D, T, t_first", [(2, 16, 23, 3), (1, 32, 9, 0), (4, 8, 17, 5)])
@pytest.mark.parametrize("bf16", [False, True])
def test_digit_product_rotates_rows_as_the_float64_product(monkeypatch, H, D, T, t_first, bf16):
    """rotate_rows with the digit blocks gives the float64 product's bits: rows cut into tiles
    (DIGIT_ROWS made small), an outlier channel, a row of zeros, a subnormal row, a row whose top
    value is a power of two (X = +-2^20 exactly)."""
    monkeypatch.setattr(fr, "DIGIT_ROWS", 4)
    g = np.random.default_rng(T)
    C = H * D
    x = (g.standard_normal((2, 2, T, C)) * 3).astype(np.float32)
    x[..., 1] *= 300.0
    x[0, 0, t_first] = 0.0
    x[0, 1, t_first] = np.float32(1e-40)
    x[1, 0, -1, :2] = [-4.0, 3.999]
    src = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) if bf16 else x
    rint = torch.from_numpy(fr.fixed_matrix(_rotation(2, H, D, T), False))
    want = np.zeros_like(x)
    got = np.zeros_like(x)
    fr.rotate_rows(src, rint, t_first, want)
    fr.rotate_rows(src, fr.digit_blocks(rint), t_first, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.abs(want[:, :, t_first:]).max() > 0


@needs_int8
@pytest.mark.parametrize("first_refined", [0, 6, 13])
@pytest.mark.parametrize("bf16_out", [False, True])
def test_digit_product_decodes_as_the_float64_product(monkeypatch, first_refined, bf16_out):
    """unrotate_values with the digit blocks: integer levels (one digit) and refined ones (256 q'
    in three, +-127.5 included), tiles that hold both, in place and into bfloat16 words."""
    monkeypatch.setattr(fr, "DIGIT_ROWS", 4)
    g = np.random.default_rng(first_refined)
    L, H, D, T, t_first = 2, 2, 16, 13, 2
    C = H * D
    z = g.integers(-127, 128, (L, 2, T, C)).astype(np.float32)
    z[:, :, first_refined:] += g.integers(-127, 129, (L, 2, T - first_refined, C)).astype(np.float32) / 256
    if first_refined < T:
        z[0, 0, -1, :2] = [127.5, -127.5]
    z[1, 1, t_first, :] = 127.0
    steps = np.ldexp(1.0, g.integers(-12, 3, (L, 2))).astype(np.float64)
    b = g.standard_normal((L, 2, C)) * 5
    rint_t = torch.from_numpy(fr.fixed_matrix(_rotation(L, H, D, 7), True))
    digits = fr.digit_blocks(rint_t)
    if bf16_out:
        want = np.zeros((L, 2, T + 3, C), np.uint16)
        got = want.copy()
        fr.unrotate_values(z, rint_t, steps, b, t_first, want, 3)
        fr.unrotate_values(z, digits, steps, b, t_first, got, 3, first_refined)
        assert np.array_equal(got, want)
        return
    want = np.zeros_like(z)
    fr.unrotate_values(z, rint_t, steps, b, t_first, want)
    got = z.copy()
    fr.unrotate_values(got, digits, steps, b, t_first, got, None, first_refined)  # in place
    assert np.array_equal(got[:, :, t_first:].view(np.uint32), want[:, :, t_first:].view(np.uint32))


@needs_int8
def test_files_and_values_are_the_same_without_the_int8_product(monkeypatch):
    """A whole encode and decode of a calibrated method with the int8 digits and with the float64
    product (a torch without a CPU int8 product) give the same bytes and values."""
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 2, 40, 2, 8, generator=g) * torch.linspace(0.2, 6, 16).view(2, 8)).to(torch.bfloat16)
    cal = calib.fit([x.reshape(2, 2, 40, 16).float()])
    kw = dict(quality="high", calibration=cal, chunk_tokens=8, device="cpu")
    blob = cg.encode(x, **kw)
    values = cg.decode(blob, calibration=cal, device="cpu")["kv"]
    monkeypatch.setattr(fr, "_INT8_PRODUCT", [False])
    monkeypatch.setattr(fr, "_KEPT", {})
    assert cg.encode(x, **kw) == blob
    assert torch.equal(cg.decode(blob, calibration=cal, device="cpu")["kv"].view(torch.int16), values.view(torch.int16))
