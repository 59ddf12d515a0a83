#!/usr/bin/env python3
"""An independent reference decoder for `.cgen` files, written from docs/format.md alone.

It imports nothing from cachegen: plain Python, numpy and the standard library, one
function per section of the spec, no speed tricks beyond numpy's element-wise arithmetic
(the range coder runs symbol by symbol in Python, so a large file takes minutes).  It
decodes format version 1 (method 1), version 2 (methods 2 and 3, every flag) and version 3
(the multi-part container: its groups are version 1 / 2 files decoded as such, its extras raw
bytes) and checks what the spec's "Rules for readers" say a reader MUST check.  It is the spec's
conformance test: tests/test_reference_decoder.py decodes every golden file and every
kind of file cachegen writes with both this module and cachegen, and compares the bits.

Usage::

    python reference/cgen_reference.py kv.cgen -o kv.safetensors
    python reference/cgen_reference.py kv.cgen --calibration cal.safetensors -o kv.npz

A `.safetensors` output holds the tensors as `cachegen decode` writes them (names, shapes,
dtypes, metadata); a `.npz` output holds numpy arrays of the tensors' dtypes, bfloat16 and
float8 values widened (exactly) to float32.

Library use: ``decode(blob, calibration=path_or_None) -> Decoded`` (its ``tensors`` map
each name to ``(dtype_name, words)``, ``words`` an unsigned-integer array of the values'
bit patterns in the tensor's shape; a version 3 file's ``groups`` hold each group's Decoded).
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import os
import re
import signal
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"\x89CGEN\r\n\x1a"
CHUNK_MAGIC = b"CGCK"
INDEX_MAGIC = b"CGIX"
TRAILER_MAGIC = b"CGENDIDX"

# Caps of the FileHeader table ("FileHeader (64 bytes)").
MAX_DESCRIPTOR_BYTES = 16 << 20
MAX_TOKENS = (1 << 32) - 1
MAX_LAYERS = 4096
MAX_CHANNELS = 65536
MAX_CHUNK_TOKENS = 16384
MAX_CHUNKS = 1 << 24
MAX_STREAM_SYMBOLS = 16384  # G x chunk_tokens
MAX_DEPTH = 16
MAX_PARAMS_BYTES = 1 << 30

PROB_BITS = 15
PROB_TOTAL = 1 << PROB_BITS
#: "CDF codes": weight(k) = round(16 x 2^(0.6 (k-1))), the list docs/format.md gives.
CODE_WEIGHTS = (0, 16, 24, 37, 56, 84, 128, 194, 294, 446, 676, 1024, 1552, 2353, 3566, 5405)

#: dtype code -> (name, bytes per word, safetensors dtype)
DTYPES = {1: ("float16", 2, "F16"), 2: ("bfloat16", 2, "BF16"), 3: ("float32", 4, "F32")}
LAYOUTS = {1: "stacked", 2: "per-layer"}

FLAG_ROTATED = 1
FLAG_REFINED = 2
FLAG_ROPE = 4
FLAG_FIXED_ROTATION = 8

#: layers.{i}.key / layers.{i}.value, {i} one to nine ASCII digits (docs/format.md, "Descriptor")
PER_LAYER_NAME = re.compile(r"layers\.([0-9]{1,9})\.(key|value)")

FLOAT32_MAX = 3.4028234663852886e38


class FormatViolation(ValueError):
    """The bytes break a rule of docs/format.md."""


# ---------------------------------------------------------------- CRC-32


def crc32(*parts: bytes) -> int:
    """CRC-32 of the concatenated parts, with the parameters docs/format.md lists
    (zlib's: reflected polynomial 0xEDB88320, init 0xFFFFFFFF, final xor 0xFFFFFFFF)."""
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc & 0xFFFFFFFF


def crc32_from_parameters(data: bytes) -> int:
    """The same CRC computed bit by bit from the parameters alone (slow; the test checks
    that it equals ``crc32``, i.e. that the page's parameters describe what zlib computes)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- bytes


class Bytes:
    """A bounds-checked view of the file: nothing is read past what is there."""

    def __init__(self, blob: bytes) -> None:
        self.blob = bytes(blob)

    def __len__(self) -> int:
        return len(self.blob)

    def take(self, offset: int, size: int, what: str) -> bytes:
        if offset < 0 or size < 0 or offset + size > len(self.blob):
            raise FormatViolation(f"the file ends inside the {what}")
        return self.blob[offset : offset + size]

    def unpack(self, fmt: str, offset: int, what: str) -> tuple:
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(offset, s.size, what))


def check(condition: bool, message: str) -> None:
    if not condition:
        raise FormatViolation(message)


# ---------------------------------------------------------------- FileHeader


@dataclass
class Header:
    version: int
    descriptor_size: int
    num_tokens: int
    L: int  # num_layers
    C: int  # num_channels
    chunk_tokens: int
    num_chunks: int
    G: int  # channels_per_stream
    dtype: int
    layout: int
    method: int
    prob_bits: int
    cdf_coding: int
    crc: int
    flags: int = 0
    params_size: int = 0
    sink_tokens: int = 0

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def word_bytes(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def groups(self) -> int:
        return -(-self.C // self.G)


def parse_file_header(f: Bytes) -> Header:
    raw = f.take(0, 64, "FileHeader")
    check(raw[:8] == MAGIC, "bad magic: not a .cgen file")
    (version,) = struct.unpack_from("<H", raw, 8)
    check(version in (1, 2), f"format version {version} is not 1 or 2")
    if version == 1:
        (_, version, header_size, desc_size, num_tokens, L, C, chunk_tokens, num_chunks, G, dtype, layout, method,
         prob_bits, cdf_coding, reserved, crc) = struct.unpack("<8sHHIQIIIIHBBBBB13sI", raw)
        h = Header(version, desc_size, num_tokens, L, C, chunk_tokens, num_chunks, G, dtype, layout, method, prob_bits,
                   cdf_coding, crc)
        check(reserved == bytes(13), "reserved header bytes are not zero")
        check(method == 1, f"unknown method {method} for version 1")
        check(cdf_coding == 1, f"unknown cdf_coding {cdf_coding} for version 1")
    else:
        (_, version, header_size, desc_size, num_tokens, L, C, chunk_tokens, num_chunks, G, dtype, layout, method,
         prob_bits, cdf_coding, flags, params_size, sink_tokens, reserved, crc) = struct.unpack(
            "<8sHHIQIIIIHBBBBBBIIII", raw)
        h = Header(version, desc_size, num_tokens, L, C, chunk_tokens, num_chunks, G, dtype, layout, method, prob_bits,
                   cdf_coding, crc, flags, params_size, sink_tokens)
        check(reserved == 0, "reserved header field is not zero")
        check(method in (2, 3), f"unknown method {method} for version 2")
        check(cdf_coding == 2, f"unknown cdf_coding {cdf_coding} for version 2")
        check(flags & ~(FLAG_ROTATED | FLAG_REFINED | FLAG_ROPE | FLAG_FIXED_ROTATION) == 0, "unknown header flags")
        check(not flags & FLAG_FIXED_ROTATION or flags & FLAG_ROTATED, "flags bit 3 without bit 0")
        check(method == 2 or (flags == 0 and sink_tokens == 0), "method 3 has no flags and no sink tokens")
        check(sink_tokens <= num_tokens, "more sink tokens than tokens")
        check(1 <= params_size <= MAX_PARAMS_BYTES, "params_size out of range")
    check(header_size == 64, "header_size is not 64")
    check(1 <= desc_size <= MAX_DESCRIPTOR_BYTES, "descriptor_size out of range")
    check(num_tokens <= MAX_TOKENS, "num_tokens out of range")
    check(1 <= L <= MAX_LAYERS, "num_layers out of range")
    check(1 <= C <= MAX_CHANNELS, "num_channels out of range")
    check(1 <= chunk_tokens <= MAX_CHUNK_TOKENS, "chunk_tokens out of range")
    check(num_chunks == -(-num_tokens // chunk_tokens) and num_chunks <= MAX_CHUNKS, "num_chunks is wrong")
    check(1 <= G <= C and G * chunk_tokens <= MAX_STREAM_SYMBOLS, "channels_per_stream out of range")
    check(dtype in DTYPES, f"unknown dtype code {dtype}")
    check(layout in LAYOUTS, f"unknown layout code {layout}")
    check(prob_bits == PROB_BITS, f"prob_bits {prob_bits} is not 15")
    return h


# ---------------------------------------------------------------- Descriptor


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest, brackets inside strings not counted (before parsing)."""
    depth = top = 0
    in_string = escaped = False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == 0x5C:  # backslash
                escaped = True
            elif ch == 0x22:
                in_string = False
        elif ch == 0x22:
            in_string = True
        elif ch in (0x5B, 0x7B):
            depth += 1
            top = max(top, depth)
        elif ch in (0x5D, 0x7D):
            depth -= 1
    return top


def load_json(raw: bytes, what: str):
    """A Descriptor's or Manifest's JSON, its depth checked before parsing."""
    check(json_depth(raw) <= MAX_DEPTH, f"the {what} nests more than 16 deep")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatViolation(f"the {what} is not UTF-8 JSON: {exc}") from None


def parse_descriptor(raw: bytes, h: Header) -> dict:
    d = load_json(raw, "Descriptor")

    def is_int(v) -> bool:  # a JSON integer: no fraction, no exponent, not true / false
        return type(v) is int

    check(isinstance(d, dict), "the Descriptor is not an object")
    check(d.get("layout") == LAYOUTS[h.layout], "the Descriptor's layout disagrees with the header")
    H, D = d.get("num_kv_heads"), d.get("head_dim")
    check(is_int(H) and is_int(D) and H >= 1 and D >= 1 and H * D == h.C, "num_kv_heads x head_dim != num_channels")
    meta = d.get("metadata", {})
    check(isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()),
          "metadata does not map strings to strings")
    tensors = d.get("tensors")
    check(isinstance(tensors, list) and len(tensors) > 0, "the Descriptor lists no tensors")
    names = set()
    for e in tensors:
        check(isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("shape"), list),
              "a tensor entry is not {name, shape}")
        check(all(is_int(s) and s >= 0 for s in e["shape"]), "a shape entry is not a non-negative JSON integer")
        check(e["name"] not in names, f"tensor {e['name']!r} is listed twice")
        names.add(e["name"])
    T = h.num_tokens
    if d["layout"] == "stacked":
        check(len(tensors) == 1 and tensors[0]["shape"] == [h.L, 2, T, H, D], "stacked tensor shape is wrong")
    else:
        check(len(tensors) == 2 * h.L, "per-layer: not 2 x num_layers tensors")
        slots = set()
        for e in tensors:
            m = PER_LAYER_NAME.fullmatch(e["name"])
            check(m is not None, f"per-layer tensor name {e['name']!r} is not layers.{{i}}.key / .value")
            slot = (int(m.group(1)), m.group(2))
            check(slot[0] < h.L and slot not in slots, f"tensor {e['name']!r}: bad or repeated layer")
            slots.add(slot)
            check(e["shape"] in ([H, T, D], [1, H, T, D]), f"tensor {e['name']!r} has the wrong shape")
    return d


# ---------------------------------------------------------------- CDF codes and the range coder


def cum_from_codes(codes) -> list[int]:
    """"CDF codes": A 4-bit codes -> cum[0..A] (cum[A] = 32768), every freq >= 1."""
    A = len(codes)
    W = sum(CODE_WEIGHTS[c] for c in codes)
    spare = PROB_TOTAL - A
    freq = [1 + (CODE_WEIGHTS[c] * spare) // W if W else 1 for c in codes]
    best = max(range(A), key=lambda s: (codes[s], -s))  # the first symbol with the highest code
    freq[best] += PROB_TOTAL - sum(freq)
    cum = [0]
    for fr in freq:
        cum.append(cum[-1] + fr)
    return cum


def nibbles(raw: bytes, count: int) -> list[int]:
    """``count`` 4-bit codes, symbol 2i in the low nibble of byte i; a padding nibble MUST be zero."""
    out = []
    for b in raw:
        out += [b & 15, b >> 4]
    if count % 2:
        check(out[count] == 0, "a padding nibble is not zero")
    return out[:count]


class RangeDecoder:
    """"Streams and the range coder", decode side, on Python integers."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 4
        self.code = int.from_bytes(data[:4].ljust(4, b"\0"), "big")  # bytes past the end read as 0
        self.range = 0xFFFFFFFF

    def symbol(self, cum: list[int]) -> int:
        r = self.range >> PROB_BITS
        q = min(self.code // r, PROB_TOTAL - 1)
        s = bisect.bisect_right(cum, q) - 1  # cum[s] <= q < cum[s+1]
        self.code -= r * cum[s]
        self.range = r * (cum[s + 1] - cum[s])
        while self.range < (1 << 24):
            byte = self.data[self.pos] if self.pos < len(self.data) else 0
            self.pos += 1
            self.code = ((self.code << 8) | byte) & 0xFFFFFFFF
            self.range <<= 8
        return s


def decode_stream(data: bytes, cums: list[list[int]], tokens: int) -> np.ndarray:
    """A stream's symbols [tokens, len(cums)]: token by token, within a token channel by channel."""
    dec = RangeDecoder(data)
    out = np.empty((tokens, len(cums)), np.int64)
    for t in range(tokens):
        for c, cum in enumerate(cums):
            out[t, c] = dec.symbol(cum)
    return out


# ---------------------------------------------------------------- value casts


def bf16_to_f64(bits) -> np.ndarray:
    """bfloat16 bit patterns -> their values (exact)."""
    b = np.asarray(bits, np.uint32) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def to_dtype_words(x: np.ndarray, dtype: int) -> np.ndarray:
    """float32 values -> the source dtype's words, rounded to nearest even and saturating:
    a value the cast would turn into an infinity becomes the largest finite value, with its sign."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == 3:
        y = np.where(np.isinf(x), np.copysign(np.float32(FLOAT32_MAX), x), x).astype(np.float32)
        return y.view(np.uint32)
    if dtype == 1:
        with np.errstate(over="ignore"):
            y = x.astype(np.float16)
        y = np.where(np.isinf(y), np.copysign(np.float16(65504), y), y).astype(np.float16)
        return y.view(np.uint16)
    bits = x.view(np.uint32).astype(np.uint64)
    check(not np.isnan(x).any(), "a decoded value is NaN")
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    inf = (rounded & 0x7FFF) == 0x7F80
    rounded = np.where(inf, (rounded & 0x8000) | 0x7F7F, rounded)
    return rounded.astype(np.uint16)


# ---------------------------------------------------------------- version 2: Params


@dataclass
class Table:
    mode: int
    lo: int
    cum: list[int]


@dataclass
class Params:
    calibration: bytes = bytes(32)
    steps: np.ndarray | None = None  # float64 [L, 2]
    offsets: np.ndarray | None = None  # float64 [L, 2, C]
    sink: np.ndarray | None = None  # words [L, 2, S, C]
    refine_tokens: int = 0
    refine_bits: int = 0
    rope: tuple | None = None  # (style, head_dim, rotary_dim, position_start, frequencies float64 [F, r/2])
    tables: list = field(default_factory=list)  # [L][2][C] Table


def parse_params(raw: bytes, h: Header) -> Params:
    L, C, S, w = h.L, h.C, h.sink_tokens, h.word_bytes
    p = Params()
    o = 0
    if h.method == 2:
        fixed = 32 + 4 * L + 4 * L * C + 2 * L * S * C * w + (5 if h.flags & FLAG_REFINED else 0)
        check(fixed <= len(raw), "the Params block is shorter than its fixed part")
        p.calibration = raw[:32]
        check((p.calibration != bytes(32)) == bool(h.flags & FLAG_ROTATED),
              "the calibration hash is non-zero exactly when the rotation flag is set")
        o = 32
        steps = np.frombuffer(raw, "<u2", 2 * L, o).reshape(L, 2)
        o += 4 * L
        offsets = np.frombuffer(raw, "<u2", 2 * L * C, o).reshape(L, 2, C)
        o += 4 * L * C
        check(not ((steps & 0x8000) | (steps == 0)).any() and not ((steps & 0x7F80) == 0x7F80).any(),
              "a step is not positive and finite")
        check(not ((offsets & 0x7F80) == 0x7F80).any(), "an offset is not finite")
        p.steps, p.offsets = bf16_to_f64(steps), bf16_to_f64(offsets)
        p.sink = np.frombuffer(raw, f"<u{w}", L * 2 * S * C, o).reshape(L, 2, S, C)
        o += 2 * L * S * C * w
        if h.flags & FLAG_REFINED:
            p.refine_tokens, p.refine_bits = struct.unpack_from("<IB", raw, o)
            o += 5
            check(1 <= p.refine_bits <= 8, "refine_bits out of range")
            check(1 <= p.refine_tokens <= h.num_tokens - S, "refine_tokens out of range")
        if h.flags & FLAG_ROPE:
            check(o + 16 <= len(raw), "the Params block ends inside the RoPE block")
            style, zero, D, r, F, p0 = struct.unpack_from("<BBHHHQ", raw, o)
            o += 16
            check(style in (0, 1) and zero == 0, "RoPE style or reserved byte")
            check(2 <= D <= C and C % D == 0, "RoPE head_dim does not divide the channels")
            check(r % 2 == 0 and 2 <= r <= D, "RoPE rotary_dim")
            check(F in (1, L), "RoPE frequency rows")
            check(o + 8 * F * (r // 2) <= len(raw), "the Params block ends inside the RoPE frequencies")
            freq = np.frombuffer(raw, "<f8", F * (r // 2), o).reshape(F, r // 2)
            o += 8 * F * (r // 2)
            check(bool(np.all((freq >= 0) & (freq <= 1))), "a RoPE frequency is outside [0, 1]")
            check(p0 + h.num_tokens <= 1 << 31, "RoPE positions reach 2^31")
            p.rope = (style, D, r, p0, freq)
        if h.flags & FLAG_ROTATED:
            top = 128 * p.steps + np.abs(p.offsets).max(axis=2)
            check(not (top > FLOAT32_MAX).any(), "128 x s + max |m| exceeds float32's range in a rotated file")
    tables = []
    for l in range(L):
        planes = []
        for kv in range(2):
            row = []
            for c in range(C):
                check(o < len(raw), "the Params block ends inside the tables")
                mode = raw[o]
                if mode == 2:
                    check(c > 0, "the first channel of a (layer, K/V) has no table to share")
                    row.append(row[-1])
                    o += 1
                    continue
                check(o + 3 <= len(raw), "the Params block ends inside a table")
                lo, A = raw[o + 1], raw[o + 2] + 1
                nb = (A + 1) // 2
                check(o + 3 + nb <= len(raw), "the Params block ends inside a table's codes")
                codes = nibbles(raw[o + 3 : o + 3 + nb], A)
                o += 3 + nb
                if h.method == 2:
                    check(mode in (0, 1), f"unknown table mode {mode}")
                    lo = lo - 256 if lo >= 128 else lo
                    check(-127 <= lo and lo + A - 1 <= 127 and A <= 255, "a table exceeds method 2's levels")
                else:
                    check(mode == 0, f"table mode {mode} is not allowed for method 3")
                    check(lo + A <= 256, "a table exceeds a byte")
                row.append(Table(mode, lo, cum_from_codes(codes)))
            planes.append(row)
        tables.append(planes)
    check(o == len(raw), "the tables do not end at the end of the Params block")
    p.tables = tables
    return p


# ---------------------------------------------------------------- calibration files


def read_safetensors(path: str) -> tuple[dict, dict, bytes]:
    """(tensor entries, metadata, data bytes) of a safetensors file (its 8-byte length, JSON header, data)."""
    with open(path, "rb") as fh:
        blob = fh.read()
    check(len(blob) >= 8, f"{path}: not a safetensors file")
    (n,) = struct.unpack_from("<Q", blob, 0)
    check(8 + n <= len(blob), f"{path}: not a safetensors file")
    head = json.loads(blob[8 : 8 + n].decode("utf-8"))
    meta = head.pop("__metadata__", {}) or {}
    return head, meta, blob[8 + n :]


def load_rotation(path: str, h: Header, want_sha: bytes) -> np.ndarray:
    """The calibration's rotation as the full float32 [L, 2, C, C] matrices (a version 2 file's
    diagonal blocks [L, 2, H, D, D] placed on the diagonal), checked against the file's SHA-256."""
    head, meta, data = read_safetensors(path)
    check(meta.get("format") == "cachegen-calibration", f"{path}: not a cachegen calibration file")
    version = meta.get("version")
    check(version in ("1", "2"), f"{path}: calibration version {version!r} is not 1 or 2")
    e = head.get("rotation")
    shape = e.get("shape") if isinstance(e, dict) else None
    if version == "1":
        ok = shape == [h.L, 2, h.C, h.C]
    else:
        ok = (isinstance(shape, list) and len(shape) == 5 and shape[:2] == [h.L, 2] and shape[3] == shape[4]
              and all(isinstance(v, int) and v > 0 for v in shape[2:]) and shape[2] * shape[3] == h.C)
    check(ok and e.get("dtype") == "F32", f"{path}: no float32 rotation for {h.L} layers x {h.C} channels")
    n = int(np.prod(shape))
    a, b = e["data_offsets"]
    check(b - a == 4 * n and b <= len(data), f"{path}: bad rotation data offsets")
    raw = data[a:b]
    check(hashlib.sha256(raw).digest() == want_sha, f"{path}: the calibration's SHA-256 is not the file's")
    if version == "1":
        return np.frombuffer(raw, "<f4").reshape(h.L, 2, h.C, h.C)
    H, D = shape[2], shape[3]
    blocks = np.frombuffer(raw, "<f4").reshape(h.L, 2, H, D, D)
    full = np.zeros((h.L, 2, h.C, h.C), np.float32)
    for g in range(H):
        full[:, :, g * D : (g + 1) * D, g * D : (g + 1) * D] = blocks[:, :, g]
    return full


def calibration_version(path: str) -> str | None:
    return read_safetensors(path)[1].get("version")


def load_group_rotation(path: str, g: dict, tensors: list, h: Header, want_sha: bytes) -> np.ndarray:
    """A version 3 calibration's rotation of one group of a version 3 file, as the full float32
    [L, 2, C, C] matrices of the group's file: each member's planes' rotation.{layer}.{kind}
    blocks in the file's (layer, K/V) order (a "planes" group: the first half of a plane's
    blocks in the K slot, the second in the V slot), checked against the group file's SHA-256."""
    head, meta, data = read_safetensors(path)
    check(meta.get("format") == "cachegen-calibration", f"{path}: not a cachegen calibration file")
    rows = []
    for member in g["members"]:
        pair = []
        for ti, *sel in member:
            e = tensors[ti]
            layer, kind = (sel[0], ("key", "value")[sel[1]]) if e["form"] == "L2THD" else (e["layer"], e["kind"])
            t = head.get(f"rotation.{layer}.{kind}")
            check(isinstance(t, dict) and t.get("dtype") == "F32" and isinstance(t.get("shape"), list)
                  and len(t["shape"]) == 3 and t["shape"][1] == t["shape"][2] and all(
                      isinstance(v, int) and v > 0 for v in t["shape"]),
                  f"{path}: no float32 [B, D, D] rotation.{layer}.{kind}")
            B, D = t["shape"][0], t["shape"][1]
            a, b = t["data_offsets"]
            check(b - a == 4 * B * D * D and b <= len(data), f"{path}: bad data offsets of rotation.{layer}.{kind}")
            r = np.frombuffer(data[a:b], "<f4").reshape(B, D, D)
            if g["kind"] == "kv":
                pair.append(r)
            else:
                check(B % 2 == 0, f"{path}: rotation.{layer}.{kind} of a plane coded in halves has an odd block count")
                pair += [r[: B // 2], r[B // 2 :]]
        rows.append(pair)
    check(len({p.shape for pair in rows for p in pair}) == 1, f"{path}: a group's rotations differ in blocks")
    blocks = np.ascontiguousarray(np.stack([np.stack(pair) for pair in rows]), "<f4")  # [L, 2, B', D, D]
    L, _, Bg, D, _ = blocks.shape
    check((L, Bg * D) == (h.L, h.C), f"{path}: the group's rotations are for {Bg * D} channels, its file has {h.C}")
    check(hashlib.sha256(blocks.tobytes()).digest() == want_sha, f"{path}: the group's rotation SHA-256 is not its file's")
    full = np.zeros((h.L, 2, h.C, h.C), np.float32)
    for k in range(Bg):
        full[:, :, k * D : (k + 1) * D, k * D : (k + 1) * D] = blocks[:, :, k]
    return full


# ---------------------------------------------------------------- chunks


@dataclass
class ChunkSections:
    index: int
    first_token: int
    tokens: int
    sections: list  # bytes of each section, in order
    end: int  # offset just past the chunk


def read_chunk(f: Bytes, at: int, k: int, h: Header, expected_sizes: list[int | None], stream_count: int,
               max_stream: int) -> ChunkSections:
    """A chunk at offset ``at``: its header checked, its CRC verified, its sections cut."""
    magic, index, first, count, s0, s1, s2, payload, reserved, crc = f.unpack("4sIIIIIIIII", at, f"chunk {k} header")
    check(magic == CHUNK_MAGIC, f"chunk {k}: bad magic")
    check(index == k and first == k * h.chunk_tokens, f"chunk {k}: wrong index or first token")
    check(count == min(h.chunk_tokens, h.num_tokens - first), f"chunk {k}: wrong token count")
    check(reserved == 0, f"chunk {k}: reserved field not zero")
    sizes = [s0, s1, s2, payload]
    for i, want in enumerate(expected_sizes):
        if want is not None:
            check(sizes[i] == want, f"chunk {k}: section {i + 1} has {sizes[i]} bytes, not {want}")
    check(payload <= stream_count * max_stream, f"chunk {k}: payload too large")
    body = f.take(at + 40, sum(sizes), f"chunk {k}")
    check(crc32(f.take(at, 36, "chunk header"), body) == crc, f"chunk {k}: CRC mismatch")
    sections, o = [], 0
    for s in sizes:
        sections.append(body[o : o + s])
        o += s
    return ChunkSections(k, first, count, sections, at + 40 + len(body))


def stream_payloads(lengths_raw: bytes, payload: bytes, count: int, max_stream: int, k: int) -> list[bytes]:
    lengths = struct.unpack(f"<{count}H", lengths_raw)
    check(sum(lengths) == len(payload), f"chunk {k}: stream lengths do not add up to payload_size")
    check(max(lengths, default=0) <= max_stream, f"chunk {k}: a stream is longer than 2 x (Tk x G) + 8 bytes")
    out, o = [], 0
    for n in lengths:
        out.append(payload[o : o + n])
        o += n
    return out


def group_channels(h: Header, g: int) -> range:
    return range(g * h.G, min(h.C, (g + 1) * h.G))


# ---------------------------------------------------------------- version 1


def decode_v1_chunk(ch: ChunkSections, h: Header, bins: list[tuple[int, int]], out: np.ndarray) -> None:
    scales_raw, codes_raw, lengths_raw, payload = ch.sections
    Tk, L, C = ch.tokens, h.L, h.C
    scales = np.frombuffer(scales_raw, "<u2").reshape(L, 2, Tk)
    check(not (scales & 0x8000).any() and not ((scales & 0x7F80) == 0x7F80).any(),
          f"chunk {ch.index}: a scale is negative or not finite")
    streams = stream_payloads(lengths_raw, payload, L * 2 * h.groups, 2 * Tk * h.G + 8, ch.index)
    o = 0
    cums = {}
    for l in range(L):
        for kv in range(2):
            A = 2 * ((bins[l][kv] - 1) // 2) + 1
            nb = (A + 1) // 2
            for c in range(C):
                cums[l, kv, c] = cum_from_codes(nibbles(codes_raw[o : o + nb], A))
                o += nb
    for l in range(L):
        for kv in range(2):
            maxq = (bins[l][kv] - 1) // 2
            s = bf16_to_f64(scales[l, kv])  # [Tk]
            unit = (s / maxq).astype(np.float32)  # float32(s / maxq)
            for g in range(h.groups):
                chans = group_channels(h, g)
                sym = decode_stream(streams[(l * 2 + kv) * h.groups + g], [cums[l, kv, c] for c in chans], Tk)
                x = (sym - maxq).astype(np.float32) * unit[:, None]  # one float32 rounding
                out[l, kv, ch.first_token : ch.first_token + Tk, chans.start : chans.stop] = to_dtype_words(x, h.dtype)


# ---------------------------------------------------------------- version 2


def unpack_bits(raw: bytes, count: int, bits: int) -> np.ndarray:
    """``count`` indices of ``bits`` bits each, least significant bit first; padding bits MUST be zero."""
    all_bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")
    check(not all_bits[count * bits :].any(), "refinement padding bits are not zero")
    weights = 1 << np.arange(bits, dtype=np.int64)
    return (all_bits[: count * bits].reshape(count, bits).astype(np.int64) * weights).sum(axis=1)


def decode_v2_chunk(ch: ChunkSections, h: Header, p: Params, rotation: np.ndarray | None, out: np.ndarray) -> None:
    raw, _, lengths_raw, payload = ch.sections
    Tk, L, C, t0 = ch.tokens, h.L, h.C, ch.first_token
    streams = stream_payloads(lengths_raw, payload, L * 2 * h.groups, 2 * Tk * h.G + 8, ch.index)
    levels = np.empty((L, 2, Tk, C), np.int64)
    for l in range(L):
        for kv in range(2):
            for g in range(h.groups):
                chans = group_channels(h, g)
                tabs = [p.tables[l][kv][c] for c in chans]
                sym = decode_stream(streams[(l * 2 + kv) * h.groups + g], [t.cum for t in tabs], Tk)
                v = sym + np.array([t.lo for t in tabs], np.int64)
                delta = np.array([t.mode == 1 for t in tabs])
                # mode 1: q[t] = q[t-1] + v[t] within the chunk; its first token is q itself
                v[:, delta] = np.cumsum(v[:, delta], axis=0)
                levels[l, kv, :, chans.start : chans.stop] = v
    if h.method == 3:
        check(levels.min(initial=0) >= 0 and levels.max(initial=0) <= 255, f"chunk {ch.index}: a level is outside [0, 255]")
        nraw = h.word_bytes - 1
        check(len(raw) == L * 2 * Tk * C * nraw, "raw section size")
        low = np.frombuffer(raw, np.uint8).reshape(L, 2, Tk, C, nraw).astype(np.uint64)
        top = ((levels >> 1) | ((levels & 1) << 7)).astype(np.uint64)  # undo the sign-bit move
        word = top << np.uint64(8 * nraw)
        for i in range(nraw):
            word |= low[..., i] << np.uint64(8 * i)
        out[:, :, t0 : t0 + Tk] = word.astype(out.dtype)
        return
    check(levels.min(initial=0) >= -127 and levels.max(initial=0) <= 127, f"chunk {ch.index}: a level is outside [-127, 127]")
    q = levels.astype(np.float64)
    refine_start = h.num_tokens - p.refine_tokens
    n_ref = max(0, t0 + Tk - max(t0, refine_start)) if p.refine_tokens else 0
    if n_ref:
        b = p.refine_bits
        n = 1 << b
        j = unpack_bits(raw, L * 2 * n_ref * C, b).reshape(L, 2, n_ref, C)
        q[:, :, Tk - n_ref :] += (j - n // 2 + 1) / n  # q' = q + (j - n/2 + 1) / n, exact
    else:
        check(len(raw) == 0, f"chunk {ch.index}: a raw section without refined tokens")
    # z = float32(q x s + m): q x s exact in float64, then one float64 addition, then float32;
    # a z beyond float32's range rounds to an infinity (the spec's rule; the output saturates),
    # which numpy would otherwise report as an overflow warning
    with np.errstate(over="ignore"):
        z = (q * p.steps[:, :, None, None] + p.offsets[:, :, None, :]).astype(np.float32)
    if rotation is not None and h.flags & FLAG_FIXED_ROTATION:
        # the fixed-point rotation: integers Rint = round(R 2^14) (ties to even) clamped to
        # +-2^14; A[c] = sum over d of q'[d] Rint[c, d], exact (as integers: q' = N / 256)
        one = float(1 << 14)
        rint = np.clip(np.rint(rotation.astype(np.float64) * one), -one, one)  # [L, 2, C(c), C(d)]
        N = (q * 256.0).astype(np.int64)
        A = np.matmul(N, rint.astype(np.int64).transpose(0, 1, 3, 2)).astype(np.float64) / 256.0
        # b[c]: the offsets through the rotation, sum over d = 0..C-1 in that order, each product
        # m[d] x (Rint[c, d] 2^-14) exact, each addition rounded
        b = np.zeros((L, 2, C), np.float64)
        for d in range(C):
            b = b + p.offsets[:, :, d : d + 1] * (rint[:, :, :, d] / one)
        v = A * (p.steps[:, :, None, None] / one) + b[:, :, None, :]  # the product exact, one rounding
        z = np.clip(v, -FLOAT32_MAX, FLOAT32_MAX).astype(np.float32)
    elif rotation is not None:
        acc = np.zeros(z.shape, np.float64)
        R = rotation.astype(np.float64)  # [L, 2, C(c), C(d)]
        zz = z.astype(np.float64)
        for d in range(C):  # x'[c] = sum over d = 0..C-1, in that order, of z[d] x R[c, d]
            acc += zz[:, :, :, d : d + 1] * R[:, :, None, :, d]
        z = acc.astype(np.float32)
    if p.rope is not None:
        z = turn_keys(z, p.rope, t0)
    words = to_dtype_words(z, h.dtype)
    S = h.sink_tokens
    if t0 < S:  # the first S tokens are the sink words, verbatim
        words[:, :, : min(S, t0 + Tk) - t0] = p.sink[:, :, t0 : min(S, t0 + Tk)]
    out[:, :, t0 : t0 + Tk] = words


# RoPE (flags bit 2): the angle's sine and cosine as docs/format.md defines them, operation by
# operation in float64 (numpy's element-wise operations round each result; nothing is fused).
_H = float.fromhex
_ROPE_K = dict(two_over_pi=_H("0x1.45f306dc9c883p-1"), p1=_H("0x1.921fb00000000p+0"), p2=_H("0x1.5110b00000000p-22"),
               p3=_H("0x1.18469898cc517p-44"))
_ROPE_S = [_H(v) for v in ("0x1.952c77030ad4ap-49", "-0x1.ae7f3e733b81fp-41", "0x1.6124613a86d09p-33",
                           "-0x1.ae64567f544e4p-26", "0x1.71de3a556c734p-19", "-0x1.a01a01a01a01ap-13",
                           "0x1.1111111111111p-7", "-0x1.5555555555555p-3")]  # S17 .. S3
_ROPE_C = [_H(v) for v in ("0x1.ae7f3e733b81fp-45", "-0x1.93974a8c07c9dp-37", "0x1.1eed8eff8d898p-29",
                           "-0x1.27e4fb7789f5cp-22", "0x1.a01a01a01a01ap-16", "-0x1.6c16c16c16c17p-10",
                           "0x1.5555555555555p-5", "-0x1.0000000000000p-1")]  # C16 .. C2


def rope_sincos(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = np.floor(theta * _ROPE_K["two_over_pi"] + 0.5)
    r = ((theta - n * _ROPE_K["p1"]) - n * _ROPE_K["p2"]) - n * _ROPE_K["p3"]
    z = r * r
    ps = np.full_like(z, _ROPE_S[0])
    for c in _ROPE_S[1:]:
        ps = ps * z + c
    sin = r + (r * z) * ps
    pc = np.full_like(z, _ROPE_C[0])
    for c in _ROPE_C[1:]:
        pc = pc * z + c
    cos = 1.0 + z * pc
    quad = n.astype(np.int64) & 3
    s_out = np.select([quad == 0, quad == 1, quad == 2], [sin, cos, -sin], -cos)
    c_out = np.select([quad == 0, quad == 1, quad == 2], [cos, -sin, -cos], sin)
    return s_out, c_out


def _sat32(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -FLOAT32_MAX, FLOAT32_MAX).astype(np.float32)


def turn_keys(z: np.ndarray, rope: tuple, t0: int) -> np.ndarray:
    """The keys (z[:, 0], float32 [L, 2, Tk, C], tokens t0 ..) turned by their RoPE angles."""
    style, D, r, p0, freq = rope
    z = z.copy()
    L, _, Tk, C = z.shape
    half = r // 2
    j = np.arange(half)
    a, b = (j, j + half) if style == 0 else (2 * j, 2 * j + 1)
    pos = (p0 + t0 + np.arange(Tk)).astype(np.float64)
    for l in range(L):
        f = freq[l if freq.shape[0] > 1 else 0]
        s, c = rope_sincos(pos[:, None] * f[None, :])  # [Tk, r/2]
        keys = z[l, 0]  # [Tk, C], a view
        for hd in range(C // D):
            xa = np.clip(keys[:, hd * D + a].astype(np.float64), -FLOAT32_MAX, FLOAT32_MAX)  # sat first
            xb = np.clip(keys[:, hd * D + b].astype(np.float64), -FLOAT32_MAX, FLOAT32_MAX)
            keys[:, hd * D + a] = _sat32(xa * c - xb * s)
            keys[:, hd * D + b] = _sat32(xb * c + xa * s)
    return z


# ---------------------------------------------------------------- the file


@dataclass
class Decoded:
    header: "Header | PartsHeader"
    descriptor: dict  # version 3: the Manifest
    cache: np.ndarray | None  # words [L, 2, num_tokens, C]; version 3: None (see groups)
    tensors: dict  # name -> (dtype name, words in the tensor's shape), in the Descriptor's (Manifest's) order
    groups: list = field(default_factory=list)  # version 3: each group's Decoded, in part order


def decode(blob: bytes, calibration: str | None = None) -> Decoded:
    """Decode a whole .cgen file (bytes) of any version, checking it as docs/format.md requires."""
    f = Bytes(blob)
    magic, version = f.unpack("8sH", 0, "FileHeader")
    check(magic == MAGIC, "bad magic: not a .cgen file")
    if version == 3:
        return decode_parts(f, calibration)
    return decode_regular(f, calibration)


def decode_regular(f: Bytes, calibration: str | None = None, group_rotation=None) -> Decoded:
    """A version 1 or 2 file: one regular cache [layers, 2, tokens, channels]."""
    h = parse_file_header(f)
    o = 64
    bins = []
    if h.version == 1:
        bins_raw = f.take(o, 2 * h.L, "BinsTable")
        o += 2 * h.L
        desc_raw = f.take(o, h.descriptor_size, "Descriptor")
        o += h.descriptor_size
        check(crc32(f.take(0, 60, "FileHeader"), bins_raw, desc_raw) == h.crc, "header CRC mismatch")
        bins = [(bins_raw[2 * l], bins_raw[2 * l + 1]) for l in range(h.L)]
        check(all(3 <= b <= 255 for pair in bins for b in pair), "bins out of range 3..255")
        params_raw = b""
    else:
        desc_raw = f.take(o, h.descriptor_size, "Descriptor")
        o += h.descriptor_size
        params_raw = f.take(o, h.params_size, "Params block")
        o += h.params_size
        check(crc32(f.take(0, 60, "FileHeader"), desc_raw, params_raw) == h.crc, "header CRC mismatch")
    descriptor = parse_descriptor(desc_raw, h)
    params = parse_params(params_raw, h) if h.version == 2 else None
    header_end = o

    # Trailer: the file's last 16 bytes; the Index right before it, right after the last chunk.
    check(len(f) >= header_end + 16 + 12 + 8 * h.num_chunks, "the file is too short for its Index and Trailer")
    index_offset, tmagic = f.unpack("Q8s", len(f) - 16, "Trailer")
    check(tmagic == TRAILER_MAGIC, "no Trailer at the end of the file")
    index_size = 12 + 8 * h.num_chunks
    check(index_offset >= header_end and index_offset + index_size + 16 == len(f),
          "the Index does not end where the Trailer starts (or bytes follow the Trailer)")
    index_raw = f.take(index_offset, index_size, "Index")
    check(index_raw[:4] == INDEX_MAGIC, "bad Index magic")
    check(crc32(index_raw[:-4]) == struct.unpack_from("<I", index_raw, index_size - 4)[0], "Index CRC mismatch")
    check(struct.unpack_from("<I", index_raw, 4)[0] == h.num_chunks, "the Index's num_chunks differs from the header's")
    offsets = struct.unpack_from(f"<{h.num_chunks}Q", index_raw, 8)

    # Before allocating: can the bytes between the header and the Index hold the announced chunks?
    streams = h.L * 2 * h.groups
    T = h.num_tokens
    if h.version == 1:
        cdf_size = h.C * sum((2 * ((b - 1) // 2) + 1 + 1) // 2 for pair in bins for b in pair)
        need = h.num_chunks * (40 + cdf_size + 2 * streams) + h.L * 2 * T * 2
    else:
        need = h.num_chunks * (40 + 2 * streams) + h.L * 2 * T * h.C * (h.word_bytes - 1 if h.method == 3 else 0)
        if h.flags & FLAG_REFINED:
            need += h.L * 2 * params.refine_tokens * h.C * params.refine_bits // 8
    check(header_end + need <= index_offset, "the file is too short for the chunks its header announces")

    word_type = np.uint32 if h.word_bytes == 4 else np.uint16
    cache = np.zeros((h.L, 2, T, h.C), word_type)
    rotation = None
    if h.version == 2 and h.flags & FLAG_ROTATED:
        check(calibration is not None, "a rotated file needs its calibration file (--calibration)")
        if group_rotation is not None:  # a group of a version 3 file with a version 3 calibration
            rotation = group_rotation(h, params.calibration)
        else:
            rotation = load_rotation(calibration, h, params.calibration)
    at = header_end
    for k in range(h.num_chunks):
        check(offsets[k] == at, f"chunk {k} does not start where the previous one ends (Index offset {offsets[k]})")
        Tk = min(h.chunk_tokens, T - k * h.chunk_tokens)
        max_stream = 2 * Tk * h.G + 8
        if h.version == 1:
            sizes = [2 * h.L * 2 * Tk, cdf_size, 2 * streams, None]
        else:
            raw_size = 0
            if h.method == 3:
                raw_size = h.L * 2 * Tk * h.C * (h.word_bytes - 1)
            elif h.flags & FLAG_REFINED:
                first = k * h.chunk_tokens
                n_ref = max(0, first + Tk - max(first, T - params.refine_tokens))
                raw_size = -(-h.L * 2 * n_ref * h.C * params.refine_bits // 8)
            sizes = [raw_size, 0, 2 * streams, None]
        ch = read_chunk(f, at, k, h, sizes, streams, max_stream)
        if h.version == 1:
            decode_v1_chunk(ch, h, bins, cache)
        else:
            decode_v2_chunk(ch, h, params, rotation, cache)
        at = ch.end
    check(at == index_offset, "bytes between the last chunk and the Index")
    return Decoded(h, descriptor, cache, to_tensors(cache, descriptor, h.dtype_name))


def to_tensors(cache: np.ndarray, descriptor: dict, dtype_name: str) -> dict:
    """The Descriptor's tensors from the cache [L, 2, T, C]: channel c = head x head_dim + dim."""
    L, _, T, C = cache.shape
    H, D = descriptor["num_kv_heads"], descriptor["head_dim"]
    out = {}
    for e in descriptor["tensors"]:
        if descriptor["layout"] == "stacked":
            words = cache.reshape(L, 2, T, H, D)
        else:
            m = PER_LAYER_NAME.fullmatch(e["name"])
            layer, kv = int(m.group(1)), 0 if m.group(2) == "key" else 1
            words = cache[layer, kv].reshape(T, H, D).transpose(1, 0, 2).reshape(e["shape"])
        out[e["name"]] = (dtype_name, np.ascontiguousarray(words))
    return out


# ---------------------------------------------------------------- version 3: the multi-part container

PARTS_HEADER_SIZE = 48
PART_ENTRY_SIZE = 24
PART_GROUP = 1  # a complete version 1 or 2 file
PART_RAW = 2  # an extra tensor's bytes
# Caps of "PartsHeader (48 bytes)" and "Manifest".
MAX_MANIFEST_BYTES = 64 << 20
MAX_PARTS = 1 << 17
MAX_MANIFEST_TENSORS = 1 << 17
MAX_GROUPS = 1 << 16
MAX_NAME_CHARS = 1 << 16
MAX_RANK = 8
MAX_DIM = 1 << 40
MAX_TENSOR_BYTES = 1 << 50
MAX_BATCH = 4096  # also: sequence numbers 0 ..= 4095
MAX_LAYER_INDEX = 4095
MAX_GROUP_MEMBERS = 4096
MAX_WINDOW = 1 << 32

#: an extra's dtype name -> (bytes per element, safetensors dtype)
TENSOR_DTYPES = {
    "bool": (1, "BOOL"), "uint8": (1, "U8"), "int8": (1, "I8"), "int16": (2, "I16"), "int32": (4, "I32"),
    "int64": (8, "I64"), "uint16": (2, "U16"), "uint32": (4, "U32"), "uint64": (8, "U64"), "float16": (2, "F16"),
    "bfloat16": (2, "BF16"), "float32": (4, "F32"), "float64": (8, "F64"), "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2")}
KV_DTYPE_CODES = {name: code for code, (name, _, _) in DTYPES.items()}  # float16 1, bfloat16 2, float32 3
#: form -> rank, and how many leading axes select a plane
FORM_RANKS = {"HTD": 3, "BHTD": 4, "TC": 2, "BTC": 3, "L2THD": 5}
FORM_SELECTORS = {"HTD": 0, "TC": 0, "BHTD": 1, "BTC": 1, "L2THD": 2}
KIND_FORMS = {"key": ("HTD", "BHTD"), "value": ("HTD", "BHTD"), "latent": ("TC", "BTC", "BHTD")}
GROUP_KEYS = {"kind", "seq", "tokens", "channels", "dtype", "part", "members", "first_positions"}


@dataclass
class PartsHeader:
    version: int
    manifest_size: int
    part_count: int
    decoded_bytes: int
    file_size: int
    crc: int
    parts: list = field(default_factory=list)  # (offset, size, kind, crc32) of each part


def parse_parts_header(f: Bytes) -> PartsHeader:
    """"PartsHeader" and the Part table, in the order "Rules for readers, version 3" gives."""
    (_, version, header_size, flags, manifest_size, part_count, decoded_bytes, file_size, reserved,
     crc) = f.unpack("8sHHIIIQQII", 0, "PartsHeader")
    check(version == 3, f"format version {version} is not 3")
    check(header_size == PARTS_HEADER_SIZE, "header_size is not 48")
    check(flags == 0, "PartsHeader flags are not zero")
    check(reserved == 0, "the reserved PartsHeader field is not zero")
    check(1 <= manifest_size <= MAX_MANIFEST_BYTES, "manifest_size out of range")
    check(part_count <= MAX_PARTS, "part_count out of range")
    check(file_size <= len(f), f"the file is truncated: {len(f)} bytes, its header says {file_size}")
    check(file_size == len(f), f"the file holds {len(f)} bytes, its header says {file_size}")
    table_at = PARTS_HEADER_SIZE + manifest_size
    data_at = table_at + PART_ENTRY_SIZE * part_count
    check(data_at <= len(f), "the file ends inside the Manifest or the Part table")
    manifest_raw = f.take(PARTS_HEADER_SIZE, manifest_size, "Manifest")
    table_raw = f.take(table_at, PART_ENTRY_SIZE * part_count, "Part table")
    check(crc32(f.take(0, 44, "PartsHeader"), manifest_raw, table_raw) == crc, "PartsHeader CRC mismatch")
    h = PartsHeader(version, manifest_size, part_count, decoded_bytes, file_size, crc)
    at = data_at
    for i in range(part_count):
        offset, size, kind, pad, part_crc = struct.unpack_from("<QQB3sI", table_raw, i * PART_ENTRY_SIZE)
        check(kind in (PART_GROUP, PART_RAW), f"part {i}: unknown kind {kind}")
        check(pad == bytes(3), f"part {i}: reserved bytes are not zero")
        check(offset == at and size <= file_size - offset, f"part {i} does not start where the previous one ends "
              "or runs past the end of the file")
        h.parts.append((offset, size, kind, part_crc))
        at = offset + size
    check(at == file_size, "the parts do not end at the end of the file")
    return h


def is_name(v, names) -> bool:
    """A JSON string among ``names`` (a list or an object there is not an error, but no name)."""
    return isinstance(v, str) and v in names


def is_int(v, lo: int, hi: int) -> bool:
    """A JSON integer (no fraction, no exponent, not true / false) in [lo, hi]."""
    return type(v) is int and lo <= v <= hi


def plane_dims(e: dict) -> tuple[int, int]:
    """(tokens, channels) of each plane of kv tensor ``e``: its form's axes ("Manifest", the plane)."""
    s, form = e["shape"], e["form"]
    if form in ("BHTD", "BTC"):  # plane b is T[b]
        s, form = s[1:], form[1:]
    if form == "HTD":
        return s[1], s[0] * s[2]
    if form == "TC":
        return s[0], s[1]
    return s[2], s[3] * s[4]  # L2THD


def check_tensor_entry(i: int, e) -> int:
    """Tensor ``i`` of the Manifest checked; its decoded bytes."""
    check(isinstance(e, dict) and isinstance(e.get("name"), str) and len(e["name"]) <= MAX_NAME_CHARS,
          f"manifest tensor {i}: no name, or a name longer than 65536 characters")
    shape = e.get("shape")
    check(isinstance(shape, list) and len(shape) <= MAX_RANK and all(is_int(s, 0, MAX_DIM) for s in shape),
          f"manifest tensor {i}: the shape is not at most 8 JSON integers 0 ..= 2^40")
    role = e.get("role")
    if role == "extra":
        check(set(e) == {"name", "role", "dtype", "shape", "part"}, f"manifest tensor {i}: an extra's keys are wrong")
        check(is_name(e["dtype"], TENSOR_DTYPES), f"manifest tensor {i}: unknown extra dtype {e['dtype']!r}")
    elif role == "kv":
        form = e.get("form")
        check(is_name(form, FORM_RANKS) and len(shape) == FORM_RANKS[form], f"manifest tensor {i}: unknown form or wrong rank")
        check(is_name(e.get("dtype"), KV_DTYPE_CODES), f"manifest tensor {i}: a kv tensor is float16, bfloat16 or float32")
        keys = {"name", "role", "form", "dtype", "shape"}
        if form == "L2THD":
            check(shape[1] == 2 and 1 <= shape[0] <= MAX_GROUP_MEMBERS,
                  f"manifest tensor {i}: an L2THD tensor is [1 ..= 4096 layers, 2, tokens, heads, head_dim]")
        else:
            keys |= {"layer", "kind", "seq"}
            check(is_int(e.get("layer"), 0, MAX_LAYER_INDEX) and is_int(e.get("seq"), 0, MAX_BATCH - 1),
                  f"manifest tensor {i}: layer or seq out of range")
            check(is_name(e.get("kind"), KIND_FORMS) and form in KIND_FORMS[e["kind"]],
                  f"manifest tensor {i}: kind {e.get('kind')!r} cannot have form {form}")
            if form in ("BHTD", "BTC"):
                check(1 <= shape[0] <= MAX_BATCH, f"manifest tensor {i}: batch out of range 1 ..= 4096")
        check(keys <= set(e) <= keys | {"sliding_window"}, f"manifest tensor {i}: missing or unknown keys")
        check("sliding_window" not in e or is_int(e["sliding_window"], 1, MAX_WINDOW),
              f"manifest tensor {i}: sliding_window out of range")
    else:
        raise FormatViolation(f"manifest tensor {i}: unknown role {role!r}")
    size = math.prod(shape) * TENSOR_DTYPES[e["dtype"]][0]
    check(size <= MAX_TENSOR_BYTES, f"manifest tensor {i}: more than 2^50 bytes")
    return size


def check_plane_ref(ref_, tensors: list) -> tuple[tuple, str]:
    """A plane reference [tensor index, selector...] checked; (its key, its kind)."""
    check(isinstance(ref_, list) and len(ref_) >= 1 and is_int(ref_[0], 0, len(tensors) - 1),
          "a plane reference names no tensor")
    e = tensors[ref_[0]]
    check(e["role"] == "kv", "a plane reference names an extra tensor")
    sel = ref_[1:]
    check(len(sel) == FORM_SELECTORS[e["form"]] and all(is_int(s, 0, e["shape"][a] - 1) for a, s in enumerate(sel)),
          f"a plane reference to {e['name'][:60]!r}: selectors out of range")
    kind = ("key", "value")[sel[1]] if e["form"] == "L2THD" else e["kind"]
    return tuple(ref_), kind


def parse_manifest(raw: bytes, h: PartsHeader) -> dict:
    """"Manifest", checked against itself, the header and the Part table."""
    m = load_json(raw, "Manifest")
    check(isinstance(m, dict) and set(m) == {"tensors", "groups", "metadata"},
          "the Manifest is not an object of exactly tensors, groups and metadata")
    meta = m["metadata"]
    check(isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()),
          "metadata does not map strings to strings")
    tensors, groups = m["tensors"], m["groups"]
    check(isinstance(tensors, list) and 1 <= len(tensors) <= MAX_MANIFEST_TENSORS, "1 ..= 131072 tensors")
    check(isinstance(groups, list) and len(groups) <= MAX_GROUPS, "0 ..= 65536 groups")
    names, total, planes_needed, extras = set(), 0, 0, []
    for i, e in enumerate(tensors):
        total += check_tensor_entry(i, e)
        check(e["name"] not in names, f"tensor {e['name'][:60]!r} is listed twice")
        names.add(e["name"])
        if e["role"] == "extra":
            extras.append(e)
        else:
            planes_needed += math.prod(e["shape"][: FORM_SELECTORS[e["form"]]])
    check(total == h.decoded_bytes, f"the tensors take {total} bytes, the PartsHeader says {h.decoded_bytes}")
    check(h.part_count == len(groups) + len(extras), "part_count is not the number of groups plus extras")
    for k, e in enumerate(extras):
        part = len(groups) + k
        want = math.prod(e["shape"]) * TENSOR_DTYPES[e["dtype"]][0]
        check(is_int(e["part"], part, part) and h.parts[part][2] == PART_RAW and h.parts[part][1] == want,
              f"extra {e['name'][:60]!r}: its part is not raw part {part} of {want} bytes")
    seen = set()
    for gi, g in enumerate(groups):
        check(isinstance(g, dict) and set(g) == GROUP_KEYS, f"group {gi}: not an object of exactly its 8 keys")
        check(is_name(g["kind"], ("kv", "planes")) and is_name(g["dtype"], KV_DTYPE_CODES), f"group {gi}: bad kind or dtype")
        check(is_int(g["seq"], 0, MAX_BATCH - 1) and is_int(g["tokens"], 0, MAX_TOKENS)
              and is_int(g["channels"], 1, MAX_CHANNELS), f"group {gi}: seq, tokens or channels out of range")
        check(is_int(g["part"], gi, gi) and h.parts[gi][2] == PART_GROUP, f"group {gi}: not in part {gi} of kind 1")
        members, firsts = g["members"], g["first_positions"]
        check(isinstance(members, list) and 1 <= len(members) <= MAX_GROUP_MEMBERS, f"group {gi}: 1 ..= 4096 members")
        check(isinstance(firsts, list) and len(firsts) == len(members) and all(is_int(p, 0, MAX_TOKENS) for p in firsts),
              f"group {gi}: first_positions are not one JSON integer 0 ..= 2^32 - 1 per member")
        width = 2 if g["kind"] == "kv" else 1
        for member in members:
            check(isinstance(member, list) and len(member) == width, f"group {gi}: a member is not {width} plane(s)")
            kinds = []
            for r in member:
                key, kind = check_plane_ref(r, tensors)
                e = tensors[key[0]]
                check((*plane_dims(e), e["dtype"]) == (g["tokens"], g["channels"], g["dtype"]),
                      f"group {gi}: a plane of {e['name'][:60]!r} does not have the group's tokens, channels, dtype")
                check(key not in seen, f"group {gi}: a plane of {e['name'][:60]!r} is listed twice")
                seen.add(key)
                kinds.append(kind)
            check(width == 1 or kinds == ["key", "value"], f"group {gi}: a kv member is not [K plane, V plane]")
    check(len(seen) == planes_needed, f"the groups hold {len(seen)} planes, the kv tensors {planes_needed}")
    return m


def part_bytes(f: Bytes, h: PartsHeader, i: int) -> bytes:
    offset, size, _, want = h.parts[i]
    raw = f.take(offset, size, f"part {i}")
    check(crc32(raw) == want, f"part {i}: CRC mismatch")
    return raw


def put_plane(out: np.ndarray, e: dict, sel: list, x: np.ndarray) -> None:
    """Plane ``x`` [tokens, channels] into its tensor: x[t, h * head_dim + d] = T[h, t, d] (HTD)."""
    form = e["form"]
    if form in ("BHTD", "BTC"):
        out, form = out[sel[0]], form[1:]
    if form == "HTD":
        H, T, D = out.shape
        out[...] = x.reshape(T, H, D).transpose(1, 0, 2)
    elif form == "TC":
        out[...] = x
    else:  # L2THD
        l, k = sel
        out[l, k] = x.reshape(out[l, k].shape)


def decode_parts(f: Bytes, calibration: str | None = None) -> Decoded:
    """A version 3 file: every group decoded as the version 1 / 2 file it is, the kv tensors
    rebuilt from their planes, the extras from their bytes."""
    h = parse_parts_header(f)
    m = parse_manifest(f.take(PARTS_HEADER_SIZE, h.manifest_size, "Manifest"), h)
    tensors = m["tensors"]
    out = {}
    for e in tensors:
        if e["role"] == "kv":
            out[e["name"]] = np.zeros(e["shape"], np.uint32 if e["dtype"] == "float32" else np.uint16)
    groups = []
    for gi, g in enumerate(m["groups"]):
        gf = Bytes(part_bytes(f, h, gi))
        gh = parse_file_header(gf)  # a group is a version 1 or 2 file (never 3)
        coded = g["channels"] if g["kind"] == "kv" else -(-g["channels"] // 2)
        check((gh.L, gh.num_tokens, gh.C, gh.dtype) == (len(g["members"]), g["tokens"], coded, KV_DTYPE_CODES[g["dtype"]]),
              f"group {gi}: its file's layers, tokens, channels or dtype are not the Manifest's")
        rot = None
        if calibration is not None and calibration_version(calibration) == "3":
            rot = lambda gh, sha, g=g: load_group_rotation(calibration, g, tensors, gh, sha)  # noqa: E731
        d = decode_regular(gf, calibration, rot)
        for j, member in enumerate(g["members"]):
            if g["kind"] == "kv":
                planes = [d.cache[j, 0], d.cache[j, 1]]
            else:  # channels 0 .. H-1 in the K slot, H .. C-1 in the V slot (an odd C's last V channel: padding)
                planes = [np.concatenate([d.cache[j, 0], d.cache[j, 1, :, : g["channels"] - coded]], axis=1)]
            for (ti, *sel), x in zip(member, planes):
                put_plane(out[tensors[ti]["name"]], tensors[ti], sel, x)
        groups.append(d)
    extras = [e for e in tensors if e["role"] == "extra"]
    for k, e in enumerate(extras):
        size = TENSOR_DTYPES[e["dtype"]][0]
        out[e["name"]] = np.frombuffer(part_bytes(f, h, len(m["groups"]) + k), f"<u{size}").reshape(e["shape"]).copy()
    return Decoded(h, m, None, {e["name"]: (e["dtype"], out[e["name"]]) for e in tensors}, groups)


# ---------------------------------------------------------------- outputs


def write_safetensors(path: str, decoded: Decoded) -> None:
    """The tensors as safetensors (names sorted, the Descriptor's / Manifest's metadata), written atomically."""
    head, parts, o = {}, [], 0
    meta = decoded.descriptor.get("metadata") or {}
    if meta:
        head["__metadata__"] = dict(sorted(meta.items()))
    for name in sorted(decoded.tensors):
        dtype_name, words = decoded.tensors[name]
        data = words.astype(words.dtype.newbyteorder("<")).tobytes()
        head[name] = {"dtype": TENSOR_DTYPES[dtype_name][1], "shape": list(words.shape), "data_offsets": [o, o + len(data)]}
        parts.append(data)
        o += len(data)
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    _write_atomic(path, [struct.pack("<Q", len(text)), text] + parts)


def float8_e4m3fn_values() -> np.ndarray:
    """The float32 value of each of the 256 float8_e4m3fn bit patterns (exact): 1 sign bit, 4
    exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0, NaN at S.1111.111, no infinity."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, mant = (b >> 3) & 15, b & 7
    v = np.where(e == 0, mant / 8 * 2.0 ** -6, (1 + mant / 8) * 2.0 ** (e - 7)) * sign
    return np.where((b & 0x7F) == 0x7F, np.nan, v).astype(np.float32)


def npz_array(dtype_name: str, words: np.ndarray) -> np.ndarray:
    """A tensor's words as numpy values: numpy's own dtype where it has one; bfloat16 and both
    float8s widened (exactly) to float32."""
    if dtype_name == "bfloat16":
        return (words.astype(np.uint32) << 16).view(np.float32)
    if dtype_name == "float8_e5m2":  # the top byte of a float16
        return (words.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    if dtype_name == "float8_e4m3fn":
        return float8_e4m3fn_values()[words]
    return words.view(np.dtype(dtype_name).newbyteorder("="))


def write_npz(path: str, decoded: Decoded) -> None:
    """Each tensor as a numpy array (npz_array: bfloat16 and float8 values widened to float32)."""
    arrays = {name: npz_array(dtype_name, words) for name, (dtype_name, words) in decoded.tensors.items()}
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    _write_atomic(path, [buf.getvalue()])


def _write_atomic(path: str, parts: list[bytes]) -> None:
    """Write ``parts`` to ``path``: a regular file through a temporary file in the same folder
    (renamed over it once complete, removed on any error or signal), a special file (a FIFO,
    /dev/stdout) directly."""
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "wb") as fh:
            for p in parts:
                fh.write(p)
        return
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".cgen_reference.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            for p in parts:
                fh.write(p)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _exit_on_signal(signum, frame) -> None:
    # SIGTERM / SIGHUP unwind like Ctrl-C, so the temporary output is removed
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Decode a .cgen file with the reference decoder (docs/format.md).")
    ap.add_argument("file", help="the .cgen file")
    ap.add_argument("--calibration", help="the calibration file a rotated file was encoded with")
    ap.add_argument("-o", "--output", required=True, help="OUT.safetensors or OUT.npz")
    args = ap.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    if not args.output.endswith((".safetensors", ".npz")):
        print("error: the output must end in .safetensors or .npz", file=sys.stderr)
        return 1
    if os.path.abspath(args.output) == os.path.abspath(args.file):
        print("error: the output would overwrite the input", file=sys.stderr)
        return 1
    try:
        with open(args.file, "rb") as fh:
            blob = fh.read()
        decoded = decode(blob, args.calibration)
        (write_npz if args.output.endswith(".npz") else write_safetensors)(args.output, decoded)
    except (FormatViolation, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    h = decoded.header
    if h.version == 3:
        print(f"{args.file}: format version 3, {len(decoded.groups)} groups (format versions "
              f"{sorted({d.header.version for d in decoded.groups})}), {len(decoded.tensors)} tensors -> {args.output}")
        return 0
    print(f"{args.file}: format version {h.version}, method {h.method}, {h.L} layers, {h.num_tokens} tokens, "
          f"{h.C} channels, {h.dtype_name} -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
