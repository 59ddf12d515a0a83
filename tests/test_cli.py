"""The command line through Typer's CliRunner: exit codes, one-line errors, no files left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cachegen_cli.cli import app
from cachegen_cli.methods import calibration as calib

from conftest import per_layer, realistic_kv

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, needle: str) -> None:
    assert result.exit_code != 0
    err = result.stderr.strip()
    assert "Traceback" not in result.output
    assert err.count("\n") == 0, err
    assert err.startswith("error:") and needle in err, err


def listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture
def kv_file(tmp_path) -> Path:
    path = tmp_path / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=3, tokens=30)}, path, metadata={"model": "synthetic"})
    return path


def test_encode_decode_stats(kv_file, tmp_path):
    r = run("encode", kv_file, "--chunk-tokens", "8")
    assert r.exit_code == 0, r.output
    assert "kv.cgen" in r.stdout and "bits/value" in r.stdout
    cgen = tmp_path / "kv.cgen"
    assert cgen.exists()
    r = run("decode", cgen)
    assert r.exit_code == 0, r.output
    out = tmp_path / "kv.decoded.safetensors"
    original, decoded = load_file(kv_file), load_file(out)
    assert decoded.keys() == original.keys() and decoded["kv"].shape == original["kv"].shape
    assert decoded["kv"].dtype == original["kv"].dtype
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"model": "synthetic"}
    r = run("stats", cgen, "--reference", kv_file)
    assert r.exit_code == 0, r.output
    assert "ratio" in r.stdout and "relative MSE" in r.stdout and "side information" in r.stdout
    r = run("stats", cgen, "--json", "--reference", kv_file)
    s = json.loads(r.stdout)
    assert s["num_layers"] == 3 and len(s["layers"]) == 3 and s["num_chunks"] == 4
    assert s["compressed_bytes"] == cgen.stat().st_size and 0 < s["side_fraction"] < 1
    assert 0 < s["error"]["rel_mse"] < 0.05 and len(s["error"]["layers"]) == 3


def test_per_layer_file_roundtrip_keeps_names(tmp_path):
    src = tmp_path / "cache.safetensors"
    tensors = per_layer(realistic_kv(layers=2, tokens=10))
    save_file(tensors, src)
    assert run("encode", src, "-o", tmp_path / "c.cgen").exit_code == 0
    assert run("decode", tmp_path / "c.cgen", "-o", tmp_path / "back.safetensors").exit_code == 0
    back = load_file(tmp_path / "back.safetensors")
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in tensors.items()}


def test_refuses_to_overwrite(kv_file, tmp_path):
    target = tmp_path / "kv.cgen"
    target.write_bytes(b"precious")
    r = run("encode", kv_file)
    one_line_error(r, "already exists")
    assert target.read_bytes() == b"precious"
    assert run("encode", kv_file, "--force").exit_code == 0
    assert target.read_bytes() != b"precious"


def test_never_overwrites_the_input(kv_file):
    before = kv_file.read_bytes()
    r = run("encode", kv_file, "-o", kv_file, "--force")
    one_line_error(r, "input")
    assert kv_file.read_bytes() == before


@pytest.mark.parametrize("cut", [10, 100, -20, -1])
def test_truncated_cgen(kv_file, tmp_path, cut):
    assert run("encode", kv_file).exit_code == 0
    blob = (tmp_path / "kv.cgen").read_bytes()
    bad = tmp_path / "bad.cgen"
    bad.write_bytes(blob[:cut])
    before = listing(tmp_path)
    r = run("decode", bad)
    assert r.exit_code == 1
    one_line_error(r, "")
    assert listing(tmp_path) == before  # no output, no temporary file


def test_corrupted_and_foreign_cgen(kv_file, tmp_path):
    assert run("encode", kv_file, "--preset", "lmcache").exit_code == 0  # the middle byte lies in a v1 payload
    blob = bytearray((tmp_path / "kv.cgen").read_bytes())
    blob[len(blob) // 2] ^= 0x40
    (tmp_path / "corrupt.cgen").write_bytes(blob)
    before = listing(tmp_path)
    one_line_error(run("decode", tmp_path / "corrupt.cgen"), "CRC")
    one_line_error(run("decode", kv_file, "-o", tmp_path / "x.safetensors"), "not a .cgen file")
    one_line_error(run("stats", kv_file), "not a .cgen file")
    assert listing(tmp_path) == before


def test_bad_inputs_leave_nothing(tmp_path):
    nan = tmp_path / "nan.safetensors"
    kv = realistic_kv(layers=2)
    kv[1, 0, 3, 0, 0] = float("nan")
    save_file({"kv": kv}, nan)
    ints = tmp_path / "ints.safetensors"
    save_file({"kv": torch.zeros(2, 2, 4, 1, 4, dtype=torch.int16)}, ints)
    odd = tmp_path / "odd.safetensors"
    save_file({"w": torch.zeros(3, 3), "b": torch.zeros(3)}, odd)
    text = tmp_path / "text.safetensors"
    text.write_text("hello")
    before = listing(tmp_path)
    one_line_error(run("encode", nan), "NaN")
    one_line_error(run("encode", ints), "dtype int16")
    one_line_error(run("encode", odd), "layout")
    one_line_error(run("encode", text), "not a readable safetensors file")
    one_line_error(run("encode", tmp_path / "missing.safetensors"), "no such file")
    one_line_error(run("decode", tmp_path / "missing.cgen"), "no such file")
    assert listing(tmp_path) == before


def test_bad_options(kv_file):
    r = run("encode", kv_file, "--preset", "gpt-9")
    assert r.exit_code == 2
    one_line_error(r, "unknown preset")
    one_line_error(run("encode", kv_file, "--chunk-tokens", "0"), "chunk_tokens")
    one_line_error(run("encode", kv_file, "--bins", "k:0-=16"), "--bins")
    one_line_error(run("encode", kv_file, "--preset", "lmcache", "--bins", "16"), "only one")


def test_config_files(kv_file, tmp_path):
    toml = tmp_path / "q.toml"
    toml.write_text(
        "chunk_tokens = 16\n"
        "[[key]]\nstart_layer = 0\nend_layer = 1\nbins = 64\n"
        "[[key]]\nstart_layer = 1\nbins = 8\n"
        "[[value]]\nstart_layer = 0\nbins = 12\n"
    )
    assert run("encode", kv_file, "--config", toml, "-o", tmp_path / "t.cgen").exit_code == 0
    s = json.loads(run("stats", tmp_path / "t.cgen", "--json").stdout)
    assert s["chunk_tokens"] == 16
    assert [r["key_bins"] for r in s["layers"]] == [64, 8, 8] and {r["value_bins"] for r in s["layers"]} == {12}
    js = tmp_path / "q.json"
    js.write_text(json.dumps({"preset": "llama-3.1-8b"}))
    assert run("encode", kv_file, "--config", js, "-o", tmp_path / "j.cgen").exit_code == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[[key]]\nbins = 'many'\n[[value]]\nbins = 4\n")
    one_line_error(run("encode", kv_file, "--config", bad, "-o", tmp_path / "b.cgen"), "config")
    bad.write_text("this is = = not toml")
    one_line_error(run("encode", kv_file, "--config", bad, "-o", tmp_path / "b.cgen"), "not valid TOML")
    assert not (tmp_path / "b.cgen").exists()


def test_help_has_examples():
    for cmd in ("encode", "decode", "stats"):
        r = run(cmd, "--help")
        assert r.exit_code == 0 and "Example" in r.stdout and f"cachegen {cmd}" in r.stdout
    r = run("presets")
    assert r.exit_code == 0 and "llama-3.1-8b" in r.stdout


def test_progress_bar_does_not_break_output(tmp_path):
    path = tmp_path / "long.safetensors"
    save_file({"kv": realistic_kv(layers=2, tokens=64, heads=1, head_dim=4)}, path)
    r = run("encode", path, "--chunk-tokens", "4")  # 16 chunks: progress bar path
    assert r.exit_code == 0, r.output
    assert run("decode", tmp_path / "long.cgen").exit_code == 0


def test_quality_lossless_and_options(kv_file, tmp_path):
    r = run("encode", kv_file, "--quality", "lossless", "-o", tmp_path / "l.cgen")
    assert r.exit_code == 0, r.output
    assert run("decode", tmp_path / "l.cgen", "-o", tmp_path / "l.safetensors").exit_code == 0
    a, b = load_file(kv_file)["kv"], load_file(tmp_path / "l.safetensors")["kv"]
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    r = run("stats", tmp_path / "l.cgen")
    assert r.exit_code == 0 and "cgen v2, lossless" in r.stdout
    r = run("encode", kv_file, "--quality", "high", "--preset", "lmcache", "-o", tmp_path / "x.cgen")
    one_line_error(r, "only one of --quality, --preset")
    assert r.exit_code == 2
    r = run("encode", kv_file, "--quality", "medium")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert not (tmp_path / "x.cgen").exists() and not (tmp_path / "y.cgen").exists()


def test_calibrate_encode_decode(kv_file, tmp_path):
    other = tmp_path / "other.safetensors"
    save_file({"kv": realistic_kv(layers=3, tokens=30, seed=4)}, other)
    cal = tmp_path / "cal.safetensors"
    r = run("calibrate", other, "-o", cal)
    assert r.exit_code == 0, r.output
    assert "rotation for 3 layers x 16 channels" in r.stdout
    one_line_error(run("calibrate", other, "-o", cal), "already exists")
    r = run("encode", kv_file, "--calibration", cal, "-o", tmp_path / "r.cgen")
    assert r.exit_code == 0, r.output
    before = listing(tmp_path)
    one_line_error(run("decode", tmp_path / "r.cgen", "-o", tmp_path / "r.safetensors"), "--calibration")
    one_line_error(run("decode", tmp_path / "r.cgen", "--calibration", kv_file, "-o", tmp_path / "r.safetensors"),
                   "calibration")
    assert listing(tmp_path) == before
    r = run("decode", tmp_path / "r.cgen", "--calibration", cal, "-o", tmp_path / "r.safetensors")
    assert r.exit_code == 0, r.output
    r = run("stats", tmp_path / "r.cgen", "--reference", kv_file, "--calibration", cal)
    assert r.exit_code == 0 and "transform + rotation" in r.stdout, r.output
    # one block per KV head: its own file (calibration version 2), its own identity
    head = tmp_path / "head.safetensors"
    r = run("calibrate", other, "--per-head", "-o", head)
    assert r.exit_code == 0 and "rotation (2 blocks) for 3 layers x 16 channels" in r.stdout, r.output
    assert calib.load(head).blocks == 2 and calib.load(head).sha256 != calib.load(cal).sha256
    assert run("encode", kv_file, "--calibration", head, "-o", tmp_path / "h.cgen").exit_code == 0
    one_line_error(run("decode", tmp_path / "h.cgen", "--calibration", cal, "-o", tmp_path / "h.safetensors"),
                   "not the one")
    r = run("decode", tmp_path / "h.cgen", "--calibration", head, "-o", tmp_path / "h.safetensors")
    assert r.exit_code == 0, r.output


def test_config_file_with_steps(kv_file, tmp_path):
    toml = tmp_path / "steps.toml"
    toml.write_text('method = "transform"\nkey_step = [0.5, 0.6, 0.7]\nvalue_step = 0.4\nsink_tokens = 2\n')
    r = run("encode", kv_file, "--config", toml, "-o", tmp_path / "s.cgen")
    assert r.exit_code == 0, r.output
    toml.write_text('quality = "small"\n')
    assert run("encode", kv_file, "--config", toml, "-o", tmp_path / "q.cgen").exit_code == 0
    toml.write_text('quality = "small"\npreset = "lmcache"\n')
    one_line_error(run("encode", kv_file, "--config", toml, "-o", tmp_path / "b.cgen"), "only one of")
    toml.write_text('method = "transform"\nkey_step = [0.5, 0.6]\n')
    one_line_error(run("encode", kv_file, "--config", toml, "-o", tmp_path / "b.cgen"), "one per layer")


def test_threads_option_gives_the_same_files(tmp_path):
    src = tmp_path / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=3, tokens=70)}, src, metadata={"model": "synthetic"})
    for method in (["--preset", "lmcache"], ["--quality", "balanced"], ["--quality", "lossless"]):
        files = []
        for flag, n in (("-T", "1"), ("--threads", "2"), ("-T", "0")):
            cgen, back = tmp_path / f"t{n}.cgen", tmp_path / f"t{n}.safetensors"
            r = run("encode", src, "-o", cgen, *method, flag, n, "--chunk-tokens", "8", "--device", "cpu", "--force")
            assert r.exit_code == 0, r.output
            r = run("decode", cgen, "-o", back, flag, n, "--device", "cpu", "--force")
            assert r.exit_code == 0, r.output
            files.append((cgen.read_bytes(), back.read_bytes()))
        assert files[0] == files[1] == files[2]
    r = run("encode", src, "-T", "-1")
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_threads_apply_to_the_call_only(tmp_path):
    import numba

    import cachegen_cli as cg

    src = tmp_path / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=2, tokens=40)}, src)
    before = numba.get_num_threads(), torch.get_num_threads()
    seen = []
    progress = lambda done, total: seen.append((numba.get_num_threads(), torch.get_num_threads()))  # noqa: E731
    cg.encode_file(src, tmp_path / "kv.cgen", chunk_tokens=8, device="cpu", threads=1, progress=progress)
    cg.decode_file(tmp_path / "kv.cgen", tmp_path / "out.safetensors", device="cpu", threads=1, progress=progress)
    assert seen and set(seen) == {(1, 1)}
    assert (numba.get_num_threads(), torch.get_num_threads()) == before
