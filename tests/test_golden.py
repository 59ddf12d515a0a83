"""Golden files of format versions 1, 2 and 3 (tests/data/golden/, written once by scripts/make_golden.py).

For every case of ``manifest.json``: the committed .cgen file decodes to the recorded tensors
(SHA-256 of their bytes: decoding is integer / IEEE exact, so the same on every machine), with
cachegen and with the independent reference decoder (reference/cgen_reference.py); its header
(BinsTable, Params block, version 3's PartsHeader, Manifest and Part table) says what the case
is meant to cover (parsed here with ``struct`` from docs/format.md, not with cachegen's reader),
and re-encoding the committed source with the recorded options gives the same bytes (the encoder
is pinned too).

A golden file is never regenerated: a change that breaks one needs a new format version or
flag (tests/data/README.md).
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.storage import kvio

GOLDEN = Path(__file__).parent / "data" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "reference"))

import cgen_reference as ref  # noqa: E402
import make_golden  # noqa: E402

PARTS_HEADER = "<8sHHIIIQQII"  # docs/format.md, "PartsHeader (48 bytes)"
PART_ENTRY = "<QQB3sI"  # "Part table entry (24 bytes)"


def _case(name: str) -> dict:
    return MANIFEST[name]


def _blob(case: dict) -> bytes:
    return (GOLDEN / case["file"]).read_bytes()


def _calibration(case: dict):
    return GOLDEN / case["calibration"] if case.get("calibration") else None


def test_manifest_covers_every_case():
    """Every case make_golden.py knows is committed (a new case must be generated and committed)."""
    assert set(make_golden.CASES) <= set(MANIFEST)
    for name, case in MANIFEST.items():
        assert (GOLDEN / case["file"]).is_file() and (GOLDEN / case["source"]).is_file(), name
        assert len(_blob(case)) < 12_000, "golden files stay small"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_is_the_committed_one(name):
    case = _case(name)
    assert hashlib.sha256(_blob(case)).hexdigest() == case["sha256"]


def _version(case: dict) -> int:
    return case["expect"]["version"]


def _lossless(case: dict) -> bool:
    return case["config"]["method"] == "lossless"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_decodes_to_its_recorded_tensors(name):
    case = _case(name)
    out = cg.decode(_blob(case), device="cpu", calibration=_calibration(case))
    assert sorted(out) == sorted(case["decoded"])
    for tensor_name, want in case["decoded"].items():
        assert make_golden.tensor_digest(out[tensor_name]) == want, tensor_name
    source, _ = kvio.read_tensors(GOLDEN / case["source"])
    assert list(out) == list(source), "the source's tensors, in its order"
    kv, got = [], []
    for tensor_name, t in source.items():
        back = out[tensor_name]
        assert back.dtype == t.dtype and back.shape == t.shape, tensor_name
        if _lossless(case) or not t.is_floating_point():  # lossless, or an extra tensor: stored exactly
            assert torch.equal(back.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), tensor_name
        else:
            kv.append(t.float().flatten())
            got.append(back.float().flatten())
    if kv and sum(x.numel() for x in kv):  # a lossy case still decodes close to its source (steps <= 1.5 x RMS)
        x, y = torch.cat(kv), torch.cat(got)
        assert float(((x - y) ** 2).mean() / (x ** 2).mean()) < 0.25


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_reference_decoder_gives_the_recorded_tensors(name):
    """The reference decoder (docs/format.md alone, nothing from cachegen) reproduces the SHA-256
    the manifest pins (make_golden.tensor_digest's rule: the little-endian words of each tensor),
    names and order included; tests/test_reference_decoder.py compares it with cachegen bit for bit."""
    case = _case(name)
    cal = _calibration(case)
    decoded = ref.decode(_blob(case), None if cal is None else str(cal))
    got = {n: {"dtype": d, "shape": list(w.shape), "sha256": hashlib.sha256(w.astype(w.dtype.newbyteorder("<")).tobytes()).hexdigest()}
           for n, (d, w) in decoded.tensors.items()}
    assert got == case["decoded"]
    assert list(decoded.tensors) == list(kvio.read_tensors(GOLDEN / case["source"])[0])


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_decodes_to_file(name, tmp_path):
    """The streaming file -> file decoder gives the same tensors as decode()."""
    from safetensors.torch import load_file

    case = _case(name)
    src = tmp_path / "in.cgen"
    src.write_bytes(_blob(case))
    dst = cg.decode_file(src, tmp_path / "out.safetensors", device="cpu", calibration=_calibration(case))
    got = load_file(str(dst))
    assert {k: make_golden.tensor_digest(v) for k, v in got.items()} == case["decoded"]


def _header(blob: bytes) -> dict:
    """The 64-byte FileHeader of a version 1 or 2 file (the two tables of docs/format.md)."""
    (magic, version, header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens, num_chunks, group,
     dtype, layout, method, prob_bits, cdf_coding) = struct.unpack_from("<8sHHIQIIIIHBBBBB", blob, 0)
    assert magic == b"\x89CGEN\r\n\x1a" and header_size == 64 and prob_bits == 15
    h = dict(version=version, desc_size=desc_size, num_tokens=num_tokens, L=num_layers, C=num_channels,
             chunk_tokens=chunk_tokens, num_chunks=num_chunks, group=group, dtype=dtype, layout=layout, method=method,
             cdf_coding=cdf_coding, flags=0, params_size=0, sink_tokens=0)
    if version == 1:
        assert blob[47:60] == bytes(13), "reserved"
    else:
        assert version == 2
        h["flags"], h["params_size"], h["sink_tokens"], reserved = struct.unpack_from("<BIII", blob, 47)
        assert reserved == 0
    return h


def _bins_table(blob: bytes, h: dict) -> list[list[int]]:
    """Version 1's BinsTable: [keys' bins, values' bins] of each layer."""
    raw = blob[64 : 64 + 2 * h["L"]]
    return [[raw[2 * i], raw[2 * i + 1]] for i in range(h["L"])]


def _params(blob: bytes, h: dict) -> dict:
    """The Params block, walked as docs/format.md describes it: the refinement fields and the
    kind ("direct", "delta" or "same") and alphabet of each table entry."""
    L, C, S = h["L"], h["C"], h["sink_tokens"]
    w = {1: 2, 2: 2, 3: 4}[h["dtype"]]
    start = 64 + h["desc_size"]
    end = start + h["params_size"]
    o = start
    out: dict = {"refine_tokens": 0, "refine_bits": 0}
    if h["method"] == 2:
        o += 32 + 4 * L + 4 * L * C + 2 * L * S * C * w
        if h["flags"] & 2:
            out["refine_tokens"], out["refine_bits"] = struct.unpack_from("<IB", blob, o)
            o += 5
        if h["flags"] & 4:  # the RoPE block: style, reserved, head_dim, rotary_dim, rows, position_start, f64s
            style, zero, head_dim, rotary_dim, rows, start = struct.unpack_from("<BBHHHQ", blob, o)
            assert zero == 0
            out["rope"] = [style, head_dim, rotary_dim, rows, start]
            o += 16 + 8 * rows * (rotary_dim // 2)
    kinds, alphabets = [], []
    for i in range(L * 2 * C):
        mode = blob[o]
        if mode == 2:
            assert i % C, "a (layer, K/V)'s first channel has its own table"
            kinds.append("same")
            alphabets.append(alphabets[-1])
            o += 1
            continue
        kinds.append({0: "direct", 1: "delta"}[mode])
        alphabet = blob[o + 2] + 1
        alphabets.append(alphabet)
        o += 3 + (alphabet + 1) // 2
    assert o == end, "the tables fill the Params block exactly"
    out["tables"], out["alphabets"] = kinds, alphabets
    return out


def _index_offsets(blob: bytes) -> list[int]:
    """The Index's chunk offsets (found through the Trailer)."""
    index_at, magic = struct.unpack_from("<Q8s", blob, len(blob) - 16)
    assert magic == b"CGENDIDX"
    index_magic, count = struct.unpack_from("<4sI", blob, index_at)
    assert index_magic == b"CGIX" and index_at + 12 + 8 * count == len(blob) - 16
    return list(struct.unpack_from(f"<{count}Q", blob, index_at + 8))


def _chunk_headers(blob: bytes) -> list[dict]:
    """Each chunk's ChunkHeader (through the Index): its tokens and section sizes."""
    out = []
    for k, at in enumerate(_index_offsets(blob)):
        magic, index, first, count, raw, cdf, lengths, payload, reserved = struct.unpack_from("<4sIIIIIIII", blob, at)
        assert magic == b"CGCK" and index == k and reserved == 0
        out.append(dict(first=first, count=count, raw=raw, cdf=cdf, lengths=lengths, payload=payload))
    return out


def _parts(blob: bytes) -> dict:
    """A version 3 file: its PartsHeader, Manifest and Part table (each part's kind and bytes)."""
    (magic, version, header_size, flags, manifest_size, part_count, decoded_bytes, file_size, reserved,
     crc) = struct.unpack_from(PARTS_HEADER, blob, 0)
    assert magic == b"\x89CGEN\r\n\x1a" and version == 3 and header_size == 48 and flags == 0 and reserved == 0
    assert file_size == len(blob)
    manifest = json.loads(blob[48 : 48 + manifest_size])
    table_at = 48 + manifest_size
    parts, at = [], table_at + 24 * part_count
    for i in range(part_count):
        offset, size, kind, res, _ = struct.unpack_from(PART_ENTRY, blob, table_at + 24 * i)
        assert offset == at and res == bytes(3), "parts back to back"
        parts.append((kind, blob[offset : offset + size]))
        at += size
    assert at == file_size
    return dict(manifest=manifest, parts=parts, decoded_bytes=decoded_bytes)


def _check_regular(case: dict, blob: bytes) -> None:
    """What a version 1 or 2 case claims, from its header, BinsTable or Params block and Index."""
    h = _header(blob)
    expect = case["expect"]
    for key in ("version", "method", "flags", "sink_tokens", "dtype", "layout", "num_tokens", "group"):
        if key in expect:
            assert h[key] == expect[key], key
    chunk_tokens = case.get("chunk_tokens", make_golden.CHUNK_TOKENS)
    assert h["chunk_tokens"] == chunk_tokens
    assert h["num_chunks"] == -(-h["num_tokens"] // chunk_tokens) == len(_index_offsets(blob))
    if h["num_tokens"]:
        assert h["num_tokens"] % chunk_tokens, "the last chunk is a short one"
    if "group" in expect:  # more than one channel group per (layer, K/V), the last one narrower
        assert h["C"] > h["group"] and h["C"] % h["group"], "two or more channel groups, the last narrower"
    else:
        assert h["group"] == h["C"], "one channel group"
    chunks = _chunk_headers(blob)
    streams = h["L"] * 2 * -(-h["C"] // h["group"])  # a u16 length per (layer, K/V, channel group)
    assert [c["lengths"] for c in chunks] == [2 * streams] * len(chunks)
    if h["version"] == 1:
        assert h["cdf_coding"] == 1
        assert _bins_table(blob, h) == expect["bins"]
        alphabets = [2 * ((b - 1) // 2) + 1 for pair in expect["bins"] for b in pair]
        for c in chunks:  # scales u16[L][2][Tk]; 4-bit CDF codes per channel and alphabet
            assert c["raw"] == 2 * h["L"] * 2 * c["count"] and c["cdf"] == h["C"] * sum((a + 1) // 2 for a in alphabets)
        return
    p = _params(blob, h)
    for key in ("refine_tokens", "refine_bits"):
        assert p[key] == expect.get(key, 0), key
    assert p.get("rope") == expect.get("rope")
    assert h["cdf_coding"] == 2
    if h["method"] == 2:  # the Raw section: refinement indices of the chunk's refined tokens only
        R, b = p["refine_tokens"], p["refine_bits"]
        for c in chunks:
            refined = max(0, c["first"] + c["count"] - max(c["first"], h["num_tokens"] - R))
            assert c["raw"] == -(-h["L"] * 2 * refined * h["C"] * b // 8) and c["cdf"] == 0
    if h["flags"] & 1:  # rotated: the calibration hash is that of the committed calibration file
        from cachegen_cli.methods.calibration import load

        assert blob[64 + h["desc_size"] : 64 + h["desc_size"] + 32] == load(_calibration(case)).sha256
    if not case["config"]["token_delta"]:
        assert "delta" not in p["tables"]
    for kind in expect.get("tables", ()):
        assert kind in p["tables"], f"{kind!r} table entry"
    if h["num_tokens"] == 0:  # docs/format.md, "Edge cases, version 2": every table of A = 1, mode 0
        assert set(p["tables"]) <= {"direct", "same"} and set(p["alphabets"]) == {1}


def _check_parts(case: dict, blob: bytes) -> None:
    """What a version 3 case claims: its groups (kind, tokens, channels, the version and method of
    each group's file) and extras (stored exactly: the part holds the source tensor's bytes)."""
    f = _parts(blob)
    m, parts, expect = f["manifest"], f["parts"], case["expect"]
    groups = [dict(kind=g["kind"], tokens=g["tokens"], channels=g["channels"]) for g in m["groups"]]
    assert groups == [{k: g[k] for k in ("kind", "tokens", "channels")} for g in expect["groups"]]
    assert [k for k, _ in parts] == [1] * len(groups) + [2] * len(expect["extras"])
    for want, (g, (_, data)) in zip(expect["groups"], zip(m["groups"], parts)):
        h = _header(data)  # a group is a complete version 1 or 2 file, stacked, never rotated
        assert (h["version"], h["method"], h["layout"], h["flags"] & 1) == (want["version"], want["method"], 1, 0)
        assert (h["L"], h["num_tokens"], h["C"]) == (len(g["members"]), g["tokens"], -(-g["channels"] // 2)
                                                     if g["kind"] == "planes" else g["channels"])
    extras = [e for e in m["tensors"] if e["role"] == "extra"]
    assert [e["name"] for e in extras] == expect["extras"]
    source, _ = kvio.read_tensors(GOLDEN / case["source"])
    for e, (_, data) in zip(extras, parts[len(groups):]):
        assert data == source[e["name"]].contiguous().view(torch.uint8).numpy().tobytes(), e["name"]
    assert f["decoded_bytes"] == sum(t.numel() * t.element_size() for t in source.values())


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_covers_what_it_claims(name):
    case = _case(name)
    blob = _blob(case)
    assert struct.unpack_from("<H", blob, 8)[0] == _version(case)
    if _version(case) == 3:
        _check_parts(case, blob)
    else:
        _check_regular(case, blob)


def test_golden_cases_cover_every_method_and_flag():
    """The combinations the writers produce each have a golden file (docs/format.md, tests/data/README.md)."""
    expects = [c["expect"] for c in MANIFEST.values()]
    regular = [e for e in expects if e["version"] in (1, 2)]
    # every (version, method) with every source dtype
    for version, method in ((1, 1), (2, 2), (2, 3)):
        assert {e["dtype"] for e in regular if (e["version"], e["method"]) == (version, method)} >= {1, 2, 3}, method
    assert {e["flags"] for e in regular if e["version"] == 2} >= {0, 1, 2, 3}  # rotation and refinement, and both
    assert {e["flags"] & 5 for e in regular if e.get("flags", 0) & 4} == {4, 5}  # keys without RoPE, alone and rotated
    assert {e["rope"][0] for e in regular if "rope" in e} == {0, 1}  # both pair styles
    assert {e.get("refine_bits") for e in regular} >= {1, 2, 3, 8}
    chunk = make_golden.CHUNK_TOKENS  # refined tokens in two chunks: [20 - R, 20) crosses a chunk boundary
    assert any((make_golden.TOKENS - e["refine_tokens"]) // chunk != (make_golden.TOKENS - 1) // chunk
               for e in regular if e.get("refine_tokens"))
    assert any(e["sink_tokens"] > 1 for e in regular if e["version"] == 2)
    assert any({"delta", "same"} <= set(e.get("tables", ())) for e in regular)
    for version in (1, 2):
        mine = [e for e in regular if e["version"] == version]
        assert any(e.get("layout") == 2 for e in mine), "a per-layer source"
        assert any(e.get("num_tokens") == 0 for e in mine), "a cache of no tokens"
        assert any("group" in e for e in mine), "more than one channel group"
    parts = [e for e in expects if e["version"] == 3]
    assert {g["kind"] for e in parts for g in e["groups"]} == {"kv", "planes"}
    assert {g["version"] for e in parts for g in e["groups"]} == {1, 2}
    assert any(len({g["tokens"] for g in e["groups"]}) > 1 for e in parts), "layers of different token counts"
    assert any(e["extras"] for e in parts), "an extra tensor"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_reencoding_the_source_gives_the_golden_bytes(name):
    """Pins the encoder: the committed source, encoded with the recorded options (in memory and
    file -> file), gives the golden file byte for byte."""
    case = _case(name)
    assert make_golden.encode_case(case, GOLDEN) == _blob(case)


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_reencoding_file_to_file_gives_the_golden_bytes(name, tmp_path):
    case = _case(name)
    dst = tmp_path / "out.cgen"
    with make_golden.rotation_arithmetic(case):
        cg.encode_file(GOLDEN / case["source"], dst, quantization=make_golden.config_of(case),
                       calibration=_calibration(case), chunk_tokens=case.get("chunk_tokens", make_golden.CHUNK_TOKENS),
                       device="cpu")
    assert dst.read_bytes() == _blob(case)
