"""reference/cgen_reference.py, the decoder written from docs/format.md alone, against cachegen.

Both decoders are defined by the spec's exact (integer and IEEE) arithmetic, so they must
agree bit for bit: every golden file and a set of freshly encoded files (every --quality,
--preset lmcache, lossless, rotation, refinement, token delta, the three dtypes, both
layouts, odd token counts, several chunks, narrower last channel groups) are decoded by
both and compared through the values' bit patterns and dtypes.  A disagreement means the
spec, the reference or cachegen is wrong; the spec is the one that decides.
"""

from __future__ import annotations

import ast
import json
import os
import re
import struct
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.methods import calibration as calib
from cachegen_cli.methods.config import TransformConfig

import cgen_conformance
from conftest import SAMPLE_STACKED, per_layer, realistic_kv

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "reference" / "cgen_reference.py"
GOLDEN = ROOT / "tests" / "data" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
sys.path.insert(0, str(REFERENCE.parent))

import cgen_reference as ref  # noqa: E402

#: element size -> the integer dtype whose view of a tensor gives its bit patterns
BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_values(blob: bytes, calibration=None) -> ref.Decoded:
    """Decode ``blob`` with both decoders and compare every tensor's name, dtype, shape and bits."""
    mine = ref.decode(blob, None if calibration is None else str(calibration))
    theirs = cg.decode(blob, device="cpu", calibration=calibration)
    assert list(theirs) == list(mine.tensors), "tensor names and order"
    for name, (dtype_name, words) in mine.tensors.items():
        t = theirs[name].detach().cpu().contiguous()
        assert str(t.dtype).removeprefix("torch.") == dtype_name, name
        assert list(t.shape) == list(words.shape), name
        assert words.dtype.itemsize == t.element_size(), name
        bits = t.view(BIT_VIEWS[t.element_size()]).numpy().view(words.dtype)
        differ = int((bits != words).sum())
        assert differ == 0, f"{name}: {differ} of {words.size} values differ"
    cgen_conformance.mark_checked(blob, calibration)  # compared here: the plugin need not do it again
    return mine


# ---------------------------------------------------------------- golden files


GOLDEN_FILES = [("golden_v1.cgen", None)] + [
    (f"golden/{c['file']}", c.get("calibration")) for _, c in sorted(MANIFEST.items())]


@pytest.mark.parametrize("name, calibration", GOLDEN_FILES, ids=[n for n, _ in GOLDEN_FILES])
def test_golden_file_decodes_to_the_same_values(name, calibration):
    blob = (ROOT / "tests" / "data" / name).read_bytes()
    decoded = assert_same_values(blob, GOLDEN / calibration if calibration else None)
    assert decoded.tensors
    # every golden file but the caches of no tokens decodes to values
    assert any(w.size for _, w in decoded.tensors.values()) or name.endswith(("_empty.cgen", "_empty_lossless.cgen"))


# The reference's decoding of each golden file against the SHA-256 the manifest pins:
# tests/test_golden.py, test_reference_decoder_gives_the_recorded_tensors.


# ---------------------------------------------------------------- freshly encoded files


def _stacked(dtype=torch.bfloat16, tokens=21, heads=2, head_dim=8, layers=3, seed=0):
    kv = realistic_kv(layers=layers, tokens=max(tokens, 1), heads=heads, head_dim=head_dim, dtype=dtype, seed=seed)
    return kv[:, :, :tokens].contiguous()


def _refined(bits: int, tokens: int = 7, **kw) -> TransformConfig:
    return TransformConfig("transform", (0.5,), (0.7,), recent_tokens=tokens, recent_bits=bits, **kw)


#: id -> (tensors, encode() keyword arguments)
CASES = {
    **{f"quality-{q}-{d}": (lambda q=q, dt=dt: (_stacked(dt), dict(quality=q)))
       for q in ("lossless", "high", "balanced", "small")
       for d, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))},
    **{f"lmcache-{d}": (lambda dt=dt: (_stacked(dt), dict(preset="lmcache")))
       for d, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))},
    "bins-16": (lambda: (_stacked(), dict(bins=16))),
    "bins-17-per-layer": (lambda: (per_layer(_stacked(), batch=False), dict(bins=17))),
    "bins-3": (lambda: (_stacked(), dict(bins=3))),
    "lmcache-one-token": (lambda: (_stacked(tokens=1), dict(preset="lmcache"))),
    "lmcache-zero-tokens": (lambda: (_stacked(tokens=0), dict(preset="lmcache"))),
    "balanced-zero-tokens": (lambda: (_stacked(tokens=0), dict(quality="balanced"))),
    "lossless-zero-tokens": (lambda: (_stacked(tokens=0), dict(quality="lossless"))),
    "balanced-one-token": (lambda: (_stacked(tokens=1), dict(quality="balanced"))),
    "per-layer-batch": (lambda: (per_layer(_stacked()), dict(quality="balanced"))),
    "per-layer-lossless-fp32": (lambda: (per_layer(_stacked(torch.float32), batch=False), dict(quality="lossless"))),
    "no-delta": (lambda: (_stacked(), dict(quantization=TransformConfig("transform", (0.5,), (0.5,), token_delta=False)))),
    "delta-sinks-3": (lambda: (_stacked(), dict(quantization=TransformConfig("transform", (1.5,), (1.5,), sink_tokens=3)))),
    "sinks-span-chunks": (lambda: (_stacked(), dict(quantization=TransformConfig("transform", (0.5,), (0.5,), sink_tokens=11)))),
    "sinks-all-tokens": (lambda: (_stacked(tokens=5), dict(quantization=TransformConfig("transform", (0.5,), (0.5,), sink_tokens=5)))),
    "dead-zone": (lambda: (_stacked(), dict(quantization=TransformConfig("transform", (0.4,), (0.4,), rounding=0.7)))),
    "per-layer-steps": (lambda: (_stacked(), dict(quantization=TransformConfig("transform", (0.3, 0.6, 0.9), (1.0, 2.0, 0.2))))),
    **{f"refined-{b}bits": (lambda b=b: (_stacked(), dict(quantization=_refined(b)))) for b in (1, 2, 3, 8)},
    "refined-all-but-sink-fp16": (lambda: (_stacked(torch.float16), dict(quantization=_refined(3, tokens=20)))),
    "refined-fp32-no-delta": (lambda: (_stacked(torch.float32), dict(quantization=_refined(2, token_delta=False)))),
    # C = 24 in chunks of 100 tokens: v2 streams of 20 channels, v1 of 10, so the last group is narrower
    "narrow-last-group-v2": (lambda: (_stacked(tokens=230, heads=3, layers=2), dict(quality="small"))),
    "narrow-last-group-v1": (lambda: (_stacked(tokens=230, heads=3, layers=2), dict(preset="lmcache"))),
    "narrow-last-group-lossless": (lambda: (_stacked(torch.float16, tokens=230, heads=3, layers=1), dict(quality="lossless"))),
    # the small-cache rule (docs/config.md): one token of 8 layers x 128 channels grows at `balanced`
    # and is written losslessly with one table per plane (channels 64.. refer past a 64-channel span)
    "small-cache-plane-tables": (lambda: (_stacked(tokens=1, layers=8, heads=2, head_dim=64), dict(quality="balanced"))),
    "small-cache-zero-tokens-v1": (lambda: (_stacked(tokens=0, layers=8, heads=2, head_dim=64), dict(quality="high"))),
}
CHUNK_TOKENS = {"narrow-last-group-v2": 100, "narrow-last-group-v1": 100, "narrow-last-group-lossless": 100}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fresh_file_decodes_to_the_same_values(case):
    tensors, kw = CASES[case]()
    blob = cg.encode(tensors, chunk_tokens=CHUNK_TOKENS.get(case, 8), device="cpu", metadata={"case": case}, **kw)
    if case.startswith("small-cache"):  # the rule did write its alternative
        assert (blob[8], blob[44]) == ((2, 3) if "plane" in case else (1, 1)), (blob[8], blob[44])
    assert_same_values(blob)


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    cal = calib.fit([realistic_kv(layers=3, tokens=64, heads=2, head_dim=8, seed=7).reshape(3, 2, 64, 16)])
    path = tmp_path_factory.mktemp("cal") / "cal.safetensors"
    calib.save(cal, path)
    with_sensitivity = path.with_name("cal_sens.safetensors")
    calib.save(cal.with_sensitivity(np.array([[1.0, 2.0], [0.5, 1.0], [3.0, 0.25]])), with_sensitivity)
    per_head = path.with_name("cal_head.safetensors")  # calibration version 2: one block per head
    calib.save(calib.fit([realistic_kv(layers=3, tokens=64, heads=2, head_dim=8, seed=7).reshape(3, 2, 64, 16)],
                         blocks=2), per_head)
    return path, with_sensitivity, per_head


@pytest.mark.parametrize("case", ["balanced", "high-fp16", "refined-fp32", "sensitivity", "no-sinks-per-layer",
                                  "per-head"])
def test_rotated_file_decodes_to_the_same_values(case, calibration_file):
    plain, sens, per_head = calibration_file
    kv, kw, cal = _stacked(), dict(quality="balanced"), plain
    if case == "per-head":
        cal = per_head
    if case == "high-fp16":
        kv, kw = _stacked(torch.float16), dict(quality="high")
    elif case == "refined-fp32":
        kv, kw = _stacked(torch.float32), dict(quantization=_refined(3))
    elif case == "sensitivity":
        cal = sens
    elif case == "no-sinks-per-layer":
        kv, kw = per_layer(_stacked()), dict(quantization=TransformConfig("transform", (0.5,), (0.5,), sink_tokens=0))
    blob = cg.encode(kv, chunk_tokens=8, device="cpu", calibration=cal, **kw)
    assert blob[47] & 1, "a rotated file"
    assert_same_values(blob, cal)
    with pytest.raises(ref.FormatViolation, match="calibration"):
        ref.decode(blob)  # a rotated file needs its calibration


def test_real_sample_slice_decodes_to_the_same_values():
    """A slice of the real SmolLM2 cache (outliers, sinks and all): 2 layers, 64 tokens, every head."""
    from safetensors.torch import load_file

    kv = load_file(str(SAMPLE_STACKED))["kv"][[0, 29], :, :64].contiguous()
    for kw in (dict(quality="balanced"), dict(preset="lmcache"), dict(quality="lossless")):
        assert_same_values(cg.encode(kv, chunk_tokens=32, device="cpu", **kw))


def test_float16_saturation_decodes_to_the_same_values():
    """Values at the top of float16: decoded levels round past 65504 and saturate (both versions)."""
    kv = _stacked(torch.float32, seed=3)
    kv = (kv / kv.abs().max() * 65504).to(torch.float16)
    kv[0, 0, 2, 0, :] = 65504
    kv[1, 1, 3, 1, :] = -65504
    for kw in (dict(preset="lmcache"), dict(quality="small"), dict(bins=3), dict(quality="lossless")):
        decoded = assert_same_values(cg.encode(kv, chunk_tokens=8, device="cpu", **kw))
        assert not np.isinf(decoded.tensors["kv"][1].view(np.float16)).any()


# ---------------------------------------------------------------- the reference's own rules and CLI


def test_reference_imports_nothing_from_cachegen():
    """Only the standard library and numpy: the reference is independent of the package."""
    allowed = {"__future__", "argparse", "bisect", "hashlib", "io", "json", "math", "os", "re", "signal", "struct", "sys",
               "tempfile", "zlib", "dataclasses", "numpy"}
    found = set()
    for node in ast.walk(ast.parse(REFERENCE.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            found.add(node.module.split(".")[0])
    assert found <= allowed, found - allowed
    assert "cachegen" not in REFERENCE.read_text().replace("cachegen-calibration", "").split('"""', 2)[2].split("import")[0]


def test_crc_parameters_describe_zlib():
    """docs/format.md gives the CRC-32's parameters; computed from them bit by bit, it is zlib's."""
    for data in (b"", b"123456789", bytes(range(256)), (GOLDEN / "v2_transform.cgen").read_bytes()[:300]):
        assert ref.crc32_from_parameters(data) == zlib.crc32(data)
    assert ref.crc32_from_parameters(b"123456789") == 0xCBF43926  # the CRC-32 check value
    text = (ROOT / "docs" / "format.md").read_text()
    assert "0xEDB88320" in text and "0x04C11DB7" in text


def test_cdf_weights_are_the_listed_ones():
    """The 15 weights: the formula, the reference's table and the list on the page agree."""
    formula = [0] + [int(round(16 * 2 ** (0.6 * (k - 1)))) for k in range(1, 16)]
    assert list(ref.CODE_WEIGHTS) == formula
    text = (ROOT / "docs" / "format.md").read_text()
    listed = re.search(r"weight\(1\) \.\. weight\(15\) = ([0-9, ]+)", text)
    assert listed, "docs/format.md lists the weights"
    assert [int(x) for x in listed.group(1).split(",")] == formula[1:]


def test_cli_writes_what_cachegen_decode_writes(tmp_path):
    """The reference CLI's safetensors output equals `cachegen decode`'s file, byte for byte."""
    for name, cal in (("golden/v2_rotated.cgen", GOLDEN / "calibration_c16.safetensors"),
                      ("golden/v2_delta_shared.cgen", None), ("golden_v1.cgen", None)):
        src = ROOT / "tests" / "data" / name
        out = tmp_path / (src.stem + ".safetensors")
        args = [str(src), "-o", str(out)] + (["--calibration", str(cal)] if cal else [])
        assert ref.main(args) == 0
        want = cg.decode_file(src, tmp_path / (src.stem + ".cachegen.safetensors"), device="cpu", calibration=cal)
        assert out.read_bytes() == want.read_bytes(), name
        assert out.stat().st_mode & 0o777 == want.stat().st_mode & 0o777, "the umask's permissions"
    npz = tmp_path / "v.npz"
    assert ref.main([str(ROOT / "tests" / "data" / "golden" / "v2_fp16.cgen"), "-o", str(npz)]) == 0
    want = cg.decode((GOLDEN / "v2_fp16.cgen").read_bytes(), device="cpu")
    with np.load(npz) as z:
        assert sorted(z.files) == sorted(want)
        for k in z.files:
            assert z[k].dtype == np.float16 and np.array_equal(z[k].view(np.uint16), want[k].view(torch.int16).numpy().view(np.uint16))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cgen_reference")] == []
    assert ref.main([str(GOLDEN / "v2_sinks.cgen"), "-o", str(tmp_path / "no" / "x.safetensors")]) == 1  # no such folder
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    got = {}
    reader = threading.Thread(target=lambda: got.update(data=fifo.read_bytes()))
    reader.start()
    assert ref.main([str(GOLDEN / "v2_sinks.cgen"), "-o", str(fifo)]) == 0  # written into, not replaced
    reader.join(30)
    assert got["data"] == cg.decode_file(GOLDEN / "v2_sinks.cgen", tmp_path / "s.safetensors", device="cpu").read_bytes()


def test_cli_reports_a_bad_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.cgen"
    blob = bytearray((GOLDEN / "v2_transform.cgen").read_bytes())
    blob[-30] ^= 0xFF  # inside the Index: its CRC fails
    bad.write_bytes(bytes(blob))
    out = tmp_path / "x.safetensors"
    assert ref.main([str(bad), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and not out.exists()
    assert ref.main([str(bad), "-o", str(tmp_path / "x.txt")]) == 1


def _variants(blob: bytes) -> dict[str, bytes]:
    """Broken copies of a valid file that both decoders must refuse."""
    out = {"byte after the trailer": blob + b"\0", "truncated": blob[:-1], "bad magic": b"\x88" + blob[1:]}
    flipped = bytearray(blob)
    (index_offset,) = struct.unpack_from("<Q", blob, len(blob) - 16)
    flipped[index_offset - 1] ^= 0x01  # the last chunk's payload: its CRC fails
    out["chunk crc"] = bytes(flipped)
    header = bytearray(blob)
    header[70] ^= 0x01  # inside the Descriptor: the header CRC fails
    out["header crc"] = bytes(header)
    return out


@pytest.mark.parametrize("name", ["golden_v1.cgen", "golden/v2_refined.cgen", "golden/v2_lossless_bf16.cgen"])
def test_both_decoders_refuse_broken_files(name):
    blob = (ROOT / "tests" / "data" / name).read_bytes()
    for what, bad in _variants(blob).items():
        with pytest.raises(ref.FormatViolation):
            ref.decode(bad)
        with pytest.raises(cg.CacheGenError):
            cg.decode(bad, device="cpu")


def _with_params(blob: bytes, params: bytes) -> bytes:
    """A version 2 file with another Params block of the same size (header CRC fixed)."""
    desc_size, params_size = struct.unpack_from("<I", blob, 12)[0], struct.unpack_from("<I", blob, 48)[0]
    assert len(params) == params_size
    head = bytearray(blob[:64])
    desc = blob[64 : 64 + desc_size]
    struct.pack_into("<I", head, 60, zlib.crc32(bytes(head[:60]) + desc + params))
    return bytes(head) + desc + params + blob[64 + desc_size + params_size :]


def _crafted() -> dict[str, bytes]:
    """Files with valid CRCs that break a rule of docs/format.md, keyed by the reference's message."""
    from test_hardening import _ramp, _shift_delta_tables, with_descriptor

    out = {"outside \\[-127, 127\\]": _shift_delta_tables(
        cg.encode(_ramp(), quality="high", chunk_tokens=64, device="cpu"), 10)}
    lossless = (GOLDEN / "v2_lossless_bf16.cgen").read_bytes()
    desc_size = struct.unpack_from("<I", lossless, 12)[0]
    params = bytearray(lossless[64 + desc_size : 64 + desc_size + struct.unpack_from("<I", lossless, 48)[0]])
    assert params[0] == 0
    params[0] = 1  # method 3's first table in token-delta mode
    out["mode 1 is not allowed for method 3"] = _with_params(lossless, bytes(params))

    v1 = bytearray((ROOT / "tests" / "data" / "golden_v1.cgen").read_bytes())
    L, desc_size = struct.unpack_from("<I", v1, 24)[0], struct.unpack_from("<I", v1, 12)[0]
    at = 64 + 2 * L + desc_size  # chunk 0
    sizes = struct.unpack_from("<4I", v1, at + 16)
    struct.pack_into("<H", v1, at + 40, 0x8000)  # its first scale: -0.0
    struct.pack_into("<I", v1, at + 36, zlib.crc32(bytes(v1[at : at + 36]) + bytes(v1[at + 40 : at + 40 + sum(sizes)])))
    out["a scale is negative"] = bytes(v1)

    v2 = (GOLDEN / "v2_delta_shared.cgen").read_bytes()
    desc = json.loads(v2[64 : 64 + struct.unpack_from("<I", v2, 12)[0]])
    twice = json.loads(json.dumps(desc))
    for e in twice["tensors"]:
        if e["name"] == "layers.1.key":
            e["name"] = "layers.00.key"  # layer 0's key twice, layer 1's key missing
    out["bad or repeated layer"] = with_descriptor(v2, json.dumps(twice).encode())
    boolean = json.loads(json.dumps(desc))
    assert boolean["tensors"][0]["shape"][0] == 1
    boolean["tensors"][0]["shape"][0] = True  # == 1 in Python, not a JSON integer
    out["not a non-negative JSON integer"] = with_descriptor(v2, json.dumps(boolean).encode())
    deep = dict(desc, extra=json.loads("[" * 16 + "]" * 16))  # the object + 16 arrays
    out["nests more than 16 deep"] = with_descriptor(v2, json.dumps(deep).encode())
    return out


def test_both_decoders_refuse_files_that_break_a_rule():
    for message, bad in _crafted().items():
        with pytest.raises(ref.FormatViolation, match=message):
            ref.decode(bad)
        with pytest.raises(cg.CacheGenError):
            cg.decode(bad, device="cpu")


# ---------------------------------------------------------------- format version 3 (the multi-part container)


def _t(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype)


def _windowed(layers=4, full=12, window=5, dtype=torch.bfloat16):
    """Gemma-2 style: even layers keep the last ``window`` tokens, odd layers all, plus input_ids / attention_mask."""
    from test_shapes import sliding

    return sliding(layers=layers, full=full, window=window, dtype=dtype)


def _extras_of_every_kind():
    """A regular-looking cache plus extras of every stored dtype, a scalar and an empty one (so: version 3)."""
    kv = per_layer(_stacked(tokens=9, layers=2))
    kv["input_ids"] = torch.arange(9, dtype=torch.int64).unsqueeze(0) * 1000003
    kv["attention_mask"] = torch.tensor([[True] * 7 + [False] * 2])
    kv["position_ids"] = torch.arange(9, dtype=torch.int32)
    kv["scale"] = torch.tensor(0.125, dtype=torch.float64)  # a scalar
    kv["nothing"] = torch.zeros(0, 3, dtype=torch.int16)
    kv["logits"] = _t(9, 5, dtype=torch.bfloat16, seed=5)
    kv["bytes"] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    kv["signed"] = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    kv["half"] = _t(4, dtype=torch.float16, seed=6)
    kv["single"] = _t(3, dtype=torch.float32, seed=7)
    if hasattr(torch, "float8_e4m3fn"):
        kv["f8a"] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)  # every pattern
        kv["f8b"] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e5m2)
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            kv[name] = torch.arange(5, dtype=torch.int64).to(getattr(torch, name))
    return kv


def _ragged_batch():
    """One tensor per sequence, each its own length (--names with a seq group)."""
    kv = {}
    for s, T in enumerate((7, 13)):
        for i in range(2):
            kv[f"seq{s}.blk.{i}.attn_k"] = _t(2, T, 8, seed=10 * s + i)
            kv[f"seq{s}.blk.{i}.attn_v"] = _t(2, T, 8, seed=10 * s + i + 5)
    return kv, r"seq(?P<seq>\d+)\.blk\.(?P<layer>\d+)\.attn_(?P<kind>k|v)"


#: id -> (tensors, encode() keyword arguments); every case is a version 3 file
V3_CASES = {
    **{f"windowed-{q}": (lambda q=q: (_windowed(), dict(quality=q))) for q in ("lossless", "balanced", "small")},
    "windowed-lmcache-v1-groups": (lambda: (_windowed(), dict(preset="lmcache"))),
    "windowed-fp16-bins-32": (lambda: (_windowed(dtype=torch.float16), dict(bins=32))),
    "windowed-fp32-balanced": (lambda: (_windowed(dtype=torch.float32), dict(quality="balanced"))),
    "windowed-drop-extras": (lambda: (_windowed(), dict(quality="high", extras="drop"))),
    **{f"unequal-kv-{q}": (lambda q=q: ({f"layers.{i}.{k}": _t(1, 1, 11, c, seed=2 * i + (k == "value"))
                                         for i in range(2) for k, c in (("key", 20), ("value", 7))}, dict(quality=q)))
       for q in ("lossless", "balanced")},
    "heads-differ-between-layers": (lambda: ({"layers.0.key": _t(2, 7, 8), "layers.0.value": _t(2, 7, 8, seed=1),
                                             "layers.1.key": _t(1, 7, 16, seed=2), "layers.1.value": _t(4, 7, 16, seed=3)},
                                            dict(quality="balanced"))),
    **{f"latent-odd-channels-{q}": (lambda q=q: ({f"layers.{i}.latent": _t(10, 13, seed=i) for i in range(2)}, dict(quality=q)))
       for q in ("lossless", "small")},
    "latent-batch-BTC": (lambda: ({f"kv_latent.{i}": _t(2, 6, 10, seed=i) for i in range(2)}, dict(quality="balanced"))),
    "batch-of-3-fp16": (lambda: ({f"past_key_values.{i}.{j}": _t(3, 2, 9, 4, dtype=torch.float16, seed=2 * i + j)
                                  for i in range(2) for j in range(2)}, dict(quality="balanced"))),
    **{f"ragged-batch-{q}": (lambda q=q: (_ragged_batch()[0], dict(quality=q, names=_ragged_batch()[1])))
       for q in ("lossless", "balanced")},
    "stacked-with-input-ids": (lambda: ({"kv": _stacked(tokens=10, layers=2), "input_ids": torch.arange(10)},
                                        dict(preset="lmcache"))),
    "extras-of-every-dtype-lossless": (lambda: (_extras_of_every_kind(), dict(quality="lossless"))),
    "zero-tokens-in-a-layer": (lambda: ({"layers.0.key": _t(1, 2, 0, 8), "layers.0.value": _t(1, 2, 0, 8),
                                         "layers.1.key": _t(1, 2, 3, 8), "layers.1.value": _t(1, 2, 3, 8, seed=1)},
                                        dict(quality="balanced"))),
}


def _v3(case: str) -> bytes:
    tensors, kw = V3_CASES[case]()
    blob = cg.encode(tensors, chunk_tokens=8, device="cpu", metadata={"case": case}, **kw)
    assert struct.unpack_from("<H", blob, 8)[0] == 3, "a multi-part file"
    return blob


@pytest.mark.parametrize("case", sorted(V3_CASES))
def test_version_3_file_decodes_to_the_same_tensors(case):
    """The reference rebuilds every named tensor (kv and extras) with cachegen's names, order,
    dtypes, shapes and bits; lossless files also give back the input exactly."""
    tensors, kw = V3_CASES[case]()
    decoded = assert_same_values(_v3(case))
    assert decoded.header.version == 3 and decoded.descriptor["metadata"] == {"case": case}
    assert {d.header.version for d in decoded.groups} <= {1, 2} and decoded.groups
    kept = [n for n in tensors if not (kw.get("extras") == "drop" and n in ("input_ids", "attention_mask"))]
    assert list(decoded.tensors) == kept
    if kw.get("quality") == "lossless":
        for name in kept:
            t = tensors[name].contiguous()
            assert np.array_equal(decoded.tensors[name][1], t.view(BIT_VIEWS[t.element_size()]).numpy().view(
                decoded.tensors[name][1].dtype)), name


def test_version_3_cli_writes_what_cachegen_decode_writes(tmp_path):
    """The reference CLI's safetensors output of a version 3 file equals `cachegen decode`'s, byte for byte;
    its npz holds numpy's values (bfloat16 and float8 widened exactly to float32)."""
    for case in ("windowed-balanced", "extras-of-every-dtype-lossless"):
        src = tmp_path / f"{case}.cgen"
        src.write_bytes(_v3(case))
        out = tmp_path / f"{case}.safetensors"
        assert ref.main([str(src), "-o", str(out)]) == 0
        want = cg.decode_file(src, tmp_path / f"{case}.cachegen.safetensors", device="cpu")
        assert out.read_bytes() == want.read_bytes(), case
    npz = tmp_path / "x.npz"
    assert ref.main([str(src), "-o", str(npz)]) == 0
    want = cg.decode(src.read_bytes(), device="cpu")
    with np.load(npz) as z:
        assert sorted(z.files) == sorted(want)
        for name in z.files:
            t = want[name]
            if t.dtype in (torch.bfloat16, getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
                expect = t.float().numpy()
            else:
                expect = t.numpy()
            assert z[name].dtype == expect.dtype and z[name].shape == expect.shape, name
            assert np.array_equal(z[name], expect, equal_nan=True), name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cgen_reference")] == []


def _v3_tampered() -> dict[str, tuple[bytes, str]]:
    """Broken version 3 files, keyed by what is wrong: (bytes, the reference's message)."""
    from test_shapes import _manifest, _resealed

    blob = _v3("windowed-lossless")
    out = {"truncated": (blob[:-1], "truncated"), "a byte after the end": (blob + b"\0", "its header says"),
           "truncated in the header": (blob[:40], "ends inside the PartsHeader")}

    def manifest(edit):
        m = _manifest(blob)
        edit(m)
        return _resealed(blob, m)

    out["a plane listed twice"] = (manifest(lambda m: m["groups"][0]["members"].__setitem__(1, m["groups"][0]["members"][0])),
                                   "listed twice")
    out["a plane missing"] = (manifest(lambda m: (m["groups"][0]["members"].pop(), m["groups"][0]["first_positions"].pop())),
                              "the groups hold 6 planes, the kv tensors 8")
    out["a K/V pair swapped"] = (manifest(lambda m: m["groups"][0]["members"][0].reverse()), "not \\[K plane, V plane\\]")
    out["a float count"] = (manifest(lambda m: m["groups"][0].__setitem__("tokens", 5.0)), "out of range")
    out["a bool seq"] = (manifest(lambda m: m["groups"][1].__setitem__("seq", True)), "out of range")
    out["an unknown key"] = (manifest(lambda m: m["tensors"][0].__setitem__("x", 1)), "unknown keys")
    out["an extra's part"] = (manifest(lambda m: m["tensors"][-1].__setitem__("part", 0)), "its part")
    out["an extra's dtype"] = (manifest(lambda m: m["tensors"][-2].__setitem__("dtype", "int32")), "bytes")
    out["a first position past 2^32 - 1"] = (manifest(lambda m: m["groups"][0]["first_positions"].__setitem__(0, 1 << 32)),
                                             "first_positions")
    out["two groups claiming 5 tokens"] = (manifest(lambda m: [g.__setitem__("tokens", 5) for g in m["groups"]]),
                                           "does not have the group's tokens")
    deep = _manifest(blob)
    raw = json.dumps(deep)[:-1] + ',"deep":' + "[" * 20 + "]" * 20 + "}"
    from test_shapes import _raw_manifest

    out["nested too deep"] = (_raw_manifest(blob, raw.encode()), "nests more than 16 deep")
    flipped = bytearray(blob)
    flipped[-100] ^= 0x01  # inside the last group or an extra: that part's CRC fails
    out["a part's CRC"] = (bytes(flipped), "CRC mismatch")
    head = bytearray(blob)
    head[60] ^= 0x01  # inside the Manifest: the PartsHeader CRC fails
    out["the header CRC"] = (bytes(head), "PartsHeader CRC mismatch")

    def kind(h, table_raw):
        table_raw[16] = 2  # group 0's part announced as raw bytes

    out["a group's part kind"] = (_resealed(blob, edit=kind), "kind 1")
    return out


def test_both_decoders_refuse_tampered_version_3_files():
    for what, (bad, message) in _v3_tampered().items():
        with pytest.raises(ref.FormatViolation, match=message):
            ref.decode(bad)
        with pytest.raises(cg.CacheGenError):
            cg.decode(bad, device="cpu")


def _with_part(blob: bytes, i: int, data: bytes) -> bytes:
    """The version 3 file with part ``i`` replaced by ``data`` (the Part table, file_size and CRCs made consistent)."""
    manifest_size, count = struct.unpack_from("<II", blob, 16)
    table_at = 48 + manifest_size
    entries = [list(struct.unpack_from("<QQB3sI", blob, table_at + 24 * k)) for k in range(count)]
    parts = [blob[o : o + n] for o, n, *_ in entries]
    parts[i] = data
    at = table_at + 24 * count
    for e, p in zip(entries, parts):
        e[0], e[1], e[4] = at, len(p), zlib.crc32(p)
        at += len(p)
    table = b"".join(struct.pack("<QQB3sI", *e) for e in entries)
    head = bytearray(blob[:48])
    struct.pack_into("<Q", head, 32, at)
    manifest = blob[48:table_at]
    struct.pack_into("<I", head, 44, zlib.crc32(bytes(head[:44]) + manifest + table))
    return bytes(head) + manifest + table + b"".join(parts)


def test_a_group_file_in_another_layout_gives_the_same_tensors():
    """docs/format.md: a reader MAY accept a group file in the per-layer layout (the same
    [layers, 2, tokens, channels] cache); both decoders do, and agree. A group file of
    another size, or a version 3 file as a group, is refused by both."""
    blob = _v3("windowed-lossless")
    manifest_size = struct.unpack_from("<I", blob, 16)[0]
    offset, size = struct.unpack_from("<QQ", blob, 48 + manifest_size)
    group = cg.decode(blob[offset : offset + size], device="cpu")["group"]  # [2, 2, 5, 1, 16]
    per_layer_group = cg.encode(per_layer(group), quality="lossless", device="cpu")
    assert json.loads(per_layer_group[64 : 64 + struct.unpack_from("<I", per_layer_group, 12)[0]])["layout"] == "per-layer"
    swapped = _with_part(blob, 0, per_layer_group)
    assert swapped != blob
    decoded = assert_same_values(swapped)
    tensors, _ = V3_CASES["windowed-lossless"]()
    t = tensors["layers.2.key"]
    assert np.array_equal(decoded.tensors["layers.2.key"][1], t.view(torch.int16).numpy().view(np.uint16))
    for what, bad, message in (
            ("a group of 4 tokens", _with_part(blob, 0, cg.encode(group[:, :, :4].contiguous(), quality="lossless",
                                                                   device="cpu")), "not the Manifest's"),
            ("a version 3 group", _with_part(blob, 0, blob), "format version 3 is not 1 or 2")):
        with pytest.raises(ref.FormatViolation, match=message):
            ref.decode(bad)
        with pytest.raises(cg.CacheGenError):
            cg.decode(bad, device="cpu")


def test_manifest_values_of_the_wrong_json_type_are_a_format_violation():
    """Every key of a kv tensor, an extra and a group set to a JSON value of another type: both
    decoders refuse the file, the reference with FormatViolation (never a TypeError or KeyError)."""
    from test_shapes import _manifest, _resealed

    blob = _v3("windowed-lossless")
    m0 = _manifest(blob)
    targets = [("tensors", 0), ("tensors", len(m0["tensors"]) - 1), ("groups", 0)]
    tried = 0
    for where, i in targets:
        for key in sorted(m0[where][i]):
            for value in ([], {}, None, "x", -1, [[]]):
                m = json.loads(json.dumps(m0))
                if m[where][i][key] == value or (key == "name" and value == "x"):  # "x" is a valid name
                    continue
                m[where][i][key] = value
                bad = _resealed(blob, m)
                with pytest.raises(ref.FormatViolation):
                    ref.decode(bad)
                with pytest.raises(cg.CacheGenError):
                    cg.decode(bad, device="cpu")
                tried += 1
    assert tried > 100
