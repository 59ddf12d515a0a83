"""Golden files of format version 2 (tests/data/golden/, written once by scripts/make_golden.py).

For every case of ``manifest.json``: the committed .cgen file decodes to the recorded tensors
(SHA-256 of their bytes: decoding is integer / IEEE exact, so the same on every machine), its
header and Params block say what the case is meant to cover (parsed here with ``struct`` from
docs/format.md, not with cachegen's reader), and re-encoding the committed source with the
recorded options gives the same bytes (the encoder is pinned too).

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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import make_golden  # noqa: E402


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


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_decodes_to_its_recorded_tensors(name):
    case = _case(name)
    out = cg.decode(_blob(case), device="cpu", calibration=_calibration(case))
    assert sorted(out) == sorted(case["decoded"])
    for tensor_name, want in case["decoded"].items():
        assert make_golden.tensor_digest(out[tensor_name]) == want, tensor_name
    source = kvio.read_safetensors(GOLDEN / case["source"])
    back = kvio.from_tensors(out)
    assert back.data.dtype == source.data.dtype and back.data.shape == source.data.shape
    if case["config"]["method"] == "lossless":
        assert torch.equal(back.data.view(torch.uint8), source.data.view(torch.uint8))
    else:  # a lossy case still decodes close to its source (steps <= 1.5 x RMS: relative MSE < 0.25)
        x, y = source.data.float(), back.data.float()
        assert float(((x - y) ** 2).mean() / (x ** 2).mean()) < 0.25


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
    (magic, version, header_size, desc_size, num_tokens, num_layers, num_channels, chunk_tokens, num_chunks, group,
     dtype, layout, method, prob_bits, cdf_coding, flags, params_size, sink_tokens, reserved,
     crc) = struct.unpack_from("<8sHHIQIIIIHBBBBBBIIII", blob, 0)
    assert magic == b"\x89CGEN\r\n\x1a" and header_size == 64 and reserved == 0
    return dict(version=version, desc_size=desc_size, num_tokens=num_tokens, L=num_layers, C=num_channels,
                dtype=dtype, layout=layout, method=method, cdf_coding=cdf_coding, flags=flags,
                params_size=params_size, sink_tokens=sink_tokens)


def _params(blob: bytes, h: dict) -> dict:
    """The Params block, walked as docs/format.md describes it: the refinement fields and the
    kind of each table entry ("direct", "delta" or "same")."""
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
    kinds = []
    for i in range(L * 2 * C):
        mode = blob[o]
        if mode == 2:
            assert i % C, "a (layer, K/V)'s first channel has its own table"
            kinds.append("same")
            o += 1
            continue
        kinds.append({0: "direct", 1: "delta"}[mode])
        alphabet = blob[o + 2] + 1
        o += 3 + (alphabet + 1) // 2
    assert o == end, "the tables fill the Params block exactly"
    out["tables"] = kinds
    return out


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_file_covers_what_it_claims(name):
    case = _case(name)
    blob = _blob(case)
    h = _header(blob)
    p = _params(blob, h)
    expect = case["expect"]
    for key in ("version", "method", "flags", "sink_tokens", "dtype", "layout"):
        if key in expect:
            assert h[key] == expect[key], key
    for key in ("refine_tokens", "refine_bits"):
        assert p[key] == expect.get(key, 0), key
    assert h["cdf_coding"] == 2
    if h["flags"] & 1:  # rotated: the calibration hash is that of the committed calibration file
        from cachegen_cli.methods.calibration import load

        assert blob[64 + h["desc_size"] : 64 + h["desc_size"] + 32] == load(_calibration(case)).sha256
    if not case["config"]["token_delta"]:
        assert "delta" not in p["tables"]
    for kind in expect.get("tables", ()):
        assert kind in p["tables"], f"{name} has no {kind!r} table entry"
    assert h["num_tokens"] % make_golden.CHUNK_TOKENS, "the last chunk is a short one"


def test_golden_cases_cover_every_method_and_flag():
    expects = [c["expect"] for c in MANIFEST.values()]
    assert {e["method"] for e in expects} >= {2, 3}
    assert {e["dtype"] for e in expects} >= {1, 2, 3}
    assert {e["flags"] for e in expects} >= {0, 1, 2}
    assert any(e["sink_tokens"] > 1 for e in expects)
    assert any({"delta", "same"} <= set(e.get("tables", ())) for e in expects)
    assert any(e.get("layout") == 2 for e in expects)


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
    cg.encode_file(GOLDEN / case["source"], dst, quantization=make_golden.config_of(case),
                   calibration=_calibration(case), chunk_tokens=case.get("chunk_tokens", make_golden.CHUNK_TOKENS),
                   device="cpu")
    assert dst.read_bytes() == _blob(case)
