"""Every real KV cache shape and naming scheme (issue 12): format version 3, the multi-part file.

Round trips keep every name, shape, dtype, token count and extra tensor (bit-exact with
quality lossless); every refused input is one error naming the tensor and the reason; the
file's bytes are what docs/format.md ("Format version 3") says and the reader trusts none of
them.  The model-level tests (capture -> encode -> decode -> eval on tiny transformers models)
are in tests/test_model_shapes.py."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.cli import app
from cachegen_cli.errors import (
    ChecksumError,
    ConfigError,
    DTypeError,
    FormatError,
    LayoutError,
    NonFiniteError,
    OutputTooLargeError,
    ShapeError,
    SizeError,
    TruncatedError,
)
from cachegen_cli.format import parts as fmt
from cachegen_cli.storage import kvparts

from conftest import per_layer, realistic_kv
from test_format_doc import table

runner = CliRunner()


def _t(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype)


def sliding(layers=4, full=12, window=5, heads=2, head_dim=8, dtype=torch.bfloat16):
    """Gemma-2 style: even layers windowed (the last ``window`` tokens), odd layers full, plus extras."""
    kv = {}
    for i in range(layers):
        T = window if i % 2 == 0 else full
        kv[f"layers.{i}.key"] = _t(1, heads, T, head_dim, dtype=dtype, seed=2 * i)
        kv[f"layers.{i}.value"] = _t(1, heads, T, head_dim, dtype=dtype, seed=2 * i + 1)
    kv["input_ids"] = torch.arange(full, dtype=torch.int64).unsqueeze(0) * 7
    kv["attention_mask"] = torch.ones(1, full, dtype=torch.bool)
    return kv


def mla(layers=3, tokens=20, rank=32, rope=7):
    """transformers' DeepSeek-V2/V3 cache: K slot the kv_lora_rank latent, V slot the rope part (1 head each)."""
    return {n: t for i in range(layers) for n, t in
            ((f"layers.{i}.key", _t(1, 1, tokens, rank, seed=i)), (f"layers.{i}.value", _t(1, 1, tokens, rope, seed=9 + i)))}


CASES = {
    "sliding window + extras": lambda: sliding(),
    "MLA K/V of different sizes": lambda: mla(),
    "batch of 3, past_key_values names, fp16": lambda: {f"past_key_values.{i}.{j}": _t(3, 2, 9, 4, dtype=torch.float16, seed=i * 2 + j)
                                                         for i in range(2) for j in range(2)},
    "key_cache / value_cache names, fp32": lambda: {f"{k}_cache.{i}": _t(1, 1, 6, 256, dtype=torch.float32, seed=i)
                                                   for i in range(2) for k in ("key", "value")},
    "latents layers.i.latent, odd channels": lambda: {f"layers.{i}.latent": _t(15, 577, seed=i) for i in range(2)},
    "latents kv_latent.i [batch, tokens, C]": lambda: {f"kv_latent.{i}": _t(2, 11, 64, seed=i) for i in range(3)},
    "stacked tensor + input_ids": lambda: {"kv": realistic_kv(layers=2, tokens=10), "input_ids": torch.arange(10)},
    "layers with gaps (hybrid linear attention)": lambda: {n: t for n, t in per_layer(realistic_kv(layers=4)).items()
                                                           if not n.startswith(("layers.1.", "layers.2."))},
    "heads differ between layers": lambda: {"layers.0.key": _t(2, 7, 8), "layers.0.value": _t(2, 7, 8, seed=1),
                                            "layers.1.key": _t(1, 7, 16, seed=2), "layers.1.value": _t(4, 7, 16, seed=3)},
    "zero tokens in a layer": lambda: {"layers.0.key": _t(1, 2, 0, 8), "layers.0.value": _t(1, 2, 0, 8),
                                       "layers.1.key": _t(1, 2, 3, 8), "layers.1.value": _t(1, 2, 3, 8, seed=1)},
}


def _same(a: dict, b: dict, exact: bool = True) -> None:
    assert list(a) == list(b), "names or their order differ"
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        if exact:
            assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.bool else a[name],
                               b[name].view(torch.uint8) if b[name].dtype == torch.bool else b[name]), name


@pytest.mark.parametrize("case", list(CASES))
def test_lossless_round_trip_is_bit_exact(case):
    kv = CASES[case]()
    blob = cg.encode(kv, quality="lossless", device="cpu", metadata={"model": "x", "token_ids": "[1, 2]"})
    assert struct.unpack_from("<H", blob, 8)[0] == 3
    _same(kv, cg.decode(blob, device="cpu"))


@pytest.mark.parametrize("how", [dict(quality="balanced"), dict(quality="small"), dict(preset="lmcache"), dict(bins=32)])
def test_lossy_round_trip_keeps_names_shapes_dtypes_and_extras(how):
    kv = sliding()
    out = cg.decode(cg.encode(kv, device="cpu", **how), device="cpu")
    _same(kv, out, exact=False)
    assert torch.equal(out["input_ids"], kv["input_ids"]) and torch.equal(out["attention_mask"], kv["attention_mask"])
    for name in kv:
        if name.startswith("layers."):
            x, y = kv[name].double(), out[name].double()
            assert float((x - y).pow(2).sum() / x.pow(2).sum()) < 0.05, name  # coded, not garbage


def test_per_layer_steps_follow_the_layer_numbers():
    """A per-layer config (steps per layer, as `cachegen tune` writes) applies at each group's own layers."""
    from cachegen_cli.methods.config import TransformConfig
    from cachegen_cli.pipeline.parts import group_quantization

    pc = kvparts.analyse(sliding(layers=4))
    cfg = TransformConfig(key_step=(0.1, 0.2, 0.3, 0.4), value_step=(1.0, 2.0, 3.0, 4.0))
    windowed, full = pc.groups
    assert windowed.layers() == [0, 2] and full.layers() == [1, 3]
    assert group_quantization(cfg, windowed, 4).key_step == (0.1, 0.3)
    assert group_quantization(cfg, full, 4).value_step == (2.0, 4.0)
    unequal = kvparts.analyse(mla(layers=2)).groups  # key planes, then value planes
    assert [g.plane_kinds() for g in unequal] == [["key", "key"], ["value", "value"]]
    two = TransformConfig(key_step=(0.1, 0.2), value_step=(1.0, 2.0))
    assert group_quantization(two, unequal[1], 2).key_step == (1.0, 2.0)  # both halves of a V plane: V's step
    # a finer step gives a larger file: the settings reach the groups
    coarse = cg.encode(sliding(layers=4), quantization=TransformConfig(key_step=(2.0,), value_step=(2.0,)), device="cpu")
    fine = cg.encode(sliding(layers=4), quantization=TransformConfig(key_step=(0.05,), value_step=(0.05,)), device="cpu")
    assert len(fine) > len(coarse)


def test_groups_of_a_sliding_window_cache():
    pc = kvparts.analyse(sliding(layers=6, full=12, window=5))
    assert [(g.kind, g.tokens, g.layers()) for g in pc.groups] == [("kv", 5, [0, 2, 4]), ("kv", 12, [1, 3, 5])]
    # the windowed layers keep the last 5 of 12 tokens: positions 7..11
    assert pc.groups[0].first_positions == [7, 7, 7] and pc.groups[1].first_positions == [0, 0, 0]
    assert pc.extras == ["input_ids", "attention_mask"]


def test_names_option_with_sequences_for_a_ragged_batch():
    """--names with a seq group: one tensor per sequence, each its own length."""
    kv = {}
    for s, T in enumerate((7, 13)):
        for i in range(2):
            kv[f"seq{s}.blk.{i}.attn_k"] = _t(2, T, 8, seed=10 * s + i)
            kv[f"seq{s}.blk.{i}.attn_v"] = _t(2, T, 8, seed=10 * s + i + 5)
    names = r"seq(?P<seq>\d+)\.blk\.(?P<layer>\d+)\.attn_(?P<kind>k|v)"
    with pytest.raises(LayoutError, match="no tensor in a known KV layout"):
        cg.encode(kv, device="cpu")
    blob = cg.encode(kv, names=names, quality="lossless", device="cpu")
    _same(kv, cg.decode(blob, device="cpu"))
    pc = kvparts.analyse(kv, names=names)
    assert [(g.seq, g.tokens) for g in pc.groups] == [(0, 7), (1, 13)]


def test_drop_extras():
    kv = sliding()
    out = cg.decode(cg.encode(kv, quality="lossless", extras="drop", device="cpu"), device="cpu")
    assert set(kv) - set(out) == {"input_ids", "attention_mask"}
    _same({n: t for n, t in kv.items() if n.startswith("layers.")}, out)


def test_a_regular_cache_still_gives_version_1_and_2_files_byte_for_byte():
    """A regular cache goes the way it always went: the same bytes as the codec writes for it."""
    import io

    from cachegen_cli.methods.config import resolve_quantization
    from cachegen_cli.pipeline import codec
    from cachegen_cli.storage import kvio

    for kv in (realistic_kv(layers=2, tokens=30), per_layer(realistic_kv(layers=2, tokens=30))):
        for quality, version in (("balanced", 2), ("lossless", 2)):
            blob = cg.encode(kv, quality=quality, device="cpu")
            buf = io.BytesIO()
            cache = kvio.from_tensors(kv)
            codec.encode_to_stream(cache, buf, resolve_quantization(2, quality=quality), 256, device="cpu")
            assert blob == buf.getvalue() and struct.unpack_from("<H", blob, 8)[0] == version
        assert struct.unpack_from("<H", cg.encode(kv, preset="lmcache", device="cpu"), 8)[0] == 1


# ---------------------------------------------------------------- refused inputs: one error naming the tensor


REFUSED = [
    ({"layers.0.key": torch.zeros(1, 2, 4, 8, dtype=torch.int32), "layers.0.value": torch.zeros(1, 2, 4, 8)},
     DTypeError, "'layers.0.key' has dtype int32"),
    ({"layers.0.key": _t(2, 4), "layers.0.value": _t(2, 4)}, ShapeError, "'layers.0.key' has shape [2, 4]"),
    ({"layers.0.key": _t(1, 2, 4, 8), "layers.0.value": _t(1, 2, 4, 8), "layers.1.key": _t(1, 2, 4, 8)},
     LayoutError, "'layers.1.key' has no value: layers.1.value is missing"),
    ({"past_key_values.0.1": _t(1, 2, 4, 8)}, LayoutError, "'past_key_values.0.1' has no key: past_key_values.0.0 is missing"),
    ({"layers.0.key": _t(1, 2, 4, 8), "layers.0.value": _t(1, 2, 5, 8)}, ShapeError,
     "'layers.0.key' holds 4 tokens but 'layers.0.value' 5"),
    ({"layers.0.key": _t(1, 2, 4, 8), "layers.0.value": _t(2, 2, 4, 8)}, ShapeError, "batch size 1 but 'layers.0.value' 2"),
    ({"layers.0.key": _t(1, 2, 4, 8), "layers.0.value": _t(1, 2, 4, 8, dtype=torch.float16)}, DTypeError,
     "'layers.0.key' is bfloat16, but 'layers.0.value' is float16"),
    ({"layers.0.key": _t(1, 2, 4, 8), "layers.0.value": _t(1, 2, 4, 8), "layers.0.latent": _t(4, 8)}, LayoutError,
     "'layers.0.latent' is layer 0's latent, but the layer has a key or value too"),
    ({"layers.0.key": _t(1, 2, 4, 8), "layers.00.key": _t(1, 2, 4, 8), "layers.0.value": _t(1, 2, 4, 8)},
     LayoutError, "both name layer 0's key"),
    ({"layers.99999.key": _t(2, 4, 8), "layers.99999.value": _t(2, 4, 8)}, LayoutError,
     "'layers.99999.key': layer number out of range"),
    ({"layers.0.key": _t(1, 1, 3, 70000), "layers.0.value": _t(1, 1, 3, 70000)}, ShapeError,
     "'layers.0.key' has 70000 channels per token"),
    ({"bias": _t(3), "weights": _t(3, 4)}, LayoutError, "no tensor in a known KV layout among 'bias', 'weights'"),
]


@pytest.mark.parametrize("tensors, error, message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_refused_inputs_name_the_tensor_and_the_reason(tensors, error, message):
    with pytest.raises(error) as info:
        cg.encode(tensors, device="cpu")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_non_finite_values_name_the_tensor():
    kv = sliding()
    kv["layers.2.value"][0, 1, 3, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="'layers.2.value' holds NaN values"):
        cg.encode(kv, device="cpu")


def test_bad_names_options_and_settings():
    kv = sliding()
    for names, needle in (("(", "not a regular expression"), (r"layers\.\d+", "(?P<layer>"),
                          (r"(?P<layer>\d+)(?P<head>x)", "unknown named group 'head'")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("?", r"\?")):
            cg.encode(kv, names=names, device="cpu")
    with pytest.raises(LayoutError, match="kind 'q' is none of"):
        cg.encode({"blk.0.q": _t(2, 4, 8)}, names=r"blk\.(?P<layer>\d+)\.(?P<kind>\w)", device="cpu")
    with pytest.raises(ConfigError, match="extras must be"):
        cg.encode(kv, extras="maybe", device="cpu")
    with pytest.raises(ConfigError, match="key_step has 3 values"):
        from cachegen_cli.methods.config import TransformConfig

        cg.encode(kv, quantization=TransformConfig(key_step=(1.0, 1.0, 1.0)), device="cpu")


def test_a_calibration_is_refused_for_a_multi_part_file(tmp_path):
    from cachegen_cli.methods import calibration

    cal = calibration.fit([realistic_kv(layers=4, tokens=64).reshape(4, 2, 64, -1)])
    with pytest.raises(ConfigError, match="one shape"):
        cg.encode(sliding(), calibration=cal, device="cpu")


# ---------------------------------------------------------------- the CLI


def _err_line(result, needle: str, code: int = 1) -> None:
    assert result.exit_code == code, result.output
    err = result.stderr.strip()
    assert "Traceback" not in result.output and err.count("\n") == 0, err
    assert err.startswith("error:") and needle in err, err


def test_cli_round_trip_keeps_names_shapes_dtypes_metadata_and_extras(tmp_path):
    src, enc, dec = tmp_path / "sw.safetensors", tmp_path / "sw.cgen", tmp_path / "sw.decoded.safetensors"
    kv = sliding()
    meta = {"model": "tiny-gemma2", "token_ids": json.dumps(list(range(12))), "note": "é"}
    save_file(kv, src, metadata=meta)
    r = runner.invoke(app, ["encode", str(src), "-o", str(enc), "--quality", "lossless", "--device", "cpu"])
    assert r.exit_code == 0 and "2 groups, 2 extra tensors kept" in r.stdout, r.output
    r = runner.invoke(app, ["decode", str(enc), "--device", "cpu"])
    assert r.exit_code == 0 and dec.exists(), r.output
    with safe_open(str(dec), "pt") as f:
        assert f.metadata() == meta
        got = {n: f.get_tensor(n) for n in f.keys()}
    _same({n: kv[n] for n in sorted(kv)}, {n: got[n] for n in sorted(got)})
    r = runner.invoke(app, ["test", str(enc), "-v", "--device", "cpu"])
    assert r.exit_code == 0 and "OK (12 tokens in 2 chunks, format v3" in r.stdout, r.output
    r = runner.invoke(app, ["stats", str(enc), "--reference", str(src), "--json", "--device", "cpu"])
    s = json.loads(r.stdout)
    assert s["format_version"] == 3 and [g["layers"] for g in s["groups"]] == ["0,2", "1,3"]
    assert s["error"]["rel_mse"] == 0.0 and s["error"]["extras_identical"]
    r = runner.invoke(app, ["stats", str(enc)])
    assert r.exit_code == 0 and "cgen v3 (multi-part)" in r.stdout


def test_cli_names_and_drop_extras(tmp_path):
    src = tmp_path / "gguf.safetensors"
    kv = {f"blk.{i}.attn_{k}": _t(2, 6, 8, seed=i) for i in range(2) for k in "kv"}
    kv["tokens"] = torch.arange(6)
    save_file(kv, src)
    _err_line(runner.invoke(app, ["encode", str(src), "--device", "cpu"]), "no tensor in a known KV layout")
    r = runner.invoke(app, ["encode", str(src), "--names", r"blk\.(?P<layer>\d+)\.attn_(?P<kind>k|v)", "--drop-extras",
                            "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["dropped"] == ["tokens"]
    _err_line(runner.invoke(app, ["encode", str(src), "-f", "--names", "(", "--device", "cpu"]),
              "--names: not a regular expression", code=2)


@pytest.mark.parametrize("tensors, error, message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_cli_refused_inputs_are_one_line(tmp_path, tensors, error, message):
    src = tmp_path / "bad.safetensors"
    save_file({n: t.contiguous() for n, t in tensors.items()}, src)
    _err_line(runner.invoke(app, ["encode", str(src), "--device", "cpu"]), message)
    assert not (tmp_path / "bad.cgen").exists()


# ---------------------------------------------------------------- the bytes: docs/format.md, and no trust


def _blob(**kw) -> bytes:
    return cg.encode(sliding(), quality="lossless", device="cpu", metadata={"m": "1"}, **kw)


def test_file_parsed_with_struct_from_the_doc_tables():
    blob = _blob()
    header, names = table("### PartsHeader (48 bytes)")
    h = dict(zip(names, header.unpack_from(blob, 0)))
    assert h["magic"] == b"\x89CGEN\r\n\x1a" and (h["format_version"], h["header_size"], h["flags"]) == (3, 48, 0)
    assert h["file_size"] == len(blob)
    entry, enames = table("### Part table entry (24 bytes)")
    manifest = blob[48:48 + h["manifest_size"]]
    table_at = 48 + h["manifest_size"]
    raw_table = blob[table_at:table_at + entry.size * h["part_count"]]
    assert zlib.crc32(blob[:44] + manifest + raw_table) == h["header_crc32"]
    m = json.loads(manifest)
    kv = sliding()
    assert [e["name"] for e in m["tensors"]] == list(kv) and m["metadata"] == {"m": "1"}
    assert h["decoded_bytes"] == sum(t.numel() * t.element_size() for t in kv.values())
    at = table_at + len(raw_table)
    for i in range(h["part_count"]):
        p = dict(zip(enames, entry.unpack_from(raw_table, i * entry.size)))
        assert p["offset"] == at and zlib.crc32(blob[at:at + p["size"]]) == p["crc32"]
        if p["kind"] == 1:  # a whole version 1 / 2 file
            assert blob[at:at + 8] == blob[:8] and struct.unpack_from("<H", blob, at + 8)[0] in (1, 2)
        at += p["size"]
    assert at == len(blob)
    ids = next(e for e in m["tensors"] if e["name"] == "input_ids")
    p = dict(zip(enames, entry.unpack_from(raw_table, ids["part"] * entry.size)))
    assert blob[p["offset"]:p["offset"] + p["size"]] == kv["input_ids"].numpy().tobytes()


def _resealed(blob: bytes, manifest: dict | None = None, edit=None) -> bytes:
    """The file with a new manifest (and its header fields and CRC made consistent again)."""
    h = list(fmt.PARTS_HEADER.unpack_from(blob, 0))
    old = blob[48:48 + h[4]]
    count = h[5]
    table_raw = bytearray(blob[48 + h[4]:48 + h[4] + 24 * count])
    parts = blob[48 + h[4] + 24 * count:]
    new = json.dumps(manifest if manifest is not None else json.loads(old), separators=(",", ":")).encode()
    shift = len(new) - len(old)
    for i in range(count):
        off = struct.unpack_from("<Q", table_raw, 24 * i)[0]
        struct.pack_into("<Q", table_raw, 24 * i, off + shift)
    if edit:
        edit(h, table_raw)
    h[4] = len(new)
    h[7] = 48 + len(new) + len(table_raw) + len(parts)
    head = fmt.PARTS_HEADER.pack(*h[:-1], 0)[:-4]
    head += struct.pack("<I", zlib.crc32(head + new + bytes(table_raw)))
    return head + new + bytes(table_raw) + parts


def test_resealing_an_unchanged_manifest_decodes():
    blob = _blob()
    _same(sliding(), cg.decode(_resealed(blob), device="cpu"))


def _manifest(blob: bytes) -> dict:
    return json.loads(blob[48:48 + struct.unpack_from("<I", blob, 16)[0]])


TAMPERED = {
    "a shape": lambda m: m["tensors"][0]["shape"].__setitem__(2, 6),
    "a plane listed twice": lambda m: m["groups"][0]["members"].__setitem__(1, m["groups"][0]["members"][0]),
    "a plane missing": lambda m: (m["groups"][0]["members"].pop(), m["groups"][0]["first_positions"].pop()),
    "a selector out of range": lambda m: m["groups"][0]["members"][0][0].append(3),
    "a tensor index out of range": lambda m: m["groups"][0]["members"][0][0].__setitem__(0, 99),
    "an extra's part": lambda m: m["tensors"][-1].__setitem__("part", 0),
    "an extra's dtype": lambda m: m["tensors"][-2].__setitem__("dtype", "int32"),
    "a dtype": lambda m: m["tensors"][0].__setitem__("dtype", "float64"),
    "a float count": lambda m: m["groups"][0].__setitem__("tokens", 5.0),
    "a bool count": lambda m: m["groups"][1].__setitem__("seq", True),
    "a name twice": lambda m: m["tensors"][1].__setitem__("name", m["tensors"][0]["name"]),
    "an unknown field": lambda m: m.__setitem__("x", 1),
    "a group's kind": lambda m: m["groups"][0].__setitem__("kind", "planes"),
    "a K/V pair swapped": lambda m: m["groups"][0]["members"][0].reverse(),
    "huge rank": lambda m: m["tensors"][0].__setitem__("shape", [1] * 9),
    "metadata not strings": lambda m: m.__setitem__("metadata", {"a": 1}),
}


@pytest.mark.parametrize("what", list(TAMPERED))
def test_a_tampered_manifest_is_refused(what):
    blob = _blob()
    m = _manifest(blob)
    TAMPERED[what](m)
    with pytest.raises(SizeError):
        cg.decode(_resealed(blob, m), device="cpu")


def test_a_manifest_nested_too_deep_is_refused_before_parsing():
    blob = _blob()
    m = _manifest(blob)
    m["metadata"] = {}
    raw = json.dumps(m)[:-1] + ',"deep":' + "[" * 100000 + "]" * 100000 + "}"
    with pytest.raises(SizeError, match="deep"):
        cg.decode(_raw_manifest(blob, raw.encode()), device="cpu")


def _raw_manifest(blob: bytes, raw: bytes) -> bytes:
    h = list(fmt.PARTS_HEADER.unpack_from(blob, 0))
    old = h[4]
    count = h[5]
    table_raw = bytearray(blob[48 + old:48 + old + 24 * count])
    for i in range(count):
        off = struct.unpack_from("<Q", table_raw, 24 * i)[0]
        struct.pack_into("<Q", table_raw, 24 * i, off + len(raw) - old)
    parts = blob[48 + old + 24 * count:]
    h[4], h[7] = len(raw), 48 + len(raw) + len(table_raw) + len(parts)
    head = fmt.PARTS_HEADER.pack(*h[:-1], 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head + raw + bytes(table_raw))) + raw + bytes(table_raw) + parts


@pytest.mark.parametrize("field, value, error", [
    (1, 4, FormatError), (2, 40, SizeError), (3, 1, FormatError), (4, 0, SizeError), (4, (64 << 20) + 1, SizeError),
    (5, (1 << 17) + 1, SizeError), (6, 1, SizeError), (7, 10 ** 9, TruncatedError), (8, 1, FormatError)])
def test_header_fields_out_of_range_are_refused(field, value, error):
    blob = _blob()
    h = list(fmt.PARTS_HEADER.unpack_from(blob, 0))
    h[field] = value
    head = fmt.PARTS_HEADER.pack(*h[:-1], 0)[:-4]
    rest = blob[48:]
    size = h[4] + 24 * h[5] if h[4] < len(rest) else 0
    bad = head + struct.pack("<I", zlib.crc32(head + rest[:size])) + rest
    with pytest.raises(error):
        cg.decode(bad, device="cpu")


def test_every_flipped_byte_and_every_truncation_is_an_error_not_a_crash():
    blob = _blob()
    step = max(1, len(blob) // 97)
    for i in range(0, len(blob), step):
        bad = bytearray(blob)
        bad[i] ^= 0x5A
        with pytest.raises(FormatError):
            cg.decode(bytes(bad), device="cpu")
    for n in list(range(0, 60, 7)) + list(range(60, len(blob), step)):
        with pytest.raises(FormatError):
            cg.decode(blob[:n], device="cpu")
    with pytest.raises(SizeError):
        cg.decode(blob + b"\0", device="cpu")


def test_a_part_table_entry_out_of_place_is_refused():
    blob = _blob()

    def move(h, table_raw):
        off = struct.unpack_from("<Q", table_raw, 24)[0]
        struct.pack_into("<Q", table_raw, 24, off + 1)

    with pytest.raises(SizeError, match="part 1"):
        cg.decode(_resealed(blob, edit=move), device="cpu")

    def kind(h, table_raw):
        table_raw[16] = 7

    with pytest.raises(FormatError, match="unknown kind"):
        cg.decode(_resealed(blob, edit=kind), device="cpu")


def test_a_group_file_that_contradicts_the_manifest_is_refused():
    """Two groups' files swapped (each CRC recomputed): the manifest's shapes do not match."""
    blob = _blob()
    m = _manifest(blob)
    m["groups"][0]["tokens"], m["groups"][1]["tokens"] = 5, 5  # now both claim 5 tokens
    with pytest.raises(SizeError):
        cg.decode(_resealed(blob, m), device="cpu")


def test_max_output_size_reads_the_v3_header(tmp_path):
    blob = _blob()
    need = sum(t.numel() * t.element_size() for t in sliding().values())
    with pytest.raises(OutputTooLargeError):
        cg.decode(blob, device="cpu", max_output_size=need - 1)
    assert list(cg.decode(blob, device="cpu", max_output_size=need)) == list(sliding())
    path = tmp_path / "f.cgen"
    path.write_bytes(blob)
    _err_line(runner.invoke(app, ["decode", str(path), "--max-output-size", str(need - 1), "--device", "cpu"]),
              "more than the limit")
    assert not (tmp_path / "f.decoded.safetensors").exists()


def test_cli_corrupt_v3_file_is_one_line(tmp_path):
    bad = bytearray(_blob())
    bad[len(bad) // 2] ^= 1
    path = tmp_path / "bad.cgen"
    path.write_bytes(bytes(bad))
    for command in ("decode", "test", "stats"):
        r = runner.invoke(app, [command, str(path), "--device", "cpu"])
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert r.stderr.strip().startswith("error:") and "CRC" in r.stderr, r.output
    assert not (tmp_path / "bad.decoded.safetensors").exists()


def test_a_cache_object_with_linear_attention_states_is_refused():
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    cache = transformers.DynamicCache()
    full, linear = DynamicLayer(), LinearAttentionLayer()
    full.update(_t(1, 2, 4, 8), _t(1, 2, 4, 8, seed=1))
    linear.conv_states[0] = torch.zeros(1, 4, 3)
    cache.layers = [full, linear]
    with pytest.raises(LayoutError, match="layer 1 of the DynamicCache holds linear-attention"):
        cg.encode(cache, device="cpu")
    cache.layers = [full]  # without it: a regular per-layer cache, rebuilt by as_cache
    back = cg.decode(cg.encode(cache, quality="lossless", device="cpu"), device="cpu", as_cache=True)
    assert torch.equal(back.layers[0].keys, full.keys) and torch.equal(back.layers[0].values, full.values)
