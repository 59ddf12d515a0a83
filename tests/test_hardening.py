"""Reader hardening (issue "Hardening": inputs found by fuzzing).  Each case is refused with a
one-line ``error:`` and exit code 1 by the CLI, and with a specific error type by the library."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.format import container
from cachegen_cli.cli import app
from cachegen_cli.errors import FormatError, LayoutError, SizeError, TruncatedError

from conftest import SAMPLE_STACKED

runner = CliRunner()


def real_kv(layers: int = 2, tokens: int = 12, channels: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    """[layers, 2, tokens, 1, channels] cut from the real SmolLM2 sample."""
    from safetensors.torch import load_file

    kv = load_file(str(SAMPLE_STACKED))["kv"]
    return kv[3 : 3 + layers, :, :tokens, :1, :channels].to(dtype).contiguous()


def cli_error(tmp_path: Path, command: str, blob: bytes, needle: str = "") -> str:
    """Run ``cachegen COMMAND file`` on the bytes: exit code 1 and one line ``error: ...``."""
    src = tmp_path / "bad.cgen"
    src.write_bytes(blob)
    args = [command, str(src)] + (["-o", str(tmp_path / "out.safetensors"), "--device", "cpu"] if command == "decode" else [])
    r = runner.invoke(app, args)
    err = r.stderr.strip()
    assert r.exit_code == 1, (r.exit_code, r.output)
    assert "Traceback" not in r.output and "internal error" not in err, err
    assert err.count("\n") == 0 and err.startswith("error:"), err
    assert needle in err, err
    assert not (tmp_path / "out.safetensors").exists()
    return err


def with_descriptor(blob: bytes, desc: bytes) -> bytes:
    """The .cgen bytes with another Descriptor (sizes, CRC, index offsets and trailer fixed)."""
    version, = struct.unpack_from("<H", blob, 8)
    old_size, = struct.unpack_from("<I", blob, 12)
    layers, = struct.unpack_from("<I", blob, 24)
    head = bytearray(blob[:64])
    struct.pack_into("<I", head, 12, len(desc))
    if version == 1:
        before = bytes(blob[64 : 64 + 2 * layers])
        after_at = 64 + 2 * layers + old_size
        crc = zlib.crc32(bytes(head[:60]) + before + desc)
        extra = b""
    else:
        params_size, = struct.unpack_from("<I", blob, 48)
        before = b""
        extra = bytes(blob[64 + old_size : 64 + old_size + params_size])
        after_at = 64 + old_size + params_size
        crc = zlib.crc32(bytes(head[:60]) + desc + extra)
    struct.pack_into("<I", head, 60, crc)
    shift = len(desc) - old_size
    rest = bytearray(blob[after_at:])
    index_offset, magic = struct.unpack_from("<Q8s", blob, len(blob) - 16)
    at = index_offset - after_at  # the Index within rest
    count, = struct.unpack_from("<I", rest, at + 4)
    offsets = np.frombuffer(bytes(rest[at + 8 : at + 8 + 8 * count]), "<u8").astype(np.int64) + shift
    index = b"CGIX" + struct.pack("<I", count) + offsets.astype("<u8").tobytes()
    index += struct.pack("<I", zlib.crc32(index))
    rest = rest[:at] + index + struct.pack("<Q8s", index_offset + shift, magic)
    return bytes(head) + before + desc + extra + bytes(rest)


def descriptor_of(blob: bytes) -> dict:
    version, = struct.unpack_from("<H", blob, 8)
    size, = struct.unpack_from("<I", blob, 12)
    layers, = struct.unpack_from("<I", blob, 24)
    at = 64 + (2 * layers if version == 1 else 0)
    return json.loads(blob[at : at + size])


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@pytest.fixture(scope="module")
def blobs() -> dict[str, bytes]:
    kv = real_kv()
    per = {f"layers.{i}.{k}": kv[i, j].permute(1, 0, 2).unsqueeze(0).contiguous()
           for i in range(kv.shape[0]) for j, k in enumerate(("key", "value"))}
    return {
        "v1": cg.encode(kv, preset="lmcache", chunk_tokens=4, device="cpu"),
        "v2": cg.encode(kv, quality="balanced", chunk_tokens=4, device="cpu"),
        "v1_per_layer": cg.encode(per, preset="lmcache", chunk_tokens=4, device="cpu"),
        "v2_per_layer": cg.encode(per, quality="lossless", chunk_tokens=4, device="cpu"),
    }


def test_helper_keeps_a_file_valid(blobs):
    for blob in blobs.values():
        again = with_descriptor(blob, dumps(descriptor_of(blob)) + b" ")
        a, b = cg.decode(blob, device="cpu"), cg.decode(again, device="cpu")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- 1. deeply nested JSON


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("depth", [5000, 100_000])
def test_deeply_nested_descriptor_is_a_format_error(blobs, kind, depth):
    d = descriptor_of(blobs[kind])
    text = dumps(d)[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(SizeError, match="nest"):
        cg.decode(with_descriptor(blobs[kind], text), device="cpu")


def test_nesting_inside_strings_does_not_count(blobs):
    d = descriptor_of(blobs["v2"])
    d["metadata"] = {"brackets": "[" * 5000 + '\\"{' * 100}
    out = cg.decode(with_descriptor(blobs["v2"], dumps(d)), device="cpu")
    assert out["kv"].shape == (2, 2, 12, 1, 8)


def test_nesting_just_over_the_cap_is_refused(blobs):
    d = descriptor_of(blobs["v2"])
    ok = dumps(d)[:-1] + b',"x":' + b"[" * (container.MAX_DESCRIPTOR_DEPTH - 1) + b"]" * (container.MAX_DESCRIPTOR_DEPTH - 1) + b"}"
    cg.decode(with_descriptor(blobs["v2"], ok), device="cpu")  # an unknown key, within the depth: accepted
    bad = dumps(d)[:-1] + b',"x":' + b"[" * container.MAX_DESCRIPTOR_DEPTH + b"]" * container.MAX_DESCRIPTOR_DEPTH + b"}"
    with pytest.raises(SizeError, match="nest"):
        cg.decode(with_descriptor(blobs["v2"], bad), device="cpu")


@pytest.mark.parametrize("command", ["decode", "stats"])
def test_cli_deeply_nested_descriptor(blobs, tmp_path, command):
    d = descriptor_of(blobs["v1"])
    text = dumps(d)[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    cli_error(tmp_path, command, with_descriptor(blobs["v1"], text), "nest")


# ---------------------------------------------------------------- 2. JSON booleans are not integers


def _bool_variants(d: dict) -> list[dict]:
    """Descriptors where one integer is replaced by true / false (equal to 1 / 0 in Python)."""
    out = []
    if d["layout"] == "per-layer":
        e = json.loads(json.dumps(d))
        e["tensors"][0]["shape"][0] = True  # [1, H, T, D] -> [true, H, T, D]
        out.append(e)
        e = json.loads(json.dumps(d))
        e["tensors"][1]["shape"][1] = True  # H = 1
        out.append(e)
    else:
        e = json.loads(json.dumps(d))
        e["tensors"][0]["shape"][3] = True  # H = 1
        out.append(e)
    e = json.loads(json.dumps(d))
    e["num_kv_heads"] = True
    out.append(e)
    return out


@pytest.mark.parametrize("kind", ["v1", "v2", "v1_per_layer", "v2_per_layer"])
def test_booleans_in_the_descriptor_are_refused(blobs, kind):
    d = descriptor_of(blobs[kind])
    variants = _bool_variants(d)
    assert variants
    for v in variants:
        with pytest.raises(SizeError, match="descriptor"):
            cg.decode(with_descriptor(blobs[kind], dumps(v)), device="cpu")


def test_validate_descriptor_is_strict_about_integers():
    from cachegen_cli.storage.kvio import validate_descriptor

    good = {"layout": "stacked", "num_kv_heads": 1, "head_dim": 8, "metadata": {},
            "tensors": [{"name": "kv", "shape": [2, 2, 12, 1, 8]}]}
    assert validate_descriptor(good, 2, 12, 8) is good
    for path, value in ((("num_kv_heads",), True), (("head_dim",), 8.0), (("tensors", 0, "shape", 0), 2.0),
                        (("tensors", 0, "shape", 3), True), (("tensors", 0, "shape", 1), False)):
        bad = json.loads(json.dumps(good))
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(ValueError):
            validate_descriptor(bad, 2, 12, 8)


@pytest.mark.parametrize("command", ["decode", "stats"])
def test_cli_boolean_shape(blobs, tmp_path, command):
    d = descriptor_of(blobs["v2_per_layer"])
    d["tensors"][0]["shape"][0] = True
    cli_error(tmp_path, command, with_descriptor(blobs["v2_per_layer"], dumps(d)), "descriptor")


# ---------------------------------------------------------------- 3. sizes claimed beyond the file


def _claiming(blob: bytes, num_tokens: int, chunk_tokens: int, fill: int = 40, channels: int | None = None) -> bytes:
    """A file with ``blob``'s layers, channels, tables and descriptor that claims ``num_tokens``
    tokens: the header, then ``fill`` bytes per announced chunk (fake chunks), a valid Index
    and Trailer.  Nothing but the header's numbers says how large the cache is."""
    from cachegen_cli.pipeline import codec

    f, _ = codec.open_input(blob)
    h, _ = container.read_file_header(f, len(blob))
    h.num_tokens, h.chunk_tokens = num_tokens, chunk_tokens
    h.num_chunks = -(-num_tokens // chunk_tokens)
    h.group = 1
    d = json.loads(json.dumps(h.descriptor))
    if channels is not None:  # version 1 only (a version-2 Params block has C entries)
        h.num_channels = channels
        d["num_kv_heads"], d["head_dim"] = 1, channels
        for e in d["tensors"]:
            e["shape"][-1], e["shape"][-2 if d["layout"] == "stacked" else -3] = channels, 1
    for e in d["tensors"]:
        if d["layout"] == "stacked":
            e["shape"][2] = num_tokens
        else:
            e["shape"][-2] = num_tokens
    h.descriptor = d
    head = container.pack_file_header(h)
    offsets = [len(head) + fill * i for i in range(h.num_chunks)]
    index_at = len(head) + fill * h.num_chunks
    return head + bytes(fill * h.num_chunks) + container.pack_index(offsets) + container.pack_trailer(index_at)


@pytest.mark.parametrize("kind", ["v1", "v2", "v2_per_layer"])
def test_claimed_size_beyond_the_file_fails_before_allocating(blobs, kind, monkeypatch):
    # 2 layers x 2 x 2^22 tokens x 8 channels x 2 bytes = 256 MiB claimed by a file of 12 KB
    bad = _claiming(blobs[kind], 1 << 22, 1 << 14)
    assert len(bad) < 20_000

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated the output of a file that cannot hold it")

    from cachegen_cli.pipeline import codec

    monkeypatch.setattr(codec.torch, "empty", no_allocation)
    with pytest.raises(TruncatedError, match="at least"):
        cg.decode(bad, device="cpu")
    with pytest.raises(TruncatedError, match="at least"):
        codec.read_header_and_index(container.BufferReader(bad))


def test_a_file_of_empty_chunks_still_decodes(blobs):
    """The bound is each chunk's fixed bytes: a real file that holds exactly them (all-zero
    cache, every stream empty) is not refused."""
    kv = torch.zeros(2, 2, 40, 1, 8, dtype=torch.bfloat16)
    for blob in (cg.encode(kv, preset="lmcache", chunk_tokens=4, device="cpu"),
                 cg.encode(kv, quality="balanced", chunk_tokens=4, device="cpu"),
                 cg.encode(kv, quality="lossless", chunk_tokens=4, device="cpu")):
        assert torch.equal(cg.decode(blob, device="cpu")["kv"], kv)


def test_cli_claimed_size_beyond_the_file(blobs, tmp_path):
    # 550 GB claimed by a 3 KB file: 2 layers x 2 x 2^20 tokens x 65536 channels x 2 bytes
    bad = _claiming(blobs["v1"], 1 << 20, 1 << 14, channels=1 << 16)
    assert len(bad) < 4000
    for command in ("decode", "stats"):
        cli_error(tmp_path, command, bad, "at least")


# ---------------------------------------------------------------- 4. names of the same layer


def _per_layer_tensors(names: list[str]) -> dict[str, torch.Tensor]:
    kv = real_kv(layers=1)
    planes = {"key": kv[0, 0], "value": kv[0, 1]}
    return {n: planes[n.rsplit(".", 1)[1]].permute(1, 0, 2).unsqueeze(0).clone() for n in names}


@pytest.mark.parametrize("names", [["layers.0.key", "layers.00.key", "layers.0.value"],
                                   ["layers.0.key", "layers.0.value", "layers.00.value"]])
def test_two_names_for_one_tensor_are_refused_on_encode(names):
    tensors = _per_layer_tensors(names)
    for kw in (dict(preset="lmcache"), dict(quality="balanced")):
        with pytest.raises(LayoutError, match="both"):
            cg.encode(tensors, device="cpu", **kw)


@pytest.mark.parametrize("names", [["layers.0.key", "layers.0.value", "layers.\u0660.key"],
                                   ["layers.\u0660.key", "layers.\u0660.value"],
                                   ["layers.0.key", "layers.0.value", "layers.1.key", "layers.\u0661.value"]])
def test_layer_numbers_in_other_digits_are_refused_on_encode(names):
    """docs/format.md: `{i}` is ASCII digits (the reference decoder refuses others), so the
    encoder does not write a file whose names another reader would refuse."""
    tensors = _per_layer_tensors(names)
    for kw in (dict(preset="lmcache"), dict(quality="balanced")):
        with pytest.raises(LayoutError, match="ASCII"):
            cg.encode(tensors, device="cpu", **kw)


def test_a_name_with_a_trailing_newline_is_not_a_layer_name():
    tensors = _per_layer_tensors(["layers.0.key", "layers.0.value"])
    tensors["layers.1.key\n"] = tensors["layers.0.key"].clone()
    blob = cg.encode(tensors, quality="lossless", device="cpu")  # carried as an extra tensor, exactly
    back = cg.decode(blob, device="cpu")
    assert set(back) == set(tensors) and torch.equal(back["layers.1.key\n"], tensors["layers.1.key\n"])


def test_cli_two_names_for_one_tensor(tmp_path):
    src = tmp_path / "kv.safetensors"
    save_file(_per_layer_tensors(["layers.0.key", "layers.00.key", "layers.0.value"]), src)
    r = runner.invoke(app, ["encode", str(src), "-o", str(tmp_path / "kv.cgen"), "--device", "cpu"])
    err = r.stderr.strip()
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert err.count("\n") == 0 and err.startswith("error:") and "both" in err, err
    assert not (tmp_path / "kv.cgen").exists()


def _aliased(blob: bytes) -> bytes:
    """A one-layer per-layer file whose descriptor names layer 0's key twice and its value never."""
    d = descriptor_of(blob)
    assert [e["name"] for e in d["tensors"]] == ["layers.0.key", "layers.0.value"]
    d["tensors"][1]["name"] = "layers.00.key"
    return with_descriptor(blob, dumps(d))


@pytest.mark.parametrize("quality", ["lmcache", "balanced", "lossless"])
def test_a_descriptor_naming_one_tensor_twice_is_refused(quality):
    tensors = _per_layer_tensors(["layers.0.key", "layers.0.value"])
    kw = dict(preset="lmcache") if quality == "lmcache" else dict(quality=quality)
    blob = _aliased(cg.encode(tensors, chunk_tokens=4, device="cpu", **kw))
    with pytest.raises(SizeError, match="twice"):
        cg.decode(blob, device="cpu")


@pytest.mark.parametrize("command", ["decode", "stats"])
def test_cli_descriptor_naming_one_tensor_twice(tmp_path, command):
    tensors = _per_layer_tensors(["layers.0.key", "layers.0.value"])
    blob = _aliased(cg.encode(tensors, quality="balanced", chunk_tokens=4, device="cpu"))
    cli_error(tmp_path, command, blob, "twice")


def test_layer_numbers_with_thousands_of_digits_are_a_layout_error():
    tensors = _per_layer_tensors(["layers.0.key", "layers.0.value"])
    tensors["layers." + "9" * 5000 + ".key"] = tensors["layers.0.key"]
    with pytest.raises(LayoutError):
        cg.encode(tensors, device="cpu")


# ---------------------------------------------------------------- 5. extreme finite values decode finite

_REL_ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
EXTREMES = {
    torch.float16: [65504.0, 65400.0, 65281.0, 6e-8, 6.1e-5],
    torch.bfloat16: [float(torch.finfo(torch.bfloat16).max), 3.0e38, 1e-40],
    torch.float32: [float(torch.finfo(torch.float32).max), 3.39e38, 1e38, 1e-45, 1e-40],
}
METHODS = {"lmcache": dict(preset="lmcache"), "bins255": dict(bins="255"), "small": dict(quality="small"),
           "balanced": dict(quality="balanced"), "high": dict(quality="high"), "lossless": dict(quality="lossless")}


def _extreme_kv(dtype, value: float, where: str) -> torch.Tensor:
    x = real_kv(layers=2, tokens=24, channels=16, dtype=torch.float32)
    if where == "spots":  # a few values and one whole token at the extreme
        x[0, 0, 5, 0, 3], x[1, 1, 7, 0, 0], x[0, 1, 2, 0, :] = value, -value, value
    else:  # whole channels at the extreme (their means too)
        x[0, 0, :, 0, 3], x[1, 1, :, 0, 0] = value, -value
    return x.to(dtype)


def _error_bound(blob: bytes, x: torch.Tensor) -> torch.Tensor:
    """What the method allows for each value [L, 2, T, C] (float64): half a quantization step
    (method 1: the token's scale / (2 maxq); method 2: the plane's step / 2) plus the rounding
    to the output dtype; 0 for lossless."""
    from cachegen_cli.pipeline import codec
    from cachegen_cli.format.params import bf16_values

    f, _ = codec.open_input(blob)
    h, _, offsets, size = codec.read_header_and_index(f)
    L, T, C = h.num_layers, h.num_tokens, h.num_channels
    xs = x.double().reshape(L, 2, T, C).abs()
    rounding = xs * _REL_ULP[x.dtype] + 1e-300
    if h.version == 1:
        scales = np.concatenate([c.scales for c in codec.iter_chunks(f, h, offsets, size)], axis=2)
        s = torch.from_numpy(bf16_values(scales))  # [L, 2, T]
        maxq = torch.from_numpy(h.maxq.astype(np.float64))[:, :, None]
        half = s / (2 * maxq)
        # A token whose maxq / s exceeds float32 (a scale below ~1e-39: subnormal values) is
        # quantized with inv = the largest float32 (docs/format.md): its levels are 0, its error <= s.
        half = torch.where(maxq / s.clamp(min=1e-300) > float(torch.finfo(torch.float32).max), s, half)
        return half[..., None] * (1 + 1e-6) + rounding
    if h.method == 3:
        return torch.zeros_like(xs)
    steps = torch.from_numpy(bf16_values(h.params.steps))  # [L, 2]
    return (steps / 2)[:, :, None, None] * (1 + 1e-6) + rounding


@pytest.mark.parametrize("dtype", list(EXTREMES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("where", ["spots", "channel"])
def test_extreme_finite_values_decode_finite_within_the_error(dtype, method, where):
    for value in EXTREMES[dtype]:
        x = _extreme_kv(dtype, value, where)
        blob = cg.encode(x, chunk_tokens=8, device="cpu", **METHODS[method])
        y = cg.decode(blob, device="cpu")["kv"]
        assert bool(torch.isfinite(y).all()), (value, method)
        err = (y.double() - x.double()).abs().reshape(_error_bound(blob, x).shape)
        bound = _error_bound(blob, x)
        assert bool((err <= bound).all()), (value, method, float((err - bound).max()))


def test_fp16_top_values_do_not_change_normal_bytes():
    """The clamp only touches float16 values above 65280: a cache without them keeps its bytes."""
    x = _extreme_kv(torch.float16, 65280.0, "spots")
    from cachegen_cli.pipeline import codec

    assert codec.fp16_headroom(x) is x
    y = _extreme_kv(torch.float16, 65504.0, "spots")
    assert torch.equal(codec.fp16_headroom(y), x)
    assert cg.encode(y, preset="lmcache", chunk_tokens=8, device="cpu") == cg.encode(x, preset="lmcache", chunk_tokens=8,
                                                                                      device="cpu")


def test_files_from_before_the_clamp_decode_saturated(monkeypatch):
    """A float16 file whose scale rounded up to 65536 (what the encoder wrote before) decodes its
    top values to 65504, float16's largest, not to Inf."""
    from cachegen_cli.pipeline import codec

    x = _extreme_kv(torch.float16, 65504.0, "spots")
    monkeypatch.setattr(codec, "fp16_headroom", lambda block: block)
    blob = cg.encode(x, preset="lmcache", chunk_tokens=8, device="cpu")
    monkeypatch.undo()
    f, _ = codec.open_input(blob)
    h, _, offsets, size = codec.read_header_and_index(f)
    scales = np.concatenate([c.scales for c in codec.iter_chunks(f, h, offsets, size)], axis=2)
    assert int(scales.max()) == 0x4780  # 65536
    y = cg.decode(blob, device="cpu")["kv"]
    assert bool(torch.isfinite(y).all()) and float(y.max()) == 65504.0


def test_cli_fp16_top_values_round_trip_finite(tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "kv.safetensors"
    save_file({"kv": _extreme_kv(torch.float16, 65504.0, "spots")}, src)
    for args in (["--preset", "lmcache"], ["--quality", "small"]):
        r = runner.invoke(app, ["encode", str(src), "-o", str(tmp_path / "kv.cgen"), "--device", "cpu", "-f", *args])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["decode", str(tmp_path / "kv.cgen"), "-o", str(tmp_path / "out.safetensors"), "-f",
                                "--device", "cpu"])
        assert r.exit_code == 0, r.output
        assert bool(torch.isfinite(load_file(str(tmp_path / "out.safetensors"))["kv"]).all())


# ---------------------------------------------------------------- 7. decompression bombs


def test_max_output_size_refuses_before_allocating(blobs, monkeypatch, tmp_path):
    from cachegen_cli.errors import OutputTooLargeError
    from cachegen_cli.pipeline import codec

    blob = blobs["v2"]
    n = container.decoded_size(blob)
    assert n == 2 * 2 * 12 * 8 * 2
    assert cg.decode(blob, device="cpu", max_output_size=n)["kv"].shape == (2, 2, 12, 1, 8)

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated the output of a file over the limit")

    monkeypatch.setattr(codec.torch, "empty", no_allocation)
    for kind in ("v1", "v2", "v1_per_layer", "v2_per_layer"):
        with pytest.raises(OutputTooLargeError, match="limit"):
            cg.decode(blobs[kind], device="cpu", max_output_size=n - 1)
        src = tmp_path / f"{kind}.cgen"
        src.write_bytes(blobs[kind])
        with pytest.raises(OutputTooLargeError, match=str(src)):
            cg.decode_file(src, tmp_path / "out.safetensors", device="cpu", max_output_size=n - 1)
        assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(Exception, match="max_output_size"):
        cg.decode(blob, device="cpu", max_output_size=-1)


def test_cli_max_output_size_default(blobs, tmp_path, monkeypatch):
    from cachegen_cli.cli import commands

    assert commands.parse_size(commands.DEFAULT_MAX_OUTPUT_SIZE, "x") == 64 << 30
    monkeypatch.setattr(commands, "DEFAULT_MAX_OUTPUT_SIZE", "100")  # the default applies without the option
    err = cli_error(tmp_path, "decode", blobs["v2"], "--max-output-size")
    assert "bad.cgen" in err and "decodes to 768 bytes" in err


def test_cli_max_output_size_option(blobs, tmp_path):
    src = tmp_path / "ok.cgen"
    src.write_bytes(blobs["v1"])
    out = tmp_path / "out.safetensors"
    r = runner.invoke(app, ["decode", str(src), "-o", str(out), "--device", "cpu", "--max-output-size", "100"])
    assert r.exit_code == 1 and r.stderr.strip().startswith("error:") and "100" in r.stderr and not out.exists()
    for ok in ("1K", "1KiB", "none"):
        r = runner.invoke(app, ["decode", str(src), "-o", str(out), "--device", "cpu", "--max-output-size", ok, "-f"])
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["decode", str(src), "-o", str(out), "--device", "cpu", "--max-output-size", "lots", "-f"])
    assert r.exit_code == 2 and r.stderr.strip().startswith("error:") and "--max-output-size" in r.stderr


# ---------------------------------------------------------------- 6. levels summed past the method's range


def _shift_delta_tables(blob: bytes, by: int) -> bytes:
    """The file with every token-delta table's lo raised by ``by`` (tables still within the
    spec's bounds, CRC fixed): each decoded delta grows by ``by``, so the levels drift by
    ``by`` per token within a chunk."""
    from cachegen_cli.pipeline import codec

    f, _ = codec.open_input(blob)
    h, end = container.read_file_header(f, len(blob))
    p = h.params
    assert (p.modes == 1).all()  # (method 3 codes direct only, its tables bound its values to a byte)
    p.lo = (p.lo.astype(np.int64) + by).astype(p.lo.dtype)
    head = container.pack_file_header(h)
    assert len(head) == end
    return head + blob[end:]


def _ramp(dtype=torch.bfloat16, tokens: int = 64) -> torch.Tensor:
    t = torch.arange(tokens, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 2, tokens, 1, 8, generator=g) * 0.01 + t[None, None, :, None, None] * 0.1).to(dtype)


@pytest.mark.parametrize("quality", ["high", "small"])
def test_token_deltas_summed_past_the_range_are_refused(quality, tmp_path):
    blob = cg.encode(_ramp(), quality=quality, chunk_tokens=64, device="cpu")
    assert torch.equal(cg.decode(_shift_delta_tables(blob, 0), device="cpu")["kv"], cg.decode(blob, device="cpu")["kv"])
    bad = _shift_delta_tables(blob, 10)  # 64 tokens x 10: far past 127, well inside int16
    with pytest.raises(SizeError, match="outside"):
        cg.decode(bad, device="cpu")
    cli_error(tmp_path, "decode", bad, "outside")


def test_token_deltas_past_int16_are_refused(tmp_path):
    # 16384 tokens in one chunk with every delta +100 more: the sum passes 32767 and would wrap
    blob = cg.encode(_ramp(tokens=4096), quality="high", chunk_tokens=4096, device="cpu")
    with pytest.raises(SizeError, match="outside"):
        cg.decode(_shift_delta_tables(blob, 100), device="cpu")


def test_levels_within_the_range_still_decode_as_the_spec_says():
    from cachegen_cli.format.params import LEVEL_RANGE, check_level_range

    for method, (lo, hi) in LEVEL_RANGE.items():
        check_level_range(lo, hi, method)
        with pytest.raises(SizeError):
            check_level_range(lo - 1, hi, method)
        with pytest.raises(SizeError):
            check_level_range(lo, hi + 1, method)


def test_rotated_steps_past_float32_are_refused():
    from cachegen_cli.format.params import FLOAT32_MAX, check_rotated_range

    def bf16(x):
        return (np.array(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    steps, offsets = bf16(np.full((2, 2), 1.0)), bf16(np.zeros((2, 2, 4)))
    check_rotated_range(steps, offsets)
    big = bf16(np.full((2, 2), 1.0))
    big[1, 0] = bf16(FLOAT32_MAX / 100)  # 128 x s = 1.28 x FLOAT32_MAX: z would be Inf, the rotation NaN
    with pytest.raises(SizeError, match="layer 1 K"):
        check_rotated_range(big, offsets)
    near = bf16(np.full((2, 2), FLOAT32_MAX / 256))
    check_rotated_range(near, offsets)
    with pytest.raises(SizeError):
        check_rotated_range(near, bf16(np.full((2, 2, 4), FLOAT32_MAX / 1.5)))
