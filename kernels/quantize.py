"""Quantization device functions: per-token abs-max scaling, CacheGen style.

Each (layer, K/V, token) row of channels is scaled by its largest magnitude m
and rounded to the integer levels -maxq..maxq, stored as symbols 0..2*maxq.
The scale is kept as bfloat16 bits, rounded *up*, so that |x| / m_stored <= 1
and no value leaves the alphabet.

Why the arithmetic looks the way it does: the CPU (@njit) and the GPU
(numba-cuda) must produce the same symbols bit for bit.  Every value is
therefore computed in a way that cannot round differently on the two devices:
the reciprocal comes from a float64 division (correctly rounded on both) cast
to float32; the product x * inv of two float32 values is exact in float64, so
a fused multiply-add, which CUDA compilers like to form, changes nothing; and
rounding is done by comparing the exact fractional part with 0.5.

All functions here are ``register_jitable``: plain Python functions that
compile into whichever target calls them (CPU kernels in ``cpu.py``, CUDA
kernels in ``cuda.py``).
"""

import math

import numpy as np
from numba.extending import register_jitable

BF16_MAX_BITS = 0x7F7F  # largest finite bfloat16


@register_jitable
def bf16_bits_round_up(absmax):
    """bfloat16 bits of the smallest bfloat16 >= absmax (absmax finite, >= 0).

    Pure arithmetic (frexp / ceil in float64, all exact) rather than a bit cast,
    so that CPU, CUDA and the CUDA simulator compile the very same operations.
    """
    m = np.float64(np.float32(absmax))
    if m <= 0.0:
        return np.int64(0)
    if m < 1.1754943508222875e-38:  # below float32's smallest normal: bfloat16 subnormal, steps of 2**-133
        return np.int64(math.ceil(math.ldexp(m, 133)))
    mant, exp = math.frexp(m)  # m = mant * 2**exp, mant in [0.5, 1)
    q = np.int64(math.ceil(mant * 256.0))  # 8 significant bits, rounded up: 128..256
    if q == 256:
        q = 128
        exp += 1
    biased = np.int64(exp) - 1 + 127
    bits = (biased << 7) | (q - 128)
    if bits > BF16_MAX_BITS:  # rounding up overflowed to infinity: keep the largest finite
        bits = np.int64(BF16_MAX_BITS)
    return bits


@register_jitable
def bf16_bits_to_float64(bits):
    """Value of bfloat16 ``bits`` (non-negative, finite) as float64."""
    b = np.int64(bits)
    exp = b >> 7
    mant = b & 0x7F
    if exp == 0:
        return math.ldexp(np.float64(mant), -133)
    return math.ldexp(np.float64(128 + mant), int(exp) - 134)


@register_jitable
def quant_inverse_step(scale_bits, maxq):
    """float32 factor that maps a value to level units: maxq / scale (0 when scale is 0,
    the largest float32 when maxq / scale would overflow it)."""
    scale = bf16_bits_to_float64(scale_bits)
    if scale == 0.0:
        return np.float32(0.0)
    inv = np.float64(maxq) / scale
    if inv > 3.4028234663852886e38:
        # A row whose abs-max is below ~1e-37: maxq / scale overflows float32.  Use the
        # largest float32 instead of inf, so every level stays finite (|x| <= scale) and
        # every device computes the same symbols.
        return np.float32(3.4028234663852886e38)
    return np.float32(inv)


@register_jitable
def dequant_step(scale_bits, maxq):
    """float32 size of one level: scale / maxq."""
    scale = bf16_bits_to_float64(scale_bits)
    return np.float32(scale / np.float64(maxq))


@register_jitable
def quantize_value(value, inv, maxq):
    """Symbol (0..2*maxq) of one float32 value, rounding half away from zero."""
    level = np.float64(np.float32(value)) * np.float64(inv)  # exact: 24 x 24 bits < 53
    q = np.int64(level)  # truncates toward zero
    frac = level - np.float64(q)  # exact
    if frac >= 0.5:
        q += 1
    elif frac <= -0.5:
        q -= 1
    if q > maxq:
        q = maxq
    elif q < -maxq:
        q = -maxq
    return q + maxq


@register_jitable
def dequantize_value(symbol, step, maxq):
    """float32 value of one symbol."""
    return np.float32(np.float32(np.int64(symbol) - maxq) * step)


@register_jitable
def float_from_bits16(bits, fmt):
    """float32 value of a bfloat16 (fmt 1) or float16 (fmt 2) word, by exact arithmetic.

    Lets a GPU kernel read 16-bit caches directly instead of a float32 copy."""
    b = np.int64(bits) & 0xFFFF
    if fmt == 1:
        e = (b >> 7) & 0xFF
        m = b & 0x7F
        if e == 0:
            v = math.ldexp(np.float64(m), -133)
        else:
            v = math.ldexp(np.float64(128 + m), int(e) - 134)
    else:
        e = (b >> 10) & 0x1F
        m = b & 0x3FF
        if e == 0:
            v = math.ldexp(np.float64(m), -24)
        else:
            v = math.ldexp(np.float64(1024 + m), int(e) - 25)
    if b & 0x8000:
        v = -v
    return np.float32(v)


@register_jitable
def _round_half_even(y):
    """Non-negative y rounded to the nearest integer, ties to even (y - floor(y) is exact)."""
    q = np.int64(math.floor(y))
    d = y - np.float64(q)
    if d > 0.5 or (d == 0.5 and (q & 1) == 1):
        q += 1
    return q


@register_jitable
def bf16_bits_nearest(value):
    """bfloat16 bits (as int64) of a finite float32 value, rounded to nearest even,
    as torch's float32 -> bfloat16 cast does."""
    v = np.float64(np.float32(value))
    sign = np.int64(0)
    if math.copysign(1.0, v) < 0.0:  # also -0.0
        sign = np.int64(0x8000)
        v = -v
    if v == 0.0:
        return sign
    if v < 1.1754943508222875e-38:  # bfloat16 subnormal range: steps of 2**-133
        return sign | _round_half_even(math.ldexp(v, 133))  # 128 rounds up to the smallest normal: same bits
    mant, exp = math.frexp(v)
    q = _round_half_even(mant * 256.0)
    if q == 256:
        q = 128
        exp += 1
    bits = ((np.int64(exp) - 1 + 127) << 7) | (q - 128)
    if bits > 0x7F80:
        bits = np.int64(0x7F80)
    return sign | bits
