"""Rotary position embeddings (RoPE) of the keys: removed before quantization, restored after
decoding (format version 2, flags bit 2; docs/format.md, "Keys without their rotary embedding").

A model stores its keys after RoPE: channel pair (a, b) of every head at position p is rotated
by the angle p x f_j.  All heads' keys at one position turn by the same angles, which hides
the keys' per-channel structure (a channel's mean turns with the position) and their
low-rank structure within a head; removing the rotation gives the quantizer and a per-head
calibration stationary coordinates (scripts/rotation_structures.py measured it).

Why the arithmetic is spelled out: the encoder and decoder, the CPU and a GPU must agree bit
for bit, and libm's sin and cos are not correctly rounded (they differ between libraries and
devices).  So the angle's sine and cosine are defined here by a fixed sequence of float64
operations, each rounded to nearest even, and no multiply-add is fused: a Cody-Waite
reduction by pi/2 in three parts (the first two short enough that k x part is exact for
k < 2^31) and Taylor polynomials on |r| <= pi/4 + tiny (their truncation error is below
1e-17: far below what a bfloat16 key can show).  ``make_sincos(mul)`` builds the function
over a multiplication: plain ``*`` on the CPU (numba does not contract without fastmath), a
non-contractable ``dmul_rn`` on a GPU.

Pairs of a head's first ``rotary_dim`` channels (style 0, "rotate half", Llama / Qwen /
Mistral in transformers): (j, j + r/2); style 1 ("interleaved", GPT-J): (2j, 2j + 1).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from .cpu import _FAST

STYLE_HALF = 0
STYLE_INTERLEAVED = 1

#: float64 constants of the reduction (2/pi rounded; pi/2 = PIO2_1 + PIO2_2 + PIO2_3 with the
#: first two of at most 22 significant bits) and of the polynomials (+-1/n! rounded).
TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
PIO2_1 = float.fromhex("0x1.921fb00000000p+0")
PIO2_2 = float.fromhex("0x1.5110b00000000p-22")
PIO2_3 = float.fromhex("0x1.18469898cc517p-44")
S3, S5, S7, S9, S11, S13, S15, S17 = (float.fromhex(h) for h in (
    "-0x1.5555555555555p-3", "0x1.1111111111111p-7", "-0x1.a01a01a01a01ap-13", "0x1.71de3a556c734p-19",
    "-0x1.ae64567f544e4p-26", "0x1.6124613a86d09p-33", "-0x1.ae7f3e733b81fp-41", "0x1.952c77030ad4ap-49"))
C2, C4, C6, C8, C10, C12, C14, C16 = (float.fromhex(h) for h in (
    "-0x1.0000000000000p-1", "0x1.5555555555555p-5", "-0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-16",
    "-0x1.27e4fb7789f5cp-22", "0x1.1eed8eff8d898p-29", "-0x1.93974a8c07c9dp-37", "0x1.ae7f3e733b81fp-45"))

#: Limits a file must keep (the angle p x f stays below 2^31, where the reduction is exact).
MAX_POSITION = 1 << 31
FLOAT32_MAX = float(np.finfo(np.float32).max)


def make_sincos(mul):
    """sincos(theta) -> (sin, cos) for 0 <= theta < 2^31, every product through ``mul``."""

    @register_jitable
    def sincos(theta):
        n = int(math.floor(mul(theta, TWO_OVER_PI) + 0.5))  # below 2^31 (a float on a GPU, an int on a CPU)
        k = float(n)
        r = ((theta - mul(k, PIO2_1)) - mul(k, PIO2_2)) - mul(k, PIO2_3)
        z = mul(r, r)
        p = S17
        p = mul(p, z) + S15
        p = mul(p, z) + S13
        p = mul(p, z) + S11
        p = mul(p, z) + S9
        p = mul(p, z) + S7
        p = mul(p, z) + S5
        p = mul(p, z) + S3
        s = r + mul(mul(r, z), p)
        q = C16
        q = mul(q, z) + C14
        q = mul(q, z) + C12
        q = mul(q, z) + C10
        q = mul(q, z) + C8
        q = mul(q, z) + C6
        q = mul(q, z) + C4
        q = mul(q, z) + C2
        c = 1.0 + mul(z, q)
        n = n & 3
        if n == 0:
            return s, c
        if n == 1:
            return c, -s
        if n == 2:
            return -s, -c
        return -c, s

    return sincos


def make_pair_ops(mul):
    """(unturn, turn) over a multiplication ``mul``, as make_sincos.

    unturn(k_a, k_b, s, c) -> (x_a, x_b): a key pair turned by the angle whose sine and cosine
    are s, c, turned back: x_a = k_a c + k_b s, x_b = k_b c - k_a s, each product and sum
    rounded in float64, then to float32 (saturating: a turned pair's channel can reach
    sqrt(2) x the larger input).  turn is its inverse: k_a = x_a c - x_b s, k_b = x_b c + x_a s,
    its inputs saturated first (a decoded value can be an infinity)."""

    @register_jitable
    def unturn(ka, kb, s, c):
        return to_float32(mul(ka, c) + mul(kb, s)), to_float32(mul(kb, c) - mul(ka, s))

    @register_jitable
    def turn(xa, xb, s, c):
        # A decoded value may be an infinity (a z past float32's range): saturated first, so that
        # no infinity meets a zero or another infinity (NaN)
        xa = min(max(xa, -FLOAT32_MAX), FLOAT32_MAX)
        xb = min(max(xb, -FLOAT32_MAX), FLOAT32_MAX)
        return to_float32(mul(xa, c) - mul(xb, s)), to_float32(mul(xb, c) + mul(xa, s))

    return unturn, turn


@register_jitable
def to_float32(v):
    """float32 of a float64, saturating at float32's largest finite value."""
    return np.float32(min(max(v, -FLOAT32_MAX), FLOAT32_MAX))


@register_jitable
def pair_channels(j, style, rotary_dim):
    """The (a, b) channels of pair j inside a head."""
    if style == STYLE_HALF:
        return j, j + rotary_dim // 2
    return 2 * j, 2 * j + 1


@register_jitable
def _mul(x, y):
    return x * y


sincos = make_sincos(_mul)
unturn, turn = make_pair_ops(_mul)


def angles(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sin, cos) [len(positions), F] of the angles position x f (for tests and tools; the
    kernels compute them as they go)."""
    s = np.empty((positions.size, inv_freq.size), np.float64)
    c = np.empty_like(s)
    _angles(np.asarray(inv_freq, np.float64), np.asarray(positions, np.int64), s, c)
    return s, c


@njit(**_FAST)
def _angles(inv_freq, positions, s, c):
    for i in range(positions.shape[0]):
        p = np.float64(positions[i])
        for j in range(inv_freq.shape[0]):
            s[i, j], c[i, j] = sincos(p * inv_freq[j])


def turn_keys(x, freq, rope, t_first, sink, forward):
    """In place on float32 x [L, 2, T, C] (tokens t_first .. of the cache): the key planes x[:, 0]
    with their rotary embedding removed (``forward`` False: the encoder's step) or restored
    (True: the decoder's last step before the source dtype), for the tokens at or past ``sink``
    (the sink tokens are stored verbatim, never turned).  ``rope``: format.params.Rope; ``freq``:
    its frequencies, float64 [F, rotary_dim / 2] (F = 1: every layer, or L); token t's position
    is rope.position_start + t.  The signature of cuda_pipeline.turn_keys."""
    freq = np.ascontiguousarray(freq, np.float64)
    T = x.shape[2]
    # One row of frequencies (every layer's): each token's angles once, not once per layer.
    shared = freq.shape[0] == 1 and x.shape[0] > 1
    sin_t = np.empty((T if shared else 0, rope.rotary_dim // 2), np.float64)
    cos_t = np.empty_like(sin_t)
    if shared:
        _angles(freq[0], rope.position_start + t_first + np.arange(T, dtype=np.int64), sin_t, cos_t)
    _turn_keys(x, freq, rope.style, rope.rotary_dim, rope.head_dim, rope.position_start, t_first, sink, forward,
               sin_t, cos_t)


@njit(parallel=True, **_FAST)
def _turn_keys(x, inv_freq, style, rotary_dim, head_dim, pos0, t_first, sink, forward, sin_t, cos_t):
    """turn_keys: one job per (layer, token); each pair's angle once, for every head (taken from
    sin_t / cos_t [T, rotary_dim / 2] when they hold every token's, else computed)."""
    L, _, T, C = x.shape
    H = C // head_dim
    F = rotary_dim // 2
    tabled = sin_t.shape[0] == T
    for job in prange(L * T):
        l = job // T
        i = job % T
        t = t_first + i
        if t < sink:
            continue
        freq = inv_freq[l if inv_freq.shape[0] > 1 else 0]
        row = x[l, 0, i]
        for j in range(F):
            if tabled:
                s, c = sin_t[i, j], cos_t[i, j]
            else:
                s, c = sincos(np.float64(pos0 + t) * freq[j])
            a, b = pair_channels(j, style, rotary_dim)
            for h in range(H):
                ca = h * head_dim + a
                cb = h * head_dim + b
                if forward:
                    row[ca], row[cb] = turn(np.float64(row[ca]), np.float64(row[cb]), s, c)
                else:
                    row[ca], row[cb] = unturn(np.float64(row[ca]), np.float64(row[cb]), s, c)


@njit(parallel=True, **_FAST)
def widen_bf16(src, dst):
    """dst (uint32 bits of float32) = bfloat16 bits src widened (exact), any shape alike."""
    a = src.reshape(-1)
    b = dst.reshape(-1)
    for i in prange(a.shape[0]):
        b[i] = np.uint32(a[i]) << np.uint32(16)


@register_jitable
def bf16_bits_saturating(u):
    """The bfloat16 bits of float32 bits u (uint32), rounded to nearest even, a rounding up to an
    infinity kept at the largest finite value (docs/format.md, "Casting to the source dtype")."""
    b = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    if (b & np.uint32(0x7FFF)) == np.uint32(0x7F80):  # rounded up to an infinity
        b -= np.uint32(1)
    return b


#: store_values' targets
KIND_FLOAT32 = 0
KIND_BFLOAT16 = 1


@njit(parallel=True, **_FAST)
def store_values(x, sink, out, t_out, kind):
    """out[:, :, t_out + t] = x[:, :, t] in the source dtype for t >= sink: float32 bits
    (KIND_FLOAT32; out uint32) or bfloat16 bits rounded to nearest even and saturating
    (KIND_BFLOAT16; out uint16; docs/format.md, "Casting to the source dtype")."""
    L, _, T, C = x.shape
    for job in prange(L * 2 * T):
        l = job // (2 * T)
        kv = (job // T) % 2
        t = job % T
        if t < sink:
            continue
        row = x[l, kv, t].view(np.uint32)
        dst = out[l, kv, t_out + t]
        if kind == KIND_FLOAT32:
            for c in range(C):
                dst[c] = row[c]
        else:
            for c in range(C):
                dst[c] = bf16_bits_saturating(row[c])
