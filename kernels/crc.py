"""CRC-32 (zlib's) as device functions, so a GPU can checksum chunk records in parallel.

A record is cut into segments; each thread takes the CRC-32 of one segment
(`crc32_range`, a byte at a time through a 256-entry table), and one thread per
record joins its segments' CRCs in order with zlib's combine rule
crc(A + B) = x^(8 |B|) * crc(A) xor crc(B) in GF(2)[x] mod the CRC polynomial
(`crc32_combine`, after zlib's crc32_combine64).  The result equals
``zlib.crc32`` of the whole record.
"""

import numpy as np
from numba.extending import register_jitable

POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _make_table() -> np.ndarray:
    table = np.zeros(256, np.int64)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        table[n] = c
    return table


CRC_TABLE = _make_table()


def _make_slices() -> np.ndarray:
    """Slicing-by-8 tables: slices[k][i] = the CRC register after byte i is followed by k zero
    bytes (slices[0] = CRC_TABLE), so 8 bytes take 8 independent lookups instead of a chain of 8."""
    out = np.zeros((8, 256), np.int64)
    out[0] = CRC_TABLE
    for k in range(1, 8):
        prev = out[k - 1]
        out[k] = (prev >> 8) ^ CRC_TABLE[prev & 0xFF]
    return out


CRC_SLICES = _make_slices()


@register_jitable
def multmodp(a, b):
    """a * b modulo the CRC polynomial (reflected bit order)."""
    a = np.int64(a)
    b = np.int64(b)
    m = np.int64(1) << 31
    p = np.int64(0)
    while m != 0:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        if b & 1:
            b = (b >> 1) ^ POLY
        else:
            b = b >> 1
    return p


def _make_x2n() -> np.ndarray:
    """x2n[k] = x^(2^k) modulo the polynomial."""
    out = np.zeros(32, np.int64)
    p = 1 << 30  # x^1
    out[0] = p
    for k in range(1, 32):
        p = int(multmodp(p, p))
        out[k] = p
    return out


X2N_TABLE = _make_x2n()


@register_jitable
def x8nmodp(nbytes):
    """x^(8 * nbytes) modulo the polynomial."""
    n = np.int64(nbytes)
    p = np.int64(1) << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = multmodp(X2N_TABLE[k & 31], p)
        n >>= 1
        k += 1
    return p


@register_jitable
def crc32_combine(crc_a, crc_b, len_b):
    """zlib.crc32(A + B) from zlib.crc32(A), zlib.crc32(B) and len(B)."""
    return multmodp(x8nmodp(len_b), crc_a) ^ np.int64(crc_b)


@register_jitable
def crc32_range(data, start, length, table):
    """zlib.crc32(data[start:start + length])."""
    c = np.int64(0xFFFFFFFF)
    for p in range(start, start + length):
        c = table[(c ^ np.int64(data[p])) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
