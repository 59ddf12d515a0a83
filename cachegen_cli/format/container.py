"""The .cgen container, byte for byte as docs/format.md specifies it.

    FileHeader (64 B) | bins table (2 x num_layers B) | descriptor (JSON)
    Chunk 0 | Chunk 1 | ... | Index | Trailer (16 B)

All integers are little-endian.  This module only packs and parses bytes; it
knows nothing of quantization or coding beyond the sizes the sections must
have.  The reader trusts no length it reads: each is range-checked against
the header, the format's caps and the bytes actually left in the file before
anything is allocated or read.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..errors import (BadMagicError, CacheGenError, ChecksumError, FormatError, SizeError, TruncatedError,
                      UnsupportedVersionError)
from ..kernels.coding_params import MAX_ALPHABET, MAX_STREAM_SYMBOLS, PROB_BITS, alphabet_size, max_stream_bytes
from .params import ITEMSIZE, METHOD_LOSSLESS, METHOD_TRANSFORM, Params, pack_params, parse_params, refinement_bytes

MAGIC = b"\x89CGEN\r\n\x1a"
FORMAT_VERSION = 1  # what method 1 files are written as (unchanged since version 1)
FORMAT_VERSION_2 = 2  # methods 2 and 3: tables shared by the chunks, in a Params block
KNOWN_VERSIONS = (1, 2)
CHUNK_MAGIC = b"CGCK"
INDEX_MAGIC = b"CGIX"
TRAILER_MAGIC = b"CGENDIDX"

FILE_HEADER = struct.Struct("<8sHHIQIIIIHBBBBB13sI")
#: Version 2 gives meaning to v1's 13 reserved bytes: flags, params_size, sink_tokens, reserved.
FILE_HEADER_V2 = struct.Struct("<8sHHIQIIIIHBBBBBBIIII")
CHUNK_HEADER = struct.Struct("<4sIIIIIIIII")
TRAILER = struct.Struct("<Q8s")
assert FILE_HEADER.size == 64 and FILE_HEADER_V2.size == 64 and CHUNK_HEADER.size == 40 and TRAILER.size == 16

DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3}
LAYOUT_CODES = {"stacked": 1, "per-layer": 2}
METHOD_ABSMAX_PER_TOKEN = 1
CDF_CODING_NIBBLES = 1
CDF_CODING_SHARED = 2  # version 2: one table per (layer, K/V, channel) in the Params block
FLAG_ROTATED = 1
FLAG_REFINED = 2  # method 2: the last tokens carry refinement bits (Params block + chunks' raw sections)
FLAG_ROPE = 4  # method 2: the keys are coded without their rotary embedding (Params block's RoPE block)
#: method 2 with FLAG_ROTATED: the rotation is the fixed-point one (integer products, exact in any
#: order; docs/format.md, "Fixed-point rotation"), not the float64 sums in order of bit 0 alone
FLAG_FIXED_ROTATION = 8
KNOWN_FLAGS = FLAG_ROTATED | FLAG_REFINED | FLAG_ROPE | FLAG_FIXED_ROTATION
MAX_PARAMS_BYTES = 1 << 30

# Caps: a reader refuses anything beyond these before allocating.
MAX_DESCRIPTOR_BYTES = 16 << 20
MAX_DESCRIPTOR_DEPTH = 16  # arrays / objects nested in the Descriptor (cachegen writes 4)
MAX_LAYERS = 4096
MAX_CHANNELS = 1 << 16
MAX_TOKENS = (1 << 32) - 1
MAX_CHUNKS = 1 << 24


@dataclass
class FileHeader:
    num_tokens: int
    num_layers: int
    num_channels: int
    chunk_tokens: int
    num_chunks: int
    group: int  # channels per stream
    dtype: str
    layout: str
    bins: np.ndarray  # uint8/int [num_layers, 2]
    descriptor: dict
    method: int = METHOD_ABSMAX_PER_TOKEN
    prob_bits: int = PROB_BITS
    cdf_coding: int = CDF_CODING_NIBBLES
    version: int = FORMAT_VERSION
    flags: int = 0
    sink_tokens: int = 0
    params: "Params | None" = None
    params_at: int = 0  # version 2: where the Params block starts in the file
    #: version 2 read with defer_crc: (the header's CRC-32, the CRC-32 of its first 60 bytes and the
    #: descriptor, the Params block's size), for a reader that checks the Params bytes' part itself
    deferred_crc: tuple | None = None

    @property
    def rotated(self) -> bool:
        return bool(self.flags & FLAG_ROTATED)

    @property
    def fixed_rotation(self) -> bool:
        return bool(self.flags & FLAG_FIXED_ROTATION)

    @property
    def refine_start(self) -> int:
        """First refined token (num_tokens when none)."""
        p = self.params
        return self.num_tokens - (p.refine_tokens if p is not None else 0)

    def refined_in(self, first_token: int, token_count: int) -> int:
        """How many of tokens [first_token, first_token + token_count) are refined."""
        return max(0, first_token + token_count - max(first_token, self.refine_start))

    @property
    def raw_bytes_per_value(self) -> int:
        """Version 2, lossless: the low bytes of each word stored raw in a chunk."""
        if self.version == FORMAT_VERSION_2 and self.method == METHOD_LOSSLESS:
            return ITEMSIZE[self.dtype] - 1
        return 0

    @property
    def maxq(self) -> np.ndarray:
        """int32 [L, 2]: largest quantization level per (layer, K/V)."""
        return ((self.bins.astype(np.int32) - 1) // 2).astype(np.int32)

    @property
    def alphabets(self) -> np.ndarray:
        return 2 * self.maxq + 1

    @property
    def groups(self) -> int:
        """Streams per (layer, K/V) plane in a chunk."""
        return -(-self.num_channels // self.group)

    @property
    def streams_per_chunk(self) -> int:
        return self.num_layers * 2 * self.groups

    def chunk_tokens_at(self, index: int) -> int:
        first = index * self.chunk_tokens
        return min(self.chunk_tokens, self.num_tokens - first)

    def section_sizes(self, token_count: int, first_token: int = 0) -> tuple[int, int, int]:
        """Sizes of the scales (v2: raw bytes: lossless low bytes or refinement bits), CDF-codes and
        lengths sections of a chunk."""
        if self.version == FORMAT_VERSION_2:
            raw = self.num_layers * 2 * token_count * self.num_channels * self.raw_bytes_per_value
            if self.flags & FLAG_REFINED:
                raw += refinement_bytes(self.num_layers, self.num_channels, self.refined_in(first_token, token_count),
                                        self.params.refine_bits)
            return raw, 0, self.streams_per_chunk * 2
        scales = self.num_layers * 2 * token_count * 2
        cdf = self.num_channels * int(((self.alphabets + 1) // 2).sum())
        lengths = self.streams_per_chunk * 2
        return scales, cdf, lengths

    def max_payload(self, token_count: int) -> int:
        full = max_stream_bytes(token_count * self.group)
        return self.streams_per_chunk * full


def choose_group(chunk_tokens: int, num_channels: int) -> int:
    """Channels per stream: enough that a stream holds ~1024 symbols, which keeps the
    range coder's ~1-byte flush and the 2-byte length small next to the payload."""
    return max(1, min(num_channels, 1024 // chunk_tokens, MAX_STREAM_SYMBOLS // chunk_tokens))


#: Symbols per stream the version-2 writer aims at (choose_group_v2).
STREAM_SYMBOLS_V2 = 2048


def choose_group_v2(chunk_tokens: int, num_channels: int) -> int:
    """Version 2: streams of ~2048 symbols.  Its tables live in the header, so a stream costs
    only its 2-byte length and ~1 flush byte: twice version 1's stream length makes those
    rarer, and a GPU still gets a thread for every 2048 values (twice as many as 4096-symbol
    streams give: the coders run faster for files ~0.2% larger, docs/benchmarks.md;
    benchmarks/bench_device.py --stream-symbols compares).  Any group the header's rule
    allows is valid; this is the writer's choice."""
    return max(1, min(num_channels, STREAM_SYMBOLS_V2 // chunk_tokens, MAX_STREAM_SYMBOLS // chunk_tokens))


def _crc(*parts: bytes) -> int:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc & 0xFFFFFFFF


# ---------------------------------------------------------------- file header


def pack_file_header(h: FileHeader) -> bytes:
    if h.version == FORMAT_VERSION_2:
        return _pack_file_header_v2(h)
    bins = np.ascontiguousarray(h.bins, dtype=np.uint8).tobytes()  # layer-major: K, V, K, V, ...
    desc = json.dumps(h.descriptor, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode("utf-8")
    fields = (
        MAGIC, FORMAT_VERSION, FILE_HEADER.size, len(desc), h.num_tokens, h.num_layers, h.num_channels,
        h.chunk_tokens, h.num_chunks, h.group, DTYPE_CODES[h.dtype], LAYOUT_CODES[h.layout],
        h.method, h.prob_bits, h.cdf_coding, bytes(13),
    )
    head = FILE_HEADER.pack(*fields, 0)[:-4]
    return head + struct.pack("<I", _crc(head, bins, desc)) + bins + desc


def _descriptor_bytes(h: FileHeader) -> bytes:
    return json.dumps(h.descriptor, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode("utf-8")


def _pack_file_header_v2(h: FileHeader) -> bytes:
    desc = _descriptor_bytes(h)
    params = pack_params(h.params)
    fields = (
        MAGIC, FORMAT_VERSION_2, FILE_HEADER_V2.size, len(desc), h.num_tokens, h.num_layers, h.num_channels,
        h.chunk_tokens, h.num_chunks, h.group, DTYPE_CODES[h.dtype], LAYOUT_CODES[h.layout],
        h.method, h.prob_bits, CDF_CODING_SHARED, h.flags, len(params), h.sink_tokens, 0,
    )
    head = FILE_HEADER_V2.pack(*fields, 0)[:-4]
    return head + struct.pack("<I", _crc(head, desc, params)) + desc + params


def read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TruncatedError(f"file ends inside the {what} ({len(data)} of {n} bytes)")
    return data


def read_file_header(f: BinaryIO, file_size: int | None = None, defer_tables: bool = False,
                     defer_crc: bool = False) -> tuple[FileHeader, int]:
    """Parse the header at the current position; returns it and its total size in bytes.
    ``defer_tables``: a version-2 Params block's tables are only walked (params.parse_params)."""
    raw = bytes(f.read(FILE_HEADER.size))
    if len(raw) < len(MAGIC) or raw[: len(MAGIC)] != MAGIC:
        if len(raw) < len(MAGIC) and MAGIC.startswith(raw) and raw:
            raise TruncatedError("file ends inside the .cgen magic")
        raise BadMagicError("not a .cgen file (bad magic)")
    if len(raw) < FILE_HEADER.size:
        raise TruncatedError(f"file ends inside the file header ({len(raw)} of {FILE_HEADER.size} bytes)")
    (version,) = struct.unpack_from("<H", raw, 8)
    if version == FORMAT_VERSION_2:
        return _read_file_header_v2(f, raw, file_size, defer_tables, defer_crc)
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(f"format version {version} is not supported (this reader knows versions 1 and 2)")
    (_, version, header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens, num_chunks,
     group, dtype_code, layout_code, method, prob_bits, cdf_coding, reserved, crc) = FILE_HEADER.unpack(raw)
    dtype, layout = _check_dims(header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens,
                                num_chunks, group, dtype_code, layout_code, prob_bits)
    rest = 2 * num_layers + desc_size
    if file_size is not None and FILE_HEADER.size + rest > file_size:
        raise TruncatedError("file ends inside the header's bins table or descriptor")
    if method != METHOD_ABSMAX_PER_TOKEN:
        raise UnsupportedVersionError(f"unknown quantization method {method} for format version 1")
    if cdf_coding != CDF_CODING_NIBBLES:
        raise UnsupportedVersionError(f"unknown CDF coding {cdf_coding}")
    bins_raw = bytes(read_exact(f, 2 * num_layers, "bins table"))
    desc_raw = bytes(read_exact(f, desc_size, "descriptor"))
    if _crc(raw[:-4], bins_raw, desc_raw) != crc:
        raise ChecksumError("file header CRC mismatch: the file is corrupted")
    if any(reserved):
        raise UnsupportedVersionError("reserved header bytes are set (written by a newer cachegen?)")
    bins = np.frombuffer(bins_raw, dtype=np.uint8).reshape(num_layers, 2).astype(np.int32)
    if bins.min() < 3 or bins.max() > MAX_ALPHABET:
        raise SizeError(f"bins out of range 3..{MAX_ALPHABET}")
    descriptor = _parse_descriptor(desc_raw, num_layers, num_tokens, num_channels)
    header = FileHeader(num_tokens, num_layers, num_channels, chunk_tokens, num_chunks, group, dtype, layout,
                        bins, descriptor, method, prob_bits, cdf_coding)
    return header, FILE_HEADER.size + rest


def _check_dims(header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens, num_chunks, group,
                dtype_code, layout_code, prob_bits) -> tuple[str, str]:
    """The checks both versions share; returns (dtype, layout) names."""
    if header_size != FILE_HEADER.size:
        raise SizeError(f"file header size {header_size}, expected {FILE_HEADER.size}")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise SizeError(f"layer count {num_layers} out of range 1..{MAX_LAYERS}")
    if not 1 <= num_channels <= MAX_CHANNELS:
        raise SizeError(f"channel count {num_channels} out of range 1..{MAX_CHANNELS}")
    if not 1 <= chunk_tokens <= MAX_STREAM_SYMBOLS:
        raise SizeError(f"chunk size {chunk_tokens} tokens out of range 1..{MAX_STREAM_SYMBOLS}")
    if num_tokens > MAX_TOKENS:
        raise SizeError(f"token count {num_tokens} out of range")
    if num_chunks != -(-num_tokens // chunk_tokens) or num_chunks > MAX_CHUNKS:
        raise SizeError(f"chunk count {num_chunks} does not match {num_tokens} tokens in chunks of {chunk_tokens}")
    if not 1 <= group <= num_channels or group * chunk_tokens > MAX_STREAM_SYMBOLS:
        raise SizeError(f"channels per stream {group} out of range")
    if not 0 < desc_size <= MAX_DESCRIPTOR_BYTES:
        raise SizeError(f"descriptor size {desc_size} out of range 1..{MAX_DESCRIPTOR_BYTES}")
    dtype = {v: k for k, v in DTYPE_CODES.items()}.get(dtype_code)
    layout = {v: k for k, v in LAYOUT_CODES.items()}.get(layout_code)
    if dtype is None:
        raise UnsupportedVersionError(f"unknown dtype code {dtype_code}")
    if layout is None:
        raise UnsupportedVersionError(f"unknown layout code {layout_code}")
    if prob_bits != PROB_BITS:
        raise UnsupportedVersionError(f"probability precision {prob_bits} bits is not supported")
    return dtype, layout


def load_capped_json(raw: bytes, what: str):
    """The UTF-8 JSON of a descriptor or manifest, its nesting depth checked before parsing;
    SizeError otherwise."""
    # (no deeper than its count of opening brackets: a descriptor with few needs no scan)
    depth = _json_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_DESCRIPTOR_DEPTH else 0
    if depth > MAX_DESCRIPTOR_DEPTH:
        raise SizeError(f"{what} nests arrays and objects {depth} deep (at most {MAX_DESCRIPTOR_DEPTH})")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise SizeError(f"{what} is not valid UTF-8 JSON") from None


def _parse_descriptor(desc_raw: bytes, num_layers: int, num_tokens: int, num_channels: int) -> dict:
    descriptor = load_capped_json(desc_raw, "descriptor")
    from ..storage.kvio import validate_descriptor

    try:
        validate_descriptor(descriptor, num_layers, num_tokens, num_channels)
    except ValueError as exc:
        raise SizeError(f"descriptor does not match the header: {exc}") from None
    return descriptor


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)


def _json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not
    count), without parsing it: json.loads recurses once per level, so a deep enough text
    would exhaust the interpreter's stack.  Works on the UTF-8 bytes (quotes, backslashes
    and brackets are ASCII, and no byte of a multi-byte character is)."""
    bare = np.frombuffer(_JSON_STRING.sub(b'""', raw), np.uint8)
    if not bare.size:
        return 0
    step = (np.isin(bare, (ord("["), ord("{"))).astype(np.int64) - np.isin(bare, (ord("]"), ord("}"))))
    return int(np.cumsum(step).max(initial=0))


def _read_file_header_v2(f: BinaryIO, raw: bytes, file_size: int | None,
                         defer_tables: bool = False, defer_crc: bool = False) -> tuple[FileHeader, int]:
    (_, version, header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens, num_chunks,
     group, dtype_code, layout_code, method, prob_bits, cdf_coding, flags, params_size, sink_tokens, reserved,
     crc) = FILE_HEADER_V2.unpack(raw)
    dtype, layout = _check_dims(header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens,
                                num_chunks, group, dtype_code, layout_code, prob_bits)
    if method not in (METHOD_TRANSFORM, METHOD_LOSSLESS):
        raise UnsupportedVersionError(f"unknown quantization method {method} for format version 2")
    if cdf_coding != CDF_CODING_SHARED:
        raise UnsupportedVersionError(f"unknown CDF coding {cdf_coding} for format version 2")
    if flags & ~KNOWN_FLAGS or reserved:
        raise UnsupportedVersionError("reserved header bits are set (written by a newer cachegen?)")
    if method == METHOD_LOSSLESS and (flags or sink_tokens):
        raise SizeError("a lossless file has no rotation and no sink tokens")
    if flags & FLAG_FIXED_ROTATION and not flags & FLAG_ROTATED:
        raise SizeError("header flags: a fixed-point rotation (bit 3) without a rotation (bit 0)")
    if sink_tokens > num_tokens:
        raise SizeError(f"{sink_tokens} sink tokens in a cache of {num_tokens}")
    if not 0 < params_size <= MAX_PARAMS_BYTES:
        raise SizeError(f"Params block size {params_size} out of range 1..{MAX_PARAMS_BYTES}")
    rest = desc_size + params_size
    if file_size is not None and FILE_HEADER.size + rest > file_size:
        raise TruncatedError("file ends inside the header's descriptor or Params block")
    desc_raw = bytes(read_exact(f, desc_size, "descriptor"))
    params_raw = bytes(read_exact(f, params_size, "Params block"))
    if not defer_crc and _crc(raw[:-4], desc_raw, params_raw) != crc:
        raise ChecksumError("file header CRC mismatch: the file is corrupted")
    try:
        descriptor = _parse_descriptor(desc_raw, num_layers, num_tokens, num_channels)
        params = parse_params(params_raw, method, num_layers, num_channels, sink_tokens, dtype,
                              bool(flags & FLAG_ROTATED), bool(flags & FLAG_REFINED), num_tokens, defer_tables,
                              bool(flags & FLAG_ROPE))
    except CacheGenError:
        # defer_crc: a corrupt header still gets the checksum's error first, as without it
        if defer_crc and _crc(raw[:-4], desc_raw, params_raw) != crc:
            raise ChecksumError("file header CRC mismatch: the file is corrupted") from None
        raise
    bins = np.zeros((num_layers, 2), np.int32)
    header = FileHeader(num_tokens, num_layers, num_channels, chunk_tokens, num_chunks, group, dtype, layout,
                        bins, descriptor, method, prob_bits, cdf_coding, FORMAT_VERSION_2, flags, sink_tokens, params,
                        FILE_HEADER.size + desc_size,
                        (crc, _crc(raw[:-4], desc_raw), params_size) if defer_crc else None)
    return header, FILE_HEADER.size + rest


# ---------------------------------------------------------------- chunks


@dataclass
class Chunk:
    """One chunk's sections, as arrays.

    scales  uint16 [L, 2, token_count]  bfloat16 bits
    codes   uint8  [cdf_size]           the CDF-codes section: 4-bit codes, packed (pack_codes)
    lengths uint16 [L, 2, groups]       coded bytes of each stream
    payload uint8  [sum(lengths)]       the streams, in (layer, K/V, group) order
    """

    index: int
    first_token: int
    token_count: int
    scales: np.ndarray
    codes: np.ndarray
    lengths: np.ndarray
    payload: np.ndarray


@functools.lru_cache(maxsize=32)
def _nibble_maps(alphabets_key: bytes, num_layers: int, num_channels: int, width: int):
    """Where each nibble of the CDF-codes section comes from in a [L, 2, C, width] codes array.

    Returns (low, high, padded): for packed byte j, the flat index of its low and
    high nibble's code (index L*2*C*width, one past the end, for the padding
    nibble of an odd alphabet), and the positions of the bytes that hold a padding nibble.
    """
    alphabets = np.frombuffer(alphabets_key, np.int32).reshape(num_layers, 2)
    pad = num_layers * 2 * num_channels * width
    lows, highs = [], []
    for l in range(num_layers):
        for kv in range(2):
            a = int(alphabets[l, kv])
            nb = (a + 1) // 2
            base = ((l * 2 + kv) * num_channels + np.arange(num_channels, dtype=np.int64)[:, None]) * width
            sym = 2 * np.arange(nb, dtype=np.int64)[None, :]
            lows.append((base + sym).reshape(-1))
            hi = base + sym + 1
            hi = np.where(sym + 1 < a, hi, pad)
            highs.append(hi.reshape(-1))
    low = np.concatenate(lows) if lows else np.empty(0, np.int64)
    high = np.concatenate(highs) if highs else np.empty(0, np.int64)
    return low, high, np.flatnonzero(high == pad)


def nibble_maps(h: FileHeader, width: int):
    return _nibble_maps(np.ascontiguousarray(h.alphabets, np.int32).tobytes(), h.num_layers, h.num_channels, width)


def pack_codes(codes: np.ndarray, h: FileHeader) -> np.ndarray:
    """codes [..., L, 2, C, S] -> the CDF-codes section(s) [..., cdf_size]: per (layer, K/V,
    channel) ceil(A/2) bytes, symbol 2i in the low nibble of byte i."""
    lead = codes.shape[:-4]
    width = codes.shape[-1]
    low, high, _ = nibble_maps(h, width)
    flat = codes.reshape(lead + (-1,))
    flat = np.concatenate([flat, np.zeros(lead + (1,), np.uint8)], axis=-1)
    return (flat[..., low] | (flat[..., high] << 4)).astype(np.uint8)


def unpack_codes(packed: np.ndarray, h: FileHeader, width: int) -> np.ndarray:
    """Inverse of pack_codes: [..., cdf_size] -> zero-padded [..., L, 2, C, width]."""
    lead = packed.shape[:-1]
    low, high, padded = nibble_maps(h, width)
    flat = np.zeros(lead + (h.num_layers * 2 * h.num_channels * width + 1,), np.uint8)
    flat[..., low] = packed & 0x0F
    flat[..., high] = packed >> 4
    return np.ascontiguousarray(flat[..., :-1]).reshape(lead + (h.num_layers, 2, h.num_channels, width))


def check_code_padding(packed: np.ndarray, h: FileHeader, width: int) -> bool:
    """True when every padding nibble is zero, as the format requires."""
    _, _, padded = nibble_maps(h, width)
    return not (packed[padded] >> 4).any()


def slab_chunks(h: FileHeader, first_chunk: int, scales: np.ndarray, packed: np.ndarray, lengths: np.ndarray,
                payload: np.ndarray, chunk_bounds: np.ndarray) -> list[Chunk]:
    """Cut the arrays of a slab of K consecutive chunks into Chunk records.

    scales [L, 2, T_slab]; packed codes [K, cdf_size]; lengths, any shape holding
    K x L x 2 x groups stream lengths; payload, the streams of all K chunks back to back;
    chunk_bounds [K + 1], where each chunk's streams start in payload.
    """
    K = packed.shape[0]
    T = scales.shape[2]
    ct = h.chunk_tokens
    lengths = lengths.reshape(K, h.num_layers, 2, h.groups)
    chunks = []
    for k in range(K):
        t0, t1 = k * ct, min(T, (k + 1) * ct)
        chunks.append(Chunk(first_chunk + k, (first_chunk + k) * ct, t1 - t0, scales[:, :, t0:t1], packed[k],
                            lengths[k], payload[chunk_bounds[k] : chunk_bounds[k + 1]]))
    return chunks


def chunk_parts(chunk: Chunk) -> list:
    """The chunk record as a list of byte buffers (header first), without joining them."""
    sections = [
        # v1: bfloat16 scales; v2: raw bytes (uint8)
        memoryview(np.ascontiguousarray(chunk.scales, dtype=np.uint8 if chunk.scales.dtype == np.uint8 else "<u2")).cast("B"),
        memoryview(np.ascontiguousarray(chunk.codes, dtype=np.uint8)).cast("B"),
        memoryview(np.ascontiguousarray(chunk.lengths, dtype="<u2")).cast("B"),
        memoryview(np.ascontiguousarray(chunk.payload, dtype=np.uint8)).cast("B"),
    ]
    head = CHUNK_HEADER.pack(CHUNK_MAGIC, chunk.index, chunk.first_token, chunk.token_count,
                             *(len(x) for x in sections), 0, 0)[:-4]
    crc = _crc(head, *sections)
    return [head + struct.pack("<I", crc)] + sections


def pack_chunk(h: FileHeader, chunk: Chunk) -> bytes:
    return b"".join(chunk_parts(chunk))


@dataclass
class ChunkRecord:
    """A chunk's header fields and raw body, read and size-checked but not yet CRC-checked."""

    index: int
    header: bytes
    body: bytes | memoryview
    first_token: int
    token_count: int
    sizes: tuple[int, int, int, int]  # scales, cdf, lengths, payload
    reserved: int
    crc: int

    @property
    def size(self) -> int:
        return CHUNK_HEADER.size + len(self.body)

    def crc_ok(self) -> bool:
        return _crc(self.header[:-4], self.body) == self.crc


def read_chunk_record(f: BinaryIO, h: FileHeader, index: int, remaining: int | None) -> ChunkRecord:
    """Read chunk ``index`` at the current position, checking every size before reading.

    ``remaining``: bytes left in the file from here (None when unknown).
    """
    raw = bytes(f.read(CHUNK_HEADER.size))
    if len(raw) < CHUNK_HEADER.size:
        raise TruncatedError(f"file ends inside the header of chunk {index}")
    (magic, chunk_index, first_token, token_count, scales_size, cdf_size, lengths_size, payload_size,
     reserved, crc) = CHUNK_HEADER.unpack(raw)
    if magic != CHUNK_MAGIC:
        raise SizeError(f"chunk {index} does not start with the chunk magic (corrupted or misplaced)")
    if chunk_index != index:
        raise SizeError(f"chunk {index} says it is chunk {chunk_index}")
    if first_token != index * h.chunk_tokens or token_count != h.chunk_tokens_at(index):
        raise SizeError(f"chunk {index} covers tokens [{first_token}, +{token_count}), not what the header implies")
    want = h.section_sizes(token_count, first_token)
    if (scales_size, cdf_size, lengths_size) != want:
        raise SizeError(f"chunk {index} section sizes {(scales_size, cdf_size, lengths_size)} differ from {want}")
    if payload_size > h.max_payload(token_count):
        raise SizeError(f"chunk {index} payload of {payload_size} bytes exceeds its bound")
    body = scales_size + cdf_size + lengths_size + payload_size
    if remaining is not None and CHUNK_HEADER.size + body > remaining:
        raise TruncatedError(f"file ends inside chunk {index} ({remaining} bytes left, {CHUNK_HEADER.size + body} needed)")
    data = read_exact(f, body, f"chunk {index}")
    return ChunkRecord(index, raw, data, first_token, token_count,
                       (scales_size, cdf_size, lengths_size, payload_size), reserved, crc)


def parse_chunk(h: FileHeader, rec: ChunkRecord, code_width: int) -> Chunk:
    """The sections of a CRC-checked record as arrays, with their consistency checks."""
    index, data, token_count = rec.index, rec.body, rec.token_count
    scales_size, cdf_size, lengths_size, payload_size = rec.sizes
    if rec.reserved:
        raise UnsupportedVersionError(f"chunk {index} has reserved bits set")
    L = h.num_layers
    o = 0
    if h.version == FORMAT_VERSION_2:  # the "scales" section holds the raw low bytes (lossless) or nothing
        raw = np.frombuffer(data, np.uint8, scales_size, 0)
        lengths = np.frombuffer(data, "<u2", lengths_size // 2, scales_size).reshape(L, 2, h.groups).astype(np.int32)
        _check_lengths(h, index, lengths, token_count, payload_size)
        payload = np.frombuffer(data, np.uint8, payload_size, scales_size + lengths_size)
        return Chunk(index, rec.first_token, token_count, raw, np.empty(0, np.uint8), lengths, payload)
    scales = np.frombuffer(data, "<u2", scales_size // 2, o).reshape(L, 2, token_count).astype(np.uint16)
    o += scales_size
    codes = np.frombuffer(data, np.uint8, cdf_size, o)
    if not check_code_padding(codes, h, code_width):
        raise SizeError(f"chunk {index}: a padding nibble of the CDF codes is not zero")
    o += cdf_size
    lengths = np.frombuffer(data, "<u2", lengths_size // 2, o).reshape(L, 2, h.groups).astype(np.int32)
    o += lengths_size
    _check_lengths(h, index, lengths, token_count, payload_size)
    if (scales & 0x8000).any() or ((scales & 0x7F80) == 0x7F80).any():
        raise SizeError(f"chunk {index} has a negative or non-finite scale")
    payload = np.frombuffer(data, np.uint8, payload_size, o)
    return Chunk(index, rec.first_token, token_count, scales, codes, lengths, payload)


def _check_lengths(h: FileHeader, index: int, lengths: np.ndarray, token_count: int, payload_size: int) -> None:
    if int(lengths.sum()) != payload_size:
        raise SizeError(f"chunk {index} stream lengths add up to {int(lengths.sum())}, not {payload_size}")
    if int(lengths.max(initial=0)) > max_stream_bytes(token_count * h.group):
        raise SizeError(f"chunk {index} has a stream longer than its bound")


def read_chunk(f: BinaryIO, h: FileHeader, index: int, remaining: int | None, code_width: int) -> tuple[Chunk, int]:
    """Read, CRC-check and parse chunk ``index`` at the current position; returns it and its size."""
    rec = read_chunk_record(f, h, index, remaining)
    if not rec.crc_ok():
        raise ChecksumError(f"chunk {index} CRC mismatch: the file is corrupted")
    return parse_chunk(h, rec, code_width), rec.size


class BufferReader:
    """The read/seek/tell of a binary file over a buffer, returning zero-copy memoryviews."""

    def __init__(self, buffer) -> None:
        self.view = memoryview(buffer).cast("B")
        self.pos = 0

    def read(self, n: int = -1) -> memoryview:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = self.view[self.pos : end]
        self.pos = end
        return out

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos


# ---------------------------------------------------------------- index and trailer


def pack_index(offsets: list[int]) -> bytes:
    body = INDEX_MAGIC + struct.pack("<I", len(offsets)) + np.asarray(offsets, dtype="<u8").tobytes()
    return body + struct.pack("<I", _crc(body))


def pack_trailer(index_offset: int) -> bytes:
    return TRAILER.pack(index_offset, TRAILER_MAGIC)


def read_index(f: BinaryIO, h: FileHeader, header_end: int, file_size: int) -> list[int]:
    """Read the chunk index through the trailer; validates every offset."""
    if file_size < header_end + TRAILER.size:
        raise TruncatedError("file ends before the chunk index")
    f.seek(file_size - TRAILER.size)
    index_offset, magic = TRAILER.unpack(bytes(read_exact(f, TRAILER.size, "trailer")))
    if magic != TRAILER_MAGIC:
        raise TruncatedError("no trailer at the end of the file: truncated or not completely written")
    size = 12 + 8 * h.num_chunks
    if index_offset < header_end or index_offset + size + TRAILER.size != file_size:
        raise SizeError("index offset in the trailer is out of range")
    f.seek(index_offset)
    raw = bytes(read_exact(f, size, "chunk index"))
    if raw[:4] != INDEX_MAGIC:
        raise SizeError("chunk index does not start with its magic")
    (count,) = struct.unpack_from("<I", raw, 4)
    (crc,) = struct.unpack_from("<I", raw, size - 4)
    if _crc(raw[:-4]) != crc:
        raise ChecksumError("chunk index CRC mismatch: the file is corrupted")
    if count != h.num_chunks:
        raise SizeError(f"index lists {count} chunks, header says {h.num_chunks}")
    offsets = [int(x) for x in np.frombuffer(raw, "<u8", count, 8)]
    previous = header_end - 1
    for i, off in enumerate(offsets):
        if off <= previous or off + CHUNK_HEADER.size > index_offset:
            raise SizeError(f"index offset of chunk {i} is out of range")
        previous = off
    if offsets and offsets[0] != header_end:
        raise SizeError("first chunk offset does not follow the header")
    if not offsets and index_offset != header_end:
        raise SizeError("index offset does not follow the header")
    # Every chunk holds at least its header and the sections whose sizes the file header fixes
    # (v1: scales, CDF codes, stream lengths; v2: raw bytes, stream lengths): a file too short
    # for them is refused here, before a decoder allocates the output the header announces.
    K, T = h.num_chunks, h.num_tokens
    scales, cdf, lengths = h.section_sizes(min(h.chunk_tokens, T)) if K else (0, 0, 0)
    if h.version == FORMAT_VERSION_2:
        need = K * (CHUNK_HEADER.size + lengths) + h.num_layers * 2 * T * h.num_channels * h.raw_bytes_per_value
        if h.flags & FLAG_REFINED:
            need += h.num_layers * 2 * h.params.refine_tokens * h.num_channels * h.params.refine_bits // 8
    else:
        need = K * (CHUNK_HEADER.size + cdf + lengths) + h.num_layers * 2 * T * 2
    if header_end + need > index_offset:
        raise TruncatedError(f"the header announces {T} tokens in {K} chunks, which take at least {need} bytes; "
                             f"the file holds {index_offset - header_end} (truncated or corrupted)")
    return offsets


def _stream_size(f: BinaryIO) -> int | None:
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
        return end - here
    except (OSError, io.UnsupportedOperation, AttributeError):
        return None


def read_header_and_index(f: BinaryIO, defer_tables: bool = False) -> tuple[FileHeader, int, list[int], int]:
    """Header, header size, chunk offsets and file size of a seekable .cgen stream at offset 0.
    ``defer_tables``: a version-2 Params block's tables are only walked and checked to fit
    (read_file_header), for a caller that does not read them on the host."""
    size = _stream_size(f)
    if size is None:
        raise FormatError("the .cgen input must be seekable")
    h, header_end = read_file_header(f, size, defer_tables=defer_tables)
    offsets = read_index(f, h, header_end, size)
    f.seek(header_end)
    return h, header_end, offsets, size


def decoded_size(head: bytes) -> int | None:
    """The bytes of the decoded tensors (L x 2 x num_tokens x C x the dtype's size) that the
    fixed 64-byte FileHeader announces, or None when ``head`` is not the start of a .cgen file
    (the usual checks then say why).  Nothing past byte 64 is needed, so a reader can refuse a
    decompression bomb before reading, let alone allocating, anything else."""
    head = bytes(head[:64])
    if len(head) >= 32 and head[:8] == MAGIC and struct.unpack_from("<H", head, 8)[0] == 3:
        return struct.unpack_from("<Q", head, 24)[0]  # version 3 (format/parts.py): the header says it
    if len(head) < 64 or head[:8] != MAGIC:
        return None
    num_tokens, num_layers, num_channels = struct.unpack_from("<QII", head, 16)
    itemsize = {1: 2, 2: 2, 3: 4}.get(head[42])
    if itemsize is None:
        return None
    return num_layers * 2 * num_tokens * num_channels * itemsize


def check_decoded_size(head: bytes, max_output_size: int | None, what: str = "the file") -> None:
    """Raise OutputTooLargeError when the decoded cache ``head`` announces exceeds ``max_output_size`` bytes."""
    if max_output_size is None:
        return
    n = decoded_size(head)
    if n is not None and n > max_output_size:
        from ..errors import OutputTooLargeError

        big = f"{what} decodes to {n:,} bytes, more than the limit of {max_output_size:,}"
        raise OutputTooLargeError(f"{big} (max_output_size=)", cli=f"{big} (--max-output-size)")
