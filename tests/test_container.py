"""The .cgen container: pinned bytes, a golden file, and one test per error class with bad bytes."""

from __future__ import annotations

import hashlib
import io
import struct
import zlib
from pathlib import Path

import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.format import container
from cachegen_cli.errors import (
    BadMagicError,
    ChecksumError,
    FormatError,
    SizeError,
    TruncatedError,
    UnsupportedVersionError,
)

from conftest import realistic_kv

GOLDEN = Path(__file__).parent / "data" / "golden_v1.cgen"


def tiny_kv() -> torch.Tensor:
    return realistic_kv(layers=2, tokens=9, heads=1, head_dim=4, dtype=torch.bfloat16, seed=7)


def tiny_blob() -> bytes:
    return cg.encode(tiny_kv(), preset="lmcache", chunk_tokens=4, metadata={"source": "tiny"})


def test_tiny_file_bytes_are_pinned():
    assert hashlib.sha256(tiny_blob()).hexdigest() == TINY_SHA256


def test_golden_v1_file_still_decodes():
    """A file written by format version 1 must decode to the same values forever."""
    out = cg.decode(GOLDEN.read_bytes())
    kv = out["kv"]
    assert kv.shape == (2, 2, 9, 1, 4) and kv.dtype == torch.bfloat16
    digest = hashlib.sha256(kv.view(torch.int16).numpy().tobytes()).hexdigest()
    assert digest == GOLDEN_DECODED_SHA256
    assert cg.decode(GOLDEN.read_bytes())["kv"].equal(cg.decode(tiny_blob())["kv"])


def _fix_header_crc(blob: bytearray) -> bytearray:
    (desc_size,) = struct.unpack_from("<I", blob, 12)
    (layers,) = struct.unpack_from("<I", blob, 24)
    end = 64 + 2 * layers + desc_size
    struct.pack_into("<I", blob, 60, zlib.crc32(bytes(blob[:60]) + bytes(blob[64:end])))
    return blob


def _decode(blob: bytes):
    return cg.decode(bytes(blob))


def test_bad_magic():
    blob = bytearray(tiny_blob())
    blob[1] ^= 0xFF
    with pytest.raises(BadMagicError, match="not a .cgen file"):
        _decode(blob)


def test_foreign_files():
    from safetensors.torch import save

    for foreign in (save({"kv": tiny_kv()}), b"", b"hello world", b"\x89PNG\r\n\x1a\n" + bytes(100)):
        with pytest.raises(BadMagicError):
            _decode(foreign)


def test_unknown_version():
    blob = bytearray(tiny_blob())
    struct.pack_into("<H", blob, 8, 2)
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        _decode(_fix_header_crc(blob))


def test_unknown_method_and_reserved_bytes():
    blob = bytearray(tiny_blob())
    blob[44] = 9
    with pytest.raises(UnsupportedVersionError, match="method"):
        _decode(_fix_header_crc(blob))
    blob = bytearray(tiny_blob())
    blob[50] = 1
    with pytest.raises(UnsupportedVersionError, match="reserved"):
        _decode(_fix_header_crc(blob))


def test_header_checksum():
    blob = bytearray(tiny_blob())
    blob[70] ^= 0x01  # inside the descriptor
    with pytest.raises(ChecksumError, match="header CRC"):
        _decode(blob)


def test_chunk_checksum():
    blob = bytearray(tiny_blob())
    offsets = _offsets(bytes(blob))
    blob[offsets[1] + 60] ^= 0x10  # inside chunk 1's sections
    with pytest.raises(ChecksumError, match="chunk 1 CRC"):
        _decode(blob)


def test_index_checksum():
    blob = bytearray(tiny_blob())
    (index_offset,) = struct.unpack_from("<Q", blob, len(blob) - 16)
    blob[index_offset + 9] ^= 0x01
    with pytest.raises(ChecksumError, match="index CRC"):
        _decode(blob)


def _offsets(blob: bytes) -> list[int]:
    f = io.BytesIO(blob)
    h, end = container.read_file_header(f, len(blob))
    return container.read_index(f, h, end, len(blob))


@pytest.mark.parametrize(
    "offset, fmt, value, message",
    [
        (24, "<I", 0, "layer count"),
        (24, "<I", 100000, "layer count"),
        (28, "<I", 0, "channel count"),
        (32, "<I", 0, "chunk size"),
        (32, "<I", 1 << 20, "chunk size"),
        (36, "<I", 99, "chunk count"),
        (16, "<Q", 1 << 40, "token count"),
        (12, "<I", 0xFFFFFFFF, "descriptor size"),
        (40, "<H", 0, "channels per stream"),
        (40, "<H", 5000, "channels per stream"),
    ],
)
def test_header_sizes_out_of_range(offset, fmt, value, message):
    blob = bytearray(tiny_blob())
    struct.pack_into(fmt, blob, offset, value)
    with pytest.raises(SizeError, match=message):
        _decode(_fix_header_crc(blob))


def test_descriptor_larger_than_file():
    blob = bytearray(tiny_blob())
    struct.pack_into("<I", blob, 12, 1 << 20)
    with pytest.raises(TruncatedError):
        _decode(_fix_header_crc(blob))


@pytest.mark.parametrize("field, value", [(16, 7), (20, 1), (24, 3), (28, 1 << 30), (4, 5), (8, 1)])
def test_chunk_header_sizes_checked_before_reading(field, value):
    blob = bytearray(tiny_blob())
    first = _offsets(bytes(blob))[0]
    struct.pack_into("<I", blob, first + field, value)
    with pytest.raises(SizeError):
        _decode(blob)


def test_lengths_must_add_up():
    """Stream lengths that disagree with payload_size are refused even with a valid CRC."""
    blob = bytearray(tiny_blob())
    first = _offsets(bytes(blob))[0]
    scales, cdf, lengths = struct.unpack_from("<III", blob, first + 16)
    at = first + 40 + scales + cdf
    (n,) = struct.unpack_from("<H", blob, at)
    struct.pack_into("<H", blob, at, n + 1)
    head_and_body = bytes(blob[first : first + 36]) + bytes(blob[first + 40 : _offsets(bytes(blob))[1]])
    struct.pack_into("<I", blob, first + 36, zlib.crc32(head_and_body))
    with pytest.raises(SizeError, match="add up"):
        _decode(blob)


def test_every_truncation_is_a_format_error():
    blob = tiny_blob()
    for cut in range(len(blob)):
        with pytest.raises(FormatError):
            _decode(blob[:cut])


def test_trailing_garbage_is_refused():
    with pytest.raises(FormatError):
        _decode(tiny_blob() + b"\x00" * 5)


def test_random_corruption_never_crashes():
    import random

    rng = random.Random(5)
    blob = tiny_blob()
    for _ in range(300):
        bad = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        with pytest.raises(FormatError):
            _decode(bad)


TINY_SHA256 = "3cb6bb277f5844e05a80ecfa0c2ea9afb110394e7b63ace733d8052680dd2372"
GOLDEN_DECODED_SHA256 = "0e88f87ca4f9cf04454c0b5cd552ddcf96a09e785e6c77c6765991d261fbea43"
