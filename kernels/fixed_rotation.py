"""The fixed-point rotation of format version 2 (flags bit 3; docs/format.md, "Fixed-point
rotation"): the calibration's rotation applied as a product of integers, so that any matrix
product computes it exactly.

Why: the float64 rotation of flags bit 0 alone is defined as sums in one order, which only a
hand-written loop can follow (~3 T multiply-adds/s on an H200, 7 MB/s per CPU core for a full
rotation).  Here every operand of the product is an integer (scaled by a power of two) and
every partial sum an integer below 2^53, so float64 arithmetic is exact in any order, fused
or not: BLAS on a CPU and cuBLAS on a GPU give the same bits, and so does a reader's own
integer loop.

Array conventions (P = L x 2 planes, H diagonal blocks of D channels, C = H x D; T' the rows
from ``t_first`` on):
  x      float32 [L, 2, T, C]       rows to rotate (encoder)
  X      float64 [L, 2, T', C]      integer-valued rows (encoder), or the levels q' (decoder):
                                    the matrix product's input
  e      int32   [L, 2, T']         each row's power-of-two scale (encoder)
  rint   float64 [L, 2, H, D, D]    round(R x 2^R_BITS) per block (fixed_matrix), integer-valued
  Y, A   float64 [L, 2, T', C]      the product

The CUDA kernels with the same names and signatures are in cuda_pipeline.py; the product
itself is ``block_product`` (torch.matmul) on either device.
"""

from . import jit_cache  # noqa: F401  (sets the cache folder before any @njit)

import math

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from .rope import bf16_bits_saturating

_JIT = dict(cache=True, nogil=True)

#: Bits of a row's integers: X = round(x 2^(X_BITS - e)), |X| <= 2^X_BITS (the encoder's
#: choice; it is not in the file).
X_BITS = 20
#: Bits of the rotation's integers: Rint = round(R 2^R_BITS), |Rint| <= 2^R_BITS for |R| <= 1
#: (docs/format.md).  With C <= 2^16 channels, |X Rint| sums stay below 2^50 and the decoder's
#: below 2^45 / n: exact in float64, and times a bfloat16 step still exact.
R_BITS = 14
#: float32's largest finite value (sat32 of docs/format.md).
FLOAT32_MAX = 3.4028234663852886e38


def fixed_matrix(rot: np.ndarray, transposed: bool) -> np.ndarray:
    """round(rot x 2^R_BITS) (half to even) clamped to +-2^R_BITS, as float64, each D x D block
    transposed when ``transposed`` (the decoder's product), C-contiguous.  rot: float32 [L, 2,
    H, D, D].  (The clamp keeps the sums' bounds for any matrix; an orthonormal one needs none.)"""
    one = float(1 << R_BITS)
    rint = np.clip(np.rint(rot.astype(np.float64) * one), -one, one)
    if transposed:
        rint = rint.swapaxes(-1, -2)
    return np.ascontiguousarray(rint)


_KEPT: dict = {}


def fixed_matrix_kept(rot: np.ndarray, digest: bytes, transposed: bool, digits: bool = False):
    """fixed_matrix(rot, transposed) as a torch tensor (float64), or with ``digits`` its int8
    digit blocks (digit_blocks), kept for the last two rotations (by their SHA-256): a
    calibration's integers are made once, not once per call."""
    import torch

    key = (digest, transposed, digits)
    t = _KEPT.pop(key, None)
    if t is None:
        t = torch.from_numpy(fixed_matrix(rot, transposed))
        if digits:
            t = digit_blocks(t)
    _KEPT[key] = t
    while len(_KEPT) > 4:
        _KEPT.pop(next(iter(_KEPT)))
    return t


# ---- the CPU's product in int8 digits: a core's int8 matrix units (VNNI, AMX) multiply ~20x
# faster than its float64 ones, and integer sums are exact in any order, so the bits stay those of
# docs/format.md.  Rint (|Rint| <= 2^14) = d0 + 256 d1 with d0 in [-128, 127], d1 in [-64, 64];
# an encoder's X (|X| <= 2^20) = x0 + 256 x1 + 65536 x2 with x0, x1 in [-128, 127], |x2| <= 16;
# a decoder's 256 q' (|q'| <= 127.5) likewise in three digits, and an integer level q alone
# (|q| <= 127) in one.  Each digit product sums at most C <= 2^16 products below 2^14: below
# 2^30, exact in int32; the digits' weighted sum is an integer below 2^53, exact in float64.

#: Rows of a (layer, K/V) plane per round of the integer product: their digits (3 bytes a
#: value) and the int32 digit products (24 bytes a value) stay in a core's cache.
DIGIT_ROWS = 256


def digit_blocks(rint):
    """The int8 digits of rint (torch float64 [L, 2, H, D, D], integer-valued, |rint| <= 2^14)
    side by side: [L, 2, H, D, 2 D], d0 (the signed low byte) then d1, rint = d0 + 256 d1."""
    import torch

    R = rint.to(torch.int64)
    d0 = R.to(torch.int8)  # the low byte, as a signed digit
    d1 = (R - d0.to(torch.int64)) // 256
    return torch.cat([d0, d1.to(torch.int8)], dim=-1).contiguous()


_INT8_PRODUCT: list = []


def int8_products() -> bool:
    """Whether this torch multiplies int8 matrices on the CPU (torch._int_mm), checked once on a
    small product against int64's."""
    if not _INT8_PRODUCT:
        import torch

        try:
            a = (torch.arange(32 * 8, dtype=torch.int32).reshape(32, 8) * 37 % 256 - 128).to(torch.int8)
            b = a[:16].t().contiguous()
            ok = torch.equal(torch._int_mm(a, b).to(torch.int64), a.to(torch.int64) @ b.to(torch.int64))
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _INT8_PRODUCT.append(ok)
    return _INT8_PRODUCT[0]


@register_jitable
def row_exponent(abs_bits):
    """e with max |x| < 2^e, from the largest float32 magnitude bits of a row (its exponent
    field E: a value below 2^(E - 126)); 0 bits (a row of zeros) give -126, any e works."""
    return np.int32((abs_bits >> np.uint32(23)) & np.uint32(0xFF)) - np.int32(126)


@register_jitable
def round_even(v):
    """v rounded to the nearest integer, ties to even, for |v| < 2^51 (adding and removing
    1.5 x 2^52 leaves exactly the rounded integer; two additions, nothing to fuse)."""
    big = 6755399441055744.0
    return (v + big) - big


@register_jitable
def _fixed_row(bits, dst):
    """dst = round(x 2^(X_BITS - e)) for the float32 row whose bits are ``bits``; returns e."""
    top = np.uint32(0)
    for c in range(bits.shape[0]):
        a = bits[c] & np.uint32(0x7FFFFFFF)
        if a > top:
            top = a
    ex = row_exponent(top)
    scale = math.ldexp(1.0, int(X_BITS - ex))
    row = bits.view(np.float32)
    for c in range(bits.shape[0]):
        dst[c] = round_even(np.float64(row[c]) * scale)
    return ex


@njit(parallel=True, **_JIT)
def fixed_rows(x, t_first, X, e):
    """X[l, kv, t - t_first, c] = round(x[l, kv, t, c] 2^(X_BITS - e)) and e[l, kv, t - t_first]
    (row_exponent of the row's largest magnitude), for t >= t_first."""
    L, K, T, C = x.shape
    n = T - t_first
    for job in prange(L * K * n):
        l = job // (K * n)
        kv = (job // n) % K
        t = job % n
        e[l, kv, t] = _fixed_row(x[l, kv, t_first + t].view(np.uint32), X[l, kv, t])


@njit(parallel=True, **_JIT)
def fixed_rows_bf16(w, t_first, X, e):
    """fixed_rows of a bfloat16 cache given as its uint16 words (widened exactly row by row: no
    float32 copy of the cache)."""
    L, K, T, C = w.shape
    n = T - t_first
    for job in prange(L * K * n):
        l = job // (K * n)
        kv = (job // n) % K
        t = job % n
        src = w[l, kv, t_first + t]
        bits = np.empty(C, np.uint32)
        for c in range(C):
            bits[c] = np.uint32(src[c]) << np.uint32(16)
        e[l, kv, t] = _fixed_row(bits, X[l, kv, t])


@njit(parallel=True, **_JIT)
def fixed_rows_out(Y, e, t_first, y):
    """y[l, kv, t, c] = float32(Y[l, kv, t - t_first, c] 2^(e - X_BITS - R_BITS)) for t >= t_first:
    the rotated rows (the scaling is exact; one rounding, to float32)."""
    L, K, n, C = Y.shape
    for job in prange(L * K * n):
        l = job // (K * n)
        kv = (job // n) % K
        t = job % n
        # 2^k is a normal float64 (e - 34 in [-160, 95]) and Y x 2^k is exact (a float32 below
        # 2^-1022 rounds to 0 either way): the same bits as ldexp, without a call per value
        scale = math.ldexp(1.0, int(e[l, kv, t] - X_BITS - R_BITS))
        src = Y[l, kv, t]
        dst = y[l, kv, t_first + t]
        for c in range(C):
            dst[c] = np.float32(src[c] * scale)


@njit(parallel=True, **_JIT)
def offset_sums(offsets, rint_t, b):
    """b[l, kv, h D + i] = sum over j = 0 .. D - 1, in that order, of float64(offsets[l, kv, h D +
    j]) x (rint_t[l, kv, h, j, i] 2^-R_BITS) (each product exact, each sum rounded): the offsets
    carried through the inverse rotation, once per file.  rint_t: the decoder's blocks
    (fixed_matrix(rot, transposed=True))."""
    L, K, H, D, _ = rint_t.shape
    unit = math.ldexp(1.0, -R_BITS)
    for job in prange(L * K * H):
        l = job // (K * H)
        kv = (job // H) % K
        h = job % H
        acc = np.zeros(D, np.float64)
        for j in range(D):
            m = np.float64(offsets[l, kv, h * D + j])
            col = rint_t[l, kv, h, j]
            for i in range(D):
                acc[i] = acc[i] + m * (col[i] * unit)
        for i in range(D):
            b[l, kv, h * D + i] = acc[i]


@register_jitable
def fixed_value(a, step_unit, b):
    """sat32(a x step_unit + b) as float32 (a x step_unit is exact: one rounding of the sum,
    then the clamp to float32's range and one rounding to float32)."""
    v = a * step_unit + b
    if v > FLOAT32_MAX:
        v = FLOAT32_MAX
    elif v < -FLOAT32_MAX:
        v = -FLOAT32_MAX
    return np.float32(v)


@register_jitable
def _values_row(A, steps, b, job, dst):
    """dst[c] = x' of row ``job`` (l, kv, t in that order) of A: fixed_value of each entry.
    Returns (l, kv, t)."""
    _, K, n, C = A.shape
    l = job // (K * n)
    kv = (job // n) % K
    t = job % n
    unit = math.ldexp(steps[l, kv], -R_BITS)
    src = A[l, kv, t]
    bl = b[l, kv]
    for c in range(C):
        dst[c] = fixed_value(src[c], unit, bl[c])
    return l, kv, t


@njit(parallel=True, **_JIT)
def fixed_values(A, steps, b, t_first, out):
    """out[l, kv, t, c] = sat32(A[l, kv, t - t_first, c] x steps[l, kv] 2^-R_BITS + b[l, kv, c]) for
    t >= t_first: the decoder's values x'."""
    L, K, n, C = A.shape
    for job in prange(L * K * n):
        l = job // (K * n)
        kv = (job // n) % K
        t = job % n
        _values_row(A, steps, b, job, out[l, kv, t_first + t])


@njit(parallel=True, **_JIT)
def fixed_values_bf16(A, steps, b, t_first, out, t_out):
    """out[l, kv, t_out + t_first + t] (uint16: bfloat16 bits) = fixed_values' x' rounded to
    nearest even, an overflow to infinity kept at the largest finite value (rope.store_values'
    KIND_BFLOAT16 rule, docs/format.md "Casting to the source dtype"): the two passes in one,
    without the float32 array between them."""
    L, K, n, C = A.shape
    for job in prange(L * K * n):
        row = np.empty(C, np.float32)
        l, kv, t = _values_row(A, steps, b, job, row)
        dst = out[l, kv, t_out + t_first + t]
        bits = row.view(np.uint32)
        for c in range(C):
            dst[c] = bf16_bits_saturating(bits[c])


# ---- the int8 digit product's passes (one tile of DIGIT_ROWS rows of one plane each)


@register_jitable
def _signed_digits3(v, d0, d1, d2, c):
    """d0[c], d1[c], d2[c] = the signed base-256 digits of the int32 v (|v| < 2^23)."""
    a = np.int8(v)  # the low byte, signed
    v1 = (v - np.int32(a)) >> np.int32(8)
    b = np.int8(v1)
    d0[c] = a
    d1[c] = b
    d2[c] = np.int8((v1 - np.int32(b)) >> np.int32(8))


@njit(parallel=True, **_JIT)
def digit_rows(x, shift, t0, rows, Xd, e):
    """Xd[a, t, c] (int8, a = 0, 1, 2) = the digits of X = round(x[t0 + t, c] 2^(X_BITS - e[t]))
    (fixed_rows' integers: X = Xd[0] + 256 Xd[1] + 65536 Xd[2]) and e[t], for t < rows; x: one
    plane's float32 bits (uint32, shift 0) or bfloat16 words (uint16, shift 16) [T, C]."""
    C = x.shape[1]
    for t in prange(rows):
        src = x[t0 + t]
        top = np.uint32(0)
        for c in range(C):
            top = max(top, np.uint32(np.uint32(src[c]) << np.uint32(shift)) & np.uint32(0x7FFFFFFF))
        ex = row_exponent(top)
        scale = math.ldexp(1.0, int(X_BITS - ex))
        d0, d1, d2 = Xd[0, t], Xd[1, t], Xd[2, t]
        for c in range(C):
            v = np.uint32(np.uint32(src[c]) << np.uint32(shift)).view(np.float32)
            _signed_digits3(np.int32(round_even(np.float64(v) * scale)), d0, d1, d2, c)
        e[t] = ex


@njit(parallel=True, **_JIT)
def level_digits(z, t0, rows, digits, Qd):
    """The digits of a decoder's levels q' = z[t0 + t, c] (float32, multiples of 1/256): with
    ``digits`` 1, Qd[0, t, c] = q' (integers, |q'| <= 127); with 3, Qd[a, t, c] = the digits of
    256 q' (|q'| < 2^15)."""
    C = z.shape[1]
    for t in prange(rows):
        src = z[t0 + t]
        if digits == 1:
            d = Qd[0, t]
            for c in range(C):
                d[c] = np.int8(np.int32(src[c]))
        else:
            d0, d1, d2 = Qd[0, t], Qd[1, t], Qd[2, t]
            for c in range(C):
                _signed_digits3(np.int32(src[c] * np.float32(256.0)), d0, d1, d2, c)


@register_jitable
def _digit_sum(P, h, t, rows, digits, i, D):
    """sum over a < digits, b < 2 of P[h, a rows + t, b D + i] 256^(a + b): the integer
    product's entry (exact in float64)."""
    acc = np.float64(P[h, t, i]) + np.float64(P[h, t, D + i]) * 256.0
    if digits == 3:
        acc += (np.float64(P[h, rows + t, i]) + np.float64(P[h, rows + t, D + i]) * 256.0) * 256.0
        acc += (np.float64(P[h, 2 * rows + t, i]) + np.float64(P[h, 2 * rows + t, D + i]) * 256.0) * 65536.0
    return acc


@njit(parallel=True, **_JIT)
def digit_rows_out(P, e, t0, rows, y):
    """y[t0 + t, h D + i] = float32(Y 2^(e[t] - X_BITS - R_BITS)) (fixed_rows_out), Y the digit
    products P [H, 3 rows, 2 D] (int32) of the tile's rows summed (_digit_sum)."""
    H, D = P.shape[0], P.shape[2] // 2
    for t in prange(rows):
        scale = math.ldexp(1.0, int(e[t] - X_BITS - R_BITS))
        dst = y[t0 + t]
        for h in range(H):
            for i in range(D):
                dst[h * D + i] = np.float32(_digit_sum(P, h, t, rows, 3, i, D) * scale)


@njit(parallel=True, **_JIT)
def digit_values(P, digits, step, b, t0, rows, out, kind):
    """The decoder's x' (fixed_value) of the tile's rows from their digit products P [H, digits
    rows, 2 D]: out[t0 + t, h D + i] float32 (kind 0) or bfloat16 words (kind 1, rope's
    KIND_BFLOAT16 rounding, as fixed_values_bf16)."""
    H, D = P.shape[0], P.shape[2] // 2
    unit = math.ldexp(step, -R_BITS - (8 if digits == 3 else 0))
    for t in prange(rows):
        dst = out[t0 + t]
        for h in range(H):
            for i in range(D):
                v = fixed_value(_digit_sum(P, h, t, rows, digits, i, D), unit, b[h * D + i])
                if kind == 0:
                    dst[h * D + i] = v
                else:
                    dst[h * D + i] = bf16_bits_saturating(np.float32(v).view(np.uint32))


def block_product(X, rint, out=None):
    """Y = X R per (layer, K/V), R block-diagonal with rint's blocks: torch tensors X float64 [L,
    K, T', C] (integer-valued, or multiples of 1/256) and rint float64 [L, K, H, D, D], on any
    device; Y float64 [L, K, T', C] (``out`` when given).  Exact (every partial sum an integer
    multiple below 2^53), so any BLAS gives the same bits.  The blocks of a plane are one
    strided batch (rows of C, batch stride D): no copy of X into a head-major layout."""
    import torch

    L, K, n, C = X.shape
    P = L * K
    H, D = rint.shape[2], rint.shape[3]
    Y = torch.empty_like(X) if out is None else out
    if X.numel() == 0:
        return Y
    if H == 1:
        torch.bmm(X.view(P, n, C), rint.view(P, C, C), out=Y.view(P, n, C))
        return Y
    Xv, Yv, Rv = X.view(P, n, H, D), Y.view(P, n, H, D), rint.view(P, H, D, D)
    for p in range(P):
        torch.bmm(Xv[p].transpose(0, 1), Rv[p], out=Yv[p].transpose(0, 1))
    return Y


# ---- the CPU's passes, a (layer, K/V) plane at a time: the float64 scratch of one plane is
# reused (and stays in cache), where slab-sized arrays would each cost their pages' first touch
# (on the development machine, more than the arithmetic)


def _digit_products(digits_of, rint_digits, rows_digits, P):
    """P[h, :rows_digits] = the int8 digit rows of head h (``digits_of``: [rows_digits, C] int8,
    heads side by side) times head h's digit blocks (rint_digits [H, D, 2 D]), in int32."""
    import torch

    H, D = rint_digits.shape[0], rint_digits.shape[1]
    for h in range(H):
        torch._int_mm(digits_of[:, h * D : (h + 1) * D], rint_digits[h], out=P[h, :rows_digits])


def rotate_rows(x, rint, t_first, y):
    """y[:, :, t] = the fixed-point rotation of x[:, :, t] (fixed_rows, block_product,
    fixed_rows_out) for t >= t_first; x float32, or a bfloat16 cache's uint16 words, and y
    float32, [L, 2, T, C] numpy; rint: torch [L, 2, H, D, D] float64 (fixed_matrix) or its int8
    digit blocks [L, 2, H, D, 2 D] (digit_blocks: the same bits, from int8 products)."""
    import torch

    L, _, T, C = x.shape
    n = T - t_first
    if n <= 0:
        return
    if rint.dtype == torch.int8:
        H, D = rint.shape[2], rint.shape[3]
        rows = min(n, DIGIT_ROWS)
        Xd = np.empty(3 * rows * C, np.int8)  # a tile's digits [3, r, C], contiguous for every r
        e = np.empty(rows, np.int32)
        P = torch.empty((H, 3 * rows, 2 * D), dtype=torch.int32)
        Pn = P.numpy()
        shift = 16 if x.dtype == np.uint16 else 0
        bits = x if shift else x.view(np.uint32)
        for l in range(L):
            for kv in range(2):
                for t0 in range(t_first, T, rows):
                    r = min(rows, T - t0)
                    tile = Xd[: 3 * r * C].reshape(3, r, C)
                    digit_rows(bits[l, kv], shift, t0, r, tile, e)
                    _digit_products(torch.from_numpy(tile).view(3 * r, C), rint[l, kv], 3 * r, P)
                    digit_rows_out(Pn[:, : 3 * r], e, t0, r, y[l, kv])
        return
    X = np.empty((1, 1, n, C), np.float64)
    Y = np.empty_like(X)
    e = np.empty((1, 1, n), np.int32)
    Xt, Yt = torch.from_numpy(X), torch.from_numpy(Y)
    rows = fixed_rows_bf16 if x.dtype == np.uint16 else fixed_rows
    for l in range(L):
        for kv in range(2):
            rows(x[l : l + 1, kv : kv + 1], t_first, X, e)
            block_product(Xt, rint[l : l + 1, kv : kv + 1], Yt)
            fixed_rows_out(Y, e, t_first, y[l : l + 1, kv : kv + 1])


def unrotate_values(z, rint_t, steps, b, t_first, out, t_out=None, first_refined=None):
    """out[:, :, t] = x' of the levels q' in z[:, :, t] (block_product with the transposed blocks,
    fixed_values) for t >= t_first; z, out float32 [L, 2, T, C] numpy (may be the same array);
    rint_t: torch [L, 2, H, D, D] float64, or its int8 digit blocks (digit_blocks; then
    ``first_refined``: the first row whose q' may be fractional, the rows before it integers);
    steps float64 [L, 2]; b float64 [L, 2, C] (offset_sums).  With ``t_out`` (an int), out is
    uint16 bfloat16 words and gets x' rounded as rope.store_values does, at out[:, :, t_out + t]
    (fixed_values_bf16)."""
    import torch

    L, _, T, C = z.shape
    n = T - t_first
    if n <= 0:
        return
    if rint_t.dtype == torch.int8:
        H, D = rint_t.shape[2], rint_t.shape[3]
        rows = min(n, DIGIT_ROWS)
        Qd = np.empty(3 * rows * C, np.int8)  # a tile's digits [digits, r, C], contiguous
        P = torch.empty((H, 3 * rows, 2 * D), dtype=torch.int32)
        Pn = P.numpy()
        refined_from = T if first_refined is None else first_refined
        for l in range(L):
            for kv in range(2):
                dst = out[l, kv] if t_out is None else out[l, kv, t_out:]
                for t0 in range(t_first, T, rows):
                    r = min(rows, T - t0)
                    digits = 1 if t0 + r <= refined_from else 3
                    tile = Qd[: digits * r * C].reshape(digits, r, C)
                    level_digits(z[l, kv], t0, r, digits, tile)
                    _digit_products(torch.from_numpy(tile).view(digits * r, C), rint_t[l, kv], digits * r, P)
                    digit_values(Pn[:, : digits * r], digits, float(steps[l, kv]), b[l, kv], t0, r, dst,
                                 0 if t_out is None else 1)
        return
    Q = np.empty((1, 1, n, C), np.float64)
    A = np.empty_like(Q)
    Qt, At = torch.from_numpy(Q), torch.from_numpy(A)
    for l in range(L):
        for kv in range(2):
            Q[0, 0] = z[l, kv, t_first:]  # q', exact in float64
            block_product(Qt, rint_t[l : l + 1, kv : kv + 1], At)
            if t_out is None:
                fixed_values(A, steps[l : l + 1, kv : kv + 1], b[l : l + 1, kv : kv + 1], t_first,
                             out[l : l + 1, kv : kv + 1])
            else:
                fixed_values_bf16(A, steps[l : l + 1, kv : kv + 1], b[l : l + 1, kv : kv + 1], t_first,
                                  out[l : l + 1, kv : kv + 1], t_out)
