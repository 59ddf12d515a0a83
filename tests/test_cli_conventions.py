"""The command's conventions from zstd / xz / gzip (issue "Hardening"): fast --help, `-`,
-c/--stdout, several inputs, `cachegen test`, -q / -v / --json, and the output details."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numba", "numpy", "safetensors")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_importing_the_cli_loads_neither_torch_nor_numba():
    r = _python(f"import sys, cachegen_cli.cli; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["encode", "--help"], ["decode", "--help"],
                                  ["test", "--help"], ["encode"], ["no-such-command"]])
def test_help_version_and_argument_errors_load_neither_torch_nor_numba(argv):
    r = _python(
        "import sys\n"
        f"sys.argv = ['cachegen'] + {argv!r}\n"
        "from cachegen_cli.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        f"print('LOADED', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n"
    )
    assert "LOADED []" in r.stderr, r.stderr[-2000:]


def test_the_package_still_exports_the_api_lazily():
    r = _python("import cachegen_cli as cg, sys; assert 'torch' not in sys.modules; "
                "print(cg.encode.__module__, cg.QuantizationConfig.__name__, 'decode' in dir(cg))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cachegen_cli.api", "QuantizationConfig", "True"]


# ---------------------------------------------------------------- through the CLI runner

import json  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from conftest import realistic_kv  # noqa: E402

runner = CliRunner()


def _app():
    from cachegen_cli.cli import app

    return app


def invoke(*args, input=None):
    return runner.invoke(_app(), [str(a) for a in args], input=input)


@pytest.fixture
def kv_file(tmp_path) -> Path:
    p = tmp_path / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=2, tokens=20, heads=1, head_dim=8).contiguous()}, str(p))
    return p


def one_error_line(r, needle: str = "") -> str:
    err = r.stderr.strip()
    assert "Traceback" not in r.output and err.startswith("error:") and "\n" not in err, r.output
    assert needle in err, err
    return err


def test_encode_stdin_to_stdout_is_the_same_file(kv_file, tmp_path):
    assert invoke("encode", kv_file, "-q").exit_code == 0
    want = kv_file.with_suffix(".cgen").read_bytes()
    r = invoke("encode", "-", "-q", input=kv_file.read_bytes())  # stdin goes to stdout by default
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == want
    r = invoke("encode", kv_file, "-c")
    assert r.exit_code == 0 and r.stdout_bytes == want
    assert "kv.safetensors -> <stdout>" in r.stderr  # the summary goes to stderr
    r = invoke("encode", kv_file, "-o", "-", "-q")
    assert r.exit_code == 0 and r.stdout_bytes == want


def test_decode_stdin_and_stdout(kv_file, tmp_path):
    invoke("encode", kv_file, "-q")
    cgen = kv_file.with_suffix(".cgen")
    r = invoke("decode", "-", "-q", input=cgen.read_bytes())
    assert r.exit_code == 0, r.output
    out = tmp_path / "from_stdout.safetensors"
    out.write_bytes(r.stdout_bytes)
    assert invoke("decode", cgen, "-q").exit_code == 0
    assert out.read_bytes() == (tmp_path / "kv.decoded.safetensors").read_bytes()
    assert load_file(str(out))["kv"].shape == (2, 2, 20, 1, 8)
    r = invoke("decode", "-c", cgen)
    assert r.exit_code == 0 and r.stdout_bytes == out.read_bytes() and "<stdout>" in r.stderr


def test_refuses_to_write_compressed_data_to_a_terminal(kv_file, monkeypatch):
    from cachegen_cli.cli import common

    monkeypatch.setattr(common, "_is_terminal", lambda stream: True)
    r = invoke("encode", kv_file, "-c")
    assert r.exit_code == 1
    one_error_line(r, "error: refusing to write compressed data to a terminal")
    r = invoke("decode", "-", "-o", "x.safetensors")
    assert r.exit_code == 1
    one_error_line(r, "refusing to read compressed data from a terminal")
    r = invoke("encode", kv_file, "-c", "-f", "-q")  # -f overrides
    assert r.exit_code == 0 and r.stdout_bytes.startswith(b"\x89CGEN")


@pytest.mark.parametrize("args,needle", [
    (["-o", "x.cgen"], "-o/--output takes one input"),
    (["-c"], "-c/--stdout takes one input"),
])
def test_several_inputs_refuse_one_output(kv_file, args, needle):
    r = invoke("encode", kv_file, kv_file, *args)
    assert r.exit_code == 2
    one_error_line(r, needle)


def test_several_inputs_each_get_their_default_name_and_errors_go_on(kv_file, tmp_path):
    other = tmp_path / "b.safetensors"
    other.write_bytes(kv_file.read_bytes())
    missing = tmp_path / "missing.safetensors"
    r = invoke("encode", kv_file, missing, other)
    assert r.exit_code == 1
    one_error_line(r, f"error: {missing}: no such file")
    assert kv_file.with_suffix(".cgen").is_file() and other.with_suffix(".cgen").is_file()
    assert kv_file.is_file() and other.is_file()  # inputs are kept
    assert r.stdout.count("\n") == 2
    r = invoke("decode", kv_file.with_suffix(".cgen"), other.with_suffix(".cgen"), "--json")
    assert r.exit_code == 0, r.output
    results = json.loads(r.stdout)
    assert [x["ok"] for x in results] == [True, True]
    assert (tmp_path / "kv.decoded.safetensors").is_file() and (tmp_path / "b.decoded.safetensors").is_file()


def test_help_says_inputs_are_kept():
    for cmd in ("encode", "decode"):
        r = invoke(cmd, "--help")
        assert "Inputs are always kept" in " ".join(r.stdout.split())


def test_test_command_one_line_per_file_and_exit_status(kv_file, tmp_path):
    invoke("encode", kv_file, "-q")
    good = kv_file.with_suffix(".cgen")
    bad = tmp_path / "bad.cgen"
    blob = bytearray(good.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    bad.write_bytes(bytes(blob))
    r = invoke("test", good)
    assert r.exit_code == 0 and r.stdout == f"{good}: OK\n" and r.stderr == ""
    r = invoke("test", good, bad)
    assert r.exit_code == 1
    assert r.stdout == f"{good}: OK\n"
    one_error_line(r, f"error: {bad}: ")
    assert "CRC" in r.stderr
    r = invoke("test", good, bad, "-q")
    assert r.exit_code == 1 and r.stdout == ""
    r = invoke("test", good, bad, "--json")
    results = json.loads(r.stdout)
    assert [x["ok"] for x in results] == [True, False] and results[1]["error_type"] == "ChecksumError"
    assert results[0]["num_tokens"] == 20
    r = invoke("test", "-", input=good.read_bytes())
    assert r.exit_code == 0 and r.stdout == "<stdin>: OK\n"
    r = invoke("test", good, "-v", "-T", "1")
    assert r.exit_code == 0 and "20 tokens in 1 chunk," in r.stdout
    assert not (tmp_path / "kv.decoded.safetensors").exists()  # writes nothing


def test_dash_t_is_test(kv_file, capsys):
    from cachegen_cli.cli import main

    invoke("encode", kv_file, "-q")
    with pytest.raises(SystemExit) as e:
        main(["-t", str(kv_file.with_suffix(".cgen"))])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip().endswith(": OK")


def test_quiet_verbose_json_on_encode(kv_file):
    r = invoke("encode", kv_file, "-q", "-f")
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
    r = invoke("encode", kv_file, "-v", "-f", "-T", "1")
    assert r.exit_code == 0 and "format v2" in r.stdout and " s\n" in r.stdout
    r = invoke("encode", kv_file, "--json", "-f")
    (res,) = json.loads(r.stdout)
    assert res["ok"] and res["num_chunks"] == 1 and res["output"].endswith("kv.cgen") and res["ratio"] > 1


def test_one_chunk_is_singular(kv_file):
    r = invoke("encode", kv_file, "-f")
    assert "1 chunk of" in r.stdout and "1 chunks" not in r.stdout


def test_long_paths_are_not_wrapped_when_piped(tmp_path):
    deep = tmp_path / ("d" * 90) / ("e" * 90)
    deep.mkdir(parents=True)
    src = deep / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=1, tokens=4, heads=1, head_dim=4).contiguous()}, str(src))
    r = invoke("encode", src)
    assert r.exit_code == 0, r.output
    assert r.stdout.count("\n") == 1 and str(src) in r.stdout


def test_compiling_note_on_a_cold_cache(kv_file, monkeypatch):
    from cachegen_cli.kernels import cache_state

    monkeypatch.setattr(cache_state, "cold_cache", lambda: True)
    r = invoke("encode", kv_file, "-f")
    assert "compiling kernels (first run only)" in r.stderr
    r = invoke("encode", kv_file, "-f", "-q")
    assert r.stderr == ""


def test_cold_cache_is_detected_in_an_empty_cache_folder(tmp_path, monkeypatch):
    from cachegen_cli.kernels import cache_state

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert cache_state.cold_cache()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "k.nbi").write_bytes(b"")
    assert not cache_state.cold_cache()


def test_progress_moves_from_the_start_on_a_terminal(monkeypatch):
    import io

    from rich.console import Console

    from cachegen_cli.cli import commands

    buf = io.StringIO()
    monkeypatch.setattr(commands, "err", Console(file=buf, force_terminal=True, width=100))
    with commands._progress("encoding kv", True) as update:
        assert update is not None
        import time

        time.sleep(0.3)  # before the library's first report the bar already shows (pulsing, elapsed time)
        assert "encoding kv" in buf.getvalue()
        update(3, 65)
        update(65, 65)
    with commands._progress("encoding kv", False) as update:
        assert update is None


def test_no_progress_bar_when_stderr_is_not_a_terminal(kv_file):
    r = invoke("encode", kv_file, "-f", "--chunk-tokens", "2")
    assert r.exit_code == 0 and r.stderr == ""


def test_stats_takes_threads_and_prints_no_rate_for_0_tokens(tmp_path):
    src = tmp_path / "z.safetensors"
    save_file({"kv": torch.zeros(2, 2, 0, 1, 8, dtype=torch.bfloat16)}, str(src))
    assert invoke("encode", src, "-q").exit_code == 0
    r = invoke("stats", tmp_path / "z.cgen", "-T", "1")
    assert r.exit_code == 0, r.output
    assert "no values (0 tokens)" in r.stdout and "bits/value" not in r.stdout.splitlines()[3]
    assert "1 KV head x" in r.stdout and "0 tokens in 0 chunks" in r.stdout
    r = invoke("encode", src, "-f")
    assert "no values" in r.stdout and "bits/value" not in r.stdout


@pytest.mark.parametrize("quality", ["balanced", "lossless"])
def test_progress_is_reported_slab_by_slab_encode_and_decode(tmp_path, monkeypatch, quality):
    """The library reports progress after each slab it codes, so that a file of several slabs
    moves the bar while it is coded (not 0 until the end): increasing reports, the last one the
    whole file, on encode_file and on decode_file."""
    import torch
    from safetensors.torch import save_file

    import cachegen_cli as cg
    from cachegen_cli.methods import transform as transform_codec

    kv = torch.randn(2, 2, 64, 2, 8).to(torch.bfloat16)
    src = tmp_path / "kv.safetensors"
    save_file({"kv": kv}, str(src))
    # 4-token chunks of 2 layers x 16 channels: 512 float32 bytes a chunk, so 3 chunks a slab
    monkeypatch.setattr(transform_codec, "V2_SLAB_BYTES", 3 * 4 * 2 * 2 * 16 * 4)
    for direction in ("encode", "decode"):
        seen = []
        if direction == "encode":
            cg.encode_file(src, tmp_path / "kv.cgen", quality=quality, chunk_tokens=4, device="cpu",
                           progress=lambda done, total: seen.append((done, total)), force=True)
        else:
            cg.decode_file(tmp_path / "kv.cgen", tmp_path / "out.safetensors", device="cpu",
                           progress=lambda done, total: seen.append((done, total)), force=True)
        assert len(seen) >= 5, (direction, seen)
        assert all(t == 16 for _, t in seen) and seen[-1] == (16, 16), (direction, seen)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[0][0] < 16, (direction, seen)
