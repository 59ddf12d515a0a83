"""A byte-oriented range coder over one stream, as device functions.

One stream is the symbols of tokens [t0, t1) and channels [c0, c1) of one
(layer, K/V) plane, token by token, channel by channel; channel c codes with
CDF row ``cum[row0 + (c - c0) * row_step]``.  On the CPU that is simply
``cum[c]`` of the plane's table (row0 = c0, row_step = 1); a GPU kernel passes
a copy in shared memory where the rows of a block's threads are interleaved
(row0 = thread, row_step = threads) so that threads reading the same symbol's
entry hit different memory banks.  Streams are independent, so a kernel runs
one per thread.

The coder (after Subbotin and LZMA's rc): a 32-bit range and a low end kept
below 2**32 by shifting out its top byte whenever the range falls below 2**24.
A carry out of ``low`` is added straight into the bytes already written (walk
back over 0xFF bytes), so no cache byte is needed and the first byte written is
a real one.  The flush writes the fewest bytes (0..4) that pin a value inside
the final interval, then trailing zero bytes are dropped: the decoder reads
zeros past the end of a stream.  Per-stream overhead is therefore about one
byte, which matters for 256-token chunks of a few hundred symbols per stream.

The decoder never reads outside [start, start + length) and never fails: on a
corrupt stream it decodes some symbols within the alphabet (the chunk's CRC is
what detects corruption).
"""

import numpy as np
from numba.extending import register_jitable

from .coding_params import MASK32, PROB_BITS, PROB_TOTAL, RANGE_INIT, RANGE_TOP


@register_jitable
def stream_coords(s, groups, L, group, chunk_tokens, T, C):
    """(chunk k, layer l, K/V, t0, t1, c0, c1) of stream s, streams being numbered (chunk,
    layer, K/V, channel group) row-major: the layout every coder kernel shares."""
    g = s % groups
    kv = (s // groups) % 2
    l = (s // (2 * groups)) % L
    k = s // (L * 2 * groups)
    t0 = k * chunk_tokens
    t1 = min(T, t0 + chunk_tokens)
    c0 = g * group
    c1 = min(C, c0 + group)
    return k, l, kv, t0, t1, c0, c1


@register_jitable
def _add_carry(out, n):
    """Add one to the big-endian number held in out[:n]."""
    i = n - 1
    while i >= 0 and out[i] == 255:
        out[i] = 0
        i -= 1
    if i >= 0:
        out[i] += 1


@register_jitable
def encode_stream(symbols, t0, t1, c0, c1, cum, row0, row_step, out):
    """Code symbols[t0:t1, c0:c1] (row-major) into out; returns the byte count.

    symbols: uint8 [T, C]; cum: integer CDF rows (see the module docstring); out: uint8 buffer of
    at least max_stream_bytes((t1 - t0) * (c1 - c0)) bytes.
    """
    low = np.int64(0)
    rng = np.int64(RANGE_INIT)
    n = 0
    for t in range(t0, t1):
        for c in range(c0, c1):
            s = np.int64(symbols[t, c])
            j = row0 + (c - c0) * row_step
            base = np.int64(cum[j, s])
            r = rng >> PROB_BITS
            low += r * base
            rng = r * (np.int64(cum[j, s + 1]) - base)
            if low > MASK32:
                _add_carry(out, n)
                low &= MASK32
            while rng < RANGE_TOP:
                out[n] = (low >> 24) & 0xFF
                n += 1
                low = (low << 8) & MASK32
                rng <<= 8
    return flush_stream(low, rng, n, out)


@register_jitable
def flush_stream(low, rng, n, out):
    """End a stream whose coder state is (low, rng) after n bytes in out: the shortest prefix
    of some value in [low, low + rng), then trailing zero bytes dropped (the decoder reads
    zeros past the end).  Returns the stream's length."""
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
        _add_carry(out, n)
        value &= MASK32
    for j in range(nbytes):
        out[n] = (value >> (24 - 8 * j)) & 0xFF
        n += 1
    while n > 0 and out[n - 1] == 0:
        n -= 1
    return n


@register_jitable
def decode_stream(data, start, length, t0, t1, c0, c1, cum, row0, row_step, alphabet, symbols):
    """Decode into symbols[t0:t1, c0:c1] the stream data[start:start + length].

    cum, row0, row_step: the CDF rows, as for encode_stream.  The quotient
    code // r is taken in float64: code < 2**32 and r >= 2**9, so the correctly
    rounded quotient never crosses an integer and its floor is exact, and a
    float division is much cheaper than a 64-bit integer one on both devices."""
    pos = 0
    code = np.int64(0)
    for _ in range(4):
        b = np.int64(0)
        if pos < length:
            b = np.int64(data[start + pos])
        pos += 1
        code = (code << 8) | b
    rng = np.int64(RANGE_INIT)
    for t in range(t0, t1):
        for c in range(c0, c1):
            r = rng >> PROB_BITS
            q = np.int64(np.float64(code) / np.float64(r))
            if q >= PROB_TOTAL:
                q = PROB_TOTAL - 1
            j = row0 + (c - c0) * row_step
            lo = 0
            hi = alphabet
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if cum[j, mid] <= q:
                    lo = mid
                else:
                    hi = mid
            base = np.int64(cum[j, lo])
            code -= r * base
            rng = r * (np.int64(cum[j, lo + 1]) - base)
            while rng < RANGE_TOP:
                b = np.int64(0)
                if pos < length:
                    b = np.int64(data[start + pos])
                pos += 1
                code = ((code << 8) | b) & MASK32
                rng <<= 8
            symbols[t, c] = lo
