"""The Params block of a version-2 .cgen file: what every chunk shares.

    method 2 (transform):  calibration SHA-256 | steps | offsets | sink tokens | [refinement] | [RoPE] | tables
    method 3 (lossless):   tables

A table per (layer, K/V, channel) replaces version 1's per-chunk CDF codes: one
mode byte, the smallest coded value, the alphabet size and one 4-bit code per
symbol (docs/format.md, "Params").  This module packs and parses the block;
the reader checks every value against the header before anything uses it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import SizeError, TruncatedError, UnsupportedVersionError
from ..kernels.transform import MODE_DELTA, MODE_DIRECT, MODE_SAME, TRANSFORM_QMAX

METHOD_TRANSFORM = 2
METHOD_LOSSLESS = 3
MAX_TABLE_ALPHABET = 256
MAX_REFINE_BITS = 8
REFINEMENT_BYTES = 5  # u32 tokens, u8 bits
ROPE_BYTES = 16  # u8 style, u8 zero, u16 head_dim, u16 rotary_dim, u16 frequency rows, u64 position of token 0
MAX_ROPE_POSITION = 1 << 31  # position of the last token + 1 (kernels/rope: the angle's reduction is exact below)
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass
class Rope:
    """The rotary embedding removed from the keys (FLAG_ROPE; kernels/rope.py): pairs of each
    head's first ``rotary_dim`` channels, turned by (position_start + t) x inv_freq."""

    style: int  # kernels.rope.STYLE_HALF (pairs j, j + r/2) or STYLE_INTERLEAVED (2j, 2j + 1)
    head_dim: int
    rotary_dim: int
    position_start: int
    inv_freq: np.ndarray  # float64 [F, rotary_dim / 2], F = 1 (every layer) or num_layers

    def pack(self) -> bytes:
        f = np.ascontiguousarray(self.inv_freq, "<f8")
        return struct.pack("<BBHHHQ", self.style, 0, self.head_dim, self.rotary_dim, f.shape[0],
                           self.position_start) + f.tobytes()

    @property
    def size(self) -> int:
        return ROPE_BYTES + 8 * int(np.asarray(self.inv_freq).size)


def check_rope(rope: Rope, num_layers: int, num_channels: int, num_tokens: int) -> None:
    """The rules of docs/format.md for a RoPE block (SizeError naming the field)."""
    if rope.style not in (0, 1):
        raise SizeError(f"RoPE style {rope.style} (0 or 1)")
    if not 2 <= rope.head_dim <= num_channels or num_channels % rope.head_dim:
        raise SizeError(f"RoPE head_dim {rope.head_dim} does not divide the {num_channels} channels")
    if rope.rotary_dim % 2 or not 2 <= rope.rotary_dim <= rope.head_dim:
        raise SizeError(f"RoPE rotary_dim {rope.rotary_dim} (even, 2..head_dim {rope.head_dim})")
    f = np.asarray(rope.inv_freq)
    if f.ndim != 2 or f.shape[0] not in (1, num_layers) or f.shape[1] != rope.rotary_dim // 2:
        raise SizeError(f"RoPE frequencies of shape {tuple(f.shape)} (1 or {num_layers} rows of "
                        f"{rope.rotary_dim // 2})")
    if not (np.isfinite(f).all() and (f >= 0).all() and (f <= 1).all()):
        raise SizeError("a RoPE frequency is not in [0, 1]")
    if rope.position_start + num_tokens > MAX_ROPE_POSITION:
        raise SizeError(f"RoPE positions {rope.position_start} + {num_tokens} tokens reach past 2^31")


def parse_rope(raw: bytes, o: int, num_layers: int, num_channels: int, num_tokens: int) -> tuple[Rope, int]:
    """The RoPE block at raw[o:], checked; and the offset after it."""
    if o + ROPE_BYTES > len(raw):
        raise SizeError("the Params block ends inside its RoPE block")
    style, zero, head_dim, rotary_dim, rows, start = struct.unpack_from("<BBHHHQ", raw, o)
    if zero:
        raise SizeError("a reserved RoPE byte is not zero")
    o += ROPE_BYTES
    if rows not in (1, num_layers) or rotary_dim % 2 or not rotary_dim:
        raise SizeError(f"RoPE block with {rows} frequency rows and rotary_dim {rotary_dim}")
    n = rows * (rotary_dim // 2)
    if o + 8 * n > len(raw):
        raise SizeError("the Params block ends inside its RoPE frequencies")
    freq = np.frombuffer(raw, "<f8", n, o).reshape(rows, rotary_dim // 2).astype(np.float64)
    rope = Rope(style, head_dim, rotary_dim, start, freq)
    check_rope(rope, num_layers, num_channels, num_tokens)
    return rope, o + 8 * n


@dataclass
class Params:
    """Arrays of the Params block ([L, 2, ...] indexed by layer and K/V)."""

    method: int
    modes: np.ndarray  # uint8 [L, 2, C]
    lo: np.ndarray  # int64 [L, 2, C]
    alphabet: np.ndarray  # int64 [L, 2, C]
    codes: np.ndarray  # uint8 [L, 2, C, width]  4-bit codes, zero past each alphabet
    calibration: bytes = bytes(32)  # SHA-256 of the rotation; zeros when none
    steps: np.ndarray | None = None  # uint16 [L, 2] bfloat16 bits          (method 2)
    offsets: np.ndarray | None = None  # uint16 [L, 2, C] bfloat16 bits     (method 2)
    sink: np.ndarray | None = None  # uint8 [L, 2, S, C, itemsize] raw words (method 2)
    shared: np.ndarray | None = None  # bool [L, 2, C]: uses the table of the previous own-table channel
    refine_tokens: int = 0  # the last refine_tokens tokens carry refine_bits more bits each (FLAG_REFINED)
    refine_bits: int = 0
    rope: Rope | None = None  # FLAG_ROPE: the keys are coded without their rotary embedding
    #: Set instead of modes / lo / alphabet / codes when the tables were only walked
    #: (parse_params(defer_tables=True)): where each entry's codes start in the Params block,
    #: and the table each entry uses (its own index, or the entry it shares).
    table_starts: np.ndarray | None = None
    table_source: np.ndarray | None = None

    @property
    def width(self) -> int:
        return int(self.codes.shape[-1])


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """float64 values of bfloat16 bit patterns."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def tables_size(alphabet: np.ndarray) -> int:
    return int((3 + (alphabet + 1) // 2).sum())


def params_size(method: int, num_layers: int, num_channels: int, sink_tokens: int, itemsize: int,
                alphabet: np.ndarray) -> int:
    size = tables_size(alphabet)
    if method == METHOD_TRANSFORM:
        size += 32 + 4 * num_layers + 4 * num_layers * num_channels + 2 * num_layers * sink_tokens * num_channels * itemsize
    return size


def refinement_bytes(num_layers: int, num_channels: int, tokens: int, bits: int) -> int:
    """Bytes of ``tokens`` tokens' refinement indices, ``bits`` bits each, packed (a chunk's raw section)."""
    return -(-(num_layers * 2 * tokens * num_channels * bits) // 8)


def pack_refinement(ref: np.ndarray, bits: int) -> bytes:
    """uint8 indices (any shape, row-major) -> ``bits`` bits each, least significant bit first."""
    v = np.ascontiguousarray(ref, np.uint8).reshape(-1)
    planes = (v[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_refinement(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    """Inverse of pack_refinement: ``count`` indices; the padding bits must be zero."""
    allbits = np.unpackbits(np.asarray(raw, np.uint8), bitorder="little")
    if allbits[count * bits :].any():
        raise SizeError("nonzero padding bits after a refinement section")
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (allbits[: count * bits].reshape(count, bits) * weights).sum(axis=1).astype(np.uint8)


def pack_params(p: Params) -> bytes:
    parts: list[bytes] = []
    if p.method == METHOD_TRANSFORM:
        parts += [p.calibration, np.ascontiguousarray(p.steps, "<u2").tobytes(),
                  np.ascontiguousarray(p.offsets, "<u2").tobytes(), np.ascontiguousarray(p.sink, np.uint8).tobytes()]
        if p.refine_tokens:
            parts.append(struct.pack("<IB", p.refine_tokens, p.refine_bits))
        if p.rope is not None:
            parts.append(p.rope.pack())
    shared = p.shared if p.shared is not None else np.zeros(p.modes.shape, np.bool_)
    parts.append(pack_tables(p.modes, p.lo, p.alphabet, p.codes, shared))
    return b"".join(parts)


def pack_tables(modes: np.ndarray, lo: np.ndarray, alphabet: np.ndarray, codes: np.ndarray,
                shared: np.ndarray) -> bytes:
    """Each table: mode, lo (int8 for method 2, uint8 for method 3), alphabet - 1, nibbles;
    a shared one: the single byte MODE_SAME."""
    shared = shared.reshape(-1)
    modes = modes.reshape(-1)
    lo = lo.reshape(-1)
    alphabet = alphabet.reshape(-1)
    codes = codes.reshape(alphabet.size, -1)
    nb = np.where(shared, 0, (alphabet + 1) // 2)
    head = np.where(shared, 1, 3)
    out = np.zeros(int((head + nb).sum()), np.uint8)
    starts = np.zeros(alphabet.size + 1, np.int64)
    np.cumsum(head + nb, out=starts[1:])
    s = starts[:-1]
    out[s] = np.where(shared, MODE_SAME, modes)
    own = ~shared
    s = s[own]
    lo, alphabet, codes, nb = lo[own], alphabet[own], codes[own], nb[own]
    if not own.any():
        return out.tobytes()
    out[s + 1] = (lo & 0xFF).astype(np.uint8)
    out[s + 2] = (alphabet - 1).astype(np.uint8)
    width = codes.shape[1]
    padded = np.zeros((alphabet.size, width + (width & 1)), np.uint8)
    padded[:, :width] = codes
    pairs = padded[:, 0::2] | (padded[:, 1::2] << 4)  # [N, ceil(width/2)]
    col = np.arange(pairs.shape[1])
    take = col[None, :] < nb[:, None]
    dest = (s + 3)[:, None] + col[None, :]
    out[dest[take]] = pairs[take]
    return out.tobytes()


def parse_params(raw: bytes, method: int, num_layers: int, num_channels: int, sink_tokens: int, dtype: str,
                 rotated: bool, refined: bool = False, num_tokens: int = 0, defer_tables: bool = False,
                 roped: bool = False) -> Params:
    """Parse and check a Params block of exactly len(raw) bytes (``refined``: the header's FLAG_REFINED).

    With ``defer_tables`` the tables are only walked (every entry's size checked against the
    bytes left, the block filled exactly): the returned Params has table_starts and
    table_source instead of the table arrays, for a decoder that reads and checks the
    entries themselves (device_pipeline does, on the GPU)."""
    L, C = num_layers, num_channels
    itemsize = ITEMSIZE[dtype]
    o = 0
    calibration = bytes(32)
    steps = offsets = sink = None
    refine_tokens = refine_bits = 0
    rope = None
    if method == METHOD_TRANSFORM:
        fixed = 32 + 4 * L + 4 * L * C + 2 * L * sink_tokens * C * itemsize + (REFINEMENT_BYTES if refined else 0)
        if fixed > len(raw):
            raise SizeError("the Params block is shorter than its fixed part")
        calibration = bytes(raw[:32])
        if rotated == (calibration == bytes(32)):
            raise SizeError("the calibration hash disagrees with the header's rotation flag")
        o = 32
        steps = np.frombuffer(raw, "<u2", 2 * L, o).reshape(L, 2).astype(np.uint16)
        o += 4 * L
        offsets = np.frombuffer(raw, "<u2", 2 * L * C, o).reshape(L, 2, C).astype(np.uint16)
        o += 4 * L * C
        n = 2 * L * sink_tokens * C * itemsize
        sink = np.frombuffer(raw, np.uint8, n, o).reshape(L, 2, sink_tokens, C, itemsize).copy()
        o += n
        if refined:
            refine_tokens, refine_bits = struct.unpack_from("<IB", raw, o)
            o += REFINEMENT_BYTES
            if not 1 <= refine_bits <= MAX_REFINE_BITS:
                raise SizeError(f"{refine_bits} refinement bits (1..{MAX_REFINE_BITS})")
            if not 1 <= refine_tokens <= num_tokens - sink_tokens:
                raise SizeError(f"{refine_tokens} refined tokens in a cache of {num_tokens} with {sink_tokens} sink "
                                "token(s)")
        if roped:
            rope, o = parse_rope(raw, o, L, C, num_tokens)
        if (steps & 0x8000).any() or ((steps & 0x7F80) == 0x7F80).any() or (steps == 0).any():
            raise SizeError("a quantization step is not positive and finite")
        if ((offsets & 0x7F80) == 0x7F80).any():
            raise SizeError("an offset is not finite")
        if rotated:
            check_rotated_range(steps, offsets)
    elif method != METHOD_LOSSLESS:
        raise UnsupportedVersionError(f"unknown quantization method {method}")
    elif roped:
        raise SizeError("the RoPE flag is set on a lossless file")
    if defer_tables:
        # each entry's table: its own, or the nearest preceding own one (a plane's first entry is own)
        starts, heads, source = walk_table_entries(raw, o, L * 2 * C, C, np.int32)  # (< MAX_PARAMS_BYTES)
        shared = heads == MODE_SAME
        return Params(method, None, None, None, None, calibration, steps, offsets, sink, shared.reshape(L, 2, C),
                      refine_tokens, refine_bits, rope, starts, source)
    modes, lo, alphabet, codes, shared = parse_tables(raw, o, L * 2 * C, method, C)
    shape = (L, 2, C)
    shared = shared.reshape(shape)
    arrays = [modes.reshape(shape), lo.reshape(shape), alphabet.reshape(shape), codes.reshape(shape + (codes.shape[-1],))]
    if shared.any():
        arrays = expand_shared(shared, *arrays)
    return Params(method, *arrays, calibration, steps, offsets, sink, shared, refine_tokens, refine_bits, rope)


def walk_table_entries(raw: bytes, start: int, count: int, per_plane: int,
                       index_dtype=np.int64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, heads, source): where each of ``count`` table entries from ``start`` has its
    codes, its first byte, and the entry whose table it uses (itself, or for a "same" entry the
    nearest preceding one with its own table); the entries checked to fit and to end exactly
    at the end of ``raw``.  ``index_dtype``: of starts and source (int32: half the bytes to
    copy to a device; a Params block is under 2^31 bytes)."""
    from ..kernels.cpu_transform import walk_tables

    buf = np.frombuffer(raw, np.uint8)
    starts = np.empty(count, index_dtype)
    heads = np.zeros(count, np.uint8)
    source = np.empty(count, index_dtype)
    end = walk_tables(buf, start, count, per_plane, starts, heads, source)
    if end == -(1 << 40):
        raise SizeError("the first table of a (layer, K/V) cannot refer to a previous one")
    if end < 0:
        raise TruncatedError(f"the Params block ends inside table {-1 - end}")
    if end != len(buf):
        raise SizeError("bytes left over after the tables of the Params block")
    return starts, heads, source


def parse_tables(raw: bytes, start: int, count: int, method: int, per_plane: int):
    """Walk ``count`` tables from ``start`` (``per_plane`` per (layer, K/V)); they must end
    exactly at the end of ``raw``."""
    buf = np.frombuffer(raw, np.uint8)
    modes = np.empty(count, np.uint8)
    lo = np.empty(count, np.int64)
    alphabet = np.empty(count, np.int64)
    # Tables have variable sizes: a small kernel walks them in order, checking each
    # entry's size against the bytes left before stepping over it.
    starts, heads, _ = walk_table_entries(raw, start, count, per_plane)
    shared = heads == MODE_SAME
    own = ~shared
    modes[:] = np.where(shared, MODE_DIRECT, heads)
    idx = np.where(own, starts, 0)
    lo[:] = np.where(own, buf[np.maximum(idx - 2, 0)], 0)
    alphabet[:] = np.where(own, buf[np.maximum(idx - 1, 0)].astype(np.int64) + 1, 1)
    if method == METHOD_TRANSFORM:
        lo = np.where(lo >= 128, lo - 256, lo)
        bad_mode = (modes != MODE_DIRECT) & (modes != MODE_DELTA)
        top = lo + alphabet - 1
        if (lo < -TRANSFORM_QMAX).any() or (top > TRANSFORM_QMAX).any() or (alphabet > 255).any():
            raise SizeError("a table's range exceeds the levels of method 2")
    else:
        bad_mode = modes != MODE_DIRECT
        if (lo + alphabet > 256).any():
            raise SizeError("a table's range exceeds a byte")
    if bad_mode.any():
        raise UnsupportedVersionError(f"unknown table mode {int(modes[bad_mode][0])}")
    width = int(alphabet.max(initial=1))
    nbw = (width + 1) // 2
    col = np.arange(nbw)
    nb = np.where(shared, 0, (alphabet + 1) // 2)
    take = col[None, :] < nb[:, None]
    idx = np.where(take, starts[:, None] + col[None, :], 0)
    pairs = np.where(take, buf[idx], 0).astype(np.uint8)
    codes = np.empty((count, 2 * nbw), np.uint8)
    codes[:, 0::2] = pairs & 0x0F
    codes[:, 1::2] = pairs >> 4
    odd = ((alphabet & 1) == 1) & ~shared
    if (codes[np.flatnonzero(odd), alphabet[odd]] != 0).any():
        raise SizeError("a padding nibble of a table is not zero")
    return modes, lo, alphabet, np.ascontiguousarray(codes[:, :width]), shared


def expand_shared(shared, *arrays):
    """Copy, along the channel axis of [L, 2, C, ...] arrays, each shared channel's entries
    from the last channel before it in its (layer, K/V) that has its own table."""
    from ..kernels import cpu_transform as k2

    C = shared.shape[2]
    idx = np.where(shared, 0, np.arange(C)[None, None, :])
    np.maximum.accumulate(idx, axis=2, out=idx)
    out = []
    for a in arrays:
        if a.ndim == 4:  # the codes and CDF tables: a parallel row copy (take_along_axis runs on one core)
            dst = np.empty(a.shape, a.dtype)
            k2.take_channels(np.ascontiguousarray(a), idx, dst)
            out.append(dst)
            continue
        take = idx.reshape(idx.shape + (1,) * (a.ndim - 3))
        out.append(np.ascontiguousarray(np.take_along_axis(a, np.broadcast_to(take, idx.shape + a.shape[3:]), axis=2)))
    return out


#: The levels a decoded (layer, K/V, channel, token) may take, direct or summed from token
#: deltas (docs/format.md, "Levels"): method 2's levels in [-127, 127], method 3's coded top
#: bytes in [0, 255].  A chunk whose token deltas add up to a level outside is rejected: a
#: decoder would otherwise wrap it (int16) or mask it (a top byte) differently from the spec.
LEVEL_RANGE = {METHOD_TRANSFORM: (-127, 127), METHOD_LOSSLESS: (0, 255)}


def check_level_range(low: int, high: int, method: int) -> None:
    """Raise SizeError when the smallest and largest decoded levels of a run of chunks leave the method's range."""
    lo, hi = LEVEL_RANGE[method]
    if low < lo or high > hi:
        bad = low if low < lo else high
        raise SizeError(f"a decoded level ({bad}) is outside [{lo}, {hi}]: the token deltas add up past the "
                        f"method's range")


#: float32's largest finite value.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_rotated_range(steps: np.ndarray, offsets: np.ndarray) -> None:
    """A rotated file's coordinates z = float32(q x s + m[d]) must all be finite for every level
    |q| <= 128 (refined levels included): the rotation sums them, and an infinite z would make
    Inf - Inf = NaN, which no saturation can undo (docs/format.md).  steps uint16 [L, 2],
    offsets uint16 [L, 2, C] (bfloat16 bits)."""
    s = bf16_values(steps).astype(np.float64)
    m = np.abs(bf16_values(offsets).astype(np.float64)).max(axis=-1, initial=0.0)
    top = 128.0 * s + m
    if (top > FLOAT32_MAX).any():
        l, kv = (int(i) for i in np.argwhere(top > FLOAT32_MAX)[0])
        raise SizeError(f"layer {l} {'KV'[kv]}: the largest level times the step plus the offset "
                        f"({top[l, kv]:.3g}) exceeds float32's range in a rotated file")
