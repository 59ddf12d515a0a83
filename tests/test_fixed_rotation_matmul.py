"""kernels/fixed_rotation_matmul.py: the matrix-unit kernels give the integers of
kernels/fixed_rotation.py exactly (hence the CPU's bits), at the bounds of their digits too.
Here on the GPU, or under Triton's interpreter on CPU tensors (tests/conftest.py, with numba's
simulator); tests/test_device_pipeline.py runs them through the pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen_cli.kernels import fixed_rotation as fx
from cachegen_cli.kernels import fixed_rotation_matmul as fm

#: where the kernels run: the GPU, or the CPU under Triton's interpreter
DEV = next((torch.device(d) for d in ("cuda", "cpu") if (d == "cpu" or torch.cuda.is_available())
            and fm.runs_on(torch.device(d))), None)
pytestmark = pytest.mark.skipif(DEV is None, reason="needs Triton: a GPU, or its interpreter (TRITON_INTERPRET=1)")


def _rotation(rng, L, H, D, scale=1.0):
    out = np.empty((L, 2, H, D, D), np.float32)
    for i in np.ndindex(L, 2, H):
        out[i] = np.linalg.qr(rng.standard_normal((D, D)))[0] * scale
    return out


def _rows(rng, L, T, C, dtype):
    spread = np.exp(rng.standard_normal(C) * 2).astype(np.float32)
    x = torch.from_numpy((rng.standard_normal((L, 2, T, C)) * spread).astype(np.float32)).to(dtype)
    return x


def _assert_rows_are_the_cpu_bits(x, rot, S):
    """fm.rotate_rows of bfloat16 rows x (as their words) gives fx.rotate_rows' float32 bits."""
    rint = torch.from_numpy(fx.fixed_matrix(rot, False))
    want = np.zeros(x.shape, np.float32)
    fx.rotate_rows(x.to(torch.float32).numpy(), rint, S, want)
    got = torch.zeros(x.shape, device=DEV)
    fm.rotate_rows(x.view(torch.int16).to(DEV), fm.rotation_digits(rint.to(DEV)), S, got)
    assert np.array_equal(got.cpu().numpy()[:, :, S:].view(np.int32), want[:, :, S:].view(np.int32))


@pytest.mark.parametrize("L, T, H, D, S, dtype, seed", [
    (2, 70, 2, 32, 3, torch.float32, 1), (1, 130, 1, 64, 0, torch.bfloat16, 2), (1, 40, 4, 32, 5, torch.bfloat16, 3),
    (1, 30, 2, 96, 1, torch.bfloat16, 4),  # a block of 96: the kernels pad it to 128 with zero digits
])
def test_encoder_rows_are_the_cpu_bits(L, T, H, D, S, dtype, seed):
    rng = np.random.default_rng(seed)
    C = H * D
    x = _rows(rng, L, T, C, dtype)
    x[0, 0, S + 2] = 0  # a row of zeros
    x[0, 1, S + 4, :] = x[0, 1, S + 4, :] * 0 + 1.0  # every value at the row's top: X = 2^20 - ...
    x[0, 1, S + 4, 0] = -1.9999  # |X| at 2^20 after rounding: the top digit at its bound
    if dtype == torch.float32:
        x[0, 1, S + 6, 3] = 1e-40  # a subnormal row
        x[0, 1, S + 6, 4:] = 0
    rint = torch.from_numpy(fx.fixed_matrix(_rotation(rng, L, H, D), False))
    rint[0, 0, 0, 0, :] = 2.0 ** 14  # the largest entries the format allows: r1 = 64
    rint[0, 0, 0, 1, :] = -(2.0 ** 14)
    want = np.zeros((L, 2, T, C), np.float32)
    fx.rotate_rows(x.to(torch.float32).numpy(), rint, S, want)
    got = torch.full((L, 2, T, C), 7.0, device=DEV)
    xin = (x.view(torch.int16) if dtype == torch.bfloat16 else x).to(DEV)
    fm.rotate_rows(xin, fm.rotation_digits(rint.to(DEV)), S, got)
    got = got.cpu()
    assert np.array_equal(got.numpy()[:, :, S:].view(np.int32), want[:, :, S:].view(np.int32))
    assert (got[:, :, :S] == 7.0).all(), "rows before t_first are not written"


@pytest.mark.parametrize("bf16_out, D", [(False, 32), (True, 32), (False, 96)])
def test_decoder_values_are_the_cpu_bits_at_the_levels_bounds(bf16_out, D):
    rng = np.random.default_rng(7)
    L, T, H, S = 2, 67, 2, 2
    C = H * D
    n = 256  # 8 refinement bits: q' = q + (j - 127) / 256, j in 0..255
    q = rng.integers(-127, 128, (L, 2, T, C)) + (rng.integers(0, n, (L, 2, T, C)) - n / 2 + 1) / n
    q[..., :3] = 127.5  # the largest refined level: 256 q' = 32640
    q[..., 3:5] = -127.5 + 1 / n  # the smallest
    z = q.astype(np.float32)
    rot = _rotation(rng, L, H, D)
    rint_t = torch.from_numpy(fx.fixed_matrix(rot, True))
    rint_t[1, 1, 1, :, 0] = 2.0 ** 14
    steps = torch.tensor(rng.uniform(0.01, 3, (L, 2)), dtype=torch.float32).to(torch.bfloat16).to(torch.float64)
    steps[0, 0] = 3.0e38  # a step near the top: the values saturate
    offsets = torch.tensor(rng.standard_normal((L, 2, C)), dtype=torch.float32).to(torch.bfloat16).float().numpy()
    b = np.empty((L, 2, C))
    fx.offset_sums(offsets, rint_t.numpy(), b)
    want = np.zeros_like(z)
    fx.unrotate_values(z, rint_t, steps.numpy(), b, S, want)
    out = torch.full((L, 2, T, C), 5, dtype=torch.int16 if bf16_out else torch.float32, device=DEV)
    rt = rint_t.to(DEV)
    fm.unrotate_values(torch.from_numpy(z).to(DEV), fm.rotation_digits(rt), fm.column_sums(rt), steps.to(DEV),
                       torch.from_numpy(b).to(DEV), S, out)
    out = out.cpu()
    assert np.isfinite(want).all()
    if bf16_out:
        lim = float(torch.finfo(torch.bfloat16).max)
        ref = torch.from_numpy(want).clamp(-lim, lim).to(torch.bfloat16).view(torch.int16)
        assert torch.equal(out[:, :, S:], ref[:, :, S:])
        assert (out[0, 0, S:].view(torch.bfloat16).float().abs() == lim).any(), "some values saturate"
    else:
        assert np.array_equal(out.numpy()[:, :, S:].view(np.int32), want[:, :, S:].view(np.int32))
    assert (out[:, :, :S] == 5).all()


def test_digits_rebuild_the_integers():
    rint = torch.arange(-(2 ** 14), 2 ** 14 + 1, dtype=torch.float64).reshape(1, 1, 1, 1, -1)[..., :32 * 32]
    rint = rint.reshape(1, 1, 1, 32, 32)
    d = fm.rotation_digits(rint).to(torch.int64)
    assert torch.equal(d[0] + 256 * d[1], rint.to(torch.int64))
    assert d[1].abs().max() <= 64


def test_blocks_the_kernels_take_and_the_switch():
    assert fm.supports(32) and fm.supports(128) and fm.supports(96)
    assert fm.supports(1024) and not fm.supports(16) and not fm.supports(40) and not fm.supports(2048)
    with pytest.raises(ValueError, match="blocks"):
        fm.rotate_rows(torch.zeros(1, 2, 4, 16, device=DEV), torch.zeros(2, 1, 2, 1, 16, 16, dtype=torch.int8,
                       device=DEV), 0, torch.zeros(1, 2, 4, 16, device=DEV))


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv("CACHEGEN_ROTATION_MATMUL", "0")
    assert not fm.runs_on(DEV)
    monkeypatch.setenv("CACHEGEN_ROTATION_MATMUL", "1")
    other = torch.device("cuda" if DEV.type == "cpu" else "cpu")
    assert fm.runs_on(DEV) and not fm.runs_on(other)


@pytest.mark.parametrize("launch", [
    {"rows": 16, "warps": 4, "stages": 1, "tile": 32, "spread": 1},  # one program a part: 3 row tiles each
    {"rows": 32, "warps": 4, "stages": 2, "tile": 64, "spread": 2},
    {"rows": 64, "warps": 8, "stages": 2, "tile": 128, "spread": 64},  # more programs than row tiles
])
def test_every_launch_shape_gives_the_same_bits(monkeypatch, launch):
    """Tiles of outputs and of rows, shared by one or many programs, cover every value: the
    CPU's bits whatever the launch (the sweep's shapes), from float32 levels or int16 words."""
    monkeypatch.setattr(fm, "ENCODE_LAUNCH", launch)
    monkeypatch.setattr(fm, "DECODE_LAUNCH", launch)
    rng = np.random.default_rng(11)
    L, T, H, D, S = 1, 45, 2, 128, 1
    C = H * D
    x = _rows(rng, L, T, C, torch.bfloat16)
    x[0, 0, S, :] = 1.0  # every digit at its bound in one row
    x[0, 0, S, ::3] = -1.9999
    rot = _rotation(rng, L, H, D)
    _assert_rows_are_the_cpu_bits(x, rot, S)

    q = (rng.integers(-127, 128, (L, 2, T, C)) + (rng.integers(0, 256, (L, 2, T, C)) - 127) / 256).astype(np.float32)
    q[0, 1, S, :] = 127.5
    rint_t = torch.from_numpy(fx.fixed_matrix(rot, True))
    steps = torch.tensor([[0.25, 0.0078125]], dtype=torch.float64)
    b = np.empty((L, 2, C))
    fx.offset_sums(np.zeros((L, 2, C), np.float32), rint_t.numpy(), b)
    want_v = np.zeros_like(q)
    fx.unrotate_values(q, rint_t, steps.numpy(), b, S, want_v)
    out = torch.zeros((L, 2, T, C), device=DEV)
    rt = rint_t.to(DEV)
    fm.unrotate_values(torch.from_numpy(q).to(DEV), fm.rotation_digits(rt), fm.column_sums(rt), steps.to(DEV),
                       torch.from_numpy(b).to(DEV), S, out)
    assert np.array_equal(out.cpu().numpy()[:, :, S:].view(np.int32), want_v[:, :, S:].view(np.int32))
    # the levels as int16 words Q = 256 q' - 1 (dequantize's): the same values
    words = torch.from_numpy((q.astype(np.float64) * 256 - 1).astype(np.int16)).to(DEV)
    out.zero_()
    fm.unrotate_values(words, fm.rotation_digits(rt), fm.column_sums(rt), steps.to(DEV), torch.from_numpy(b).to(DEV),
                       S, out)
    assert np.array_equal(out.cpu().numpy()[:, :, S:].view(np.int32), want_v[:, :, S:].view(np.int32))


@pytest.mark.parametrize("H, D", [(2, 256), (1, 1024)])
def test_blocks_past_the_registers_stream_their_digits(H, D):
    """Blocks wider than RESIDENT_BLOCK go through the streaming kernels: the CPU's bits both
    ways, from float32 levels and int16 words."""
    assert D > fm.RESIDENT_BLOCK and fm.supports(D)
    rng = np.random.default_rng(D)
    L, T, S = 1, 35, 2
    C = H * D
    x = _rows(rng, L, T, C, torch.bfloat16)
    x[0, 1, S, :] = 1.0
    x[0, 1, S, ::5] = -1.9999
    rot = _rotation(rng, L, H, D)
    _assert_rows_are_the_cpu_bits(x, rot, S)

    q = (rng.integers(-127, 128, (L, 2, T, C)) + (rng.integers(0, 256, (L, 2, T, C)) - 127) / 256).astype(np.float32)
    q[0, 0, S, :] = 127.5
    rint_t = torch.from_numpy(fx.fixed_matrix(rot, True))
    steps = torch.tensor([[0.5, 0.0078125]], dtype=torch.float64)
    b = np.empty((L, 2, C))
    fx.offset_sums(rng.standard_normal((L, 2, C)).astype(np.float32), rint_t.numpy(), b)
    want_v = np.zeros_like(q)
    fx.unrotate_values(q, rint_t, steps.numpy(), b, S, want_v)
    rt = rint_t.to(DEV)
    for levels in (torch.from_numpy(q), torch.from_numpy((q.astype(np.float64) * 256 - 1).astype(np.int16))):
        out = torch.zeros((L, 2, T, C), dtype=torch.int16, device=DEV)  # bfloat16 words
        fm.unrotate_values(levels.to(DEV), fm.rotation_digits(rt), fm.column_sums(rt), steps.to(DEV),
                           torch.from_numpy(b).to(DEV), S, out)
        ref = torch.from_numpy(want_v).to(torch.bfloat16).view(torch.int16)
        assert torch.equal(out.cpu()[:, :, S:], ref[:, :, S:])


# ---------------------------------------------------------------- keys turned by their RoPE

def _rope(rng, style, head_dim, rotary_dim, rows):
    from cachegen_cli.format.params import Rope

    f = np.sort(rng.uniform(1e-4, 1.0, (rows, rotary_dim // 2)))[:, ::-1].copy()
    return Rope(style, head_dim, rotary_dim, int(rng.integers(0, 5000)), f)


def _angles(rope, t_first, T):
    """fm.RopeAngles of rows t_first .. T - 1 from kernels/rope.angles (the CPU's sincos)."""
    from cachegen_cli.kernels import rope as rk

    pos = rope.position_start + np.arange(t_first, T)
    s, c = zip(*(rk.angles(f, pos) for f in rope.inv_freq))
    return fm.RopeAngles(torch.from_numpy(np.stack(s)).to(DEV), torch.from_numpy(np.stack(c)).to(DEV), rope.style,
                         rope.head_dim, rope.rotary_dim)


@pytest.mark.parametrize("H, D, style, head_dim, rotary_dim, rows, dtype", [
    (2, 32, 0, 32, 32, 1, torch.bfloat16),  # a rotation block per head, every channel turned
    (1, 64, 1, 32, 24, 2, torch.float32),  # interleaved pairs, part of each head turned, a row per layer
    (2, 64, 0, 16, 16, 1, torch.bfloat16),  # several heads per block
    (2, 32, 0, 64, 64, 1, torch.bfloat16),  # a head across two blocks (the encoder takes any)
    (1, 256, 0, 128, 128, 1, torch.bfloat16),  # a block past the registers: the streaming kernel
])
def test_encoder_turns_the_keys_as_the_cpu(H, D, style, head_dim, rotary_dim, rows, dtype):
    from cachegen_cli.kernels import rope as rk

    rng = np.random.default_rng(11 + D + style)
    L, T, S = 2, 45, 3
    C = H * D
    x = _rows(rng, L, T, C, dtype)
    x[1, 0, S + 1, :2] = 3.0e38 if dtype == torch.float32 else 3.0e38  # a pair that saturates when turned
    rope = _rope(rng, style, head_dim, rotary_dim, rows if rows == 1 else L)
    rint = torch.from_numpy(fx.fixed_matrix(_rotation(rng, L, H, D), False))
    turned = x.to(torch.float32).numpy().copy()
    rk.turn_keys(turned, rope.inv_freq, rope, 0, S, False)
    want = np.zeros((L, 2, T, C), np.float32)
    fx.rotate_rows(turned, rint, S, want)
    got = torch.full((L, 2, T, C), 7.0, device=DEV)
    xin = (x.view(torch.int16) if dtype == torch.bfloat16 else x).to(DEV)
    fm.rotate_rows(xin, fm.rotation_digits(rint.to(DEV)), S, got, rope=_angles(rope, S, T))
    got = got.cpu()
    assert np.array_equal(got.numpy()[:, :, S:].view(np.int32), want[:, :, S:].view(np.int32))
    assert (got[:, :, :S] == 7.0).all()


@pytest.mark.parametrize("H, D, style, head_dim, rotary_dim, rows, bf16_out", [
    (2, 32, 0, 32, 32, 1, True),
    (1, 64, 1, 32, 24, 2, False),  # interleaved, part of each head turned, a row per layer
    (2, 64, 0, 16, 12, 1, True),  # several heads per block, part turned
    (1, 96, 0, 32, 32, 1, False),  # a block of 96: padded digits
    (2, 32, 0, 64, 64, 1, True),  # a head across two blocks
])
def test_decoder_turns_the_keys_as_the_cpu(H, D, style, head_dim, rotary_dim, rows, bf16_out):
    from cachegen_cli.kernels import rope as rk

    rng = np.random.default_rng(5 + D)
    L, T, S = 2, 41, 2
    C = H * D
    q = rng.integers(-127, 128, (L, 2, T, C)) + (rng.integers(0, 4, (L, 2, T, C)) - 1) / 4
    z = q.astype(np.float32)
    rint_t = torch.from_numpy(fx.fixed_matrix(_rotation(rng, L, H, D), True))
    steps = torch.tensor(rng.uniform(0.01, 3, (L, 2)), dtype=torch.float32).to(torch.bfloat16).to(torch.float64)
    steps[1, 0] = 3.0e38  # keys near the top: x' saturates, and so do their turned pairs
    offsets = torch.tensor(rng.standard_normal((L, 2, C)), dtype=torch.float32).to(torch.bfloat16).float().numpy()
    b = np.empty((L, 2, C))
    fx.offset_sums(offsets, rint_t.numpy(), b)
    want = np.zeros_like(z)
    fx.unrotate_values(z, rint_t, steps.numpy(), b, S, want)
    rope = _rope(rng, style, head_dim, rotary_dim, rows if rows == 1 else L)
    rk.turn_keys(want, rope.inv_freq, rope, 0, S, True)
    out = torch.full((L, 2, T, C), 5, dtype=torch.int16 if bf16_out else torch.float32, device=DEV)
    rt = rint_t.to(DEV)
    # the keys' float32 values apart (the values' words straight into out), then turned into out
    keys = torch.full((L, 1, T, C), 6.0, device=DEV)
    fm.unrotate_values(torch.from_numpy(z).to(DEV), fm.rotation_digits(rt), fm.column_sums(rt), steps.to(DEV),
                       torch.from_numpy(b).to(DEV), S, out, keys=keys)
    assert (out[:, 0, S:] == 5).all()  # the key planes left for the turn
    fm.turn_rows(keys, _angles(rope, S, T), S, out, True)
    out = out.cpu()
    if bf16_out:
        lim = float(torch.finfo(torch.bfloat16).max)
        ref = torch.from_numpy(want).clamp(-lim, lim).to(torch.bfloat16).view(torch.int16)
        assert torch.equal(out[:, :, S:], ref[:, :, S:])
    else:
        assert np.array_equal(out.numpy()[:, :, S:].view(np.int32), want[:, :, S:].view(np.int32))
    assert (out[:, :, :S] == 5).all()


@pytest.mark.parametrize("style, head_dim, rotary_dim, rows, forward, bf16", [
    (0, 16, 16, 1, False, True), (1, 12, 8, 2, True, False), (0, 20, 6, 2, False, False), (1, 8, 8, 1, True, True)])
@pytest.mark.parametrize("planes", ["both", "keys out", "keys in"])
def test_turn_rows_is_turn_keys(style, head_dim, rotary_dim, rows, forward, bf16, planes):
    """fm.turn_rows (pairs of channels a step, the values planes copied) gives rope.turn_keys' bits
    on a float32 copy, back or forward, float32 or bfloat16 words in and out, with heads whose
    size is not a power of two and a RoPE row per layer; rows before t_first untouched.  With
    the keys alone on one side ([L, 1, T, C]): the keys turned, the values' plane of out
    untouched."""
    from cachegen_cli.kernels import rope as rk

    rng = np.random.default_rng(head_dim + rotary_dim)
    L, T, S = 2, 37, 4
    C = 3 * head_dim
    x = _rows(rng, L, T, C, torch.bfloat16 if bf16 else torch.float32)
    x[0, 0, S + 1, :4] = 3.0e38  # pairs that saturate
    rope = _rope(rng, style, head_dim, rotary_dim, rows if rows == 1 else L)
    want = x.to(torch.float32).numpy().copy()
    rk.turn_keys(want, rope.inv_freq, rope, 0, S, forward)
    out = torch.full((L, 2 if planes != "keys out" else 1, T, C), 9, dtype=torch.int16 if bf16 else torch.float32,
                     device=DEV)
    xin = (x.view(torch.int16) if bf16 else x).to(DEV)
    if planes == "keys in":
        xin = xin[:, :1].contiguous()
    fm.turn_rows(xin, _angles(rope, S, T), S, out, forward)
    out = out.cpu()
    if planes != "both":
        want = want[:, :1]
    if planes == "keys in":
        assert (out[:, 1] == 9).all()
        out = out[:, :1]
    if bf16:
        lim = float(torch.finfo(torch.bfloat16).max)
        ref = torch.from_numpy(want).clamp(-lim, lim).to(torch.bfloat16).view(torch.int16)
        assert torch.equal(out[:, :, S:], ref[:, :, S:])
    else:
        assert np.array_equal(out.numpy()[:, :, S:].view(np.int32), want[:, :, S:].view(np.int32))
    assert (out[:, :, :S] == 9).all()
    assert fm.turns(head_dim) and not fm.turns(7)
    with pytest.raises(ValueError, match="even size"):
        odd = fm.RopeAngles(torch.zeros(1, T - S, 2, dtype=torch.float64, device=DEV),
                            torch.ones(1, T - S, 2, dtype=torch.float64, device=DEV), 0, 5, 4)
        fm.turn_rows(torch.zeros(L, 2, T, 15, device=DEV), odd, S, torch.zeros(L, 2, T, 15, device=DEV), forward)


@pytest.mark.parametrize("T, S, ct, t_lev, threshold, seed", [
    (70, 3, 16, 64, 0.5, 1),  # the last chunk left to quantize_levels (its values written)
    (130, 0, 64, 128, 0.62, 2),  # a dead zone; tiles of 64 rows, the last two rows past t_lev
    (40, 5, 8, 40, 0.5, 3),  # every chunk's levels from the product; chunks smaller than a tile
])
def test_encoder_levels_are_quantize_levels(T, S, ct, t_lev, threshold, seed):
    """rotate_rows(levels=...): the rows before t_lev get int8 levels in place of their values
    (LEVEL_UNDECIDED where float32 does not decide, with their values), the rows from t_lev on
    their values; cuda_pipeline.fix_levels then gives, chunk for chunk, the levels and statistics
    quantize_levels makes from all the values (transform.step_level's integers): with values
    placed on decision points (offsets that put row S + 1 exactly on n + threshold steps), a
    plane whose step float32 does not take, values past the clamp and sink rows."""
    from cachegen_cli.kernels import cuda_pipeline as cp
    from cachegen_cli.kernels.transform import TRANSFORM_QMAX, step_level

    rng = np.random.default_rng(seed)
    L, H, D = 2, 2, 32
    C = H * D
    x = _rows(rng, L, T, C, torch.bfloat16)
    rint = torch.from_numpy(fx.fixed_matrix(_rotation(rng, L, H, D), False))
    digits = fm.rotation_digits(rint.to(DEV))
    y = torch.zeros((L, 2, T, C), device=DEV)
    fm.rotate_rows(x.view(torch.int16).to(DEV), digits, S, y)
    yv = y.cpu().numpy()
    steps = (2.0 ** rng.integers(-4, 2, size=(L, 2))).astype(np.float64)
    steps[1, 1] = 2.0 ** 70  # float32's path declines the plane: every level from float64
    steps[0, 1] = 2.0 ** -12  # most quotients past the clamp
    off = torch.from_numpy(rng.standard_normal((L, 2, C)).astype(np.float32)).to(torch.bfloat16).float().numpy()
    # row S + 1: on n + threshold steps from the offset exactly (a power-of-two step: exact)
    n_steps = rng.integers(-3, 4, size=(L, 2, C)) + np.where(rng.random((L, 2, C)) < 0.5, threshold, 0.0)
    on_point = (yv[:, :, S + 1] - n_steps * steps[:, :, None]).astype(np.float32)
    off[0, 0] = on_point[0, 0]
    q = torch.full((L, 2, T, C), 99, dtype=torch.int8, device=DEV)
    y2 = torch.full((L, 2, T, C), 7.0, device=DEV)
    fm.rotate_rows(x.view(torch.int16).to(DEV), digits, S, y2,
                   levels=(q, torch.from_numpy(off).to(DEV), torch.from_numpy(steps).to(DEV), threshold, t_lev))
    qv, y2v = q.cpu().numpy(), y2.cpu().numpy()
    undecided = qv[:, :, :t_lev] == fm.LEVEL_UNDECIDED
    assert undecided[0, 0, S + 1].sum() > C // 4, "the decision points go to the float64 path"
    assert undecided[1, 1, S:t_lev].all() and not undecided[:, :, :S].any()
    assert (qv[:, :, :S] == 0).all()
    for l, kv, t, c in zip(*np.nonzero(undecided)):
        assert y2v[l, kv, t, c].view(np.int32) == yv[l, kv, t, c].view(np.int32)
    assert np.array_equal(y2v[:, :, t_lev:].view(np.int32), yv[:, :, t_lev:].view(np.int32))
    decided = np.ones_like(undecided)
    decided[:, :, :S] = False
    decided &= ~undecided
    for l, kv, t, c in zip(*np.nonzero(decided)):
        assert qv[l, kv, t, c] == step_level(yv[l, kv, t, c], off[l, kv, c], steps[l, kv], TRANSFORM_QMAX, threshold)
    # fix_levels + quantize_levels past t_lev: quantize_levels' levels and statistics over every chunk
    K = -(-T // ct)
    k_lev = t_lev // ct
    want_q = torch.zeros((L, 2, T, C), dtype=torch.int8)
    want_stats = np.zeros((L, 2, K, C, 6), np.int32)
    ref = np.zeros((L, 2, 1, C), np.uint8)
    # two values a thread: the float32 values as int64 words, the levels as int16 words
    cp.quantize_levels(yv.view(np.int64), 4, cp.FMT_FLOAT32, S, off, steps, threshold, T, 0, ct,
                       want_q.view(torch.int16).numpy(), ref, want_stats)
    got_stats = np.full((L, 2, K, C, 6), 12345, np.int32)
    qc = q.cpu()
    cp.fix_levels(qc.view(torch.int16).numpy(), y2v, S, off, steps, threshold, ct, k_lev, got_stats)
    if k_lev < K:
        cp.quantize_levels(y2v.view(np.int64), 4, cp.FMT_FLOAT32, S, off, steps, threshold, T, 0, ct,
                           qc.view(torch.int16).numpy(), ref, got_stats, k_first=k_lev)
    assert np.array_equal(qc.numpy(), want_q.numpy())
    assert np.array_equal(got_stats, want_stats)
