"""CPU kernels (@njit, parallel over rows / channels / streams).

Every kernel takes its inputs and caller-allocated outputs as arrays and
returns nothing (the stream encoder fills a lengths array).  The CUDA kernels
in ``cuda.py`` have the same names, arguments and results, byte for byte.

Array conventions (a "slab" is K consecutive chunks of one cache):
  x        float32 [L, 2, T, C]   values, K at index 0 of dim 1
  maxq     int32   [L, 2]         largest level per (layer, K/V); alphabet = 2*maxq+1
  scales   uint16  [L, 2, T]      bfloat16 bits of each token's abs-max
  symbols  uint8   [L, 2, T, C]
  counts   int32   [K, L, 2, C, S]      S >= largest alphabet
  codes    uint8   [K, L, 2, C, S]
  cum      int32   [K, L, 2, C, S + 1]
  slots    uint8   [N, slot_bytes]      one coded stream per row
  lengths  int32   [N]
Streams are numbered (chunk, layer, K/V, channel group) row-major; a group is
`group` consecutive channels, the last one possibly narrower.
"""

from . import jit_cache  # noqa: F401  (sets the cache folder before any @njit)

import numpy as np
from numba import njit, prange

from .cdf import codes_to_cum, counts_to_codes
from .quantize import bf16_bits_round_up, dequant_step, dequantize_value, quant_inverse_step, quantize_value
from .range_coder import decode_stream, encode_stream

_JIT = dict(cache=True, nogil=True)


@njit(parallel=True, **_JIT)
def quantize(x, maxq, scales, symbols):
    """Per (layer, K/V, token) row: scale by the abs-max, round to levels."""
    L, _, T, C = x.shape
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        top = np.float32(0.0)
        for c in range(C):
            a = abs(x[l, kv, t, c])
            if a > top:
                top = a
        bits = bf16_bits_round_up(top)
        scales[l, kv, t] = bits
        m = np.int64(maxq[l, kv])
        inv = quant_inverse_step(bits, m)
        for c in range(C):
            symbols[l, kv, t, c] = quantize_value(x[l, kv, t, c], inv, m)


@njit(parallel=True, **_JIT)
def dequantize(symbols, scales, maxq, out):
    """out = (symbol - maxq) * scale / maxq, row by row."""
    L, _, T, C = symbols.shape
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        m = np.int64(maxq[l, kv])
        step = dequant_step(scales[l, kv, t], m)
        for c in range(C):
            out[l, kv, t, c] = dequantize_value(symbols[l, kv, t, c], step, m)


@njit(parallel=True, **_JIT)
def histogram(symbols, chunk_tokens, counts):
    """counts[k, l, kv, c, s] = occurrences of symbol s in channel c of chunk k."""
    K, L, _, C, S = counts.shape
    T = symbols.shape[2]
    for job in prange(K * L * 2):
        k = job // (L * 2)
        l = (job // 2) % L
        kv = job % 2
        plane = counts[k, l, kv]
        plane[:, :] = 0
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        for t in range(t0, t1):
            for c in range(C):
                plane[c, symbols[l, kv, t, c]] += 1


@njit(parallel=True, **_JIT)
def build_cdf(counts, maxq, codes, cum):
    """Encoder side: counts -> 4-bit codes -> CDF, per (chunk, layer, K/V, channel)."""
    K, L, _, C, S = counts.shape
    for job in prange(K * L * 2 * C):
        k = job // (L * 2 * C)
        l = (job // (2 * C)) % L
        kv = (job // C) % 2
        c = job % C
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        counts_to_codes(counts[k, l, kv, c], alphabet, codes[k, l, kv, c])
        codes_to_cum(codes[k, l, kv, c], alphabet, cum[k, l, kv, c])


@njit(parallel=True, **_JIT)
def cum_from_codes(codes, maxq, cum):
    """Decoder side: 4-bit codes -> CDF (the same tables build_cdf made)."""
    K, L, _, C, S = codes.shape
    for job in prange(K * L * 2 * C):
        k = job // (L * 2 * C)
        l = (job // (2 * C)) % L
        kv = (job // C) % 2
        c = job % C
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        codes_to_cum(codes[k, l, kv, c], alphabet, cum[k, l, kv, c])


@njit(parallel=True, **_JIT)
def encode_streams(symbols, cum, chunk_tokens, group, slots, lengths):
    """Range-code every stream of the slab into its slot; lengths[s] = bytes used."""
    K, L, _, C, _S1 = cum.shape
    T = symbols.shape[2]
    groups = (C + group - 1) // group
    for s in prange(K * L * 2 * groups):
        k = s // (L * 2 * groups)
        l = (s // (2 * groups)) % L
        kv = (s // groups) % 2
        g = s % groups
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        c0 = g * group
        c1 = min(C, c0 + group)
        lengths[s] = encode_stream(symbols[l, kv], t0, t1, c0, c1, cum[k, l, kv], slots[s])


@njit(parallel=True, **_JIT)
def pack_streams(slots, lengths, offsets, payload):
    """payload[offsets[s]:offsets[s] + lengths[s]] = slots[s, :lengths[s]]."""
    for s in prange(lengths.shape[0]):
        o = offsets[s]
        for i in range(lengths[s]):
            payload[o + i] = slots[s, i]


@njit(parallel=True, **_JIT)
def decode_streams(payload, offsets, lengths, cum, maxq, chunk_tokens, group, symbols):
    """Inverse of encode_streams: stream s is payload[offsets[s]:offsets[s] + lengths[s]]."""
    K, L, _, C, _S1 = cum.shape
    T = symbols.shape[2]
    groups = (C + group - 1) // group
    for s in prange(K * L * 2 * groups):
        k = s // (L * 2 * groups)
        l = (s // (2 * groups)) % L
        kv = (s // groups) % 2
        g = s % groups
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        c0 = g * group
        c1 = min(C, c0 + group)
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, cum[k, l, kv], alphabet, symbols[l, kv])
