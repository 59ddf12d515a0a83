"""Keys coded without their rotary embedding (format version 2, flags bit 2; kernels/rope.py,
methods/rope.py, docs/format.md "Keys without their rotary embedding").

The angle's sine and cosine are defined by IEEE float64 operations (no libm), so the pinned bits
below hold on every machine; the accuracy test compares with libm only within a tolerance."""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.errors import CacheGenError, ConfigError, SizeError
from cachegen_cli.format import container
from cachegen_cli.format.params import Rope
from cachegen_cli.kernels import rope as kr
from cachegen_cli.methods import rope
from cachegen_cli.methods.config import quality_preset
from cachegen_cli.pipeline import codec
from cachegen_cli.storage import kvio
from conftest import SAMPLE_STACKED, realistic_kv

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reference"))
import cgen_reference as ref  # noqa: E402


def _words(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def test_sincos_is_accurate_everywhere_it_is_used():
    """Within 2^-52 of libm's (itself within an ulp) over angles up to 2^31 (docs/format.md's claim)."""
    rng = np.random.default_rng(1)
    theta = np.concatenate([rng.uniform(0, 4, 20_000), rng.uniform(0, 2.0**31, 80_000),
                            np.arange(0, 64) * (math.pi / 4), [0.0, 2.0**31 - 1]])
    s, c = kr.angles(theta, np.array([1]))
    assert np.abs(s[0] - np.sin(theta)).max() <= 2.0**-52
    assert np.abs(c[0] - np.cos(theta)).max() <= 2.0**-52


def test_sincos_bits_are_pinned_and_the_reference_agrees():
    """The spec's operations, bit for bit: these bits never change (a change breaks every
    file with flags bit 2), and the reference decoder's numpy version gives the same."""
    theta = np.array([0.0, 0.5, 1.0, 3.0, 1234.5678, 2.0**30 + 0.25])
    s, c = kr.angles(theta, np.array([1]))
    got = [(float(a).hex(), float(b).hex()) for a, b in zip(s[0], c[0])]
    assert got[0] == ("0x0.0p+0", "0x1.0000000000000p+0")
    assert got[1:] == [
        ("0x1.eaee8744b05f0p-2", "0x1.c1528065b7d50p-1"),
        ("0x1.aed548f090ceep-1", "0x1.14a280fb5068cp-1"),
        ("0x1.210386db6d55bp-3", "-0x1.fae04be85e5d2p-1"),
        ("0x1.3fa00084ee3ddp-4", "-0x1.fe7053dc31387p-1"),
        ("-0x1.9d2f4e9eafbd9p-2", "0x1.d4782accf3830p-1"),
    ]
    rng = np.random.default_rng(2)
    many = np.concatenate([rng.uniform(0, 2.0**31, 5000), rng.uniform(0, 8, 5000)])
    s, c = kr.angles(many, np.array([1]))
    rs, rc = ref.rope_sincos(many)
    assert np.array_equal(s[0], rs) and np.array_equal(c[0], rc)


def _sample() -> kvio.KVCache:
    return kvio.read_safetensors(SAMPLE_STACKED)


def test_real_cache_is_smaller_at_the_same_error():
    """SmolLM2's RoPE (theta 100000) removed from a real cache: every quality codes smaller
    (the measured gain is 3-5%, docs/config.md) at no more error."""
    cache = _sample()
    L, _, T, C = cache.data.shape
    kv = cache.data.reshape(L, 2, T, cache.num_kv_heads, cache.head_dim)
    x = kv.float()
    smol = rope.from_theta(100000.0, cache.head_dim)
    for q in ("high", "balanced", "small"):
        plain = cg.encode(kv, quality=q, device="cpu")
        unturned = cg.encode(kv, quality=q, device="cpu", rope=smol)
        err = []
        for blob in (plain, unturned):
            y = cg.decode(blob, device="cpu")["kv"].reshape(x.shape).float()
            err.append(float(((y - x)[:, :, 1:] ** 2).sum()))
        assert len(unturned) < 0.99 * len(plain), q
        assert err[1] <= 1.02 * err[0], q
        h, _, _, _ = codec.read_header_and_index(codec.open_input(unturned)[0])
        assert h.flags & container.FLAG_ROPE and h.params.rope.rotary_dim == cache.head_dim


@pytest.mark.parametrize("dtype, style, rotary_dim, rows, start, sink", [
    (torch.bfloat16, "half", 8, 1, 0, 1), (torch.float16, "interleaved", 4, 2, 1000, 0),
    (torch.float32, "half", 6, 2, 2**31 - 40, 3), (torch.bfloat16, "interleaved", 8, 1, 5, 23),
])
def test_round_trip_matches_the_reference_decoder(dtype, style, rotary_dim, rows, start, sink):
    """Every pair style, a partial rotary dim, a frequency row per layer, positions near the
    limit, sinks (all tokens sinks in the last case): cachegen and the reference decoder decode
    the same words; the error stays that of the plain file's order."""
    kv = realistic_kv(layers=2, tokens=23, heads=2, head_dim=8, dtype=dtype, seed=5)
    base = rope.from_theta(10000.0, 8, rotary_dim, style, start)
    freq = np.concatenate([base.inv_freq, base.inv_freq * 0.5])[:rows]
    r = Rope(base.style, 8, rotary_dim, start, freq)
    cfg = dataclasses.replace(quality_preset("balanced"), sink_tokens=sink)
    blob = cg.encode(kv, quantization=cfg, chunk_tokens=8, device="cpu", rope=r)
    got = cg.decode(blob, device="cpu")["kv"]
    name, words = ref.decode(blob).tensors["kv"]
    assert np.array_equal(words.reshape(-1), _words(got).reshape(-1).view(words.dtype))
    plain = cg.decode(cg.encode(kv, quantization=cfg, chunk_tokens=8, device="cpu"), device="cpu")["kv"]
    e_rope = float(((got.float() - kv.float()) ** 2).sum())
    e_plain = float(((plain.float() - kv.float()) ** 2).sum())
    assert e_rope <= 1.5 * e_plain + 1e-12
    if sink == 23:  # every token a sink: exact
        assert torch.equal(got, kv)


def test_saturates_instead_of_overflowing():
    """Keys at bfloat16's largest values: a turned pair reaches sqrt(2) x them, which must
    saturate (docs/format.md's sat32 and cast), never decode to Inf."""
    kv = realistic_kv(layers=1, tokens=12, heads=1, head_dim=4, dtype=torch.float32, seed=1)
    kv[0, 0, 3:] = 3.0e38
    kv = kv.to(torch.bfloat16)
    blob = cg.encode(kv, quality="high", chunk_tokens=4, device="cpu", rope=rope.from_theta(10.0, 4))
    out = cg.decode(blob, device="cpu")["kv"]
    assert torch.isfinite(out.float()).all()


def test_metadata_round_trip_and_resolution():
    r = rope.from_theta(500000.0, 128, 64, "interleaved", 17)
    back = rope.from_metadata(rope.to_metadata(r))
    assert (back.style, back.head_dim, back.rotary_dim, back.position_start) == (1, 128, 64, 17)
    assert np.array_equal(back.inv_freq, r.inv_freq)
    with pytest.raises(ConfigError, match="not a RoPE description"):
        rope.from_metadata('{"style": "sideways"}')
    kv = realistic_kv(layers=1, tokens=6, heads=1, head_dim=4, dtype=torch.bfloat16, seed=1)
    cfg = dataclasses.replace(quality_preset("balanced"), rope_keys=True)
    with pytest.raises(ConfigError, match="RoPE parameters"):
        cg.encode(kv, quantization=cfg, device="cpu")
    # from the cache's metadata, as `cachegen capture` writes it
    meta = {"rope": rope.to_metadata(rope.from_theta(10000.0, 4))}
    blob = cg.encode(kv, quantization=cfg, device="cpu", metadata=meta)
    assert blob == cg.encode(kv, quality="balanced", device="cpu", rope=rope.from_theta(10000.0, 4), metadata=meta)
    with pytest.raises(ConfigError, match="transform qualities"):
        cg.encode(kv, quality="lossless", device="cpu", rope=rope.from_theta(10000.0, 4))
    with pytest.raises(ConfigError, match="do not fit"):
        cg.encode(kv, quality="balanced", device="cpu", rope=rope.from_theta(10000.0, 3))


def _rope_at(blob: bytes) -> int:
    """Offset of a file's RoPE block (a file with flags bit 2, no refinement)."""
    h, _, _, _ = codec.read_header_and_index(codec.open_input(blob)[0])
    L, C, S = h.num_layers, h.num_channels, h.sink_tokens
    assert not h.flags & container.FLAG_REFINED
    return h.params_at + 32 + 4 * L + 4 * L * C + 2 * L * S * C * 2


def _with_header_crc(blob: bytearray, params_size: int) -> bytes:
    desc_size = struct.unpack_from("<I", blob, 12)[0]
    crc = zlib.crc32(bytes(blob[:60]) + bytes(blob[64 : 64 + desc_size + params_size]))
    struct.pack_into("<I", blob, 60, crc)
    return bytes(blob)


@pytest.mark.parametrize("field, value, message", [
    ("style", 2, "style"), ("reserved", 1, "reserved"), ("head_dim", 3, "head_dim"), ("head_dim", 1, "head_dim"),
    ("rotary_dim", 5, "rotary_dim"), ("rotary_dim", 16, "rotary_dim"), ("rows", 3, "rows"),
    ("start", 2**31 - 10, "2\\^31"), ("freq", 1.5, "frequency"), ("freq", float("nan"), "frequency"),
])
def test_reader_rejects_bad_rope_blocks(field, value, message):
    """Each rule of "Rules for readers, version 2" for the RoPE block, with the header's CRC
    recomputed so the mutation reaches the check; cachegen and the reference both refuse."""
    kv = realistic_kv(layers=2, tokens=20, heads=2, head_dim=8, dtype=torch.bfloat16, seed=2)
    cfg = dataclasses.replace(quality_preset("balanced"), recent_tokens=0)
    blob = bytearray(cg.encode(kv, quantization=cfg, chunk_tokens=8, device="cpu", rope=rope.from_theta(1e4, 8)))
    o = _rope_at(bytes(blob))
    assert struct.unpack_from("<BBHHHQ", blob, o) == (0, 0, 8, 8, 1, 0)
    at = {"style": (o, "<B"), "reserved": (o + 1, "<B"), "head_dim": (o + 2, "<H"), "rotary_dim": (o + 4, "<H"),
          "rows": (o + 6, "<H"), "start": (o + 8, "<Q"), "freq": (o + 16 + 8, "<d")}[field]
    struct.pack_into(at[1], blob, at[0], value)
    params_size = struct.unpack_from("<I", blob, 48)[0]
    bad = _with_header_crc(blob, params_size)
    with pytest.raises(CacheGenError):
        cg.decode(bad, device="cpu")
    with pytest.raises(ref.FormatViolation):
        ref.decode(bad)
    if field not in ("rows", "rotary_dim"):  # those change the block's length: a size error first
        with pytest.raises(SizeError, match=message):
            cg.decode(bad, device="cpu")


def _cli():
    from typer.testing import CliRunner

    from cachegen_cli.cli import app

    return CliRunner(), app


def test_cli_encode_and_calibrate_with_rope_keys(tmp_path):
    """--rope-keys needs a RoPE (one error line, exit 2: a usage error, as every ConfigError); --rope-theta gives one; a calibration
    fitted with --rope-keys --per-head records it, and files encoded with it have flags 5."""
    import shutil

    runner, app = _cli()
    src = tmp_path / "kv.safetensors"
    shutil.copyfile(SAMPLE_STACKED, src)
    r = runner.invoke(app, ["encode", str(src), "--rope-keys", "-o", str(tmp_path / "a.cgen")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and r.output.startswith("error:") and "--rope-theta" in r.output
    r = runner.invoke(app, ["encode", str(src), "--quality", "lossless", "--rope-theta", "100000", "-o",
                            str(tmp_path / "a.cgen")])
    assert r.exit_code == 2 and r.output.startswith("error:") and "--quality high/balanced/small" in r.output
    r = runner.invoke(app, ["encode", str(src), "--rope-theta", "100000", "--rope-start", "3", "-o", str(tmp_path / "a.cgen")])
    assert r.exit_code == 0, r.output
    h, _, _, _ = codec.read_header_and_index(codec.open_input((tmp_path / "a.cgen").read_bytes())[0])
    assert h.flags & container.FLAG_ROPE and h.params.rope.position_start == 3
    cal = tmp_path / "cal.safetensors"
    r = runner.invoke(app, ["calibrate", str(src), "--per-head", "--rope-theta", "100000", "-o", str(cal)])
    assert r.exit_code == 0, r.output
    from cachegen_cli.methods import calibration

    loaded = calibration.load(cal)
    assert loaded.rope is not None and loaded.rope.rotary_dim == 64 and loaded.blocks == 3
    r = runner.invoke(app, ["encode", str(src), "--calibration", str(cal), "-o", str(tmp_path / "b.cgen")])
    assert r.exit_code == 0, r.output
    h, _, _, _ = codec.read_header_and_index(codec.open_input((tmp_path / "b.cgen").read_bytes())[0])
    assert h.flags & 5 == 5
    r = runner.invoke(app, ["decode", str(tmp_path / "b.cgen"), "--calibration", str(cal), "-o", str(tmp_path / "b.safetensors")])
    assert r.exit_code == 0, r.output


def test_cli_batch_with_rope_keys(tmp_path):
    """A batch (a directory, --output-dir) passes --rope-theta to every file."""
    import shutil

    runner, app = _cli()
    (tmp_path / "in").mkdir()
    for name in ("a", "b"):
        shutil.copyfile(SAMPLE_STACKED, tmp_path / "in" / f"{name}.safetensors")
    r = runner.invoke(app, ["encode", str(tmp_path / "in"), "-r", "--output-dir", str(tmp_path / "out"),
                            "--rope-theta", "100000", "-q"])
    assert r.exit_code == 0, r.output
    outs = sorted((tmp_path / "out").rglob("*.cgen"))
    assert len(outs) == 2
    for p in outs:
        h, _, _, _ = codec.read_header_and_index(codec.open_input(p.read_bytes())[0])
        assert h.flags & container.FLAG_ROPE


def test_overflowing_levels_decode_finite():
    """A valid file whose z = q x s + m overflows float32 (a step near bfloat16's top: the spec
    lets an unrotated file have it): the keys' values are saturated before their turn, so no
    infinity meets a zero (found by scripts/fuzz.py, seed 11 case 23160); the reference agrees."""
    kv = realistic_kv(layers=1, tokens=9, heads=1, head_dim=4, dtype=torch.float32, seed=3)
    cfg = dataclasses.replace(quality_preset("balanced"), recent_tokens=0)
    blob = bytearray(cg.encode(kv, quantization=cfg, chunk_tokens=4, device="cpu", rope=rope.from_theta(10.0, 4)))
    h, _, _, _ = codec.read_header_and_index(codec.open_input(bytes(blob))[0])
    struct.pack_into("<H", blob, h.params_at + 32, 0x7F00)  # the keys' step: 1.7e38
    bad = _with_header_crc(blob, struct.unpack_from("<I", blob, 48)[0])
    out = cg.decode(bad, device="cpu")["kv"]
    assert torch.isfinite(out).all()
    name, words = ref.decode(bad).tensors["kv"]
    assert np.array_equal(words.reshape(-1), _words(out).reshape(-1).view(words.dtype))


def test_stats_names_rope_keys(tmp_path):
    kv = realistic_kv(layers=1, tokens=9, heads=1, head_dim=4, dtype=torch.bfloat16, seed=3)
    path = tmp_path / "a.cgen"
    path.write_bytes(cg.encode(kv, quality="balanced", device="cpu", rope=rope.from_theta(10.0, 4)))
    runner, app = _cli()
    r = runner.invoke(app, ["stats", str(path)])
    assert r.exit_code == 0 and "keys without RoPE" in r.output, r.output


def test_calibrate_fits_per_head_on_keys_without_rope_by_default(tmp_path):
    """`cachegen calibrate`'s default: samples that record their RoPE (as `cachegen capture`'s do)
    give one block per KV head fitted on keys without it (the smaller and the faster kind,
    docs/config.md); samples without one a full rotation, with a note naming --rope-theta; the
    flags override either choice."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cachegen_cli.methods import calibration
    from cachegen_cli.methods import rope as rope_methods

    runner, app = _cli()
    plain = tmp_path / "plain.safetensors"
    shutil.copyfile(SAMPLE_STACKED, plain)
    with_rope = tmp_path / "rope.safetensors"
    save_file(load_file(str(plain)), str(with_rope),
              metadata={rope_methods.METADATA_KEY: rope_methods.to_metadata(rope_methods.from_theta(100000.0, 64))})

    def fitted(*args):
        out = tmp_path / f"cal{len(list(tmp_path.iterdir()))}.safetensors"
        r = runner.invoke(app, ["calibrate", *map(str, args), "-o", str(out)])
        assert r.exit_code == 0, r.output
        return calibration.load(out), r.output

    cal, output = fitted(with_rope)
    assert cal.blocks == 3 and cal.rope is not None and "note:" not in output
    assert "3 blocks) on keys without their RoPE" in output
    cal, output = fitted(plain)
    assert cal.blocks == 1 and cal.rope is None
    assert "note:" in output and "--rope-theta" in output
    cal, output = fitted(plain, "--rope-theta", "100000")
    assert cal.blocks == 3 and cal.rope is not None
    cal, _ = fitted(with_rope, "--full")
    assert cal.blocks == 1 and cal.rope is not None
    cal, _ = fitted(with_rope, "--no-rope-keys")
    assert cal.blocks == 1 and cal.rope is None
    cal, output = fitted(plain, "--per-head")
    assert cal.blocks == 3 and cal.rope is None and "note:" not in output
    r = runner.invoke(app, ["calibrate", str(plain), str(with_rope), "--rope-keys", "-o", str(tmp_path / "x.safetensors")])
    assert r.exit_code == 2 and r.output.startswith("error:") and r.output.count("\n") == 1
