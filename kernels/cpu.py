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

The codec's CPU path runs the CPU-only fused kernels at the end of this file,
``encode_planes`` and ``decode_planes``, which give the same bytes and symbols as
the stage-by-stage kernels (see the section "CPU-only fast paths").
"""

from . import jit_cache  # noqa: F401  (sets the cache folder before any @njit)

import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import leading_zeros

from .cdf import codes_to_cum, counts_to_codes
from .quantize import bf16_bits_round_up, dequant_step, dequantize_value, quant_inverse_step, quantize_value
from .coding_params import CODE_LEVELS, CODE_THRESHOLD, CODE_WEIGHT, MASK32, PROB_BITS, PROB_TOTAL, RANGE_INIT, RANGE_TOP
from .range_coder import decode_stream, encode_stream, stream_coords

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
        k, l, kv, t0, t1, c0, c1 = stream_coords(s, groups, L, group, chunk_tokens, T, C)
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
        k, l, kv, t0, t1, c0, c1 = stream_coords(s, groups, L, group, chunk_tokens, T, C)
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, cum[k, l, kv], c0, 1, alphabet, symbols[l, kv])


# =====================================================================================
# CPU-only fast paths.
#
# The kernels above are the reference: they run the shared device functions stage by
# stage over the whole slab, exactly as the CUDA kernels do.  The two kernels below,
# encode_planes and decode_planes, give the same scales, codes, stream bytes and
# symbols (tests/test_cpu_fastpaths.py checks them against the reference) but are
# written for a CPU core:
#
# * fused per plane (chunk, layer, K/V): quantize -> histogram -> codes -> CDF ->
#   range coding (and CDF -> range decoding -> dequantization) run on one plane of a
#   few tens of thousands of values while it sits in L1/L2, instead of one pass over
#   the whole slab per stage;
# * quantization reads the source bits directly (bfloat16, or float32 bits), takes the
#   abs-max on integer bits (|x| orders like its bits for finite x) and rounds with
#   floor(|level| + 0.5) in float64, which is exact here (see _quantize_plane), so
#   the row loops vectorize;
# * histograms are unrolled so that the counter updates do not wait on each other;
# * 4-bit codes compare against per-channel precomputed thresholds; the 16 possible
#   frequencies of a channel are computed once, with an exact float64 division;
# * the range coder renormalizes without a data-dependent loop (the range is at least
#   2**9 after every symbol, so 0, 1 or 2 bytes move); the decoder divides in float64
#   (exact: code < 2**32 and r >= 2**9), finds the symbol through a per-channel lookup
#   table on the top bits of the quotient plus a short forward scan, and reads its
#   bytes from a zero-padded copy of the stream (the format says bytes past the end
#   read as 0); four streams are coded in lock step so their dependency chains
#   overlap;
# * decoding writes straight into the output: float32, or bfloat16 bits rounded to
#   nearest even (what torch's float32 -> bfloat16 conversion does).
#
# Indices are cast to unsigned where the hot loops index arrays: numba adds a
# negative-index wraparound to every signed index otherwise.
# =====================================================================================

#: The fast paths divide only where the divisor cannot be zero: no Python-style checks.
_FAST = dict(_JIT, error_model="numpy")
#: Decoder lookup table: one entry per 2**LUT_SHIFT of the 2**PROB_BITS probability scale.
LUT_SHIFT = 8
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


#: CODE_WEIGHT as float64, for fast_cum's divisions.
_CODE_WEIGHT_F = CODE_WEIGHT.astype(np.float64)


@njit(**_FAST)
def fast_cum(codes_row, alphabet, cum_row, table):
    """Same as cdf.codes_to_cum; ``table``: int64 scratch of 16.

    A channel's frequencies take at most 16 values, 1 + weight[k] * spare // W, one
    per code k: computed once per channel.  weight * spare < 2**28 and W < 2**21, so
    the float64 quotient is never within rounding of the next integer and its floor
    is the integer quotient.  The rounding remainder, added to the frequency of the
    first symbol with the highest code, is added to the cum entries after it.
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
    if total_weight > 0:
        spare = np.float64(PROB_TOTAL - alphabet)
        w = np.float64(total_weight)
        for k in range(16):
            table[k] = 1 + np.int64(_CODE_WEIGHT_F[k] * spare / w)
    else:
        for k in range(16):
            table[k] = 1
    acc = np.int64(0)
    cum_row[0] = 0
    for s in range(alphabet):
        acc += table[codes_row[s]]
        cum_row[s + 1] = acc
    remainder = np.int64(PROB_TOTAL) - acc
    for s in range(best + 1, alphabet + 1):
        cum_row[s] += remainder
    for s in range(alphabet + 1, cum_row.shape[0]):
        cum_row[s] = PROB_TOTAL


@njit(**_FAST)
def build_lut(cum_row, alphabet, lut_row):
    """lut_row[b] = the symbol s with cum[s] <= b << LUT_SHIFT < cum[s + 1]."""
    unit = np.int64(1) << LUT_SHIFT
    lo = np.int64(0)
    for s in range(alphabet):
        hi = min((np.int64(cum_row[s + 1]) + unit - 1) >> LUT_SHIFT, LUT_SIZE)
        lut_row[lo:hi] = s
        lo = hi


# ------------------------------------------------------------------ quantize / dequantize


@njit(**_FAST)
def _quantize_plane(xbits, shift, t_first, m, sym, scales_row):
    """Rows t_first .. t_first + Tk of one (layer, K/V) plane of source bits (float32
    bits, or bfloat16 bits with shift 16) -> sym [Tk, C] and scales_row [Tk].

    Same symbols as quantize.quantize_value: level = x * inv is exact in float64 with
    at most 48 significant bits, so |level| + 0.5 is exact whenever |level| >= 2**-5
    (at most 53 bits), and below that it cannot reach 1: floor(|level| + 0.5) is
    |level| rounded half away from zero.
    The abs-max compares bits, which order like |x| for every x but NaN (the codec
    rejects NaN before encoding; the reference kernel would skip it).
    """
    Tk, C = sym.shape
    md = np.float64(m)
    sh = np.uint32(shift)
    mask = np.uint32(0x7FFFFFFF)
    for t in range(Tk):
        row = xbits[t_first + t]
        top = np.uint32(0)
        for c in range(C):
            top = max(top, (np.uint32(row[c]) << sh) & mask)
        bits = bf16_bits_round_up(np.uint32(top).view(np.float32))
        scales_row[t] = bits
        inv32 = quant_inverse_step(bits, m)
        out = sym[t]
        inv = np.float64(inv32)
        for c in range(C):
            level = np.float64(np.uint32(np.uint32(row[c]) << sh).view(np.float32)) * inv
            q = min(np.floor(abs(level) + 0.5), md)
            q = md + (q if level >= 0 else -q)
            out[c] = np.uint8(np.int32(q))


@njit(**_FAST)
def _dequantize_plane(sym, scales_row, m, out_plane, t_out, to_bf16):
    """sym [Tk, C] -> out_plane[t_out:t_out + Tk]: float32, or bfloat16 bits (to_bf16)."""
    Tk, C = sym.shape
    mf = np.float32(m)
    for t in range(Tk):
        step = dequant_step(scales_row[t], m)
        src = sym[t]
        dst = out_plane[t_out + t]
        if to_bf16:
            for c in range(C):
                v = np.float32(np.float32(src[c]) - mf) * step
                u = np.uint32(np.float32(v).view(np.uint32))
                dst[c] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        else:
            for c in range(C):
                dst[c] = np.float32(np.float32(src[c]) - mf) * step


@njit(**_FAST)
def _histogram_plane(sym, S, counts):
    """counts[c * S + s] += occurrences of symbol s in column c of sym [Tk, C]."""
    Tk, C = sym.shape
    for t in range(Tk):
        row = sym[t]
        c = 0
        while c + 4 <= C:  # four independent updates: no store waits on the previous one
            i0 = np.uint64(c * S + row[c])
            i1 = np.uint64((c + 1) * S + row[c + 1])
            i2 = np.uint64((c + 2) * S + row[c + 2])
            i3 = np.uint64((c + 3) * S + row[c + 3])
            counts[i0] += 1
            counts[i1] += 1
            counts[i2] += 1
            counts[i3] += 1
            c += 4
        while c < C:
            counts[np.uint64(c * S + row[c])] += 1
            c += 1


# ------------------------------------------------------------------ range coder


@njit(**_FAST)
def _enc_carry(buf, n, start):
    """Add one to the big-endian number in buf[start:n] (range_coder._add_carry)."""
    i = n - 1
    while i >= start and buf[np.uint64(i)] == 255:
        buf[np.uint64(i)] = 0
        i -= 1
    if i >= start:
        buf[np.uint64(i)] += 1


@njit(**_FAST)
def _enc_step(low, rng, n, start, buf, entry):
    """One symbol of range_coder.encode_stream; entry = cum[s] | freq[s] << 16.

    After r * freq the range is at least 2**9, so at most two bytes go out: both are
    written, and n advances by the number that count.
    """
    r = rng >> PROB_BITS
    low += r * (entry & 0xFFFF)
    rng = r * (entry >> 16)
    if low > MASK32:
        _enc_carry(buf, n, start)
        low &= MASK32
    # 2**9 <= rng < 2**32: its leading zeros // 8 is the number of bytes to shift out.
    sh = np.int64(leading_zeros(np.uint32(rng))) & 24
    buf[np.uint64(n)] = low >> 24
    buf[np.uint64(n + 1)] = (low >> 16) & 0xFF
    return (low << sh) & MASK32, rng << sh, n + (sh >> 3)


@njit(**_FAST)
def _enc_flush(low, rng, n, start, buf):
    """The end of range_coder.encode_stream; returns the end of the stream in buf."""
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
        _enc_carry(buf, n, start)
        value &= MASK32
    for j in range(nbytes):
        buf[n] = (value >> (24 - 8 * j)) & 0xFF
        n += 1
    while n > start and buf[n - 1] == 0:
        n -= 1
    return n


@njit(**_FAST)
def _dec_step(code, rng, p, buf, cum, cb, lut, lb):
    """One symbol of range_coder.decode_stream; returns (symbol, code, rng, p).

    cum[cb:] and lut[lb:] are the channel's CDF and lookup table; buf[p:] the stream,
    zero-padded far enough for every read.
    """
    r = rng >> PROB_BITS
    q = min(np.int64(np.float64(code) / np.float64(r)), PROB_TOTAL - 1)
    s = np.int64(lut[np.uint64(lb + (q >> LUT_SHIFT))])
    hi = np.int64(cum[np.uint64(cb + s + 1)])
    while hi <= q:
        s += 1
        hi = np.int64(cum[np.uint64(cb + s + 1)])
    base = np.int64(cum[np.uint64(cb + s)])
    code -= r * base
    rng = r * (hi - base)
    # Shift in sh = 0, 8 or 16 bits (the range's leading zeros, rounded down to bytes):
    # the next two bytes are appended and the unused ones shifted back out.
    sh = np.int64(leading_zeros(np.uint32(rng))) & 24
    u = 16 - sh
    two = (np.int64(buf[np.uint64(p)]) << 8) | np.int64(buf[np.uint64(p + 1)])
    code = (((code << 16) | two) >> u) & MASK32
    return s, code, (rng << 16) >> u, p + (sh >> 3)


@njit(**_FAST)
def _dec_load(payload, start, length, buf, o, cap):
    """Copy a stream into buf[o:o + cap], zero-padded; returns (code, read position).

    A stream of n symbols reads at most 2 n + 6 <= cap bytes, so a longer (corrupt)
    stream is cut where no read reaches."""
    n = min(np.int64(length), cap)
    for i in range(n):
        buf[o + i] = payload[start + i]
    for i in range(n, cap):
        buf[o + i] = 0
    code = np.int64(0)
    for i in range(4):
        code = (code << 8) | np.int64(buf[o + i])
    return code, o + 4


@njit(**_FAST)
def _copy_bytes(src, start, n, dest, o):
    """dest[o:o + n] = src[start:start + n]; returns o + n.  (A plain loop: numba's slice
    assignment compiles to far more code.)"""
    for i in range(n):
        dest[o + i] = src[start + i]
    return o + n


@njit(**_FAST)
def _encode_plane_streams(sym, tab, S, group, buf, cap, dest, lengths_row):
    """Range-code the streams of one plane back to back into dest; lengths_row[g] = bytes
    of stream g; returns the bytes written.  sym [Tk, C]; tab [C * S] as for _enc_step;
    buf: scratch of INTERLEAVE * cap bytes, cap = 2 * Tk * group + 8."""
    Tk, C = sym.shape
    groups = lengths_row.shape[0]
    full = C // group  # groups of full width: coded INTERLEAVE at a time
    gs = group * S
    o = 0
    g = 0
    while g < groups:
        if g + INTERLEAVE <= full:
            l0 = l1 = l2 = l3 = np.int64(0)
            r0 = r1 = r2 = r3 = np.int64(RANGE_INIT)
            a0, a1, a2, a3 = 0, cap, 2 * cap, 3 * cap
            n0, n1, n2, n3 = a0, a1, a2, a3
            c0 = g * group
            for t in range(Tk):
                row = sym[t]
                for j in range(group):
                    c = c0 + j
                    e = np.uint64(c * S)
                    x0 = np.int64(tab[e + np.uint64(row[c])])
                    x1 = np.int64(tab[e + np.uint64(gs + row[c + group])])
                    x2 = np.int64(tab[e + np.uint64(2 * gs + row[c + 2 * group])])
                    x3 = np.int64(tab[e + np.uint64(3 * gs + row[c + 3 * group])])
                    l0, r0, n0 = _enc_step(l0, r0, n0, a0, buf, x0)
                    l1, r1, n1 = _enc_step(l1, r1, n1, a1, buf, x1)
                    l2, r2, n2 = _enc_step(l2, r2, n2, a2, buf, x2)
                    l3, r3, n3 = _enc_step(l3, r3, n3, a3, buf, x3)
            n0 = _enc_flush(l0, r0, n0, a0, buf) - a0
            n1 = _enc_flush(l1, r1, n1, a1, buf) - a1
            n2 = _enc_flush(l2, r2, n2, a2, buf) - a2
            n3 = _enc_flush(l3, r3, n3, a3, buf) - a3
            lengths_row[g] = n0
            lengths_row[g + 1] = n1
            lengths_row[g + 2] = n2
            lengths_row[g + 3] = n3
            o = _copy_bytes(buf, a0, n0, dest, o)
            o = _copy_bytes(buf, a1, n1, dest, o)
            o = _copy_bytes(buf, a2, n2, dest, o)
            o = _copy_bytes(buf, a3, n3, dest, o)
            g += INTERLEAVE
        else:
            c0 = g * group
            c1 = min(C, c0 + group)
            l0 = np.int64(0)
            r0 = np.int64(RANGE_INIT)
            n0 = 0
            for t in range(Tk):
                row = sym[t]
                for c in range(c0, c1):
                    x0 = np.int64(tab[np.uint64(c * S + row[c])])
                    l0, r0, n0 = _enc_step(l0, r0, n0, 0, buf, x0)
            n0 = _enc_flush(l0, r0, n0, 0, buf)
            lengths_row[g] = n0
            o = _copy_bytes(buf, 0, n0, dest, o)
            g += 1
    return o


@njit(**_FAST)
def _decode_plane_streams(payload, offsets, lengths, first_stream, cum, S1, lut, group, buf, cap, sym):
    """Decode streams first_stream .. of one plane into sym [Tk, C].  cum [C * S1] and
    lut [C * LUT_SIZE]: the channels' CDFs and lookup tables; buf: INTERLEAVE * cap
    bytes of scratch, cap = 2 * Tk * group + 8."""
    Tk, C = sym.shape
    groups = (C + group - 1) // group
    full = C // group
    gs = group * S1
    gl = group * LUT_SIZE
    g = 0
    while g < groups:
        i = first_stream + g
        if g + INTERLEAVE <= full:
            d0, p0 = _dec_load(payload, offsets[i], lengths[i], buf, 0, cap)
            d1, p1 = _dec_load(payload, offsets[i + 1], lengths[i + 1], buf, cap, cap)
            d2, p2 = _dec_load(payload, offsets[i + 2], lengths[i + 2], buf, 2 * cap, cap)
            d3, p3 = _dec_load(payload, offsets[i + 3], lengths[i + 3], buf, 3 * cap, cap)
            r0 = r1 = r2 = r3 = np.int64(RANGE_INIT)
            c0 = g * group
            for t in range(Tk):
                row = sym[t]
                for j in range(group):
                    c = c0 + j
                    cb = c * S1
                    lb = c * LUT_SIZE
                    x, d0, r0, p0 = _dec_step(d0, r0, p0, buf, cum, cb, lut, lb)
                    row[np.uint64(c)] = x
                    x, d1, r1, p1 = _dec_step(d1, r1, p1, buf, cum, cb + gs, lut, lb + gl)
                    row[np.uint64(c + group)] = x
                    x, d2, r2, p2 = _dec_step(d2, r2, p2, buf, cum, cb + 2 * gs, lut, lb + 2 * gl)
                    row[np.uint64(c + 2 * group)] = x
                    x, d3, r3, p3 = _dec_step(d3, r3, p3, buf, cum, cb + 3 * gs, lut, lb + 3 * gl)
                    row[np.uint64(c + 3 * group)] = x
            g += INTERLEAVE
        else:
            d0, p0 = _dec_load(payload, offsets[i], lengths[i], buf, 0, cap)
            r0 = np.int64(RANGE_INIT)
            c0 = g * group
            c1 = min(C, c0 + group)
            for t in range(Tk):
                row = sym[t]
                for c in range(c0, c1):
                    x, d0, r0, p0 = _dec_step(d0, r0, p0, buf, cum, c * S1, lut, c * LUT_SIZE)
                    row[np.uint64(c)] = x
            g += 1


# ------------------------------------------------------------------ fused kernels


@njit(**_FAST)
def _plane_index(job, L):
    return job // (L * 2), (job // 2) % L, job % 2


@njit(parallel=True, **_FAST)
def encode_planes(xbits, shift, t_first, num_tokens, maxq, chunk_tokens, group, scales, codes, lengths, plane_bytes, planes):
    """quantize + histogram + build_cdf + encode_streams, fused per plane (chunk, layer, K/V).

    xbits    uint16 bfloat16 bits (shift 16) or uint32 float32 bits (shift 0), [L, 2, >= t_first + T, C]:
             the slab is its tokens t_first .. t_first + num_tokens
    scales   uint16 [L, 2, T];  codes uint8 [K, L, 2, C, S];  lengths int32 [K, L, 2, groups]
    planes   uint8 [K * L * 2, >= groups * (2 * chunk_tokens * group + 8)]: the streams of
             plane j = (k * L + l) * 2 + kv back to back; plane_bytes[j] of them
    """
    L = xbits.shape[0]
    C = xbits.shape[3]
    K = codes.shape[0]
    S = codes.shape[4]
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(num_tokens, t0 + chunk_tokens)
        m = np.int64(maxq[l, kv])
        alphabet = 2 * m + 1
        sym = np.empty((t1 - t0, C), np.uint8)
        _quantize_plane(xbits[l, kv], shift, t_first + t0, m, sym, scales[l, kv, t0:t1])
        counts = np.zeros(C * S, np.int32)
        _histogram_plane(sym, S, counts)
        tab = np.empty(C * S, np.uint32)
        cum = np.empty(S + 1, np.int32)
        thresholds = np.empty(CODE_LEVELS - 1, np.int64)
        freqs = np.empty(16, np.int64)
        for c in range(C):
            row = codes[k, l, kv, c]
            fast_codes(counts[c * S : (c + 1) * S], alphabet, row, thresholds)
            fast_cum(row, alphabet, cum, freqs)
            for s in range(S):
                tab[c * S + s] = cum[s] | ((cum[s + 1] - cum[s]) << 16)
        cap = 2 * (t1 - t0) * group + 8
        buf = np.empty(INTERLEAVE * cap, np.uint8)
        plane_bytes[job] = _encode_plane_streams(sym, tab, S, group, buf, cap, planes[job], lengths[k, l, kv])


@njit(parallel=True, **_FAST)
def decode_planes(payload, offsets, lengths, codes, maxq, chunk_tokens, group, scales, out, t_first, to_bf16):
    """cum_from_codes + decode_streams + dequantize, fused per plane (chunk, layer, K/V).

    payload/offsets/lengths as for decode_streams; codes uint8 [K, L, 2, C, S];
    scales uint16 [L, 2, T]; out [L, 2, >= t_first + T, C]: float32 values, or uint16
    bfloat16 bits (to_bf16, rounded to nearest even), written at tokens t_first ..
    """
    K, L, _, C, S = codes.shape
    T = scales.shape[2]
    S1 = S + 1
    groups = (C + group - 1) // group
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        m = np.int64(maxq[l, kv])
        alphabet = 2 * m + 1
        cum = np.empty(C * S1, np.int32)
        lut = np.empty(C * LUT_SIZE, np.uint8)
        freqs = np.empty(16, np.int64)
        for c in range(C):
            row = cum[c * S1 : (c + 1) * S1]
            fast_cum(codes[k, l, kv, c], alphabet, row, freqs)
            build_lut(row, alphabet, lut[c * LUT_SIZE : (c + 1) * LUT_SIZE])
        cap = 2 * (t1 - t0) * group + 8
        buf = np.empty(INTERLEAVE * cap, np.uint8)
        sym = np.empty((t1 - t0, C), np.uint8)
        _decode_plane_streams(payload, offsets, lengths, job * groups, cum, S1, lut, group, buf, cap, sym)
        _dequantize_plane(sym, scales[l, kv, t0:t1], m, out[l, kv], t_first + t0, to_bf16)
