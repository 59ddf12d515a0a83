"""The small-cache rule (pipeline/codec.py smallest_encoding; docs/config.md, "Small caches"):
a cache of a few tokens whose file would be larger than its raw values is written in the
shortest exact encoding instead, so it never grows much past its raw size; the file decodes
to the input bit for bit, is the same on the CPU and the GPU, and the CLI says what it wrote."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.cli import app
from cachegen_cli.pipeline import codec
from cachegen_cli.storage import kvio
from conftest import realistic_kv

SAMPLE = "sample_data/smollm2_pydoc_520.safetensors"
REQUESTS = [dict(quality="lossless"), dict(quality="high"), dict(quality="balanced"), dict(quality="small"),
            dict(preset="lmcache")]


@pytest.fixture(scope="module")
def sample_kv():
    from pathlib import Path

    tensors, _ = kvio.read_tensors(Path(__file__).resolve().parents[1] / SAMPLE)
    return tensors["kv"]  # [30, 2, 520, 3, 64] bfloat16: a real cache


def _version_method(blob: bytes) -> tuple[int, int]:
    return struct.unpack_from("<H", blob, 8)[0], blob[44]


def _bound(x: torch.Tensor) -> int:
    """What the rule promises for one token: the raw values, plus the one "same table" byte per
    (layer, K/V, channel) of version 2, one table per plane (at most 3 + 128 bytes), and 1 KiB
    for the header, Descriptor, chunk header, stream lengths, index and trailer."""
    L, _, T, H, D = x.shape
    return x.numel() * x.element_size() + L * 2 * H * D + L * 2 * (3 + 128) + 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_token_stays_near_its_raw_size_and_decodes_exactly(sample_kv, dtype):
    x = sample_kv[:, :, :1].to(dtype).contiguous()
    sizes = {}
    for kw in REQUESTS:
        blob = cg.encode(x, device="cpu", **kw)
        sizes[str(kw)] = len(blob)
        assert len(blob) <= _bound(x), (kw, len(blob), _bound(x))
        assert _version_method(blob) == (2, 3), kw  # lossless won
        out = cg.decode(blob, device="cpu")["kv"]
        assert out.dtype == dtype and torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    # before the rule (2026-12-01): 54,493 bytes lossless, 61,425 at every quality, 119,665 lmcache (bf16)
    assert len(set(sizes.values())) == 1, sizes  # the same shortest file whatever was asked for


def test_the_rule_leaves_caches_that_compress_alone(sample_kv):
    """Past the raw size + slack only: 64 tokens keep the method asked for, and so do the tests'
    tiny caches (within SMALL_FILE_SLACK) and every encoding of more than SMALL_CACHE_TOKENS."""
    from cachegen_cli.methods.config import resolve_quantization

    cache = kvio.from_tensors(sample_kv[:, :, :64].contiguous(), "auto")
    for kw, method in ((dict(quality="balanced"), (2, 2)), (dict(preset_name="lmcache"), (1, 1))):
        buf = codec.ByteCollector()
        s = codec.encode_to_stream(cache, buf, resolve_quantization(30, **kw), 256)
        assert _version_method(buf.getvalue()) == method and s.fallback is None, kw
    tiny = realistic_kv(layers=1, tokens=3, heads=1, head_dim=4)  # 48 raw bytes, a file of a few hundred
    assert _version_method(cg.encode(tiny, quality="high", device="cpu")) == (2, 2)
    # metadata (capture stores the token ids there) is in every encoding alike: not counted
    assert _version_method(cg.encode(tiny, quality="high", device="cpu", metadata={"ids": "1," * 10000})) == (2, 2)
    # a cache that grows, one token past the limit, keeps what was asked for
    wide = sample_kv[:, :, :1].expand(-1, -1, codec.SMALL_CACHE_TOKENS + 1, -1, -1).contiguous()
    assert _version_method(cg.encode(wide, preset="lmcache", device="cpu", chunk_tokens=1)) == (1, 1)


def test_no_tokens_is_a_version_1_file(sample_kv):
    x = sample_kv[:, :, :0].contiguous()
    for kw in REQUESTS:
        blob = cg.encode(x, device="cpu", **kw)
        assert _version_method(blob) == (1, 1) and len(blob) < 512, (kw, len(blob))  # v2: 12,265 / 35,457 bytes
        out = cg.decode(blob, device="cpu")["kv"]
        assert out.shape == x.shape and out.dtype == x.dtype


def test_the_simulated_gpu_writes_the_same_file():
    """One token of 6 layers x 128 channels: the GPU's method-2 file (over 4 KiB past the raw size)
    is replaced by the same lossless file as on the CPU."""
    x = realistic_kv(layers=6, tokens=1, heads=2, head_dim=64)
    cpu = cg.encode(x, quality="balanced", device="cpu")
    gpu = cg.encode(x, quality="balanced", device="cuda")
    assert _version_method(cpu) == (2, 3) and gpu == cpu


def test_the_cli_says_what_it_wrote(sample_kv, tmp_path):
    src = tmp_path / "kv.safetensors"
    save_file({"kv": sample_kv[:, :, :1].contiguous()}, str(src))
    runner = CliRunner()
    r = runner.invoke(app, ["encode", str(src), "-o", str(tmp_path / "a.cgen"), "--quality", "balanced",
                            "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "written as lossless with one table per plane, which decodes exactly" in r.stdout
    r = runner.invoke(app, ["encode", str(src), "-o", str(tmp_path / "b.cgen"), "--preset", "lmcache",
                            "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    assert row["method"] == "lossless" and row["fallback"] == "lossless with one table per plane"
    assert row["compressed_bytes"] <= _bound(sample_kv[:, :, :1])
    r = runner.invoke(app, ["stats", str(tmp_path / "b.cgen")])
    assert r.exit_code == 0 and "cgen v2, lossless" in r.stdout
    r = runner.invoke(app, ["decode", str(tmp_path / "b.cgen"), "-o", str(tmp_path / "b.safetensors"), "-q",
                            "--device", "cpu"])
    assert r.exit_code == 0
    back, _ = kvio.read_tensors(tmp_path / "b.safetensors")
    assert torch.equal(back["kv"].view(torch.int16), sample_kv[:, :, :1].contiguous().view(torch.int16))


def test_a_multi_part_file_applies_the_rule_to_each_group(sample_kv):
    """Windowed layers (format v3): layers 0-14 hold 1 token, 15-29 hold 2, plus input_ids; each
    group is a small cache of its own, written losslessly, and the file decodes bit for bit."""
    from cachegen_cli.format import parts as parts_format
    from cachegen_cli.pipeline import parts as parts_codec

    x = sample_kv
    tensors = {}
    for i in range(30):
        T = 1 if i < 15 else 2
        for j, name in enumerate(("key", "value")):
            tensors[f"layers.{i}.{name}"] = x[i, j, -T:].permute(1, 0, 2).unsqueeze(0).contiguous()
    tensors["input_ids"] = torch.arange(2, dtype=torch.int64)
    blob = cg.encode(tensors, quality="balanced", device="cpu")
    pf = parts_format.PartsFile(blob)
    assert blob[8] == 3 and len(pf.manifest["groups"]) == 2 and parts_codec.group_versions(pf) == [2, 2]
    assert all(bytes(pf.part(i)[:64])[44] == 3 for i in range(2))  # both groups lossless
    out = cg.decode(blob, device="cpu")
    assert all(torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())
    raw = sum(v.numel() * v.element_size() for v in tensors.values())
    assert len(blob) <= raw + 2 * (15 * 2 * 192 + 15 * 2 * 131 + 1024) + 4096  # _bound per group, + the manifest
