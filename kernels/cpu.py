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
from .coding_params import CODE_LEVELS, CODE_THRESHOLD, CODE_WEIGHT, MASK32, PROB_BITS, PROB_TOTAL, RANGE_INIT, RANGE_TOP
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
        lengths[s] = encode_stream(symbols[l, kv], t0, t1, c0, c1, cum[k, l, kv], c0, 1, slots[s])


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
        decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, cum[k, l, kv], c0, 1, alphabet, symbols[l, kv])


# =====================================================================================
# CPU-only fast paths.
#
# The kernels above are the reference: they call the shared device functions stage by
# stage, exactly as the CUDA kernels do.  The kernels below give the same scales,
# codes, stream bytes and symbols (tests/test_cpu_fastpaths.py checks it) but are
# written for a CPU core:
#
# * fused per plane (chunk, layer, K/V): quantize -> histogram -> codes -> CDF ->
#   range-code runs on one ~50 K-value plane while it sits in L1/L2, instead of five
#   passes over the whole slab through memory;
# * quantization reads the source bits directly (bfloat16 or float32, no float32 copy
#   of the cache), takes the abs-max on integer bits, and rounds with trunc/compare in
#   float64 (no float -> int64 conversion), so the row loops vectorize;
# * CDFs: 4-bit codes against per-channel precomputed thresholds, and the 16 possible
#   frequencies of a channel computed once with an exact float64 division;
# * the range coder renormalizes without a data-dependent loop (0, 1 or 2 bytes per
#   symbol: range >= 2**9 after every symbol), the decoder divides in float64 (exact:
#   code < 2**32, r >= 2**9) and finds the symbol through a per-channel lookup table
#   on the top bits of the quotient plus a short forward scan; and four streams are
#   coded in lock step so that their dependency chains overlap;
# * decoding dequantizes straight into the output (float32, or bfloat16 bits rounded
#   to nearest even, as torch does).
# =====================================================================================

#: The fast paths divide only where the divisor cannot be zero: no Python-style checks.
_FAST = dict(_JIT, error_model="numpy")
#: Decoder lookup table: one entry per 2**LUT_SHIFT of the 2**PROB_BITS probability scale.
LUT_SHIFT = 9
LUT_SIZE = PROB_TOTAL >> LUT_SHIFT
#: Streams coded in lock step by one thread.
INTERLEAVE = 4


@njit(**_FAST)
def fast_codes(counts_row, alphabet, codes_row, thresholds):
    """Same as cdf.counts_to_codes; ``thresholds``: int64 scratch of CODE_LEVELS - 1."""
    top = np.int64(0)
    for s in range(alphabet):
        if counts_row[s] > top:
            top = np.int64(counts_row[s])
    for j in range(CODE_LEVELS - 1):
        thresholds[j] = top * CODE_THRESHOLD[j]
    for s in range(codes_row.shape[0]):
        code = 0
        if s < alphabet:
            c = np.int64(counts_row[s])
            if c > 0:
                scaled = c << 20
                code = 1
                for j in range(CODE_LEVELS - 1):
                    code += scaled >= thresholds[j]
        codes_row[s] = code


@njit(**_FAST)
def fast_cum(codes_row, alphabet, cum_row, table):
    """Same as cdf.codes_to_cum; ``table``: int64 scratch of 16.

    A channel's frequencies take at most 16 values, 1 + weight[k] * spare // W, one
    per code k: computed once per channel.  weight * spare < 2**28 and W < 2**21, so
    the float64 quotient is never within rounding of the next integer and its floor
    is the integer quotient.
    """
    total_weight = np.int64(0)
    best = 0
    best_code = np.int64(-1)
    for s in range(alphabet):
        code = np.int64(codes_row[s])
        total_weight += CODE_WEIGHT[code]
        if code > best_code:
            best_code = code
            best = s
    spare = np.int64(PROB_TOTAL - alphabet)
    if total_weight > 0:
        w = np.float64(total_weight)
        for k in range(16):
            table[k] = 1 + np.int64(np.float64(CODE_WEIGHT[k] * spare) / w)
    else:
        for k in range(16):
            table[k] = 1
    assigned = np.int64(0)
    for s in range(alphabet):
        assigned += table[np.int64(codes_row[s])]
    remainder = np.int64(PROB_TOTAL) - assigned
    acc = np.int64(0)
    cum_row[0] = 0
    for s in range(alphabet):
        freq = table[np.int64(codes_row[s])]
        if s == best:
            freq += remainder
        acc += freq
        cum_row[s + 1] = acc
    for s in range(alphabet + 1, cum_row.shape[0]):
        cum_row[s] = PROB_TOTAL


@njit(**_FAST)
def build_lut(cum_row, alphabet, lut_row):
    """lut_row[b] = the symbol s with cum[s] <= b << LUT_SHIFT < cum[s + 1]."""
    s = 0
    for b in range(LUT_SIZE):
        q = b << LUT_SHIFT
        while s + 1 < alphabet and cum_row[s + 1] <= q:
            s += 1
        lut_row[b] = s


# ------------------------------------------------------------------ range coder steps


@njit(**_FAST)
def _enc_symbol(low, rng, n, out, base, freq):
    """One symbol of range_coder.encode_stream, renormalizing without a loop."""
    r = rng >> PROB_BITS
    low += r * base
    rng = r * freq
    if low > MASK32:
        _add_carry_fast(out, n)
        low &= MASK32
    # rng >= 2**9 here, so at most two bytes go out; write both, keep k.
    k = np.int64(rng < RANGE_TOP) + np.int64(rng < (1 << 16))
    out[n] = (low >> 24) & 0xFF
    out[n + 1] = (low >> 16) & 0xFF
    n += k
    low = (low << (8 * k)) & MASK32
    rng <<= 8 * k
    return low, rng, n


@njit(**_FAST)
def _add_carry_fast(out, n):
    i = n - 1
    while i >= 0 and out[i] == 255:
        out[i] = 0
        i -= 1
    if i >= 0:
        out[i] += 1


@njit(**_FAST)
def _enc_flush(low, rng, n, out):
    """The end of range_coder.encode_stream: flush, drop trailing zeros; returns the length."""
    nbytes = 4
    value = low
    for k in range(5):
        unit = np.int64(1) << (32 - 8 * k)
        candidate = (low + unit - 1) & ~(unit - 1)
        if candidate < low + rng:
            nbytes = k
            value = candidate
            break
    if value > MASK32:
        _add_carry_fast(out, n)
        value &= MASK32
    for j in range(nbytes):
        out[n] = (value >> (24 - 8 * j)) & 0xFF
        n += 1
    while n > 0 and out[n - 1] == 0:
        n -= 1
    return n


@njit(**_FAST)
def _dec_byte(data, start, length, pos):
    if pos < length:
        return np.int64(data[start + pos])
    return np.int64(0)


@njit(**_FAST)
def _dec_symbol(code, rng, pos, data, start, length, cum_row, lut_row):
    """One symbol of range_coder.decode_stream: float64 division, table lookup, no loop
    in the renormalization.  Returns (symbol, code, rng, pos)."""
    r = rng >> PROB_BITS
    q = np.int64(np.float64(code) / np.float64(r))
    if q > PROB_TOTAL - 1:
        q = PROB_TOTAL - 1
    s = np.int64(lut_row[q >> LUT_SHIFT])
    while cum_row[s + 1] <= q:
        s += 1
    base = np.int64(cum_row[s])
    code -= r * base
    rng = r * (np.int64(cum_row[s + 1]) - base)
    k = np.int64(rng < RANGE_TOP) + np.int64(rng < (1 << 16))
    two = (_dec_byte(data, start, length, pos) << 8) | _dec_byte(data, start, length, pos + 1)
    code = ((code << (8 * k)) | (two >> (16 - 8 * k))) & MASK32
    pos += k
    rng <<= 8 * k
    return s, code, rng, pos


@njit(**_FAST)
def _dec_start(data, start, length):
    code = np.int64(0)
    for pos in range(4):
        code = (code << 8) | _dec_byte(data, start, length, pos)
    return code


# ------------------------------------------------------------------ plane helpers


@njit(**_FAST)
def _plane_index(job, L):
    k = job // (L * 2)
    l = (job // 2) % L
    kv = job % 2
    return k, l, kv


@njit(**_FAST)
def _quantize_plane(xbits, shift, t_first, m, sym, scales_row):
    """Quantize rows t_first .. t_first + sym.shape[0] of one (layer, K/V) plane of source
    bits (float32 bits, or bfloat16 bits with shift 16) into sym [Tk, C] and their scales."""
    Tk, C = sym.shape
    md = np.float64(m)
    for t in range(Tk):
        row = xbits[t_first + t]
        top = np.int64(0)
        for c in range(C):
            a = (np.int64(row[c]) << shift) & 0x7FFFFFFF  # |x| as bits: ordered like |x|
            top = max(top, a)
        bits = bf16_bits_round_up(np.uint32(top).view(np.float32))
        scales_row[t] = bits
        inv = np.float64(quant_inverse_step(bits, m))
        out = sym[t]
        for c in range(C):
            v = np.float64(np.uint32(np.int64(row[c]) << shift).view(np.float32))
            level = v * inv  # exact, as in quantize_value
            tr = np.trunc(level)
            frac = level - tr
            q = tr + np.float64(frac >= 0.5) - np.float64(frac <= -0.5)
            q = min(max(q, -md), md)
            out[c] = np.uint8(np.int32(q) + m)


@njit(**_FAST)
def _encode_plane_streams(sym, cum, group, scratch, dest, lengths_row):
    """Range-code the streams of one plane (sym [Tk, C], cum [C, S + 1]) back to back
    into dest; lengths_row[g] = bytes of stream g.  Returns the bytes written."""
    Tk, C = sym.shape
    groups = lengths_row.shape[0]
    full = C // group  # groups of full width: coded INTERLEAVE at a time
    o = 0
    g = 0
    while g < groups:
        if g + INTERLEAVE <= full:
            b0 = scratch[0]
            b1 = scratch[1]
            b2 = scratch[2]
            b3 = scratch[3]
            l0 = l1 = l2 = l3 = np.int64(0)
            r0 = r1 = r2 = r3 = np.int64(RANGE_INIT)
            n0 = n1 = n2 = n3 = 0
            c0 = g * group
            for t in range(Tk):
                row = sym[t]
                for j in range(group):
                    c = c0 + j
                    s = np.int64(row[c])
                    base = np.int64(cum[c, s])
                    l0, r0, n0 = _enc_symbol(l0, r0, n0, b0, base, np.int64(cum[c, s + 1]) - base)
                    c += group
                    s = np.int64(row[c])
                    base = np.int64(cum[c, s])
                    l1, r1, n1 = _enc_symbol(l1, r1, n1, b1, base, np.int64(cum[c, s + 1]) - base)
                    c += group
                    s = np.int64(row[c])
                    base = np.int64(cum[c, s])
                    l2, r2, n2 = _enc_symbol(l2, r2, n2, b2, base, np.int64(cum[c, s + 1]) - base)
                    c += group
                    s = np.int64(row[c])
                    base = np.int64(cum[c, s])
                    l3, r3, n3 = _enc_symbol(l3, r3, n3, b3, base, np.int64(cum[c, s + 1]) - base)
            n0 = _enc_flush(l0, r0, n0, b0)
            n1 = _enc_flush(l1, r1, n1, b1)
            n2 = _enc_flush(l2, r2, n2, b2)
            n3 = _enc_flush(l3, r3, n3, b3)
            lengths_row[g] = n0
            lengths_row[g + 1] = n1
            lengths_row[g + 2] = n2
            lengths_row[g + 3] = n3
            dest[o : o + n0] = b0[:n0]
            o += n0
            dest[o : o + n1] = b1[:n1]
            o += n1
            dest[o : o + n2] = b2[:n2]
            o += n2
            dest[o : o + n3] = b3[:n3]
            o += n3
            g += INTERLEAVE
        else:
            b0 = scratch[0]
            c0 = g * group
            c1 = min(C, c0 + group)
            l0 = np.int64(0)
            r0 = np.int64(RANGE_INIT)
            n0 = 0
            for t in range(Tk):
                row = sym[t]
                for c in range(c0, c1):
                    s = np.int64(row[c])
                    base = np.int64(cum[c, s])
                    l0, r0, n0 = _enc_symbol(l0, r0, n0, b0, base, np.int64(cum[c, s + 1]) - base)
            n0 = _enc_flush(l0, r0, n0, b0)
            lengths_row[g] = n0
            dest[o : o + n0] = b0[:n0]
            o += n0
            g += 1
    return o


@njit(**_FAST)
def _decode_plane_streams(payload, offsets, lengths, first_stream, cum, lut, group, sym):
    """Decode the streams first_stream .. of one plane into sym [Tk, C]."""
    Tk, C = sym.shape
    groups = (C + group - 1) // group
    full = C // group
    g = 0
    while g < groups:
        if g + INTERLEAVE <= full:
            i = first_stream + g
            s0, s1, s2, s3 = offsets[i], offsets[i + 1], offsets[i + 2], offsets[i + 3]
            n0, n1, n2, n3 = np.int64(lengths[i]), np.int64(lengths[i + 1]), np.int64(lengths[i + 2]), np.int64(lengths[i + 3])
            d0 = _dec_start(payload, s0, n0)
            d1 = _dec_start(payload, s1, n1)
            d2 = _dec_start(payload, s2, n2)
            d3 = _dec_start(payload, s3, n3)
            r0 = r1 = r2 = r3 = np.int64(RANGE_INIT)
            p0 = p1 = p2 = p3 = np.int64(4)
            c0 = g * group
            for t in range(Tk):
                row = sym[t]
                for j in range(group):
                    c = c0 + j
                    x, d0, r0, p0 = _dec_symbol(d0, r0, p0, payload, s0, n0, cum[c], lut[c])
                    row[c] = x
                    c += group
                    x, d1, r1, p1 = _dec_symbol(d1, r1, p1, payload, s1, n1, cum[c], lut[c])
                    row[c] = x
                    c += group
                    x, d2, r2, p2 = _dec_symbol(d2, r2, p2, payload, s2, n2, cum[c], lut[c])
                    row[c] = x
                    c += group
                    x, d3, r3, p3 = _dec_symbol(d3, r3, p3, payload, s3, n3, cum[c], lut[c])
                    row[c] = x
            g += INTERLEAVE
        else:
            i = first_stream + g
            s0 = offsets[i]
            n0 = np.int64(lengths[i])
            d0 = _dec_start(payload, s0, n0)
            r0 = np.int64(RANGE_INIT)
            p0 = np.int64(4)
            c0 = g * group
            c1 = min(C, c0 + group)
            for t in range(Tk):
                row = sym[t]
                for c in range(c0, c1):
                    x, d0, r0, p0 = _dec_symbol(d0, r0, p0, payload, s0, n0, cum[c], lut[c])
                    row[c] = x
            g += 1


# ------------------------------------------------------------------ fused kernels


@njit(parallel=True, **_FAST)
def encode_planes(xbits, shift, t_first, num_tokens, maxq, chunk_tokens, group, scales, codes, lengths, plane_bytes, planes):
    """quantize + histogram + build_cdf + encode_streams (+ the stream half of pack_streams),
    fused per plane (chunk, layer, K/V).

    xbits    uint16 (bfloat16 bits, shift 16) or uint32 (float32 bits, shift 0) [L, 2, >= t_first + T, C]:
             the slab is tokens t_first .. t_first + num_tokens
    scales   uint16 [L, 2, T];  codes uint8 [K, L, 2, C, S];  lengths int32 [K, L, 2, groups]
    planes   uint8 [K * L * 2, plane_cap]: plane j's streams back to back, plane_bytes[j] of them
    """
    L = xbits.shape[0]
    C = xbits.shape[3]
    K, _, _, _, S = codes.shape
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(num_tokens, t0 + chunk_tokens)
        m = np.int64(maxq[l, kv])
        alphabet = 2 * m + 1
        sym = np.empty((t1 - t0, C), np.uint8)
        _quantize_plane(xbits[l, kv], shift, t_first + t0, m, sym, scales[l, kv, t0:t1])
        counts = np.zeros((C, S), np.int32)
        for t in range(t1 - t0):
            row = sym[t]
            for c in range(C):
                counts[c, row[c]] += 1
        cum = np.empty((C, S + 1), np.int32)
        thresholds = np.empty(CODE_LEVELS - 1, np.int64)
        table = np.empty(16, np.int64)
        for c in range(C):
            fast_codes(counts[c], alphabet, codes[k, l, kv, c], thresholds)
            fast_cum(codes[k, l, kv, c], alphabet, cum[c], table)
        scratch = np.empty((INTERLEAVE, 2 * (t1 - t0) * group + 8), np.uint8)
        plane_bytes[job] = _encode_plane_streams(sym, cum, group, scratch, planes[job], lengths[k, l, kv])


@njit(parallel=True, **_FAST)
def decode_planes(payload, offsets, lengths, codes, maxq, chunk_tokens, group, scales, out, t_first, to_bf16):
    """cum_from_codes + decode_streams + dequantize, fused per plane (chunk, layer, K/V).

    payload/offsets/lengths as for decode_streams; codes uint8 [K, L, 2, C, S];
    scales uint16 [L, 2, T]; out [L, 2, >= t_first + T, C]: float32 values, or with
    to_bf16 uint16 bfloat16 bits (round to nearest even), at tokens t_first ..
    """
    K, L, _, C, S = codes.shape
    T = scales.shape[2]
    groups = (C + group - 1) // group
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        m = np.int64(maxq[l, kv])
        alphabet = 2 * m + 1
        cum = np.empty((C, S + 1), np.int32)
        lut = np.empty((C, LUT_SIZE), np.uint8)
        table = np.empty(16, np.int64)
        for c in range(C):
            fast_cum(codes[k, l, kv, c], alphabet, cum[c], table)
            build_lut(cum[c], alphabet, lut[c])
        sym = np.empty((t1 - t0, C), np.uint8)
        _decode_plane_streams(payload, offsets, lengths, job * groups, cum, lut, group, sym)
        _dequantize_plane(sym, scales[l, kv, t0:t1], m, out[l, kv], t_first + t0, to_bf16)


@njit(**_FAST)
def _dequantize_plane(sym, scales_row, m, out_plane, t_out, to_bf16):
    Tk, C = sym.shape
    mf = np.float32(m)
    for t in range(Tk):
        step = dequant_step(scales_row[t], m)
        src = sym[t]
        dst = out_plane[t_out + t]
        if to_bf16:
            for c in range(C):
                v = np.float32(np.float32(src[c]) - mf) * step
                u = np.int64(np.float32(v).view(np.uint32))
                dst[c] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        else:
            for c in range(C):
                dst[c] = np.float32(np.float32(src[c]) - mf) * step
