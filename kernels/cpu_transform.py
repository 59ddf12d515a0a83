"""CPU kernels (@njit, parallel) of format version 2: the transform and lossless methods
with tables shared by every chunk of a file.

Array conventions (the whole cache at once):
  x        float32 [L, 2, T, C]     values
  rot      float32 [L, 2, C, C]     rotation per (layer, K/V); shape [0, 0, 0, 0] = identity
  offsets  float32 [L, 2, C]        per-coordinate mean (bfloat16 values)
  steps    float64 [L, 2]           quantization step (bfloat16 values)
  q        int16   [L, 2, T, C]     levels (method 2) or top-byte symbols (method 3)
  modes    uint8   [L, 2, C]        0 direct, 1 token delta (transform.MODE_*)
  lo       int64   [L, 2, C]        smallest coded value of each table
  alphabet int64   [L, 2, C]        table sizes (1..256)
  sym      uint8   [L, 2, T, C]     coded symbols: value - lo
  counts   int64   [L, 2, C, S]     symbol counts per table, S >= largest alphabet
  codes    uint8   [L, 2, C, S]     4-bit codes per symbol
  cum      int32   [L, 2, C, S + 1] integer CDF per table
Streams are numbered (chunk, layer, K/V, channel group) row-major, as in version 1;
a stream codes its symbols token by token, channel by channel.  In delta mode a
channel codes q[t] - q[t-1] within a chunk and q itself at the chunk's first token,
so every chunk still decodes on its own.
"""

from . import jit_cache  # noqa: F401  (sets the cache folder before any @njit)

import numpy as np
from numba import njit, prange

from .cdf import codes_to_cum, counts_to_codes
from .coding_params import PROB_BITS
from .cpu import _FAST, INTERLEAVE, _decode_plane_streams, _encode_plane_streams, _plane_index, build_lut
from .range_coder import decode_stream, encode_stream, stream_coords
from .tables import share_plane
from .transform import (STATS_BLOCK, refine_index, rotate_row, symbol_top_byte, token_level, token_value, top_byte_symbol,
                        unrotate_row)

_JIT = dict(cache=True, nogil=True)


def transform_stats(x, rot, sink, sums, sumsq):
    """sums / sumsq [L, 2, C] = sum over tokens >= sink of v and v*v (float64), v = float32(y),
    summed in a fixed tree that a GPU can split across threads: tokens in blocks of
    STATS_BLOCK (by absolute position), each block summed in token order from 0, the block
    sums added in block order (transform_stats_carry over the whole cache).  The square of a
    float32 is exact in float64, so a GPU's fused multiply-add gives the same sums."""
    L, _, T, C = x.shape
    sums[:] = 0.0
    sumsq[:] = 0.0
    transform_stats_carry(x, rot, sink, 0, T, sums, sumsq, np.zeros((L, 2, C)), np.zeros((L, 2, C)))


@njit(parallel=True, **_JIT)
def transform_quantize(x, rot, sink, offsets, steps, qmax, threshold, t0, bits, q):
    """q = (y - offset) / step rounded (transform.step_level) and clamped to +-qmax; tokens
    below ``sink`` get 0; tokens from ``t0`` on, refined with ``bits`` bits, get
    transform.refined_level."""
    L, _, T, C = x.shape
    rotated = rot.shape[0] > 0
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        if t < sink:
            for c in range(C):
                q[l, kv, t, c] = 0
            continue
        step = steps[l, kv]
        refined = t >= t0 and bits > 0
        if rotated:
            y = np.empty(C, np.float64)
            rotate_row(x[l, kv, t], rot[l, kv], y)
            for c in range(C):
                q[l, kv, t, c] = token_level(y[c], offsets[l, kv, c], step, qmax, threshold, refined, bits)
        else:
            for c in range(C):
                q[l, kv, t, c] = token_level(np.float64(x[l, kv, t, c]), offsets[l, kv, c], step, qmax, threshold,
                                             refined, bits)


@njit(parallel=True, **_JIT)
def transform_refine(x, rot, t0, offsets, steps, q, bits, ref):
    """ref [L, 2, T - t0, C] = transform.refine_index of tokens t0.. (their levels q refined
    with ``bits`` bits each)."""
    L, _, T, C = x.shape
    R = T - t0
    rotated = rot.shape[0] > 0
    for row in prange(L * 2 * R):
        l = row // (2 * R)
        kv = (row // R) % 2
        t = t0 + row % R
        step = steps[l, kv]
        if rotated:
            y = np.empty(C, np.float64)
            rotate_row(x[l, kv, t], rot[l, kv], y)
            for c in range(C):
                ref[l, kv, t - t0, c] = refine_index(y[c], offsets[l, kv, c], step, q[l, kv, t, c], bits)
        else:
            for c in range(C):
                ref[l, kv, t - t0, c] = refine_index(np.float64(x[l, kv, t, c]), offsets[l, kv, c], step,
                                                     q[l, kv, t, c], bits)


@njit(parallel=True, **_JIT)
def transform_dequantize(q, rot, sink, offsets, steps, t0, bits, ref, out):
    """out = (q * step + offset) rotated back, float32; tokens below ``sink`` are left alone;
    tokens from ``t0`` on are refined by ``ref`` [L, 2, T - t0, C] (``bits`` bits each)."""
    L, _, T, C = q.shape
    rotated = rot.shape[0] > 0
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        if t < sink:
            continue
        step = steps[l, kv]
        refined = t >= t0 and bits > 0
        r = t - t0 if refined else 0  # ref's row (only read when refined)
        if rotated:
            z = np.empty(C, np.float64)
            for d in range(C):
                j = ref[l, kv, r, d] if refined else 0
                z[d] = np.float64(token_value(q[l, kv, t, d], j, refined, bits, offsets[l, kv, d], step))
            unrotate_row(z, rot[l, kv], out[l, kv, t])
        else:
            for c in range(C):
                j = ref[l, kv, r, c] if refined else 0
                out[l, kv, t, c] = token_value(q[l, kv, t, c], j, refined, bits, offsets[l, kv, c], step)


@njit(parallel=True, **_JIT)
def split_words(words, nraw, q, raw):
    """Lossless split: q = symbol of each word's top byte, raw[..., :nraw] = its low bytes
    (least significant first).  words: uint16 or uint32 [L, 2, T, C]."""
    L, _, T, C = words.shape
    shift = 8 * nraw
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        for c in range(C):
            w = np.int64(words[l, kv, t, c])
            q[l, kv, t, c] = top_byte_symbol(w >> shift)
            for b in range(nraw):
                raw[l, kv, t, c, b] = (w >> (8 * b)) & 0xFF


@njit(parallel=True, **_JIT)
def join_words(q, raw, nraw, words):
    """Inverse of split_words."""
    L, _, T, C = q.shape
    shift = 8 * nraw
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        for c in range(C):
            w = symbol_top_byte(q[l, kv, t, c]) << shift
            for b in range(nraw):
                w |= np.int64(raw[l, kv, t, c, b]) << (8 * b)
            words[l, kv, t, c] = w


@njit(parallel=True, **_JIT)
def level_stats(q, chunk_tokens, stats):
    """Per table [L, 2, C]: stats[..., 0:3] = min, max and sum of |value| of the direct
    values; stats[..., 3:6] the same for the token deltas (a chunk's first token: its value).
    One thread per (layer, K/V) plane, walking it row by row (the memory order) into one
    accumulator per statistic and channel, so that the channel loops vectorize."""
    L, _, T, C = q.shape
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        mn = np.full(C, 1 << 40, np.int64)
        mx = np.full(C, -(1 << 40), np.int64)
        ab = np.zeros(C, np.int64)
        dmn = np.full(C, 1 << 40, np.int64)
        dmx = np.full(C, -(1 << 40), np.int64)
        dab = np.zeros(C, np.int64)
        plane = q[l, kv]
        for t in range(T):
            row = plane[t]
            prev = plane[t - 1] if t % chunk_tokens != 0 else row
            first = t % chunk_tokens == 0
            for c in range(C):
                v = np.int64(row[c])
                d = v - (np.int64(0) if first else np.int64(prev[c]))
                mn[c] = min(mn[c], v)
                mx[c] = max(mx[c], v)
                ab[c] += abs(v)
                dmn[c] = min(dmn[c], d)
                dmx[c] = max(dmx[c], d)
                dab[c] += abs(d)
        st = stats[l, kv]
        for c in range(C):
            st[c, 0] = mn[c]
            st[c, 1] = mx[c]
            st[c, 2] = ab[c]
            st[c, 3] = dmn[c]
            st[c, 4] = dmx[c]
            st[c, 5] = dab[c]


@njit(parallel=True, **_JIT)
def levels_to_symbols(q, modes, lo, chunk_tokens, sym, counts):
    """sym = (value or token delta) - lo per table; counts[..., s] = occurrences of s."""
    L, _, T, C = q.shape
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        cnt = counts[l, kv]
        cnt[:, :] = 0
        plane = q[l, kv]
        out = sym[l, kv]
        md = modes[l, kv]
        base = lo[l, kv]
        for t in range(T):
            first = t % chunk_tokens == 0
            row = plane[t]
            for c in range(C):
                v = np.int64(row[c])
                if md[c] == 1 and not first:
                    v -= np.int64(plane[t - 1, c])
                s_ = v - base[c]
                out[t, c] = s_
                cnt[c, s_] += 1


@njit(parallel=True, **_JIT)
def symbols_to_levels(sym, modes, lo, chunk_tokens, q):
    """Inverse of levels_to_symbols."""
    L, _, T, C = sym.shape
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        plane = q[l, kv]
        src = sym[l, kv]
        md = modes[l, kv]
        base = lo[l, kv]
        for t in range(T):
            first = t % chunk_tokens == 0
            for c in range(C):
                v = np.int64(src[t, c]) + base[c]
                if md[c] == 1 and not first:
                    v += np.int64(plane[t - 1, c])
                plane[t, c] = v


@njit(parallel=True, **_JIT)
def build_tables(counts, alphabet, codes, cum):
    """Encoder side, per table: counts -> 4-bit codes -> CDF."""
    L, _, C, S = counts.shape
    for p in prange(L * 2 * C):
        l = p // (2 * C)
        kv = (p // C) % 2
        c = p % C
        counts_to_codes(counts[l, kv, c], alphabet[l, kv, c], codes[l, kv, c])
        codes_to_cum(codes[l, kv, c], alphabet[l, kv, c], cum[l, kv, c])


@njit(parallel=True, **_JIT)
def share_tables(counts, lo, alphabet, modes, cum, cost, shared, ref):
    """Encoder side, per (layer, K/V) plane in channel order (tables.share_plane): shared[c] =
    True when channel c codes more cheaply with the table of ref[c], the last channel before
    it that kept its own table.  ``cost``: tables.SYMBOL_COST."""
    L = counts.shape[0]
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        share_plane(counts[l, kv], lo[l, kv], alphabet[l, kv], modes[l, kv], cum[l, kv], cost, shared[l, kv],
                    ref[l, kv])


@njit(parallel=True, **_JIT)
def cum_from_table_codes(codes, alphabet, cum):
    """Decoder side: 4-bit codes -> the CDF build_tables made."""
    L, _, C, S = codes.shape
    for p in prange(L * 2 * C):
        l = p // (2 * C)
        kv = (p // C) % 2
        c = p % C
        codes_to_cum(codes[l, kv, c], alphabet[l, kv, c], cum[l, kv, c])


@njit(parallel=True, **_JIT)
def encode_table_streams(sym, cum, chunk_tokens, group, slots, lengths):
    """Range-code every stream of the cache into its slot; lengths[s] = bytes used."""
    L, _, T, C = sym.shape
    K = (T + chunk_tokens - 1) // chunk_tokens
    groups = (C + group - 1) // group
    for s in prange(K * L * 2 * groups):
        k, l, kv, t0, t1, c0, c1 = stream_coords(s, groups, L, group, chunk_tokens, T, C)
        lengths[s] = encode_stream(sym[l, kv], t0, t1, c0, c1, cum[l, kv], c0, 1, slots[s])


@njit(parallel=True, **_JIT)
def decode_table_streams(payload, offsets, lengths, cum, width, chunk_tokens, group, sym):
    """Inverse of encode_table_streams; ``width``: the largest alphabet (cum rows are
    PROB_TOTAL past a table's own alphabet, so no symbol outside it is ever decoded)."""
    L, _, T, C = sym.shape
    K = (T + chunk_tokens - 1) // chunk_tokens
    groups = (C + group - 1) // group
    for s in prange(K * L * 2 * groups):
        k, l, kv, t0, t1, c0, c1 = stream_coords(s, groups, L, group, chunk_tokens, T, C)
        decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, cum[l, kv], c0, 1, width, sym[l, kv])


# =====================================================================================
# Fast paths: the range coder of kernels/cpu.py (four streams in lock step, table lookups,
# LUT decoding) over a file's shared tables.  Same bytes and symbols as
# encode_table_streams / decode_table_streams above (tests/test_transform.py checks it).
# =====================================================================================


@njit(parallel=True, **_JIT)
def coder_tables(cum, alphabet, tab, lut):
    """Per table: tab[..., s] = cum[s] | freq[s] << 16 for the encoder, and the decoder's
    lookup table (cpu.build_lut)."""
    L, _, C, W1 = cum.shape
    W = W1 - 1
    for p in prange(L * 2 * C):
        l = p // (2 * C)
        kv = (p // C) % 2
        c = p % C
        row = cum[l, kv, c]
        for s_ in range(W):
            tab[l, kv, c, s_] = np.uint32(row[s_]) | (np.uint32(row[s_ + 1] - row[s_]) << 16)
        build_lut(row, alphabet[l, kv, c], lut[l, kv, c])


@njit(parallel=True, **_FAST)
def encode_table_planes(sym, tab, chunk_tokens, group, lengths, plane_bytes, planes):
    """Range-code every stream: one job per plane (chunk, layer, K/V), its streams back to
    back in planes[job]; lengths [K, L, 2, groups]; tab uint32 [L, 2, C * W]."""
    L, _, T, C = sym.shape
    K = lengths.shape[0]
    W = tab.shape[2] // C
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        cap = 2 * (t1 - t0) * group + 8
        buf = np.empty(INTERLEAVE * cap, np.uint8)
        plane_bytes[job] = _encode_plane_streams(sym[l, kv, t0:t1], tab[l, kv], W, group, buf, cap, planes[job],
                                                 lengths[k, l, kv])


@njit(parallel=True, **_FAST)
def decode_table_planes(payload, offsets, lengths, cum, lut, chunk_tokens, group, sym):
    """Inverse of encode_table_planes: stream s is payload[offsets[s]:offsets[s] + lengths[s]];
    cum int32 [L, 2, C * W1], lut uint8 [L, 2, C * LUT_SIZE]."""
    L, _, T, C = sym.shape
    K = (T + chunk_tokens - 1) // chunk_tokens
    W1 = cum.shape[2] // C
    groups = (C + group - 1) // group
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        cap = 2 * (t1 - t0) * group + 8
        buf = np.empty(INTERLEAVE * cap, np.uint8)
        _decode_plane_streams(payload, offsets, lengths, job * groups, cum[l, kv], W1, lut[l, kv], group, buf, cap,
                              sym[l, kv, t0:t1])


@njit(**_JIT)
def walk_tables(buf, start, count, per_plane, starts, heads):
    """Walk the table entries of a Params block: starts[i] = where entry i's codes begin,
    heads[i] = its first byte (2 = "same table").  Returns the end offset, or -1 - i when
    entry i does not fit in buf, or -(1 << 40) when a plane's first entry is "same table"."""
    n = buf.shape[0]
    o = start
    for i in range(count):
        if o >= n:
            return -1 - i
        b = buf[o]
        heads[i] = b
        if b == 2:
            if i % per_plane == 0:
                return -(1 << 40)
            starts[i] = o
            o += 1
            continue
        if o + 3 > n:
            return -1 - i
        starts[i] = o + 3
        o += 3 + (np.int64(buf[o + 2]) + 2) // 2
    if o > n:
        return -1 - count
    return o


# =====================================================================================
# Slab-by-slab kernels: the same results as the whole-cache kernels above, for a cache
# read (or written) a run of whole chunks at a time, so that encoding or decoding a file
# never holds more than one slab's temporaries (cachegen_cli/transform_codec.py).
# =====================================================================================


@njit(parallel=True, **_JIT)
def transform_stats_carry(x, rot, sink, t_first, num_tokens, s1, s2, b1, b2):
    """transform_stats over x = tokens t_first .. of a cache of num_tokens tokens, carrying
    the sums between calls: s1 / s2 [L, 2, C] the closed blocks' sums, b1 / b2 the open
    block's (all zero before the first slab).  The same additions in the same order as
    transform_stats, so after the last slab s1 and s2 are bit for bit its sums and sumsq."""
    L, _, Tx, C = x.shape
    rotated = rot.shape[0] > 0
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        y = np.empty(C, np.float64)
        a1 = s1[l, kv]
        a2 = s2[l, kv]
        o1 = b1[l, kv]
        o2 = b2[l, kv]
        for i in range(Tx):
            t = t_first + i
            if t < sink:
                continue
            if rotated:
                rotate_row(x[l, kv, i], rot[l, kv], y)
            else:
                for c in range(C):
                    y[c] = np.float64(x[l, kv, i, c])
            for c in range(C):
                v = np.float64(np.float32(y[c]))
                o1[c] += v
                o2[c] += v * v
            if (t + 1) % STATS_BLOCK == 0 or t == num_tokens - 1:
                for c in range(C):
                    a1[c] += o1[c]
                    a2[c] += o2[c]
                    o1[c] = 0.0
                    o2[c] = 0.0


@njit(parallel=True, **_JIT)
def count_symbols(q, modes, lo, chunk_tokens, counts):
    """counts[..., s] += occurrences of symbol s as levels_to_symbols codes q (whose first
    token starts a chunk), without writing the symbols: a slab's share of a file's counts."""
    L, _, T, C = q.shape
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        cnt = counts[l, kv]
        plane = q[l, kv]
        md = modes[l, kv]
        base = lo[l, kv]
        for t in range(T):
            first = t % chunk_tokens == 0
            row = plane[t]
            for c in range(C):
                v = np.int64(row[c])
                if md[c] == 1 and not first:
                    v -= np.int64(plane[t - 1, c])
                cnt[c, v - base[c]] += 1


@njit(parallel=True, **_JIT)
def merge_level_stats(total, part):
    """total = the level_stats of two runs of tokens together (min, max, sums of |value|)."""
    L, _, C, _ = total.shape
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        for c in range(C):
            a = total[l, kv, c]
            b = part[l, kv, c]
            a[0] = min(a[0], b[0])
            a[1] = max(a[1], b[1])
            a[2] += b[2]
            a[3] = min(a[3], b[3])
            a[4] = max(a[4], b[4])
            a[5] += b[5]


@njit(parallel=True, **_JIT)
def lossless_stats(words, nraw, stats):
    """level_stats' direct fields (min, max, sum of |value|) of the lossless symbols of words
    (split_words' q), computed from the words; the token-delta fields get the same values
    (lossless tables are always direct, transform_codec.tables_from_stats ignores them)."""
    L, _, T, C = words.shape
    shift = 8 * nraw
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        mn = np.full(C, 1 << 40, np.int64)
        mx = np.full(C, -(1 << 40), np.int64)
        ab = np.zeros(C, np.int64)
        plane = words[l, kv]
        for t in range(T):
            row = plane[t]
            for c in range(C):
                v = top_byte_symbol(np.int64(row[c]) >> shift)
                mn[c] = min(mn[c], v)
                mx[c] = max(mx[c], v)
                ab[c] += v
        st = stats[l, kv]
        for c in range(C):
            st[c, 0] = st[c, 3] = mn[c]
            st[c, 1] = st[c, 4] = mx[c]
            st[c, 2] = st[c, 5] = ab[c]


@njit(parallel=True, **_JIT)
def lossless_counts(words, nraw, lo, counts):
    """counts[..., s] += occurrences of symbol s = split_words' q - lo (direct tables), from the words."""
    L, _, T, C = words.shape
    shift = 8 * nraw
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        cnt = counts[l, kv]
        base = lo[l, kv]
        plane = words[l, kv]
        for t in range(T):
            row = plane[t]
            for c in range(C):
                cnt[c, top_byte_symbol(np.int64(row[c]) >> shift) - base[c]] += 1


@njit(parallel=True, **_JIT)
def lossless_symbols(words, nraw, chunk_tokens, lo, sym, raw):
    """split_words then levels_to_symbols (direct tables) in one pass: sym = q - lo, and the
    low bytes in chunk order: raw (flat uint8) holds chunk k's [L, 2, Tk, C, nraw] block (the
    chunk's Raw section, docs/format.md) from k x L x 2 x chunk_tokens x C x nraw on, so each
    chunk's section is a slice of it, not a copy."""
    L, _, T, C = words.shape
    shift = 8 * nraw
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        k = t // chunk_tokens
        tk = min(chunk_tokens, T - k * chunk_tokens)
        o = (k * L * 2 * chunk_tokens + (l * 2 + kv) * tk + t - k * chunk_tokens) * C * nraw
        src = words[l, kv, t]
        out = sym[l, kv, t]
        base = lo[l, kv]
        dst = raw[o : o + C * nraw]
        if nraw == 1:
            for c in range(C):
                w = np.int64(src[c])
                out[c] = top_byte_symbol(w >> shift) - base[c]
                dst[c] = w & 0xFF
        else:
            for c in range(C):
                w = np.int64(src[c])
                out[c] = top_byte_symbol(w >> shift) - base[c]
                for b in range(nraw):
                    dst[c * nraw + b] = (w >> (8 * b)) & 0xFF


@njit(parallel=True, **_JIT)
def join_words_chunked(q, raw, nraw, chunk_tokens, words, t_out):
    """Inverse of lossless_symbols' split (q: the symbols plus lo), into words[:, :, t_out + t]
    (uint16 or uint32); raw: the low bytes in chunk order (the chunks' Raw sections back to back)."""
    L, _, T, C = q.shape
    shift = 8 * nraw
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        k = t // chunk_tokens
        tk = min(chunk_tokens, T - k * chunk_tokens)
        o = (k * L * 2 * chunk_tokens + (l * 2 + kv) * tk + t - k * chunk_tokens) * C * nraw
        dst = words[l, kv, t_out + t]
        src = q[l, kv, t]
        low = raw[o : o + C * nraw]
        if nraw == 1:
            for c in range(C):
                dst[c] = (symbol_top_byte(src[c]) << shift) | np.int64(low[c])
        else:
            for c in range(C):
                w = symbol_top_byte(src[c]) << shift
                for b in range(nraw):
                    w |= np.int64(low[c * nraw + b]) << (8 * b)
                dst[c] = w


@njit(parallel=True, **_JIT)
def transform_dequantize_words(q, rot, sink, offsets, steps, t0, bits, ref, out, t_out, to_bf16):
    """transform_dequantize into out[:, :, t_out + t]: float32, or (to_bf16) uint16 bfloat16
    words rounded to nearest even, as torch converts float32 (the values are finite).  Tokens
    below ``sink`` are left alone."""
    L, _, T, C = q.shape
    rotated = rot.shape[0] > 0
    for row in prange(L * 2 * T):
        l = row // (2 * T)
        kv = (row // T) % 2
        t = row % T
        if t < sink:
            continue
        step = steps[l, kv]
        refined = t >= t0 and bits > 0
        r = t - t0 if refined else 0
        zf = np.empty(C, np.float32)
        if rotated:
            z = np.empty(C, np.float64)
            for d in range(C):
                j = ref[l, kv, r, d] if refined else 0
                z[d] = np.float64(token_value(q[l, kv, t, d], j, refined, bits, offsets[l, kv, d], step))
            unrotate_row(z, rot[l, kv], zf)
        else:
            for c in range(C):
                j = ref[l, kv, r, c] if refined else 0
                zf[c] = token_value(q[l, kv, t, c], j, refined, bits, offsets[l, kv, c], step)
        dst = out[l, kv, t_out + t]
        if to_bf16:
            zu = zf.view(np.uint32)
            for c in range(C):
                u = zu[c]
                dst[c] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        else:
            for c in range(C):
                dst[c] = zf[c]


@njit(parallel=True, **_JIT)
def pack_bits(values, bits, out):
    """out[j] = bits 8j .. 8j+7 of the values' low ``bits`` bits laid end to end, least
    significant first (params.pack_refinement's bytes, padding bits zero)."""
    n = values.shape[0] * bits
    for j in prange(out.shape[0]):
        acc = 0
        for k in range(8):
            bit = 8 * j + k
            if bit >= n:
                break
            acc |= ((np.int64(values[bit // bits]) >> (bit % bits)) & 1) << k
        out[j] = acc


@njit(parallel=True, **_JIT)
def unpack_bits(raw, bits, out):
    """Inverse of pack_bits: out[i] = the i-th ``bits``-bit index of raw."""
    for i in prange(out.shape[0]):
        v = 0
        for b in range(bits):
            bit = i * bits + b
            v |= ((np.int64(raw[bit >> 3]) >> (bit & 7)) & 1) << b
        out[i] = v


@njit(parallel=True, **_JIT)
def take_channels(a, idx, out):
    """out[l, kv, c, :] = a[l, kv, idx[l, kv, c], :] (transform_codec.expand_shared)."""
    L, _, C, W = a.shape
    for p in prange(L * 2 * C):
        l = p // (2 * C)
        kv = (p // C) % 2
        c = p % C
        src = a[l, kv, idx[l, kv, c]]
        dst = out[l, kv, c]
        for w in range(W):
            dst[w] = src[w]
