"""CUDA kernels (numba-cuda) of format version 2: the same names, arguments and bytes as
the reference kernels of ``cpu_transform.py``.

The arithmetic is ``transform.py``'s, ``cdf.py``'s and ``range_coder.py``'s device
functions, compiled for the GPU; every product that feeds a sum is exact in float64
(see transform.py), so a fused multiply-add changes nothing and the CPU and the GPU
compute the same levels, tables and bytes.

Who does what (host wrappers launch on ``stream`` without synchronising):
  transform_stats       one thread per (layer, K/V, coordinate), walking the tokens in order
                        (the CPU's summation order); a warp reads 32 neighbouring channels
  transform_quantize,
  transform_refine,
  transform_dequantize  one thread per value (a rotated value: one output coordinate,
                        its dot product in the CPU's order)
  split_words,
  join_words            one thread per value
  level_stats,
  levels_to_symbols,
  symbols_to_levels     one thread per (layer, K/V, channel), walking the tokens (the token
                        delta needs the previous token); reads coalesce across channels
  build_tables,
  cum_from_table_codes  one thread per table
  encode_table_streams,
  decode_table_streams  one thread per stream (chunk, layer, K/V, channel group)
"""

from __future__ import annotations

import numpy as np

from .cuda import BLOCK, _grid, _stream_coords_dev, as_device, cuda  # noqa: F401  (cuda.py restores np.row_stack)
from .cdf import codes_to_cum, counts_to_codes
from .range_coder import decode_stream, encode_stream
from .transform import refine_index, symbol_top_byte, token_level, token_value, top_byte_symbol


def _cfg(n: int):
    """(blocks, threads) for n threads of work: small launches get small blocks (no idle
    threads to start, which is what makes numba's simulator slow on tiny inputs)."""
    block = min(BLOCK, max(32, (n + 31) // 32 * 32))
    return _grid(n, block), block


def _plane_channel(i, C):
    return i // (2 * C), (i // C) % 2, i % C


_plane_channel_dev = cuda.jit(device=True)(_plane_channel)


@cuda.jit(device=True)
def _value_coords(i, T, C):
    """(layer, K/V, token, channel) of flat index i of an [L, 2, T, C] array."""
    row = i // C
    return row // (2 * T), (row // T) % 2, row % T, i % C


@cuda.jit(device=True)
def _rotated(x, rot, l, kv, t, d, C):
    """Coordinate d of token t rotated: transform.rotate_row's sum for one output, same order."""
    acc = 0.0
    for c in range(C):
        xc = np.float64(np.float32(x[l, kv, t, c]))
        if xc != 0.0:
            acc += xc * np.float64(rot[l, kv, c, d])
    return acc


@cuda.jit
def _stats_kernel(x, rot, rotated, sink, sums, sumsq):
    i = cuda.grid(1)
    L, _, T, C = x.shape
    if i >= L * 2 * C:
        return
    l, kv, d = _plane_channel_dev(i, C)
    s1 = 0.0
    s2 = 0.0
    for t in range(sink, T):
        if rotated:
            v = np.float64(np.float32(_rotated(x, rot, l, kv, t, d, C)))
        else:
            v = np.float64(np.float32(x[l, kv, t, d]))
        s1 += v
        s2 += v * v
    sums[l, kv, d] = s1
    sumsq[l, kv, d] = s2


def transform_stats(x, rot, sink, sums, sumsq, stream=0):
    L, _, _, C = x.shape
    n = L * 2 * C
    _stats_kernel[(*_cfg(n), stream)](as_device(x), as_device(rot), rot.shape[0] > 0, np.int64(sink),
                                           as_device(sums), as_device(sumsq))


@cuda.jit
def _quantize_kernel(x, rot, rotated, sink, offsets, steps, qmax, threshold, t0, bits, q):
    i = cuda.grid(1)
    L, _, T, C = x.shape
    if i >= L * 2 * T * C:
        return
    l, kv, t, d = _value_coords(i, T, C)
    if t < sink:
        q[l, kv, t, d] = 0
        return
    if rotated:
        y = _rotated(x, rot, l, kv, t, d, C)
    else:
        y = np.float64(x[l, kv, t, d])
    q[l, kv, t, d] = token_level(y, offsets[l, kv, d], steps[l, kv], qmax, threshold, t >= t0 and bits > 0, bits)


def transform_quantize(x, rot, sink, offsets, steps, qmax, threshold, t0, bits, q, stream=0):
    n = q.size
    if n == 0:
        return
    _quantize_kernel[(*_cfg(n), stream)](as_device(x), as_device(rot), rot.shape[0] > 0, np.int64(sink),
                                              as_device(offsets), as_device(steps), np.int64(qmax),
                                              np.float64(threshold), np.int64(t0), np.int64(bits), as_device(q))


@cuda.jit
def _refine_kernel(x, rot, rotated, t0, offsets, steps, q, bits, ref):
    i = cuda.grid(1)
    L, _, R, C = ref.shape
    if i >= L * 2 * R * C:
        return
    l, kv, r, d = _value_coords(i, R, C)
    t = t0 + r
    if rotated:
        y = _rotated(x, rot, l, kv, t, d, C)
    else:
        y = np.float64(x[l, kv, t, d])
    ref[l, kv, r, d] = refine_index(y, offsets[l, kv, d], steps[l, kv], q[l, kv, t, d], bits)


def transform_refine(x, rot, t0, offsets, steps, q, bits, ref, stream=0):
    n = ref.size
    if n == 0:
        return
    _refine_kernel[(*_cfg(n), stream)](as_device(x), as_device(rot), rot.shape[0] > 0, np.int64(t0),
                                            as_device(offsets), as_device(steps), as_device(q), np.int64(bits),
                                            as_device(ref))


@cuda.jit(device=True)
def _value_at(q, offsets, steps, t0, bits, ref, l, kv, t, d):
    refined = t >= t0 and bits > 0
    j = ref[l, kv, t - t0, d] if refined else 0
    return token_value(q[l, kv, t, d], j, refined, bits, offsets[l, kv, d], steps[l, kv])


@cuda.jit
def _dequantize_kernel(q, rot, rotated, sink, offsets, steps, t0, bits, ref, out):
    i = cuda.grid(1)
    L, _, T, C = q.shape
    if i >= L * 2 * T * C:
        return
    l, kv, t, c = _value_coords(i, T, C)
    if t < sink:
        return
    if rotated:
        acc = 0.0
        for d in range(C):
            z = np.float64(_value_at(q, offsets, steps, t0, bits, ref, l, kv, t, d))
            acc += z * np.float64(rot[l, kv, c, d])
        out[l, kv, t, c] = np.float32(acc)
    else:
        out[l, kv, t, c] = _value_at(q, offsets, steps, t0, bits, ref, l, kv, t, c)


def transform_dequantize(q, rot, sink, offsets, steps, t0, bits, ref, out, stream=0):
    n = q.size
    if n == 0:
        return
    _dequantize_kernel[(*_cfg(n), stream)](as_device(q), as_device(rot), rot.shape[0] > 0, np.int64(sink),
                                                as_device(offsets), as_device(steps), np.int64(t0), np.int64(bits),
                                                as_device(ref), as_device(out))


@cuda.jit
def _split_kernel(words, nraw, q, raw):
    i = cuda.grid(1)
    L, _, T, C = words.shape
    if i >= L * 2 * T * C:
        return
    l, kv, t, c = _value_coords(i, T, C)
    w = np.int64(words[l, kv, t, c])
    q[l, kv, t, c] = top_byte_symbol(w >> (8 * nraw))
    for b in range(nraw):
        raw[l, kv, t, c, b] = (w >> (8 * b)) & 0xFF


def split_words(words, nraw, q, raw, stream=0):
    n = q.size
    if n == 0:
        return
    _split_kernel[(*_cfg(n), stream)](as_device(words), np.int64(nraw), as_device(q), as_device(raw))


@cuda.jit
def _join_kernel(q, raw, nraw, words):
    i = cuda.grid(1)
    L, _, T, C = q.shape
    if i >= L * 2 * T * C:
        return
    l, kv, t, c = _value_coords(i, T, C)
    w = symbol_top_byte(q[l, kv, t, c]) << (8 * nraw)
    for b in range(nraw):
        w |= np.int64(raw[l, kv, t, c, b]) << (8 * b)
    bits = 8 * (nraw + 1)
    if w >= np.int64(1) << (bits - 1):  # the words are signed (int16 / int32): the same bits
        w -= np.int64(1) << bits
    words[l, kv, t, c] = w


def join_words(q, raw, nraw, words, stream=0):
    n = q.size
    if n == 0:
        return
    _join_kernel[(*_cfg(n), stream)](as_device(q), as_device(raw), np.int64(nraw), as_device(words))


@cuda.jit
def _level_stats_kernel(q, chunk_tokens, stats):
    i = cuda.grid(1)
    L, _, T, C = q.shape
    if i >= L * 2 * C:
        return
    l, kv, c = _plane_channel_dev(i, C)
    mn = np.int64(1 << 40)
    mx = np.int64(-(1 << 40))
    ab = np.int64(0)
    dmn = np.int64(1 << 40)
    dmx = np.int64(-(1 << 40))
    dab = np.int64(0)
    prev = np.int64(0)
    for t in range(T):
        v = np.int64(q[l, kv, t, c])
        if t % chunk_tokens == 0:
            prev = 0
        d = v - prev
        prev = v
        mn = min(mn, v)
        mx = max(mx, v)
        ab += abs(v)
        dmn = min(dmn, d)
        dmx = max(dmx, d)
        dab += abs(d)
    stats[l, kv, c, 0] = mn
    stats[l, kv, c, 1] = mx
    stats[l, kv, c, 2] = ab
    stats[l, kv, c, 3] = dmn
    stats[l, kv, c, 4] = dmx
    stats[l, kv, c, 5] = dab


def level_stats(q, chunk_tokens, stats, stream=0):
    L, _, _, C = q.shape
    _level_stats_kernel[(*_cfg(L * 2 * C), stream)](as_device(q), np.int64(chunk_tokens), as_device(stats))


@cuda.jit
def _levels_to_symbols_kernel(q, modes, lo, chunk_tokens, sym, counts):
    i = cuda.grid(1)
    L, _, T, C = q.shape
    if i >= L * 2 * C:
        return
    l, kv, c = _plane_channel_dev(i, C)
    for s in range(counts.shape[3]):
        counts[l, kv, c, s] = 0
    delta = modes[l, kv, c] == 1
    base = lo[l, kv, c]
    prev = np.int64(0)
    for t in range(T):
        v = np.int64(q[l, kv, t, c])
        if delta:
            if t % chunk_tokens == 0:
                prev = 0
            s = v - prev - base
            prev = v
        else:
            s = v - base
        sym[l, kv, t, c] = s
        counts[l, kv, c, s] += 1


def levels_to_symbols(q, modes, lo, chunk_tokens, sym, counts, stream=0):
    L, _, _, C = q.shape
    _levels_to_symbols_kernel[(*_cfg(L * 2 * C), stream)](
        as_device(q), as_device(modes), as_device(lo), np.int64(chunk_tokens), as_device(sym), as_device(counts))


@cuda.jit
def _symbols_to_levels_kernel(sym, modes, lo, chunk_tokens, q):
    i = cuda.grid(1)
    L, _, T, C = sym.shape
    if i >= L * 2 * C:
        return
    l, kv, c = _plane_channel_dev(i, C)
    delta = modes[l, kv, c] == 1
    base = lo[l, kv, c]
    prev = np.int64(0)
    for t in range(T):
        v = np.int64(sym[l, kv, t, c]) + base
        if delta:
            if t % chunk_tokens == 0:
                prev = 0
            v += prev
            prev = v
        q[l, kv, t, c] = v


def symbols_to_levels(sym, modes, lo, chunk_tokens, q, stream=0):
    L, _, _, C = sym.shape
    _symbols_to_levels_kernel[(*_cfg(L * 2 * C), stream)](
        as_device(sym), as_device(modes), as_device(lo), np.int64(chunk_tokens), as_device(q))


@cuda.jit
def _build_tables_kernel(counts, alphabet, codes, cum):
    i = cuda.grid(1)
    L, _, C, _ = counts.shape
    if i >= L * 2 * C:
        return
    l, kv, c = _plane_channel_dev(i, C)
    counts_to_codes(counts[l, kv, c], alphabet[l, kv, c], codes[l, kv, c])
    codes_to_cum(codes[l, kv, c], alphabet[l, kv, c], cum[l, kv, c])


def build_tables(counts, alphabet, codes, cum, stream=0):
    L, _, C, _ = counts.shape
    _build_tables_kernel[(*_cfg(L * 2 * C), stream)](as_device(counts), as_device(alphabet), as_device(codes),
                                                          as_device(cum))


@cuda.jit
def _cum_kernel(codes, alphabet, cum):
    i = cuda.grid(1)
    L, _, C, _ = codes.shape
    if i >= L * 2 * C:
        return
    l, kv, c = _plane_channel_dev(i, C)
    codes_to_cum(codes[l, kv, c], alphabet[l, kv, c], cum[l, kv, c])


def cum_from_table_codes(codes, alphabet, cum, stream=0):
    L, _, C, _ = codes.shape
    _cum_kernel[(*_cfg(L * 2 * C), stream)](as_device(codes), as_device(alphabet), as_device(cum))


@cuda.jit
def _encode_kernel(sym, cum, chunk_tokens, group, slots, lengths):
    s = cuda.grid(1)
    L, _, T, C = sym.shape
    K = (T + chunk_tokens - 1) // chunk_tokens
    groups = (C + group - 1) // group
    if s >= K * L * 2 * groups:
        return
    k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, T, C)
    lengths[s] = encode_stream(sym[l, kv], t0, t1, c0, c1, cum[l, kv], c0, 1, slots[s])


def encode_table_streams(sym, cum, chunk_tokens, group, slots, lengths, stream=0):
    n = lengths.shape[0]
    if n == 0:
        return
    _encode_kernel[(*_cfg(n), stream)](as_device(sym), as_device(cum), np.int64(chunk_tokens), np.int64(group),
                                            as_device(slots), as_device(lengths))


@cuda.jit
def _decode_kernel(payload, offsets, lengths, cum, width, chunk_tokens, group, sym):
    s = cuda.grid(1)
    L, _, T, C = sym.shape
    K = (T + chunk_tokens - 1) // chunk_tokens
    groups = (C + group - 1) // group
    if s >= K * L * 2 * groups:
        return
    k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, T, C)
    decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, cum[l, kv], c0, 1, width, sym[l, kv])


def decode_table_streams(payload, offsets, lengths, cum, width, chunk_tokens, group, sym, stream=0):
    n = lengths.shape[0]
    if n == 0:
        return
    _decode_kernel[(*_cfg(n), stream)](as_device(payload), as_device(offsets), as_device(lengths),
                                            as_device(cum), np.int64(width), np.int64(chunk_tokens), np.int64(group),
                                            as_device(sym))
