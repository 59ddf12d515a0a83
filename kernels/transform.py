"""Device functions of the transform methods (format version 2): rotation, uniform
step quantization, the lossless byte split, and the token-delta symbol map.

Method 2 ("transform"): each (layer, K/V) row of C channels x is optionally
rotated, y = x R (R orthonormal and block diagonal, [H, D, D] blocks from a calibration
file; identity without one),
then every coordinate is quantized with one step for the whole (layer, K/V):
level q = round((y - m) / step), m the coordinate's mean over the cache.
Method 3 ("lossless"): each 16- or 32-bit word is split into its top byte, which
is entropy coded (sign moved to the low bit so that a channel's symbols span a
narrow range), and its low byte(s), stored raw.

Why the arithmetic looks the way it does: the CPU and a GPU must compute the
same levels bit for bit.  A float32 x float32 product is exact in float64, so
the rotation's products are exact and a fused multiply-add changes nothing; the
sums run in a fixed order; (y - m) / step is one correctly rounded float64
division; rounding compares the exact fractional part with 0.5.  Decoding
rounds q * step + m to float32 (q * step is exact), so the inverse rotation's
products are exact too.
"""

import numpy as np
from numba.extending import register_jitable

#: Largest |level| of method 2: levels are stored as int16 but coded as symbols
#: in a uint8 alphabet of at most 255 entries.
TRANSFORM_QMAX = 127

#: The encoder's per-coordinate sums run over blocks of this many tokens (by absolute
#: position), each summed in order, then the block sums in order: one fixed summation tree
#: for every device (kernels/cpu_transform.transform_stats).
STATS_BLOCK = 256

MODE_DIRECT = 0
MODE_DELTA = 1
MODE_SAME = 2  # in a file's tables only: "the table of the previous channel with its own"


@register_jitable
def rotate_row(xrow, rot_plane, y):
    """y[d] = sum over c (in order) of x[c] * R[c, d], in float64 (every product exact); R is
    block diagonal, rot_plane [H, D, D] its blocks: only the products inside a block are
    summed (the others are zeros, which change no sum: y is never -0.0)."""
    H = rot_plane.shape[0]
    D = rot_plane.shape[1]
    for d in range(H * D):
        y[d] = 0.0
    for h in range(H):
        base = h * D
        for c in range(D):
            xc = np.float64(np.float32(xrow[base + c]))
            if xc != 0.0:
                for d in range(D):
                    y[base + d] += xc * np.float64(rot_plane[h, c, d])


@register_jitable
def unrotate_row(z, rot_plane, out_row):
    """out[c] = float32(sum over d (in order) of z[d] * R[c, d]); z holds float32 values;
    rot_plane [H, D, D] the blocks of R, as for rotate_row."""
    H = rot_plane.shape[0]
    D = rot_plane.shape[1]
    for h in range(H):
        base = h * D
        for c in range(D):
            acc = 0.0
            for d in range(D):
                acc += z[base + d] * np.float64(rot_plane[h, c, d])
            out_row[base + c] = np.float32(acc)


@register_jitable
def step_level(y, offset, step, qmax, threshold):
    """Level of one coordinate: (y - offset) / step rounded away from zero when its fractional
    part reaches ``threshold`` (0.5: to nearest), clamped to +-qmax.  A threshold above 0.5
    is a dead-zone quantizer: values just past a midpoint go to the level nearer zero, which
    costs a little error and saves more rate (the decoder does not need to know)."""
    v = (np.float64(y) - np.float64(offset)) / np.float64(step)
    if v >= 9.0e15 or v <= -9.0e15:  # clamped; and past int64's range a cast is undefined
        return qmax if v > 0 else -qmax
    q = np.int64(v)  # toward zero
    frac = v - np.float64(q)  # exact
    if frac >= threshold:
        q += 1
    elif frac <= -threshold:
        q -= 1
    return _clamp(q, qmax)


@register_jitable
def _clamp(q, qmax):
    if q > qmax:
        return qmax
    if q < -qmax:
        return -qmax
    return q


#: fast_level32: quotients at or past this clamp to +-TRANSFORM_QMAX whatever their rounding.
LEVEL32_CLAMP = float(TRANSFORM_QMAX + 2)
#: fast_level32's margin around a decision point, for quotients below LEVEL32_CLAMP.  The
#: float32 quotient ((y - off) rounded, times float32(1 / step) rounded, rounded) is within
#: 3 x 2^-24 (+ 2^-48) of the exact one, relatively, and step_level's float64 quotient within
#: 2^-52: 2^-22 x LEVEL32_CLAMP covers both; 2^-22 more covers the threshold's rounding to
#: float32 (<= 2^-25) and that of the comparisons' own differences (<= 2^-25 each).
LEVEL32_EPS = (LEVEL32_CLAMP + 1.0) * 2.0 ** -22


@register_jitable
def fast_level32(y, off, inv, thr):
    """(step_level(y, off, step, TRANSFORM_QMAX, threshold), True) computed in float32 when
    float32 decides it, else (0, False): then the caller computes it in float64.  y, off:
    float32; inv: float32(1 / step), a normal number (the caller keeps steps within 2^+-60);
    thr: float32(threshold).

    Why it is exact: the level is floor(a) + (frac(a) >= threshold) (clamped, signed) of the
    quotient's magnitude a, so only the integers >= 1 and the points n + threshold decide it;
    a float32 quotient farther than its error bound (LEVEL32_EPS) from every one of them is on
    the same side of each as step_level's float64 quotient, so gives its level.  Few values
    are that near (fewer than 1 in 10^4 of a real cache's: tests/test_device_pipeline.py), and
    a quotient past LEVEL32_CLAMP clamps whatever it is.  On a GPU this takes far fewer
    instructions than the float64 path (no 64-bit conversions, no float64 arithmetic:
    benchmarks/kernel_sass.py shows the quantize kernel's)."""
    v = (y - off) * inv
    a = abs(v)
    if a < np.float32(LEVEL32_CLAMP):
        whole = np.int32(a)  # toward zero: floor, a >= 0
        fa = a - np.float32(whole)  # exact
        if not (fa < np.float32(1.0 - LEVEL32_EPS) and (fa > np.float32(LEVEL32_EPS) or whole == 0)
                and abs(fa - thr) > np.float32(LEVEL32_EPS)):
            return np.int32(0), False
        q = np.int32(whole + np.int32(1 if fa >= thr else 0))
        q = np.int32(min(q, np.int32(TRANSFORM_QMAX)))
    elif a >= np.float32(LEVEL32_CLAMP):  # infinite included: clamped either way
        q = np.int32(TRANSFORM_QMAX)
    else:  # NaN
        return np.int32(0), False
    if v < np.float32(0.0):
        q = np.int32(-q)
    return q, True


@register_jitable
def level_value(q, offset, step):
    """float32 reconstruction of a level: q * step (exact) + offset, rounded once."""
    return np.float32(np.float64(q) * np.float64(step) + np.float64(offset))


@register_jitable
def _floor(x):
    """floor of a float64 of magnitude below 2^62, as int64 (no math library call)."""
    t = np.int64(x)
    if np.float64(t) > x:
        t -= 1
    return t


@register_jitable
def refined_level(y, offset, step, qmax, bits):
    """Level of a refined token (the last tokens of a file with FLAG_REFINED):
    q = floor(v + 1/2 - 1/2^(bits+1)), v = (y - offset) / step, clamped to +-qmax.  Its cell
    [q - 1/2 + 1/2^(bits+1), q + 1/2 + 1/2^(bits+1)) is split by refine_index into 2^bits
    sub-cells centred on q + k / 2^bits, k = -2^(bits-1) + 1 .. 2^(bits-1): the level's own
    value is one of the centres (an exact zero stays exact) and no sub-cell is clipped."""
    n = np.int64(1) << bits
    v = (np.float64(y) - np.float64(offset)) / np.float64(step)
    if v >= 9.0e15 or v <= -9.0e15:
        return qmax if v > 0 else -qmax
    return _clamp(_floor(v + (0.5 - 0.5 / np.float64(n))), qmax)


@register_jitable
def token_level(y, offset, step, qmax, threshold, refined, bits):
    """A coordinate's level: refined_level for the refined tokens, step_level for the others."""
    if refined:
        return refined_level(y, offset, step, qmax, bits)
    return step_level(y, offset, step, qmax, threshold)


@register_jitable
def refine_index(y, offset, step, q, bits):
    """The sub-cell of a refined value: k = floor((v - q) x 2^bits + 1/2), stored as
    j = k + 2^(bits-1) - 1 clamped to 0 .. 2^bits - 1 (only a clamped level's far values
    clamp).  (v - q) x 2^bits is exact, so a fused multiply-add rounds the sum alike: the
    same index on any device."""
    n = np.int64(1) << bits
    v = (np.float64(y) - np.float64(offset)) / np.float64(step)
    r = (v - np.float64(q)) * np.float64(n) + 0.5
    if not r >= -np.float64(n):
        return 0
    if r >= np.float64(n):
        return n - 1
    j = _floor(r) + (n >> 1) - 1
    if j < 0:
        return 0
    if j > n - 1:
        return n - 1
    return j


@register_jitable
def refined_value(q, j, bits, offset, step):
    """float32 reconstruction of a refined level: q + (j - 2^(bits-1) + 1) / 2^bits steps from
    the offset.  That multiplier is a short dyadic number, so its product with the
    (bfloat16) step is exact and a fused multiply-add gives the same value."""
    n = np.int64(1) << bits
    z = np.float64(q) + np.float64(np.int64(j) - (n >> 1) + 1) / np.float64(n)
    return np.float32(z * np.float64(step) + np.float64(offset))


@register_jitable
def token_value(q, j, refined, bits, offset, step):
    """A coordinate's float32 reconstruction: refined_value for the refined tokens, level_value
    for the others (whose j is ignored)."""
    if refined:
        return refined_value(q, j, bits, offset, step)
    return level_value(q, offset, step)


@register_jitable
def top_byte_symbol(top):
    """The coded symbol of a word's top byte: sign bit moved to bit 0 (0..255)."""
    t = np.int64(top) & 0xFF
    return ((t << 1) & 0xFF) | (t >> 7)


@register_jitable
def symbol_top_byte(sym):
    """Inverse of top_byte_symbol."""
    s = np.int64(sym) & 0xFF
    return (s >> 1) | ((s & 1) << 7)


@register_jitable
def pairwise_leaf(a, lo, n):
    """A leaf of numpy's pairwise sum (n <= 128): under 8 values in order, else 8 running sums."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@register_jitable
def pairwise_sum(a, lo, n, los, ns, stage, left):
    """sum(a[lo:lo + n]) in numpy's pairwise order (leaves of at most 128, halves split at
    multiples of 8), so the steps match what ``np.sum`` gave before this kernel.  The
    recursion runs on an explicit stack (numba's cache cannot reload a recursive function, and
    a GPU thread has no deep stack): los, ns, stage (int64) and left (float64), 64 entries
    each, are its scratch (numpy arrays on the CPU, cuda.local arrays on a GPU).  Only sums:
    no product to fuse, the same bits on every device."""
    if n <= 128:
        return pairwise_leaf(a, lo, n)
    # stage: 0 nothing summed, 1 the left half summed (in left), 2 the right half asked for
    top = 0
    los[0] = lo
    ns[0] = n
    stage[0] = 0
    value = 0.0
    have = False  # value holds the sum of the node just popped
    while top >= 0:
        if have:
            if stage[top] == 1:  # the left half came back: now the right half
                left[top] = value
                have = False
                stage[top] = 2
                n2 = ns[top] // 2
                n2 -= n2 % 8
                if ns[top] - n2 <= 128:
                    value = pairwise_leaf(a, los[top] + n2, ns[top] - n2)
                    have = True
                else:
                    los[top + 1] = los[top] + n2
                    ns[top + 1] = ns[top] - n2
                    stage[top + 1] = 0
                    top += 1
            else:  # the right half came back
                value = left[top] + value
                top -= 1
            continue
        n2 = ns[top] // 2
        n2 -= n2 % 8
        stage[top] = 1
        if n2 <= 128:
            value = pairwise_leaf(a, los[top], n2)
            have = True
        else:
            los[top + 1] = los[top]
            ns[top + 1] = n2
            stage[top + 1] = 0
            top += 1
    return value
