"""CPU kernels (@njit, parallel) of format version 2: the transform and lossless methods
with tables shared by every chunk of a file.

Array conventions (the whole cache at once):
  x        float32 [L, 2, T, C]     values
  rot      float32 [L, 2, H, D, D]  rotation per (layer, K/V): its H diagonal blocks (C = H x D);
                                    shape [0, 0, 0, 0, 0] = identity
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
from numba import njit, prange, types
from numba.extending import overload, register_jitable

from . import allocation
from .cdf import codes_to_cum, counts_to_codes
from .coding_params import PROB_BITS
from .cpu import _FAST, INTERLEAVE, _decode_plane_streams, _encode_plane_streams, _plane_index, build_lut
from .range_coder import decode_stream, encode_stream, stream_coords
from .tables import STAT_EMPTY, share_plane
from .transform import (STATS_BLOCK, pairwise_sum, refine_index, rotate_row, symbol_top_byte, token_level,
                        token_value, top_byte_symbol, unrotate_row)

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


@njit(**_JIT)
def walk_tables(buf, start, count, per_plane, starts, heads, source):
    """Walk the table entries of a Params block: starts[i] = where entry i's codes begin,
    heads[i] = its first byte (2 = "same table"), source[i] = the entry whose table entry i
    uses (i, or the nearest preceding entry with its own table).  Returns the end offset, or
    -1 - i when entry i does not fit in buf, or -(1 << 40) when a plane's first entry is
    "same table"."""
    n = buf.shape[0]
    o = start
    own = 0
    for i in range(count):
        if o >= n:
            return -1 - i
        b = buf[o]
        heads[i] = b
        if b == 2:
            if i % per_plane == 0:
                return -(1 << 40)
            starts[i] = o
            source[i] = own
            o += 1
            continue
        if o + 3 > n:
            return -1 - i
        starts[i] = o + 3
        own = i
        source[i] = i
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


@njit(parallel=True, **_FAST)
def lossless_stats(words, nraw, stats):
    """level_stats' direct fields (min, max, sum of |value|) of the lossless symbols of words
    (split_words' q), computed from the words; the token-delta fields get the same values
    (lossless tables are always direct, transform_codec.tables_from_stats ignores them).
    int32 minima and maxima so that the channel loop vectorizes."""
    L, _, T, C = words.shape
    shift = 8 * nraw
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        mn = np.full(C, 255, np.int32)
        mx = np.zeros(C, np.int32)
        ab = np.zeros(C, np.int64)
        plane = words[l, kv]
        for t in range(T):
            row = plane[t]
            for c in range(C):
                v = np.int32(top_byte_symbol(np.int64(row[c]) >> shift))
                mn[c] = min(mn[c], v)
                mx[c] = max(mx[c], v)
                ab[c] += v
        st = stats[l, kv]
        for c in range(C):
            st[c, 0] = st[c, 3] = mn[c] if T > 0 else STAT_EMPTY
            st[c, 1] = st[c, 4] = mx[c] if T > 0 else -STAT_EMPTY
            st[c, 2] = st[c, 5] = ab[c]


@njit(parallel=True, **_FAST)
def lossless_counts(words, nraw, lo, counts):
    """counts[..., s] += occurrences of symbol s = split_words' q - lo (direct tables), from the words."""
    L, _, T, C = words.shape
    W = counts.shape[3]
    shift = 8 * nraw
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        base = lo[l, kv].astype(np.int32)
        plane = words[l, kv]
        s = np.empty(C, np.int32)
        cnt = np.zeros(C * W, np.int32)
        for t in range(T):
            row = plane[t]
            for c in range(C):
                s[c] = np.int32(top_byte_symbol(np.int64(row[c]) >> shift)) - base[c]
            _count_row(s, W, cnt)
        out = counts[l, kv]
        for c in range(C):
            for j in range(W):
                out[c, j] += cnt[c * W + j]


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


# =====================================================================================
# CPU-only fast paths of the codec (transform_codec's _SlabEncoder and V2SlabDecoder).
#
# The kernels above run the shared device functions stage by stage over the whole cache,
# as the CUDA kernels do; the ones below give the same levels, refinement indices, level
# statistics, counts, stream bytes and values (tests/test_cpu_fastpaths.py checks them
# against the kernels above) but are written for a CPU core:
#
# * one pass per statistic the format needs, each doing all it can while a row is in L1:
#   quantize + refinement + level statistics in one pass; symbols are never stored (the
#   count pass and each coding job derive a chunk's symbols from the levels again, which
#   costs less than writing and re-reading them, and a channel that shares a table just
#   codes with the shared table's lo);
# * the source is read as its bits (bfloat16 or float32), no float32 copy;
# * the per-value arithmetic is branch-free so that the channel loops vectorize: the
#   quotient (y - m) / step is still one correctly rounded float64 division (vectorized
#   division is cheap), clamped to +-256 before the integer conversion, which changes no
#   level (everything past +-128 clamps to +-qmax) and lets it run on 32-bit lanes;
# * a rotation is applied ROT_ROWS rows at a time, so that each row of R is read once per
#   block instead of once per token, vectorized over the output coordinate d with the
#   accumulation order of every output (c = 0 .. C-1) unchanged.
# =====================================================================================

#: Rows rotated together (each read of a row of R serves this many tokens; measured best of
#: 4 .. 64 on a Zen 3 core with C = 1024).
ROT_ROWS = 16
#: Output coordinates a rotation block accumulates at a time (ROT_ROWS x ROT_TILE float64 in L1).
ROT_TILE = 1024


def _as_value(v, shift):
    """A source element as float64: a float as is; float32 bits (shift 0) or bfloat16 bits (shift 16)."""


@overload(_as_value, jit_options=dict(nogil=True))
def _as_value_impl(v, shift):
    if isinstance(v, types.Float):
        return lambda v, shift: np.float64(v)
    return lambda v, shift: np.float64(np.uint32(np.uint32(v) << np.uint32(shift)).view(np.float32))


@njit(**_FAST)
def _fill_rows(src, shift, rot_plane, i0, n, y, r64):
    """y[:n] = rows i0 .. i0 + n of one (layer, K/V) plane as float64 values, rotated by
    rot_plane ([H, D, D] diagonal blocks) when it is not empty (transform.rotate_row,
    ROT_ROWS rows per read of R).  src: the plane's source bits (or floats, or already
    rotated float64 rows); r64: float64 scratch of C (one row of a block widened once for
    the whole row block)."""
    C = y.shape[1]
    if rot_plane.shape[0] == 0:
        for b in range(n):
            row = src[i0 + b]
            out = y[b]
            for c in range(C):
                out[c] = _as_value(row[c], shift)
        return
    H = rot_plane.shape[0]
    D = rot_plane.shape[1]
    for b in range(n):
        y[b, :] = 0.0
    # Output coordinates in tiles of ROT_TILE, so that the block's accumulators stay in L1 while
    # every row of R passes (each output still sums over c in order).
    # (Loops from 0 over slices: a loop from d0 keeps numba's negative-index checks, which stop
    # LLVM from vectorizing it.)
    for h in range(H):
        base = h * D
        for d0 in range(0, D, ROT_TILE):
            w = min(D, d0 + ROT_TILE) - d0
            rt = r64[:w]
            for c in range(D):
                rrow = rot_plane[h, c, d0 : d0 + w]
                for d in range(w):
                    rt[d] = np.float64(rrow[d])
                for b in range(n):
                    # float64(float32(x)): exact, as rotate_row; a zero adds nothing (y is never -0.0).
                    xc = np.float64(np.float32(_as_value(src[i0 + b, base + c], shift)))
                    if xc != 0.0:
                        out = y[b, base + d0 : base + d0 + w]
                        for d in range(w):
                            out[d] += xc * rt[d]


@njit(parallel=True, **_FAST)
def rotate_rows(src, shift, rot, y):
    """y [L, 2, T, C] float64 = the rotated rows of src (transform.rotate_row), for the passes
    that would each rotate them again."""
    L, _, T, C = y.shape
    nb = (T + ROT_ROWS - 1) // ROT_ROWS
    for job in prange(L * 2 * nb):
        p = job // nb
        l = p // 2
        kv = p % 2
        t = (job % nb) * ROT_ROWS
        n = min(ROT_ROWS, T - t)
        _fill_rows(src[l, kv], shift, rot[l, kv], t, n, y[l, kv, t : t + n], np.empty(C, np.float64))


@njit(parallel=True, **_FAST)
def transform_stats_carry(src, rot, sink, t_first, num_tokens, s1, s2, b1, b2, shift=0):
    """transform_stats over src = tokens t_first .. of a cache of num_tokens tokens, carrying
    the sums between calls: s1 / s2 [L, 2, C] the closed blocks' sums, b1 / b2 the open
    block's (all zero before the first slab).  The same additions in the same order as
    transform_stats, so after the last slab s1 and s2 are bit for bit its sums and sumsq.
    src: float32 values, their bits (``shift`` as for _fill_rows), or rotated float64 rows
    with an empty rot; src [L, 1, T, C]: the key planes alone (the values' sums untouched)."""
    L, P, Tx, C = src.shape
    for p in prange(L * P):
        l = p // P
        kv = p % P
        y = np.empty((ROT_ROWS, C), np.float64)
        r64 = np.empty(C, np.float64)
        a1 = s1[l, kv]
        a2 = s2[l, kv]
        o1 = b1[l, kv]
        o2 = b2[l, kv]
        i0 = min(max(sink - t_first, 0), Tx)  # tokens below the sink are not counted
        while i0 < Tx:
            n = min(ROT_ROWS, Tx - i0)
            _fill_rows(src[l, kv], shift, rot[l, kv], i0, n, y, r64)
            for b in range(n):
                t = t_first + i0 + b
                yb = y[b]
                for c in range(C):
                    v = np.float64(np.float32(yb[c]))
                    o1[c] += v
                    o2[c] += v * v
                if (t + 1) % STATS_BLOCK == 0 or t == num_tokens - 1:
                    for c in range(C):
                        a1[c] += o1[c]
                        a2[c] += o2[c]
                        o1[c] = 0.0
                        o2[c] = 0.0
            i0 += n


@njit(**_FAST)
def _level_row(y, offsets, step, qmax, threshold, q):
    """q[c] = transform.step_level(y[c], ...), branch-free: |v| is clamped to 256 first (any
    |v| >= 128 gives +-qmax either way), so the truncation runs on int32."""
    for c in range(y.shape[0]):
        v = min(max((y[c] - np.float64(offsets[c])) / step, -256.0), 256.0)
        i = np.int32(v)
        f = v - np.float64(i)  # exact
        i += np.int32(f >= threshold) - np.int32(f <= -threshold)
        q[c] = min(max(i, -qmax), qmax)


@njit(**_FAST)
def _refined_row(y, offsets, step, qmax, bits, q, ref):
    """q[c] = transform.refined_level and ref[c] = transform.refine_index of y[c], branch-free
    (both floors taken on clamped values whose result does not change)."""
    n = np.int32(1) << bits
    nf = np.float64(n)
    half = 0.5 - 0.5 / nf
    for c in range(y.shape[0]):
        v = (y[c] - np.float64(offsets[c])) / step
        w = min(max(v, -256.0), 256.0) + half
        i = np.int32(w)
        i -= np.int32(np.float64(i) > w)  # floor
        i = min(max(i, -qmax), qmax)
        q[c] = i
        r = min(max((v - np.float64(i)) * nf + 0.5, -2.0 * nf), 2.0 * nf)
        k = np.int32(r)
        k -= np.int32(np.float64(k) > r)
        ref[c] = min(max(k + (n >> 1) - 1, 0), n - 1)


@njit(parallel=True, **_FAST)
def quantize_stats(src, shift, rot, sink, offsets, steps, qmax, threshold, t_ref, bits, chunk_tokens, q, ref, stats):
    """transform_quantize + transform_refine + level_stats in one pass over a slab (whose first
    token starts a chunk): q [L, 2, T, C] int16, ref [L, 2, T - t_ref, C] (tokens t_ref .. ,
    when bits > 0), and stats [P, L, 2, C, 6] the level statistics of P parts of each plane
    (runs of whole chunks; the caller reduces them: min, max, sums).  src / shift / rot as for
    transform_stats_carry; offsets float32 [L, 2, C]."""
    L, _, T, C = q.shape
    P = stats.shape[0]
    K = (T + chunk_tokens - 1) // chunk_tokens
    qm = np.int32(qmax)
    for job in prange(L * 2 * P):
        part = job % P
        l = (job // P) // 2
        kv = (job // P) % 2
        ta = min(T, (part * K // P) * chunk_tokens)
        tb = min(T, ((part + 1) * K // P) * chunk_tokens)
        y = np.empty((ROT_ROWS, C), np.float64)
        r64 = np.empty(C, np.float64)
        zero = np.zeros(C, np.int16)
        mn = np.full(C, qm, np.int32)
        mx = np.full(C, -qm, np.int32)
        dmn = np.full(C, 2 * qm, np.int32)
        dmx = np.full(C, -2 * qm, np.int32)
        ab = np.zeros(C, np.int32)
        dab = np.zeros(C, np.int32)
        st = stats[part, l, kv]
        for c in range(C):
            st[c, 0] = st[c, 3] = STAT_EMPTY
            st[c, 1] = st[c, 4] = -STAT_EMPTY
            st[c, 2] = st[c, 5] = 0
        off = offsets[l, kv]
        step = steps[l, kv]
        plane = q[l, kv]
        i0 = ta
        while i0 < tb:
            n = min(ROT_ROWS, tb - i0)
            if i0 + n > sink:
                _fill_rows(src[l, kv], shift, rot[l, kv], i0, n, y, r64)
            for b in range(n):
                t = i0 + b
                qrow = plane[t]
                if t < sink:
                    qrow[:] = 0
                elif bits > 0 and t >= t_ref:
                    _refined_row(y[b], off, step, qm, bits, qrow, ref[l, kv, t - t_ref])
                else:
                    _level_row(y[b], off, step, qm, threshold, qrow)
                prev = zero if t % chunk_tokens == 0 else plane[t - 1]
                for c in range(C):
                    v = np.int32(qrow[c])
                    d = v - np.int32(prev[c])
                    mn[c] = min(mn[c], v)
                    mx[c] = max(mx[c], v)
                    ab[c] += abs(v)
                    dmn[c] = min(dmn[c], d)
                    dmx[c] = max(dmx[c], d)
                    dab[c] += abs(d)
                if (t + 1) % chunk_tokens == 0 or t == tb - 1:
                    # int32 sums stay far from overflow within a chunk; the totals are int64.
                    for c in range(C):
                        st[c, 0] = mn[c]
                        st[c, 1] = mx[c]
                        st[c, 2] += ab[c]
                        st[c, 3] = dmn[c]
                        st[c, 4] = dmx[c]
                        st[c, 5] += dab[c]
                        ab[c] = 0
                        dab[c] = 0
            i0 += n


@njit(**_FAST)
def _symbol_row(row, prev, delta, base, out):
    """out[c] = a level row's coded symbols (levels_to_symbols): row - prev for delta channels
    (delta[c] = 1; prev = zeros at a chunk's first token), minus the table's lo."""
    for c in range(row.shape[0]):
        out[c] = np.int32(row[c]) - delta[c] * np.int32(prev[c]) - base[c]


@njit(parallel=True, **_FAST)
def count_symbols(q, modes, lo, chunk_tokens, counts):
    """counts[..., s] += occurrences of symbol s as levels_to_symbols codes q
    (whose first token starts a chunk), without storing the symbols."""
    L, _, T, C = q.shape
    W = counts.shape[3]
    for p in prange(L * 2):
        l = p // 2
        kv = p % 2
        plane = q[l, kv]
        delta = (modes[l, kv] == 1).astype(np.int32)
        base = lo[l, kv].astype(np.int32)
        zero = np.zeros(C, np.int16)
        s = np.empty(C, np.int32)
        cnt = np.zeros(C * W, np.int32)
        for t in range(T):
            _symbol_row(plane[t], zero if t % chunk_tokens == 0 else plane[t - 1], delta, base, s)
            _count_row(s, W, cnt)
        out = counts[l, kv]
        for c in range(C):
            for j in range(W):
                out[c, j] += cnt[c * W + j]


@njit(**_FAST)
def _count_row(s, W, cnt):
    """cnt[c * W + s[c]] += 1, four independent updates at a time (no store waits on the last)."""
    C = s.shape[0]
    c = 0
    while c + 4 <= C:
        i0 = np.uint64(c * W + s[c])
        i1 = np.uint64((c + 1) * W + s[c + 1])
        i2 = np.uint64((c + 2) * W + s[c + 2])
        i3 = np.uint64((c + 3) * W + s[c + 3])
        cnt[i0] += 1
        cnt[i1] += 1
        cnt[i2] += 1
        cnt[i3] += 1
        c += 4
    while c < C:
        cnt[np.uint64(c * W + s[c])] += 1
        c += 1


@njit(parallel=True, **_FAST)
def encode_level_planes(q, modes, lo, tab, chunk_tokens, group, lengths, plane_bytes, planes):
    """levels_to_symbols + encode_table_streams, one job per plane (chunk, layer, K/V): the
    chunk's symbols made in a scratch plane, then range-coded (cpu's lock-step coder) back to
    back into planes[job]; lengths [K, L, 2, groups]; tab uint32 [L, 2, C * W]
    (coder_tables' entries of the tables the channels code with)."""
    L, _, T, C = q.shape
    K = lengths.shape[0]
    W = tab.shape[2] // C
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        delta = (modes[l, kv] == 1).astype(np.int32)
        base = lo[l, kv].astype(np.int32)
        zero = np.zeros(C, np.int16)
        s = np.empty(C, np.int32)
        sym = np.empty((t1 - t0, C), np.uint8)
        plane = q[l, kv]
        for t in range(t0, t1):
            _symbol_row(plane[t], zero if t == t0 else plane[t - 1], delta, base, s)
            out = sym[t - t0]
            for c in range(C):
                out[c] = s[c]
        cap = 2 * (t1 - t0) * group + 8
        buf = np.empty(INTERLEAVE * cap, np.uint8)
        plane_bytes[job] = _encode_plane_streams(sym, tab[l, kv], W, group, buf, cap, planes[job], lengths[k, l, kv])


@njit(**_FAST)
def _row_levels(sym_row, prev, delta, base, lv):
    """lv[c] = symbols_to_levels of one row: symbol + lo, plus the previous row's level for delta
    channels (prev = zeros at a chunk's first token).  lv may be prev itself."""
    for c in range(sym_row.shape[0]):
        lv[c] = np.int32(sym_row[c]) + base[c] + delta[c] * prev[c]


@njit(**_FAST)
def _row_range(lv, bounds):
    """bounds[0] = min(bounds[0], min lv), bounds[1] = max(bounds[1], max lv)."""
    mn, mx = bounds[0], bounds[1]
    for c in range(lv.shape[0]):
        mn = min(mn, lv[c])
        mx = max(mx, lv[c])
    bounds[0], bounds[1] = mn, mx


@njit(**_FAST)
def _decode_plane_symbols(payload, offsets, lengths, job, cum, lut, group, Tk, C):
    """The symbols [Tk, C] of plane ``job`` (chunk, layer, K/V) of a slab, cpu's lock-step decoder."""
    groups = (C + group - 1) // group
    cap = 2 * Tk * group + 8
    buf = np.empty(INTERLEAVE * cap, np.uint8)
    sym = np.empty((Tk, C), np.uint8)
    _decode_plane_streams(payload, offsets, lengths, job * groups, cum, cum.shape[0] // C, lut, group, buf, cap, sym)
    return sym


@njit(**_FAST)
def _store_row(zf, dst, to_bf16):
    """dst = zf as float32, or (to_bf16) as bfloat16 words rounded to nearest even (torch's conversion)."""
    if to_bf16:
        zu = zf.view(np.uint32)
        for c in range(zf.shape[0]):
            u = zu[c]
            dst[c] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    else:
        for c in range(zf.shape[0]):
            dst[c] = zf[c]


@njit(parallel=True, **_FAST)
def decode_transform_planes(payload, offsets, lengths, cum, lut, chunk_tokens, group, num_tokens, modes, lo, seen,
                            rot_t, sink, voffsets, steps, t_ref, bits, ref, out, t_out, to_bf16):
    """decode_table_streams + symbols_to_levels + transform_dequantize, one job per plane
    (chunk, layer, K/V) of a slab of num_tokens tokens, the plane's symbols and levels kept in
    scratch: out[:, :, t_out + t] (float32, or bfloat16 words with to_bf16, rounded to nearest
    even as torch converts float32) for the tokens t >= sink.  cum / lut: [L, 2, C * ...] as coder_tables makes them; rot_t: the rotation's
    blocks transposed ([L, 2, H, D, D]: rot_t[h, d, c] = R_h[c, d]) or empty, so that the inverse rotation
    runs as _fill_rows (out[c] = sum over d in order of z[d] R[c, d]); t_ref, bits, ref: as for
    transform_dequantize.  seen int32 [K * L * 2, 2]: each plane's smallest and largest level
    (the caller rejects levels that token deltas summed past the method's range)."""
    L, _, _, C = out.shape
    K = (num_tokens + chunk_tokens - 1) // chunk_tokens
    rotated = rot_t.shape[0] > 0
    n = np.int32(1) << bits
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(num_tokens, t0 + chunk_tokens)
        sym = _decode_plane_symbols(payload, offsets, lengths, job, cum[l, kv], lut[l, kv], group, t1 - t0, C)
        delta = (modes[l, kv] == 1).astype(np.int32)
        base = lo[l, kv].astype(np.int32)
        off = voffsets[l, kv]
        step = steps[l, kv]
        lv = np.zeros(C, np.int32)
        bounds = seen[job]
        bounds[0], bounds[1] = 2**31 - 1, -2**31
        z = np.empty((ROT_ROWS, C), np.float64)
        zf = np.empty(C, np.float32)
        acc = np.empty((ROT_ROWS, C), np.float64) if rotated else z
        r64 = np.empty(C, np.float64)
        nb = 0
        for t in range(t0, t1):
            if t == t0:
                lv[:] = 0
            _row_levels(sym[t - t0], lv, delta, base, lv)
            _row_range(lv, bounds)
            if t < sink:
                continue
            if bits > 0 and t >= t_ref:
                j = ref[l, kv, t - t_ref]
                for c in range(C):
                    # transform.refined_value: the multiplier is a short dyadic number.
                    m = np.float64(lv[c]) + np.float64(np.int32(j[c]) - (n >> 1) + 1) / np.float64(n)
                    zf[c] = np.float32(m * step + np.float64(off[c]))
            else:
                for c in range(C):
                    zf[c] = np.float32(np.float64(lv[c]) * step + np.float64(off[c]))  # transform.level_value
            if not rotated:
                _store_row(zf, out[l, kv, t_out + t], to_bf16)
                continue
            zb = z[nb]
            for c in range(C):
                zb[c] = zf[c]
            nb += 1
            if nb == ROT_ROWS or t == t1 - 1:
                _fill_rows(z, 0, rot_t[l, kv], 0, nb, acc, r64)
                for b in range(nb):
                    ab = acc[b]
                    for c in range(C):
                        zf[c] = np.float32(ab[c])
                    _store_row(zf, out[l, kv, t_out + t - nb + 1 + b], to_bf16)
                nb = 0


@njit(parallel=True, **_FAST)
def decode_lossless_planes(payload, offsets, lengths, cum, lut, chunk_tokens, group, num_tokens, modes, lo, seen, raw,
                           nraw, words, t_out):
    """decode_table_streams + symbols_to_levels + join_words, one job per plane (chunk, layer,
    K/V): words[:, :, t_out + t] from the symbols and the low bytes in chunk order
    (raw: the chunks' Raw sections back to back); seen as for decode_transform_planes."""
    L, _, _, C = words.shape
    K = (num_tokens + chunk_tokens - 1) // chunk_tokens
    shift = 8 * nraw
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(num_tokens, t0 + chunk_tokens)
        tk = t1 - t0
        sym = _decode_plane_symbols(payload, offsets, lengths, job, cum[l, kv], lut[l, kv], group, tk, C)
        delta = (modes[l, kv] == 1).astype(np.int32)
        base = lo[l, kv].astype(np.int32)
        lv = np.zeros(C, np.int32)
        bounds = seen[job]
        bounds[0], bounds[1] = 2**31 - 1, -2**31
        for t in range(t0, t1):
            if t == t0:
                lv[:] = 0
            _row_levels(sym[t - t0], lv, delta, base, lv)
            _row_range(lv, bounds)
            o = (k * L * 2 * chunk_tokens + (l * 2 + kv) * tk + t - t0) * C * nraw
            low = raw[o : o + C * nraw]
            dst = words[l, kv, t_out + t]
            if nraw == 1:
                for c in range(C):
                    dst[c] = (symbol_top_byte(lv[c]) << shift) | np.int64(low[c])
            else:
                for c in range(C):
                    w = symbol_top_byte(lv[c]) << shift
                    for b in range(nraw):
                        w |= np.int64(low[c * nraw + b]) << (8 * b)
                    dst[c] = w


@njit(parallel=True, **_FAST)
def transpose_planes(rot, rot_t):
    """rot_t[l, kv, h] = rot[l, kv, h] transposed (decode_transform_planes' inverse rotation,
    block by block), in 64 x 64 tiles so that both sides are read and written by whole cache
    lines."""
    L, _, H, D, _ = rot.shape
    nt = (D + 63) // 64
    for p in prange(L * 2 * H * nt):
        blk = p // nt
        l = blk // (2 * H)
        kv = (blk // H) % 2
        h = blk % H
        d0 = (p % nt) * 64
        d1 = min(D, d0 + 64)
        src = rot[l, kv, h]
        dst = rot_t[l, kv, h]
        for c0 in range(0, D, 64):
            for c in range(c0, min(D, c0 + 64)):
                row = src[c]
                for d in range(d0, d1):
                    dst[d, c] = row[d]


@njit(parallel=True, **_FAST)
def encode_word_planes(words, nraw, lo, tab, chunk_tokens, group, raw, lengths, plane_bytes, planes):
    """split_words + levels_to_symbols (direct tables) + encode_table_streams for the lossless
    method, one job per plane (chunk, layer, K/V): the chunk's symbols q - lo made in a scratch
    plane and range-coded into planes[job] (as encode_level_planes), and the low bytes written
    in chunk order: raw (flat uint8) holds chunk k's [L, 2, Tk, C, nraw] block (its Raw
    section, docs/format.md) from k x L x 2 x chunk_tokens x C x nraw on."""
    L, _, T, C = words.shape
    K = lengths.shape[0]
    W = tab.shape[2] // C
    shift = 8 * nraw
    for job in prange(K * L * 2):
        k, l, kv = _plane_index(job, L)
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        tk = t1 - t0
        base = lo[l, kv]
        sym = np.empty((tk, C), np.uint8)
        for t in range(t0, t1):
            src = words[l, kv, t]
            out = sym[t - t0]
            o = (k * L * 2 * chunk_tokens + (l * 2 + kv) * tk + t - t0) * C * nraw
            dst = raw[o : o + C * nraw]
            for c in range(C):
                w = np.int64(src[c])
                out[c] = top_byte_symbol(w >> shift) - base[c]
                for b in range(nraw):
                    dst[c * nraw + b] = (w >> (8 * b)) & 0xFF
        cap = 2 * tk * group + 8
        buf = np.empty(INTERLEAVE * cap, np.uint8)
        plane_bytes[job] = _encode_plane_streams(sym, tab[l, kv], W, group, buf, cap, planes[job], lengths[k, l, kv])


@njit(**_JIT)
def _pairwise_sum(a, lo, n):
    """sum(a[lo:lo + n]) in numpy's pairwise order (transform.pairwise_sum)."""
    return pairwise_sum(a, lo, n, np.empty(64, np.int64), np.empty(64, np.int64), np.zeros(64, np.int64),
                        np.empty(64))


@njit(**_JIT)
def _bf16_bits_of(v):
    """bfloat16 bits of float64 v via float32, each rounding to nearest even (torch's)."""
    u = np.uint64(np.float32(v).view(np.uint32))
    return np.uint16((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))


@njit(**_JIT)
def _stored_offset(mean, bf16_max):
    """(bfloat16 bits, float64 value) of the offset a file stores for a mean: clipped to
    bfloat16's largest finite values (a NaN stays a NaN), rounded to nearest even."""
    b = _bf16_bits_of(min(max(mean, -bf16_max), bf16_max))
    return b, np.float64(np.uint32(np.uint32(b) << np.uint32(16)).view(np.float32))


@njit(**_JIT)
def plane_offsets_rms(sums, sumsq, n, bf16_max, offsets_bits, offsets, rms):
    """The per-coordinate offsets of transform_stats' sums over n tokens and each plane's RMS
    around them: offsets_bits [L, 2, C] (bfloat16 of the mean, clipped to +-bf16_max),
    offsets [L, 2, C] (their float64 values), rms [L, 2] = sqrt(sum_c max(sumsq - 2 m sums +
    n m^2, 0) / (n C)).  The arithmetic of the numpy expressions it replaced, operation by
    operation (so the same bits).  It is the GPU encoder's host step between two stages:
    "steps (host) + upload" took 1.20-1.72 ms with numpy in the balanced rows of
    docs/results/2026-12-01b_bench_device_*.json and 2026-12-01c_bench_device_8ddf3cb.json,
    0.63 ms with this function in 2026-12-01d_bench_device_cb10cec.json (Llama-sized cache)."""
    L, _, C = sums.shape
    resid = np.empty(C)
    fn = np.float64(n)
    denom = np.float64(max(n * C, 1))
    for l in range(L):
        for kv in range(2):
            for c in range(C):
                b, m = _stored_offset(sums[l, kv, c] / fn if n > 0 else 0.0, bf16_max)
                offsets_bits[l, kv, c] = b
                offsets[l, kv, c] = m
                r = sumsq[l, kv, c] - 2.0 * m * sums[l, kv, c] + fn * m * m
                resid[c] = 0.0 if r < 0.0 else r  # np.maximum(r, 0.0): a NaN stays NaN
            rms[l, kv] = np.sqrt(_pairwise_sum(resid, 0, C) / denom)


@njit(**_JIT)
def input_means32(sums, n, means):
    """means [L, 2, C] float32 = float32(sums / n) (0 for n = 0): the inputs' channel means in
    the form the rotation of the means takes (fixed_rotation.offset_sums: a float32 times an
    integer of 15 bits is exact in float64, so a fused multiply-add gives the same sums)."""
    L, _, C = sums.shape
    fn = np.float64(n)
    for l in range(L):
        for kv in range(2):
            for c in range(C):
                means[l, kv, c] = np.float32(sums[l, kv, c] / fn) if n > 0 else np.float32(0.0)


@njit(**_JIT)
def rotated_offsets_rms(mu, sumsq, n, bf16_max, offsets_bits, offsets, rms):
    """The fixed-point rotation's offsets and RMS from the inputs' statistics (methods/transform.
    rotated_step_params): mu [L, 2, C] the rotated channel means (offset_sums of input_means32),
    sumsq [L, 2, C] the inputs' sums of squares over n tokens.  offsets_bits / offsets as
    plane_offsets_rms' (the bfloat16 of mu, clipped); rms [L, 2] = sqrt(max(S + sum_c (n m^2 - 2 m
    n mu), 0) / (n C)), S the plane's sum of squares (an orthogonal rotation keeps it; the
    fixed-point one to ~1e-4): the residuals around the stored offsets, summed over the plane.
    Sums in numpy's pairwise order; each product rounded alone (the GPU's _mul_rn)."""
    L, _, C = mu.shape
    term = np.empty(C)
    fn = np.float64(n)
    denom = np.float64(max(n * C, 1))
    for l in range(L):
        for kv in range(2):
            for c in range(C):
                b, m = _stored_offset(mu[l, kv, c], bf16_max)
                offsets_bits[l, kv, c] = b
                offsets[l, kv, c] = m
                s1 = mu[l, kv, c] * fn
                term[c] = fn * m * m - 2.0 * m * s1
            r = _pairwise_sum(sumsq[l, kv], 0, C) + _pairwise_sum(term, 0, C)
            rms[l, kv] = np.sqrt((0.0 if r < 0.0 else r) / denom)


@register_jitable
def _mul_plain(x, y):
    return x * y


_log, _exp, _allocate = allocation.make(_mul_plain)


@njit(**_JIT)
def allocate_steps(rel, rms, sensitivity, strength, min_step, max_step, out):
    """methods/transform.allocate's relative steps over flat float64 [P] planes into ``out``
    (kernels/allocation.py: the GPU's bits)."""
    P = rel.shape[0]
    _allocate(rel, rms, sensitivity, strength, min_step, max_step, out, np.empty(P), np.empty(max(P, 1)),
              np.empty(64, np.int64), np.empty(64, np.int64), np.zeros(64, np.int64), np.empty(64))


@njit(**_JIT)
def elementary(x, out_log, out_exp):
    """kernels/allocation.py's log and exp of each x (for tests)."""
    for i in range(x.shape[0]):
        out_log[i] = _log(x[i])
        out_exp[i] = _exp(x[i])
