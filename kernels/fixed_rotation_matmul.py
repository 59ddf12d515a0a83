"""The fixed-point rotation (kernels/fixed_rotation.py, docs/format.md "Fixed-point rotation")
on the GPU's matrix units: one Triton kernel per direction, each a block-diagonal product of
8-bit integer digits with the integer rows made before it and the values made after it in the
same pass.

Why: the product's operands are integers (rows X of at most 21 bits, the rotation's Rint of 15,
the decoder's levels q' x 256 of 16), so their product is exact in any arithmetic that keeps
every partial sum; float64 (cuBLAS, as fixed_rotation.block_product) does, but an H200 runs
float64 products at ~1/30 of its 8-bit integer rate, and the float64 rows and products between
the passes cost ~30 bytes of memory traffic a value.  Split into signed 8-bit digits, every
digit product sums exactly in int32 (Triton's ``tl.dot`` on int8 -> int32 runs on the matrix
units), and the digits' sums combine exactly in int64: the same integers, hence the same bits
as the CPU's float64 product, read once and written once.

Digits (all balanced, each an int8, base 2^8):
  X  (|X| <= 2^20)          X = d0 + 2^8 d1 + 2^16 d2,      d0, d1 in [-128, 127], d2 in [-16, 16]
  Rint (|R| <= 2^14)        R = r0 + 2^8 r1,                r0 in [-128, 127],     r1 in [-64, 64]
  Q = 256 q' - 1            Q = g0 + 2^8 g1,                g0 in [-128, 127],     g1 in [-128, 127]
    (q' in [-127.5 + 1/256, 127.5]: 256 q' in [-32639, 32640]; the 1 taken off is added back
     as the column sums of Rint, so that no digit reaches 128)

Bounds: the products of one weight are chained on the matrix units into one int32 accumulator
over the whole block of D channels: encoding, P0 = d0.r0 (|P0| <= D 2^14), P8 = d0.r1 + d1.r0
(<= D (2^13 + 2^14)), P16 = d1.r1 + d2.r0 (<= D (2^13 + 2^11)), P24 = d2.r1 (<= D 2^10);
decoding, P0 = g0.r0, P8 = g0.r1 + g1.r0, P16 = g1.r1 (<= D 2^13): inside int32 for any block
up to 2^16 channels.  Their weighted sum P0 + 2^8 P8 + 2^16 P16 + 2^24 P24, made once per output
in int64, is the exact product, under D 2^34 (X) and D 2^29 (Q): exact in float64 too (D <
2^19), as docs/format.md requires.
Four (three) accumulators of int32 rather than the six partial products and an int64 sum keep
a program's registers within the GPU's 255 a thread (the first version spilled: ncu, 2026-12-02).

Who does what: a program owns one plane, one diagonal block and BN of its outputs; it loads that
block's [D, BN] digit tiles once and keeps them in registers while it walks tiles of BM rows
(tiles i, i + P, i + 2P, ... of the plane, P the programs that share them): digits of the [BM, D] tile of values times the kept
tiles, summed exactly, then scaled to float32 (or, decoding, stepped, offset, saturated, and
optionally rounded to bfloat16 words); encoding with the offsets and steps at hand, the float32
values of most rows become their int8 levels in the same program (transform.fast_level32 on the
tile: a quarter of the bytes written, and no pass reading them back; the few values float32
does not decide are written for cuda_pipeline.fix_levels, which also makes the chunks'
statistics from the levels).  The encoder's rows' exponents (their largest magnitude
over every channel, which a program of one block does not see) come from a pass before it, one
program per 32 rows.  Blocks past RESIDENT_BLOCK (a full rotation) do not fit: there one
program per BM rows walks every block, BN outputs at a time and BK channels a step, reading the
digit tiles from the L2 cache as it goes.  Adjacent lanes load adjacent channels of a row.  (The kernels before these
walked every block of their rows and re-read the digit tiles, 4 bytes of them a value, from
the L2 cache: 3.49 / 4.37 ms against 2.42 / 2.46 ms on an H200, docs/results/2026-12-03_rotation_resident_8df696f.txt.)

The host wrappers take torch tensors on one device; under numba's simulator the tests run the
same kernels through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .fixed_rotation import R_BITS, X_BITS
from .transform import LEVEL32_CLAMP, LEVEL32_EPS, STATS_BLOCK, TRANSFORM_QMAX

try:  # Triton ships with CUDA builds of torch; without it the callers use block_product
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

#: float32's largest finite value, and bfloat16's (the decoder's saturation)
_F32_MAX = 3.4028234663852886e38

#: Each direction's launch: rows per tile, warps per program, software-pipelining depth, outputs
#: per program ("tile", the largest power of two up to it dividing the block) and programs a
#: multiprocessor ("spread": the programs of each (plane, block, outputs) share its row tiles):
#: the fastest of a sweep on an H200 (benchmarks/profile_fixed_rotation.py --configs, 2026-12-03
#: ~07:12 UTC, commit 0c7de16, 8 blocks of 128, 32 x 2 x 8192 x 1024 values: encode 2.11 ms with
#: the exponents' pass, decode 2.13 ms from int16 levels, against 7.84 / 8.07 ms for the float64
#: path; docs/results/2026-12-03_rotation_sweep_0c7de16.txt).  At 128 rows and 4 warps the
#: accumulators spill, and 8 warps ran slower (benchmarks/rotation_registers.py).  Dicts, so that
#: the sweep can set them.
ENCODE_LAUNCH = {"rows": 64, "warps": 4, "stages": 3, "tile": 64, "spread": 1}
DECODE_LAUNCH = {"rows": 64, "warps": 4, "stages": 3, "tile": 64, "spread": 1}
#: The blocks the kernels take: MIN_BLOCK channels at least (the matrix units' tiles), at most
#: MAX_BLOCK (a full rotation of a 1024-channel cache; the int32 sums stay exact to 2^16).  Up to
#: RESIDENT_BLOCK a program holds its block's digit tiles in registers; past it the streaming
#: kernels read them from the L2 cache as they go (STREAM_ENCODE_LAUNCH / STREAM_DECODE_LAUNCH,
#: the fastest of a sweep on an H200, 2026-12-03 ~07:39 UTC, commit 62b07d9: one 1024-channel
#: block in 20.6 ms / 14.3 ms from int16 levels, against cuBLAS's float64 product's 21.8 / 22.0
#: ms; docs/results/2026-12-03_rotation_block1024_sweep_62b07d9.txt).  Both spill registers
#: (benchmarks/rotation_registers.py); launches that do not ran slower.
MIN_BLOCK = 32
RESIDENT_BLOCK = 128
#: rotate_rows(levels=...)'s level for a value float32 does not decide (cuda_pipeline.fix_levels
#: decides it in float64): outside the format's levels (+-TRANSFORM_QMAX)
LEVEL_UNDECIDED = -128
MAX_BLOCK = 1024
STREAM_ENCODE_LAUNCH = {"rows": 32, "warps": 4, "stages": 2, "tile": 128, "depth": 64}
STREAM_DECODE_LAUNCH = {"rows": 32, "warps": 4, "stages": 2, "tile": 128, "depth": 64}


#: Triton's interpreter (numpy, on CPU tensors) is on: what the simulator's tests run.  Triton
#: reads the variable when a kernel is decorated, so this is read once too.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device: torch.device) -> bool:
    """True when the kernels run on tensors of ``device``: Triton is importable, and the device
    is a GPU (the interpreter off) or the CPU (the interpreter on); CACHEGEN_ROTATION_MATMUL=0
    turns them off (the float64 product instead: the same bits, for comparisons)."""
    if triton is None or os.environ.get("CACHEGEN_ROTATION_MATMUL", "1") == "0":
        return False
    return (device.type == "cpu") == INTERPRETED


def supports(block: int) -> bool:
    """True when a rotation of diagonal blocks of ``block`` channels runs here (the matrix
    units take tiles of at least MIN_BLOCK channels; MAX_BLOCK: the blocks measured faster than
    cuBLAS's float64 product)."""
    return triton is not None and MIN_BLOCK <= block <= MAX_BLOCK and block % MIN_BLOCK == 0


def _tile(block: int, tile: int) -> int:
    """Channels per tile: the largest power of two up to ``tile`` (0: 128) that divides the block."""
    t = tile or 128
    while block % t:
        t //= 2
    return t


def rotation_digits(rint: torch.Tensor) -> torch.Tensor:
    """The int8 digits (r0, r1) of the fixed-point blocks ``rint`` (float64 [L, 2, H, D, D],
    integer-valued, |Rint| <= 2^14: fixed_rotation.fixed_matrix) as int8 [2, L, 2, H, D, D], on
    rint's device."""
    r = rint.to(torch.int32)
    r0 = ((r + 128) & 255) - 128
    r1 = (r - r0) >> 8
    return torch.stack([r0, r1]).to(torch.int8).contiguous()


def column_sums(rint_t: torch.Tensor) -> torch.Tensor:
    """sum over i of rint_t[l, kv, h, i, j] as int64 [L, 2, H x D]: the decoder's blocks' sums
    down each output column (what the digits' offset of 1 takes off each product)."""
    L, K, H, D, _ = rint_t.shape
    return rint_t.sum(dim=3, dtype=torch.float64).to(torch.int64).reshape(L, K, H * D).contiguous()


if triton is not None:
    # transform.fast_level32's constants, as the kernels take module constants
    _QMAX = tl.constexpr(TRANSFORM_QMAX)
    _CLAMP32 = tl.constexpr(LEVEL32_CLAMP)
    _EPS32 = tl.constexpr(LEVEL32_EPS)
    _ONE_EPS32 = tl.constexpr(1.0 - LEVEL32_EPS)
    _UNDECIDED = tl.constexpr(LEVEL_UNDECIDED)

    @triton.jit
    def _load_values(x_ptr, at, live, BF16_WORDS: tl.constexpr):
        """float32 values at offsets ``at`` of the live rows (0 elsewhere): float32 words, or
        bfloat16 words widened exactly."""
        if BF16_WORDS:
            w = tl.load(x_ptr + at, mask=live, other=0).to(tl.int32)
            v = ((w & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            v = tl.load(x_ptr + at, mask=live, other=0.0)
        return v

    @triton.jit
    def _pair_channels(i, HD: tl.constexpr, RD: tl.constexpr, STYLE: tl.constexpr):
        """Channels (a, b) of the row's pairs i under a RoPE of heads of HD channels (even) whose
        first RD are turned (kernels/rope.pair_channels; head i // (HD / 2)), the rest of a
        head paired as (RD + 2u, RD + 2u + 1) and never turned; whether pair i is turned, and
        its index j in its head."""
        PH: tl.constexpr = HD // 2
        RH: tl.constexpr = RD // 2
        head = i // PH
        jj = i % PH
        turned = jj < RH
        if STYLE == 0:
            a = jj
            b = jj + RH
        else:
            a = 2 * jj
            b = 2 * jj + 1
        u = jj - RH
        a = tl.where(turned, a, RD + 2 * u)
        b = tl.where(turned, b, RD + 2 * u + 1)
        return head * HD + a, head * HD + b, turned, tl.where(turned, jj, 0)

    @triton.jit
    def _turn_pair(xa, xb, s, c, FORWARD: tl.constexpr):
        """A pair of float32 values turned by the angle whose sine and cosine are s, c: back
        (kernels/rope.unturn: x_a = k_a c + k_b s, x_b = k_b c - k_a s) or, FORWARD, forward
        (rope.turn: k_a = x_a c - x_b s, k_b = x_b c + x_a s, its inputs saturated first); each
        product and sum rounded in float64 (the launch turns off fused multiply-adds), then
        saturated to float32."""
        F32_MAX: tl.constexpr = 3.4028234663852886e38
        a = xa.to(tl.float64)
        b = xb.to(tl.float64)
        if FORWARD:
            a = tl.minimum(tl.maximum(a, -F32_MAX), F32_MAX)
            b = tl.minimum(tl.maximum(b, -F32_MAX), F32_MAX)
            ra = a * c - b * s
            rb = b * c + a * s
        else:
            ra = a * c + b * s
            rb = b * c - a * s
        # Saturated after the conversion to float32 (a float64 past float32's largest finite value
        # rounds to it or to an infinity, then clamped: the same bits as clamping first), as float32
        # operations: float64 ones issue at a fraction of their rate
        return _saturate32(ra.to(tl.float32)), _saturate32(rb.to(tl.float32))

    @triton.jit
    def _saturate32(v):
        """A float32 infinity as the largest finite float32 of its sign (v never a NaN)."""
        F32_MAX: tl.constexpr = 3.4028234663852886e38
        return tl.minimum(tl.maximum(v, -F32_MAX), F32_MAX)

    @triton.jit
    def _nearest_integer(t):
        """round(t) ties to even, as int32, for float32 |t| <= 2^22: t + 1.5 x 2^23 has the
        exponent of 2^23, so its low mantissa bits are the rounded integer (no conversion
        instruction, which the GPU issues at a quarter of its float rate)."""
        return (t + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000

    @triton.jit
    def _store_values(out_ptr, at, live, v, BF16_OUT: tl.constexpr):
        """The decoder's float32 values v (saturated) at ``at``: as float32, or as bfloat16 bits
        rounded to nearest even, an infinity becoming the largest finite value
        (cuda_pipeline._make_fixed_values' words)."""
        if BF16_OUT:
            u = v.to(tl.int32, bitcast=True)
            wb = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            wb = tl.where((wb & 0x7FFF) == 0x7F80, wb - 1, wb)
            wb = tl.where(wb >= 32768, wb - 65536, wb)
            tl.store(out_ptr + at, wb.to(tl.int16), mask=live)
        else:
            tl.store(out_ptr + at, v, mask=live)

    @triton.jit
    def _row_scales(e, XB: tl.constexpr, RB: tl.constexpr):
        """For rows with max |x| < 2^e: 2^(XB - e) as two float32 powers of two (each normal: XB -
        e is in [-108, 146]), so that v x scale_a x scale_b is exact in float32 (a product that
        would lose bits underflows, and then rounds to the integer 0 either way); and 2^(e - XB -
        RB), normal in float64, that takes the product back."""
        sa = (XB - e) >> 1
        scale_a = ((127 + sa) << 23).to(tl.float32, bitcast=True)
        scale_b = ((127 + XB - e - sa) << 23).to(tl.float32, bitcast=True)
        back = ((1023 - XB - RB + e).to(tl.int64) << 52).to(tl.float64, bitcast=True)
        return scale_a[:, None], scale_b[:, None], back[:, None]

    @triton.jit
    def _row_digits(v, scale_a, scale_b):
        """X = round(v 2^(XB - e)) as its int8 digits d0 + 2^8 d1 + 2^16 d2 (the module's bounds)."""
        X = _nearest_integer((v * scale_a) * scale_b)
        d0 = ((X + 128) & 255) - 128
        X = (X - d0) >> 8
        d1 = ((X + 128) & 255) - 128
        return d0.to(tl.int8), d1.to(tl.int8), ((X - d1) >> 8).to(tl.int8)

    @triton.jit
    def _level_digits(Q):
        """Q = 256 q' - 1 as its int8 digits g0 + 2^8 g1 (the module's bounds)."""
        g0 = ((Q + 128) & 255) - 128
        return g0.to(tl.int8), ((Q - g0) >> 8).to(tl.int8)

    @triton.jit
    def _program_rows(T, n, t_first, C: tl.constexpr, BM: tl.constexpr, P0, PS):
        """This program's plane p = P0 + PS x axis 1 and rows (axis 0: BM rows from t_first),
        which are live, and their first words."""
        p = P0 + PS * tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        return p, rows, rows < n, (p.to(tl.int64) * T + t_first + rows) * C

    @triton.jit
    def _row_words(p, rows, t_first, T, C: tl.constexpr, KEYS_APART: tl.constexpr):
        """First words of rows of plane p in a tensor of both planes of each layer [L, 2, T, C],
        or (KEYS_APART) of key plane p in a tensor of the keys alone [L, 1, T, C]."""
        if KEYS_APART:
            return ((p // 2).to(tl.int64) * T + t_first + rows) * C
        return (p.to(tl.int64) * T + t_first + rows) * C

    @triton.jit
    def _exponent_of(top):
        """fixed_rotation.row_exponent of the largest float32 magnitude bits ``top``."""
        return ((top >> 23) & 0xFF) - 126

    @triton.jit
    def _row_exponents_kernel(x_ptr, e_ptr, T, n, t_first, P0, PS, C: tl.constexpr, BM: tl.constexpr,
                              BK: tl.constexpr, BF16_WORDS: tl.constexpr):
        """e[p, t - t_first] = fixed_rotation.row_exponent of row t of plane p (max |x| < 2^e, over
        every channel): one program per BM rows of a plane, planes P0, P0 + PS, ..."""
        p, rows, live, row_at = _program_rows(T, n, t_first, C, BM, P0, PS)
        ks = tl.arange(0, BK)
        top = tl.zeros([BM], dtype=tl.int32)
        for c0 in range(0, C, BK):
            at = row_at[:, None] + (c0 + ks)[None, :]
            bits = _load_values(x_ptr, at, live[:, None] & ((c0 + ks) < C)[None, :], BF16_WORDS).to(tl.int32,
                                                                                                 bitcast=True)
            top = tl.maximum(top, tl.max(bits & 0x7FFFFFFF, axis=1))
        tl.store(e_ptr + p.to(tl.int64) * n + rows, _exponent_of(top), mask=live)

    @triton.jit
    def _turn_rows_kernel(x_ptr, out_ptr, e_ptr, sin_ptr, cos_ptr, NF, T, n, t_first, C: tl.constexpr,
                          BM: tl.constexpr, BP: tl.constexpr, BF16_WORDS: tl.constexpr, HD: tl.constexpr,
                          RD: tl.constexpr, STYLE: tl.constexpr, FORWARD: tl.constexpr, BF16_OUT: tl.constexpr,
                          EXPONENTS: tl.constexpr, X_KEYS: tl.constexpr, OUT_KEYS: tl.constexpr):
        """out = x with the keys turned by their RoPE (rope.turn_keys: back, or FORWARD), for rows
        t_first .. of every plane (the values copied), as float32 or (BF16_OUT) bfloat16 words
        (saturating); with EXPONENTS also e as _row_exponents_kernel over the turned rows.  When
        x (X_KEYS) or out (OUT_KEYS) holds the keys alone ([L, 1, T, C]), only the key planes.
        One program per BM rows of a plane, BP pairs of channels a step: both channels of a pair
        and their angle's sine and cosine (the tables of cuda_pipeline.rope_angles, row l of
        them when NF > 1) loaded once, small tiles (the float64 turn keeps few values a thread)."""
        p, rows, live, _ = _program_rows(T, n, t_first, C, BM, 0, 2 if X_KEYS or OUT_KEYS else 1)
        row_at = _row_words(p, rows, t_first, T, C, X_KEYS)
        out_at = _row_words(p, rows, t_first, T, C, OUT_KEYS)
        ps = tl.arange(0, BP)
        top = tl.zeros([BM], dtype=tl.int32)
        NPAIRS: tl.constexpr = C // 2
        frow = tl.where(NF > 1, p // 2, 0).to(tl.int64)
        for i0 in range(0, NPAIRS, BP):
            ca, cb, turned, j = _pair_channels(i0 + ps, HD, RD, STYLE)
            mask = live[:, None] & ((i0 + ps) < NPAIRS)[None, :]
            at_a = row_at[:, None] + ca[None, :]
            at_b = row_at[:, None] + cb[None, :]
            va = _load_values(x_ptr, at_a, mask, BF16_WORDS)
            vb = _load_values(x_ptr, at_b, mask, BF16_WORDS)
            if p % 2 == 0:
                tm = mask & turned[None, :]
                ang = (frow * n + rows)[:, None] * (RD // 2) + j[None, :]
                ka, kb = _turn_pair(va, vb, tl.load(sin_ptr + ang, mask=tm, other=0.0),
                                    tl.load(cos_ptr + ang, mask=tm, other=1.0), FORWARD)
                va = tl.where(tm, ka, va)
                vb = tl.where(tm, kb, vb)
            _store_values(out_ptr, out_at[:, None] + ca[None, :], mask, va, BF16_OUT)
            _store_values(out_ptr, out_at[:, None] + cb[None, :], mask, vb, BF16_OUT)
            if EXPONENTS:
                top = tl.maximum(top, tl.max(va.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                top = tl.maximum(top, tl.max(vb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
        if EXPONENTS:
            tl.store(e_ptr + p.to(tl.int64) * n + rows, _exponent_of(top), mask=live)

    @triton.jit
    def _kept_tiles(r_ptr, plane_digits, P0, PS, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                    BN: tl.constexpr):
        """This program's plane p (of P0, P0 + PS, ...), diagonal block h and outputs n0 .. n0 +
        BN, and the [DP, BN] digit tiles r0, r1 of that block's columns (rows past D, when D is
        not a power of two, are zeros): loaded once, kept for every row tile."""
        NT: tl.constexpr = D // BN
        q = tl.program_id(1)
        n0 = (q % NT) * BN
        h = (q // NT) % H
        p = P0 + PS * (q // (NT * H))
        ks = tl.arange(0, DP)
        r_at = (((p.to(tl.int64) * H + h) * D + ks)[:, None] * D + (n0 + tl.arange(0, BN))[None, :])
        inside = (ks < D)[:, None]
        return (p, h, n0, tl.load(r_ptr + r_at, mask=inside, other=0),
                tl.load(r_ptr + plane_digits + r_at, mask=inside, other=0))

    @triton.jit
    def _tile_rows(p, tt, n, t_first, T, C: tl.constexpr, BM: tl.constexpr):
        """Row tile tt of plane p: its rows (t - t_first), which are live, their first words."""
        rows = tt * BM + tl.arange(0, BM)
        return rows, rows < n, (p.to(tl.int64) * T + t_first + rows) * C

    @triton.jit
    def _levels32(y, off, inv32, thr32):
        """transform.fast_level32 over a tile: the level where float32 decides it, else
        LEVEL_UNDECIDED (then the float64 path decides: cuda_pipeline.fix_levels).  y [BM, BN],
        off [BN] float32; inv32 = float32(1 / step), or a NaN (every level undecided)."""
        v = (y - off[None, :]) * inv32
        a = tl.abs(v)
        small = a < _CLAMP32  # (False for a NaN)
        whole = tl.where(small, a, 0.0).to(tl.int32)  # toward zero: floor
        fa = a - whole.to(tl.float32)  # exact
        sure = (fa < _ONE_EPS32) & ((fa > _EPS32) | (whole == 0)) & (tl.abs(fa - thr32) > _EPS32)
        q = tl.minimum(whole + (fa >= thr32).to(tl.int32), _QMAX)
        big = a >= _CLAMP32  # infinities included; a NaN neither small nor big
        q = tl.where(big, _QMAX, q)
        q = tl.where(v < 0.0, -q, q)
        return tl.where((small & sure) | big, q, _UNDECIDED)

    @triton.jit
    def _rotate_rows_kernel(x_ptr, e_ptr, r_ptr, y_ptr, T, n, t_first, plane_digits, P0, PS,
                            q_ptr, off_ptr, steps_ptr, thr32, t_lev,
                            C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, BF16_WORDS: tl.constexpr,
                            XB: tl.constexpr, RB: tl.constexpr, X_KEYS: tl.constexpr, LEVELS: tl.constexpr):
        """(X_KEYS: x holds the keys alone, [L, 1, T, C], and the planes are key planes.)  Row
        tiles are BM tokens by absolute position, SB // BM of them a block of SB; a program takes
        whole blocks (blocks i, i + P, ...) and their tiles in token order.  LEVELS: rows before
        t_lev (absolute) get their levels q (int8, from row 0 of the tile: rows before t_first are
        sink tokens, level 0) by _levels32 in place of their values, with the values of the
        undecided ones; the rows from t_lev on their values."""
        p, h, n0, r0, r1 = _kept_tiles(r_ptr, plane_digits, P0, PS, H, D, DP, BN)
        ks = tl.arange(0, DP)
        ns = tl.arange(0, BN)
        if LEVELS:
            step = tl.load(steps_ptr + p)
            # float32(1 / step), or (a step past 2^+-60: transform.fast_level32 does not take it)
            # a NaN, which decides nothing
            inv32 = (1.0 / step).to(tl.float32)
            inv32 = tl.where(step > 8.673617379884035e-19, inv32, float("nan"))
            inv32 = tl.where(step < 1.152921504606847e18, inv32, float("nan"))
            off = tl.load(off_ptr + p.to(tl.int64) * C + h * D + n0 + ns)
        TPB: tl.constexpr = SB // BM
        NBLK = tl.cdiv(T, SB)
        P = tl.num_programs(0)
        mine = tl.cdiv(NBLK - tl.program_id(0), P)
        out_at = p.to(tl.int64) * T * C + h * D + n0 + ns
        for it in range(0, mine * TPB):
            bb = tl.program_id(0) + (it // TPB) * P
            t0 = bb * SB + (it % TPB) * BM
            rows = t0 - t_first + tl.arange(0, BM)  # rows from t_first; those before it are not live
            live = (rows >= 0) & (rows < n)
            e = tl.load(e_ptr + p.to(tl.int64) * n + rows, mask=live, other=0)
            scale_a, scale_b, back = _row_scales(e, XB, RB)
            x_at = _row_words(p, rows, t_first, T, C, X_KEYS)
            v = _load_values(x_ptr, x_at[:, None] + (h * D + ks)[None, :], live[:, None] & (ks < D)[None, :],
                             BF16_WORDS)
            a0, a1, a2 = _row_digits(v, scale_a, scale_b)
            # the digits' products summed by their weight 2^0, 2^8, 2^16, 2^24 (exact in int32
            # over a whole block of at most 128 channels: see the module's bounds)
            p0 = tl.dot(a0, r0, out_dtype=tl.int32)
            p8 = tl.dot(a1, r0, tl.dot(a0, r1, out_dtype=tl.int32), out_dtype=tl.int32)
            p16 = tl.dot(a2, r0, tl.dot(a1, r1, out_dtype=tl.int32), out_dtype=tl.int32)
            p24 = tl.dot(a2, r1, out_dtype=tl.int32)
            acc = (p0.to(tl.int64) + (p8.to(tl.int64) << 8) + (p16.to(tl.int64) << 16)
                   + (p24.to(tl.int64) << 24))
            y = (acc.to(tl.float64) * back).to(tl.float32)
            y_at = out_at[None, :] + (t0 + tl.arange(0, BM)).to(tl.int64)[:, None] * C
            if LEVELS:
                ts = t0 + tl.arange(0, BM)
                leveled = (ts < t_lev) & (ts < T)
                q = _levels32(y, off, inv32, thr32)
                q = tl.where(live[:, None], q, 0)
                tl.store(q_ptr + y_at, q.to(tl.int8), mask=leveled[:, None])
                tl.store(y_ptr + y_at, y, mask=(live & (ts >= t_lev))[:, None] | (
                    (live & leveled)[:, None] & (q == _UNDECIDED)))
            else:
                tl.store(y_ptr + y_at, y, mask=live[:, None])

    @triton.jit
    def _unrotate_values_kernel(z_ptr, r_ptr, sums_ptr, steps_ptr, b_ptr, out_ptr, T, n, t_first, plane_digits,
                                tiles, P0, PS, C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                                BM: tl.constexpr, BN: tl.constexpr, BF16_OUT: tl.constexpr, F32_MAX: tl.constexpr,
                                LEVEL_WORDS: tl.constexpr, OUT_KEYS: tl.constexpr):
        """(OUT_KEYS: out holds the keys alone, [L, 1, T, C], and the planes are key planes.)"""
        p, h, n0, r0, r1 = _kept_tiles(r_ptr, plane_digits, P0, PS, H, D, DP, BN)
        ks = tl.arange(0, DP)
        cols = h * D + n0 + tl.arange(0, BN)
        # A x 256 x s 2^-14 / 256: the step times 2^-22 (exact: a power of two)
        unit = tl.load(steps_ptr + p) * 2.384185791015625e-07
        sums = tl.load(sums_ptr + p * C + cols)
        b = tl.load(b_ptr + p * C + cols)
        for tt in range(tl.program_id(0), tiles, tl.num_programs(0)):
            rows, live, row_at = _tile_rows(p, tt, n, t_first, T, C, BM)
            at = row_at[:, None] + (h * D + ks)[None, :]
            inside = live[:, None] & (ks < D)[None, :]
            if LEVEL_WORDS:  # Q = 256 q' - 1 as int16 words (cuda_pipeline.dequantize's levels)
                Q = tl.load(z_ptr + at, mask=inside, other=0).to(tl.int32)
            else:
                Q = _nearest_integer(tl.load(z_ptr + at, mask=inside, other=0.0) * 256.0) - 1  # exact
            a0, a1 = _level_digits(Q)
            p0 = tl.dot(a0, r0, out_dtype=tl.int32)
            p8 = tl.dot(a1, r0, tl.dot(a0, r1, out_dtype=tl.int32), out_dtype=tl.int32)
            p16 = tl.dot(a1, r1, out_dtype=tl.int32)
            # a row past D (zero digits) adds nothing; the 1 taken off each level comes back as
            # the column sums
            acc = sums[None, :] + p0.to(tl.int64) + (p8.to(tl.int64) << 8) + (p16.to(tl.int64) << 16)
            v = acc.to(tl.float64) * unit + b[None, :]
            out_at = _row_words(p, rows, t_first, T, C, OUT_KEYS)
            _store_values(out_ptr, out_at[:, None] + cols[None, :], live[:, None],
                          tl.minimum(tl.maximum(v, -F32_MAX), F32_MAX).to(tl.float32), BF16_OUT)

    @triton.jit
    def _digit_tiles(r_ptr, plane_digits, p, h, k0, n0, D: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                     H: tl.constexpr):
        """The [BK, BN] tiles of digits r0 and r1 of block h of plane p, from row k0, column n0."""
        r_at = (((p.to(tl.int64) * H + h) * D + k0 + tl.arange(0, BK))[:, None] * D
                + (n0 + tl.arange(0, BN))[None, :])
        return tl.load(r_ptr + r_at), tl.load(r_ptr + plane_digits + r_at)

    @triton.jit
    def _rotate_rows_streaming_kernel(x_ptr, e_ptr, r_ptr, y_ptr, T, n, t_first, plane_digits, P0, PS,
                                      C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                                      BN: tl.constexpr, BK: tl.constexpr, BF16_WORDS: tl.constexpr,
                                      XB: tl.constexpr, RB: tl.constexpr, X_KEYS: tl.constexpr):
        """_rotate_rows_kernel for blocks past RESIDENT_BLOCK: one program per BM rows of a plane
        walks every block, BN outputs at a time, BK channels a step, reading the digit tiles as
        it goes (the int32 sums chained over the whole block, as there)."""
        p = P0 + PS * tl.program_id(1)
        rows, live, row_at = _tile_rows(p, tl.program_id(0), n, t_first, T, C, BM)
        x_at = _row_words(p, rows, t_first, T, C, X_KEYS)
        e = tl.load(e_ptr + p.to(tl.int64) * n + rows, mask=live, other=0)
        scale_a, scale_b, back = _row_scales(e, XB, RB)
        ks = tl.arange(0, BK)
        ns = tl.arange(0, BN)
        for h in range(0, H):
            for n0 in range(0, D, BN):
                p0 = tl.zeros([BM, BN], dtype=tl.int32)
                p8 = tl.zeros([BM, BN], dtype=tl.int32)
                p16 = tl.zeros([BM, BN], dtype=tl.int32)
                p24 = tl.zeros([BM, BN], dtype=tl.int32)
                for k0 in range(0, D, BK):
                    v = _load_values(x_ptr, x_at[:, None] + (h * D + k0 + ks)[None, :], live[:, None], BF16_WORDS)
                    a0, a1, a2 = _row_digits(v, scale_a, scale_b)
                    r0, r1 = _digit_tiles(r_ptr, plane_digits, p, h, k0, n0, D, BK, BN, H)
                    p0 = tl.dot(a0, r0, p0, out_dtype=tl.int32)
                    p8 = tl.dot(a1, r0, tl.dot(a0, r1, p8, out_dtype=tl.int32), out_dtype=tl.int32)
                    p16 = tl.dot(a2, r0, tl.dot(a1, r1, p16, out_dtype=tl.int32), out_dtype=tl.int32)
                    p24 = tl.dot(a2, r1, p24, out_dtype=tl.int32)
                acc = (p0.to(tl.int64) + (p8.to(tl.int64) << 8) + (p16.to(tl.int64) << 16)
                       + (p24.to(tl.int64) << 24))
                y = (acc.to(tl.float64) * back).to(tl.float32)
                tl.store(y_ptr + row_at[:, None] + (h * D + n0 + ns)[None, :], y, mask=live[:, None])

    @triton.jit
    def _unrotate_values_streaming_kernel(z_ptr, r_ptr, sums_ptr, steps_ptr, b_ptr, out_ptr, T, n, t_first,
                                          plane_digits, P0, PS, C: tl.constexpr, H: tl.constexpr,
                                          D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                          BF16_OUT: tl.constexpr, F32_MAX: tl.constexpr, LEVEL_WORDS: tl.constexpr,
                                          OUT_KEYS: tl.constexpr):
        """_unrotate_values_kernel for blocks past RESIDENT_BLOCK, walked as the streaming encoder."""
        p = P0 + PS * tl.program_id(1)
        rows, live, row_at = _tile_rows(p, tl.program_id(0), n, t_first, T, C, BM)
        out_at = _row_words(p, rows, t_first, T, C, OUT_KEYS)
        unit = tl.load(steps_ptr + p) * 2.384185791015625e-07
        ks = tl.arange(0, BK)
        ns = tl.arange(0, BN)
        for h in range(0, H):
            for n0 in range(0, D, BN):
                cols = h * D + n0 + ns
                p0 = tl.zeros([BM, BN], dtype=tl.int32)
                p8 = tl.zeros([BM, BN], dtype=tl.int32)
                p16 = tl.zeros([BM, BN], dtype=tl.int32)
                for k0 in range(0, D, BK):
                    at = row_at[:, None] + (h * D + k0 + ks)[None, :]
                    if LEVEL_WORDS:
                        Q = tl.load(z_ptr + at, mask=live[:, None], other=0).to(tl.int32)
                    else:
                        Q = _nearest_integer(tl.load(z_ptr + at, mask=live[:, None], other=0.0) * 256.0) - 1
                    a0, a1 = _level_digits(Q)
                    r0, r1 = _digit_tiles(r_ptr, plane_digits, p, h, k0, n0, D, BK, BN, H)
                    p0 = tl.dot(a0, r0, p0, out_dtype=tl.int32)
                    p8 = tl.dot(a1, r0, tl.dot(a0, r1, p8, out_dtype=tl.int32), out_dtype=tl.int32)
                    p16 = tl.dot(a1, r1, p16, out_dtype=tl.int32)
                acc = (tl.load(sums_ptr + p * C + cols)[None, :] + p0.to(tl.int64) + (p8.to(tl.int64) << 8)
                       + (p16.to(tl.int64) << 16))
                v = acc.to(tl.float64) * unit + tl.load(b_ptr + p * C + cols)[None, :]
                _store_values(out_ptr, out_at[:, None] + cols[None, :], live[:, None],
                              tl.minimum(tl.maximum(v, -F32_MAX), F32_MAX).to(tl.float32), BF16_OUT)


class RopeAngles(NamedTuple):
    """A rotary embedding for the kernels to turn the keys by (flags bit 2): the angles' sines and
    cosines, float64 [F, n, rotary_dim / 2] on the kernels' device for the rows t_first ..
    t_first + n - 1 of the call (cuda_pipeline.rope_angles; F = 1: every layer, else a row per
    layer), and the pairs (format.params.Rope's style, head_dim, rotary_dim)."""

    sin: torch.Tensor
    cos: torch.Tensor
    style: int
    head_dim: int
    rotary_dim: int


#: The turning pass's launch: rows and pairs of channels per step of a program, warps.  Small
#: tiles: the turn is float64 arithmetic on every value of the tile (a first version turned the
#: keys inside the product's programs, on their [64, 128] tiles: 22 ms against 2.2 on an H100,
#: 2026-12-05; a second, channel by channel with each partner and angle loaded for each channel of
#: a pair, took ~3 ms for the 1.07 GB cache each way there).  The keys alone, by pairs: the
#: fastest of a sweep on an H200 (benchmarks/profile_fixed_rotation.py --rope --rope-configs,
#: 2026-12-05 ~16:27 UTC, ba46c2f): 4 rows x 64 pairs took 2.84 / 2.52 ms with the product against
#: 3.37 / 3.09 at 8 x 64 and 2.07 / 1.97 without a RoPE (docs/results/2026-12-05_profile_rope_
#: keys_apart_ba46c2f_h200.txt); on an H100 8 x 64 beat 16 x 32 and 32 x 32 (3.33 / 3.17 ms against
#: 4.47 / 4.64; ..._1f0a02c_h100.txt).  Smaller tiles: more programs to hide the float64 latency.
#: Timed alone (benchmarks/turn_launch.py's sweep, 2026-12-06 ~23:37 UTC, an H100:
#: docs/results/2026-12-06_turn_launch_sweep_h100.txt), one row of 512 pairs a program beat 4 x 64
#: both ways, back 0.69 / forward 0.65 ms against 0.80 / 0.74; rows of 2 and 2 warps ran slower (the
#: float64 turn's registers).  In the pipeline: docs/results/2026-12-06_ab_turn_sidestats_crc_h100/.
TURN_LAUNCH = {"rows": 1, "pairs": 512, "warps": 4}


def turns(head_dim: int) -> bool:
    """True when turn_rows takes a RoPE of heads of ``head_dim`` channels (its pairs tile a
    head: an even size; rope.turn_keys takes the rest)."""
    return head_dim % 2 == 0


def turn_rows(x: torch.Tensor, rope: RopeAngles, t_first: int, out: torch.Tensor, forward: bool,
              e: torch.Tensor | None = None) -> None:
    """out[:, :, t] = x[:, :, t] with the keys (x[:, 0]) turned by ``rope`` for t >= t_first, as
    kernels/rope.turn_keys (back, or ``forward``) on a float32 copy would, in one pass
    (_turn_rows_kernel): x float32, or a bfloat16 cache's int16 words; out float32, or int16 for
    bfloat16 words (saturating), not x; both [L, 2, T, C], or one of them the keys alone [L, 1,
    T, C] (then only the keys are turned: the values stay where they are); ``e`` (int32 [L x 2,
    T - t_first]): also the turned rows' exponents (rotate_rows'; the keys' rows alone when only
    the keys are turned)."""
    L, Kx, T, C = x.shape
    Ko = out.shape[1]
    n = T - t_first
    F = rope.sin.shape[0]
    if (rope.sin.dtype != torch.float64 or rope.sin.shape != rope.cos.shape or F not in (1, L)
            or tuple(rope.sin.shape[1:]) != (n, rope.rotary_dim // 2) or not rope.sin.is_contiguous()
            or not rope.cos.is_contiguous() or C % rope.head_dim or rope.rotary_dim % 2
            or not 2 <= rope.rotary_dim <= rope.head_dim or not turns(rope.head_dim)):
        raise ValueError(f"rope: sin / cos float64 [1 or {L}, {n}, {rope.rotary_dim // 2}] and heads of an even size "
                         f"dividing {C} channels, not {rope.sin.dtype} {tuple(rope.sin.shape)}, heads of {rope.head_dim}")
    if (Kx, Ko) not in ((2, 2), (2, 1), (1, 2)) or (out.shape[0], out.shape[2], out.shape[3]) != (L, T, C):
        raise ValueError(f"turn_rows: x {tuple(x.shape)} and out {tuple(out.shape)}: both planes, or one of them "
                         "the keys alone")
    go = TURN_LAUNCH
    _turn_rows_kernel[(triton.cdiv(n, go["rows"]), L * min(Kx, Ko))](
        x, out, out if e is None else e, rope.sin, rope.cos, F, T, n, t_first, C=C, BM=go["rows"],
        BP=min(go["pairs"], triton.next_power_of_2(C // 2)), BF16_WORDS=x.dtype == torch.int16, HD=rope.head_dim,
        RD=rope.rotary_dim, STYLE=rope.style, FORWARD=forward, BF16_OUT=out.dtype == torch.int16,
        EXPONENTS=e is not None, X_KEYS=Kx == 1, OUT_KEYS=Ko == 1, num_warps=go["warps"],
        enable_fp_fusion=False)  # the turn's products and sums rounded one by one, as the CPU's


def _launch(n: int, D: int, parts_before: int, go: dict) -> tuple[int, int, int, int]:
    """(BN, DP, row tiles, grid): go's outputs per program, the block padded to a power of two,
    and programs for ``parts_before`` x blocks' tiles of outputs, about go["spread"] a
    multiprocessor, each tile of rows taken by one of them."""
    tile = _tile(D, go["tile"])
    parts = parts_before * (D // tile)
    tiles = triton.cdiv(n, go["rows"])
    sms = 1 if INTERPRETED else torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    along = max(1, min(tiles, -(-go["spread"] * sms // parts)))
    return tile, triton.next_power_of_2(D), tiles, (along, parts)


def _check(t: torch.Tensor, name: str, dtypes: tuple, ndim: int) -> None:
    if t.dtype not in dtypes or t.dim() != ndim or not t.is_contiguous():
        raise ValueError(f"{name}: a contiguous {ndim}-d tensor of {dtypes}, not {t.dtype} {tuple(t.shape)}")


def _planes(L: int, keys_apart: bool) -> list[tuple[int, int, int, bool]]:
    """The product's launches: (first plane, plane stride, planes, whether they are the keys
    held apart): every plane of the L layers, or the key planes and then the value planes."""
    return [(0, 2, L, True), (1, 2, L, False)] if keys_apart else [(0, 1, 2 * L, False)]


def rotate_rows(x: torch.Tensor, digits: torch.Tensor, t_first: int, y: torch.Tensor,
                rope: RopeAngles | None = None, keys: torch.Tensor | None = None, ready=None,
                levels: tuple | None = None) -> None:
    """y[:, :, t] = the fixed-point rotation of x[:, :, t] for t >= t_first (fixed_rotation.
    rotate_rows' values): x float32 [L, 2, T, C], or a bfloat16 cache's int16 words; digits:
    rotation_digits of the encoder's blocks [L, 2, H, D, D]; y float32 [L, 2, T, C] (rows before
    t_first untouched).  ``rope``: the keys (x[:, 0]) are first turned back by it, as
    kernels/rope.turn_keys(forward=False) would in place: a pass over the keys alone that also
    finds their rows' exponents, into a float32 copy of them that the product reads (the
    values are read from x, as without a RoPE).  ``keys`` (float32 [L, 1, T, C], with ``rope``):
    that copy goes there, for the caller to read after (its rows t_first .. ); ``ready``: called
    once the passes before the product are queued (the turned keys written, in stream order),
    before the product is (so that it may queue the ``levels``' offsets and steps).  ``levels``
    = (q int8 [L, 2, T, C], offsets float32 [L, 2, C], steps float64 [L, 2], threshold, t_lev),
    blocks up to RESIDENT_BLOCK: the rows before t_lev get their levels in q instead of their
    values in y (_levels32: the sink rows 0, the values float32 does not decide LEVEL_UNDECIDED
    with their values in y, for cuda_pipeline.fix_levels); the rows from t_lev on their values
    in y."""
    _check(x, "x", (torch.float32, torch.int16), 4)
    _check(y, "y", (torch.float32,), 4)
    L, K, T, C = x.shape
    _, _, _, H, D, _ = digits.shape
    if K != 2 or H * D != C or tuple(y.shape) != (L, K, T, C) or not supports(D):
        raise ValueError(f"rotate_rows: blocks {H} x {D} for {C} channels")
    n = T - t_first
    sb = STATS_BLOCK
    if levels is not None:
        q, off, steps_d, threshold, t_lev = levels
        _check(q, "q", (torch.int8,), 4)
        if (tuple(q.shape) != (L, K, T, C) or D > RESIDENT_BLOCK
                or off.dtype != torch.float32 or tuple(off.shape) != (L, K, C) or not off.is_contiguous()
                or steps_d.dtype != torch.float64 or tuple(steps_d.shape) != (L, K) or not steps_d.is_contiguous()):
            raise ValueError("rotate_rows: levels need q int8 [L, 2, T, C], offsets float32 [L, 2, C], steps "
                             "float64 [L, 2] and blocks of at most RESIDENT_BLOCK channels")
    if n <= 0 or L == 0:
        if levels is not None:
            levels[0].zero_()  # every token a sink token: level 0
        return
    e = torch.empty((L * K, n), dtype=torch.int32, device=x.device)
    if rope is not None:
        if keys is None:
            keys = torch.empty((L, 1, T, C), dtype=torch.float32, device=x.device)
        _check(keys, "keys", (torch.float32,), 4)
        if tuple(keys.shape) != (L, 1, T, C):
            raise ValueError(f"rotate_rows: keys {tuple(keys.shape)}, not {(L, 1, T, C)}")
        turn_rows(x, rope, t_first, keys, False, e)
    else:
        keys = None
    bf16 = x.dtype == torch.int16
    _row_exponents_kernel[(triton.cdiv(n, 32), L * K if keys is None else L)](
        x, e, T, n, t_first, 0 if keys is None else 1, 1 if keys is None else 2, C=C, BM=32,
        BK=min(128, triton.next_power_of_2(C)), BF16_WORDS=bf16, num_warps=4)
    if ready is not None:
        ready()
    for p0, ps, planes, apart in _planes(L, keys is not None):
        src = keys if apart else x
        if D > RESIDENT_BLOCK:
            go = STREAM_ENCODE_LAUNCH
            _rotate_rows_streaming_kernel[(triton.cdiv(n, go["rows"]), planes)](
                src, e, digits, y, T, n, t_first, digits[0].numel(), p0, ps, C=C, H=H, D=D, BM=go["rows"],
                BN=_tile(D, go["tile"]), BK=_tile(D, go["depth"]), BF16_WORDS=src.dtype == torch.int16, XB=X_BITS,
                RB=R_BITS, X_KEYS=apart, num_warps=go["warps"], num_stages=go["stages"])
            continue
        go = ENCODE_LAUNCH
        if sb % go["rows"]:
            raise ValueError(f"rotate_rows: tiles of {go['rows']} rows, not a divisor of the block of {sb}")
        # programs along the rows take whole blocks of rows (their tiles by absolute position)
        tile, DP, _, grid = _launch(T, D, planes * H, dict(go, rows=sb))
        lv = levels if levels is not None else (y, y, y, 0.5, 0)
        _rotate_rows_kernel[grid](src, e, digits, y, T, n, t_first, digits[0].numel(), p0, ps, lv[0], lv[1], lv[2],
                                  float(lv[3]), int(lv[4]), C=C, H=H, D=D, DP=DP, BM=go["rows"], BN=tile, SB=sb,
                                  BF16_WORDS=src.dtype == torch.int16, XB=X_BITS, RB=R_BITS, X_KEYS=apart,
                                  LEVELS=levels is not None, num_warps=go["warps"], num_stages=go["stages"],
                                  enable_fp_fusion=False)  # transform.fast_level32's roundings, one by one


def unrotate_values(z: torch.Tensor, digits_t: torch.Tensor, sums: torch.Tensor, steps: torch.Tensor,
                    b: torch.Tensor, t_first: int, out: torch.Tensor, keys: torch.Tensor | None = None) -> None:
    """out[:, :, t] = x' of the levels q' in z[:, :, t] for t >= t_first (fixed_rotation.
    unrotate_values' values): z float32 [L, 2, T, C], the levels q', or int16 words 256 q' - 1
    (cuda_pipeline.dequantize's levels words); digits_t: rotation_digits of the decoder's
    (transposed) blocks; sums: column_sums of those blocks; steps float64 [L, 2]; b float64
    [L, 2, C] (offset_sums); out float32, or int16 for bfloat16 words (saturating), [L, 2, T, C].
    ``keys`` (float32 [L, 1, T, C]): the keys' values go there instead (out's key planes are not
    written), for turn_rows to turn forward by their RoPE into out."""
    _check(z, "z", (torch.float32, torch.int16), 4)
    _check(out, "out", (torch.float32, torch.int16), 4)
    L, K, T, C = z.shape
    _, _, _, H, D, _ = digits_t.shape
    if K != 2 or H * D != C or tuple(out.shape) != (L, K, T, C) or not supports(D):
        raise ValueError(f"unrotate_values: blocks {H} x {D} for {C} channels")
    if keys is not None:
        _check(keys, "keys", (torch.float32,), 4)
        if tuple(keys.shape) != (L, 1, T, C):
            raise ValueError(f"unrotate_values: keys {tuple(keys.shape)}, not {(L, 1, T, C)}")
    n = T - t_first
    if n <= 0 or L == 0:
        return
    steps = steps.to(torch.float64).contiguous()
    b = b.to(torch.float64).contiguous()
    words = z.dtype == torch.int16
    for p0, ps, planes, apart in _planes(L, keys is not None):
        dst = keys if apart else out
        bf16 = dst.dtype == torch.int16
        if D > RESIDENT_BLOCK:
            go = STREAM_DECODE_LAUNCH
            _unrotate_values_streaming_kernel[(triton.cdiv(n, go["rows"]), planes)](
                z, digits_t, sums, steps, b, dst, T, n, t_first, digits_t[0].numel(), p0, ps, C=C, H=H, D=D,
                BM=go["rows"], BN=_tile(D, go["tile"]), BK=_tile(D, go["depth"]), BF16_OUT=bf16, F32_MAX=_F32_MAX,
                LEVEL_WORDS=words, OUT_KEYS=apart, num_warps=go["warps"], num_stages=go["stages"])
            continue
        go = DECODE_LAUNCH
        tile, DP, tiles, grid = _launch(n, D, planes * H, go)
        _unrotate_values_kernel[grid](z, digits_t, sums, steps, b, dst, T, n, t_first, digits_t[0].numel(), tiles,
                                      p0, ps, C=C, H=H, D=D, DP=DP, BM=go["rows"], BN=tile, BF16_OUT=bf16,
                                      F32_MAX=_F32_MAX, LEVEL_WORDS=words, OUT_KEYS=apart, num_warps=go["warps"],
                                      num_stages=go["stages"])
