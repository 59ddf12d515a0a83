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


@njit(parallel=True, **_JIT)
def fixed_rows(x, t_first, X, e):
    """X[l, kv, t - t_first, c] = round(x[l, kv, t, c] 2^(X_BITS - e)) and e[l, kv, t - t_first]
    (row_exponent of the row's largest magnitude), for t >= t_first."""
    L, _, T, C = x.shape
    n = T - t_first
    for job in prange(L * 2 * n):
        l = job // (2 * n)
        kv = (job // n) % 2
        t = job % n
        bits = x[l, kv, t_first + t].view(np.uint32)
        top = np.uint32(0)
        for c in range(C):
            a = bits[c] & np.uint32(0x7FFFFFFF)
            if a > top:
                top = a
        ex = row_exponent(top)
        scale = math.ldexp(1.0, int(X_BITS - ex))
        row = x[l, kv, t_first + t]
        dst = X[l, kv, t]
        for c in range(C):
            dst[c] = round_even(np.float64(row[c]) * scale)
        e[l, kv, t] = ex


@njit(parallel=True, **_JIT)
def fixed_rows_out(Y, e, t_first, y):
    """y[l, kv, t, c] = float32(Y[l, kv, t - t_first, c] 2^(e - X_BITS - R_BITS)) for t >= t_first:
    the rotated rows (the scaling is exact; one rounding, to float32)."""
    L, _, n, C = Y.shape
    for job in prange(L * 2 * n):
        l = job // (2 * n)
        kv = (job // n) % 2
        t = job % n
        k = int(e[l, kv, t] - X_BITS - R_BITS)
        src = Y[l, kv, t]
        dst = y[l, kv, t_first + t]
        for c in range(C):
            dst[c] = np.float32(math.ldexp(src[c], k))


@njit(parallel=True, **_JIT)
def offset_sums(offsets, rint_t, b):
    """b[l, kv, h D + i] = sum over j = 0 .. D - 1, in that order, of float64(offsets[l, kv, h D +
    j]) x (rint_t[l, kv, h, j, i] 2^-R_BITS) (each product exact, each sum rounded): the offsets
    carried through the inverse rotation, once per file.  rint_t: the decoder's blocks
    (fixed_matrix(rot, transposed=True))."""
    L, _, H, D, _ = rint_t.shape
    unit = math.ldexp(1.0, -R_BITS)
    for job in prange(L * 2 * H):
        l = job // (2 * H)
        kv = (job // H) % 2
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


@njit(parallel=True, **_JIT)
def fixed_values(A, steps, b, t_first, out):
    """out[l, kv, t, c] = sat32(A[l, kv, t - t_first, c] x steps[l, kv] 2^-R_BITS + b[l, kv, c]) for
    t >= t_first: the decoder's values x'."""
    L, _, n, C = A.shape
    for job in prange(L * 2 * n):
        l = job // (2 * n)
        kv = (job // n) % 2
        t = job % n
        unit = math.ldexp(steps[l, kv], -R_BITS)
        src = A[l, kv, t]
        dst = out[l, kv, t_first + t]
        bl = b[l, kv]
        for c in range(C):
            dst[c] = fixed_value(src[c], unit, bl[c])


def block_product(X, rint):
    """Y = X R per (layer, K/V), R block-diagonal with rint's blocks: torch tensors X float64 [L,
    2, T', C] (integer-valued, or multiples of 1/256) and rint float64 [L, 2, H, D, D], on any
    device; Y float64 [L, 2, T', C].  Exact (every partial sum an integer multiple below 2^53),
    so any BLAS gives the same bits.  The blocks of a plane are one strided batch (rows of C,
    batch stride D): no copy of X into a head-major layout."""
    import torch

    L, _, n, C = X.shape
    H, D = rint.shape[2], rint.shape[3]
    Y = torch.empty_like(X)
    if X.numel() == 0:
        return Y
    if H == 1:
        torch.bmm(X.view(L * 2, n, C), rint.view(L * 2, C, C), out=Y.view(L * 2, n, C))
        return Y
    Xv, Yv, Rv = X.view(L * 2, n, H, D), Y.view(L * 2, n, H, D), rint.view(L * 2, H, D, D)
    for p in range(L * 2):
        torch.bmm(Xv[p].transpose(0, 1), Rv[p], out=Yv[p].transpose(0, 1))
    return Y
