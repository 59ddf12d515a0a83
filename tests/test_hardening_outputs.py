"""Output and CLI hardening (issue "Hardening", items 8-12): devices and FIFOs written in place,
no temporary files left by terminating signals, the umask respected, one ``error:`` line naming
the path and the cause for each way an input or output can be wrong, and the README's first
code block runs as pasted."""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.cli import app

from conftest import realistic_kv

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r, *needles: str, code: int = 1) -> str:
    err = r.stderr.strip()
    assert r.exit_code == code, (r.exit_code, r.output)
    assert "Traceback" not in r.output and "internal error" not in err, err
    assert err.count("\n") == 0 and err.startswith("error:"), err
    for needle in needles:
        assert needle in err, err
    return err


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def kv_file(tmp_path) -> Path:
    path = tmp_path / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=2, tokens=24)}, path)
    return path


@pytest.fixture
def cgen_file(kv_file) -> Path:
    dst = kv_file.with_suffix(".cgen")
    cg.encode_file(kv_file, dst, chunk_tokens=8, device="cpu")
    return dst


# ---------------------------------------------------------------- 8. devices and FIFOs in place


def private_device(tmp_path: Path, name: str, minor: int) -> Path:
    """A private copy of /dev/NAME (Linux: character device 1, MINOR) where we may create one
    (root), so that a regression (rename over it) cannot replace the system's node; else /dev/NAME."""
    node = tmp_path / name
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
        return node
    except (PermissionError, OSError, AttributeError):
        return Path("/dev") / name


def null_device(tmp_path: Path) -> Path:
    return private_device(tmp_path, "null", 3)


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_force_onto_a_device_writes_in_place(kv_file, cgen_file, tmp_path, command):
    dev = null_device(tmp_path)
    src = kv_file if command == "encode" else cgen_file
    r = run(command, src, "-o", dev, "--force", "--device", "cpu", "--chunk-tokens" if command == "encode" else "-T", "8" if command == "encode" else "0")
    assert r.exit_code == 0, r.output
    assert stat.S_ISCHR(os.stat(dev).st_mode), "the device node was replaced by a file"
    assert hidden(dev.parent) == [] and hidden(tmp_path) == []


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_force_onto_a_fifo_writes_into_it(kv_file, cgen_file, tmp_path, command):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = bytearray()

    def reader():
        with open(fifo, "rb") as f:
            while chunk := f.read(1 << 16):
                got.extend(chunk)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    src = kv_file if command == "encode" else cgen_file
    r = run(command, src, "-o", fifo, "--force", "--device", "cpu")
    t.join(30)
    assert r.exit_code == 0, r.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert hidden(tmp_path) == []
    if command == "encode":
        assert cg.decode(bytes(got), device="cpu")["kv"].shape == load_file(kv_file)["kv"].shape
    else:
        cg.decode_file(cgen_file, tmp_path / "ref.safetensors", device="cpu")
        assert bytes(got) == (tmp_path / "ref.safetensors").read_bytes()


def test_a_device_output_still_needs_force(cgen_file, tmp_path):
    dev = null_device(tmp_path)
    one_error(run("decode", cgen_file, "-o", dev, "--device", "cpu"), str(dev), "already exists")


# ---------------------------------------------------------------- 9. terminating signals


SLOW_DECODE = textwrap.dedent("""
    import signal, sys, time
    # the signals at their default action, as in a terminal: under nohup (or a CI runner that
    # ignores SIGHUP) an ignored signal stays ignored by the CLI, by design (outputs._cleanup_on_signals)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from cachegen_cli.pipeline import codec
    real = codec.decode_to_file
    def slow(dec, path, progress=None):
        real(dec, path, progress)
        print("written", flush=True)
        # short sleeps, not one long one: the kernel may deliver the signal to another thread
        # (numba's workers), which does not wake a sleeping main thread; Python runs the handler
        # once the main thread runs again (a fresh-clone run once timed out here under load)
        for _ in range(600):
            time.sleep(0.1)
    codec.decode_to_file = slow
    from cachegen_cli.cli import main
    sys.argv = ["cachegen", "decode", sys.argv[1], "-o", sys.argv[2], "--device", "cpu", "-q"]
    main()
""")


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGHUP])
def test_terminating_signal_leaves_no_temporary_file(cgen_file, tmp_path, signo):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", SLOW_DECODE, str(cgen_file), str(out_dir / "kv.safetensors")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "written", p.stderr.read()
        assert len(hidden(out_dir)) == 1  # the temporary file, mid-write
        p.send_signal(signo)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + signo, (p.returncode, err)
    assert hidden(out_dir) == [] and list(out_dir.iterdir()) == []
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and signal.Signals(signo).name in lines[0], err


def test_signal_handlers_are_restored(tmp_path):
    from cachegen_cli.storage.outputs import atomic_output

    before = signal.getsignal(signal.SIGTERM)
    with atomic_output(tmp_path / "x") as tmp:
        assert signal.getsignal(signal.SIGTERM) is not before
        tmp.write_bytes(b"x")
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------- 10. the umask


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_respect_the_umask(kv_file, tmp_path, umask):
    old = os.umask(umask)
    try:
        cg.encode_file(kv_file, tmp_path / "a.cgen", chunk_tokens=8, device="cpu")
        cg.decode_file(tmp_path / "a.cgen", tmp_path / "a.safetensors", device="cpu")
        assert run("encode", kv_file, "-o", tmp_path / "b.cgen", "--device", "cpu").exit_code == 0
        assert run("decode", tmp_path / "b.cgen", "-o", tmp_path / "b.safetensors", "--device", "cpu").exit_code == 0
    finally:
        os.umask(old)
    for name in ("a.cgen", "a.safetensors", "b.cgen", "b.safetensors"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name


# ---------------------------------------------------------------- 11. messages and exit codes


@pytest.mark.parametrize("command", ["encode", "decode", "stats"])
def test_a_directory_as_input(tmp_path, command):
    d = tmp_path / "dir.cgen"
    d.mkdir()
    one_error(run(command, d), str(d), "is a directory")


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_a_symlink_loop_as_input(tmp_path, command):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    err = one_error(run(command, loop, "-o", tmp_path / "x"), str(loop), "symlink loop")
    assert "no such file" not in err


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_a_symlink_loop_as_output(kv_file, cgen_file, tmp_path, command):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    src = kv_file if command == "encode" else cgen_file
    one_error(run(command, src, "-o", loop, "--device", "cpu"), str(loop), "symlink loop")
    one_error(run(command, src, "-o", loop, "--device", "cpu", "--force"), str(loop), "symlink loop")


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_an_unreadable_input(kv_file, cgen_file, tmp_path, command, monkeypatch):
    src = kv_file if command == "encode" else cgen_file
    if os.geteuid() == 0:  # root reads everything: refuse the open as the kernel would
        import builtins

        real = builtins.open

        def guarded(path, *a, **k):
            if str(path) == str(src):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(builtins, "open", guarded)
    else:
        src.chmod(0)
    one_error(run(command, src, "-o", tmp_path / "out", "--device", "cpu"), str(src), "permission denied")


def test_full_disk_on_decode(cgen_file, tmp_path, monkeypatch):
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    out = tmp_path / "out.safetensors"
    one_error(run("decode", cgen_file, "-o", out, "--device", "cpu"), str(out), "no space left")
    monkeypatch.setattr(os, "pwrite", real)
    assert not out.exists() and hidden(tmp_path) == []


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_full_device(kv_file, cgen_file, tmp_path, command):
    full = private_device(tmp_path, "full", 7)
    if not os.path.exists(full):
        pytest.skip("no /dev/full")
    src = kv_file if command == "encode" else cgen_file
    one_error(run(command, src, "-o", full, "--force", "--device", "cpu"), str(full), "no space left")
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_the_input_is_checked_before_the_output(kv_file, tmp_path):
    (tmp_path / "kv.decoded.safetensors").write_bytes(b"x")
    err = one_error(run("decode", kv_file), str(kv_file), "not a .cgen file")
    assert "exists" not in err
    (tmp_path / "junk.cgen").write_bytes(b"x" * 100)
    (tmp_path / "junk.safetensors").write_bytes(b"x")
    err = one_error(run("encode", tmp_path / "junk.safetensors", "-o", tmp_path / "kv.decoded.safetensors"),
                    "junk.safetensors")
    assert "exists" not in err


# ---------------------------------------------------------------- 12. the README's first code block


def readme_first_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_readme_first_code_block_runs_as_pasted(tmp_path):
    lines = readme_first_block()
    assert any(line.startswith("cachegen decode") for line in lines)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "cachegen"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c 'from cachegen_cli.cli import main; main()' \"$@\"\n")
    shim.chmod(0o755)
    work = tmp_path / "clone"
    (work / "sample_data").mkdir(parents=True)
    for f in (ROOT / "sample_data").glob("*.safetensors"):
        (work / "sample_data" / f.name).symlink_to(f)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for line in lines:
        r = subprocess.run(line, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (line, r.stdout, r.stderr)
    assert load_file(work / "kv.decoded.safetensors")["kv"].shape == load_file(work / "kv.safetensors")["kv"].shape
    assert torch.equal(cg.decode((work / "kv.lossless.cgen").read_bytes(), device="cpu")["kv"],
                       load_file(work / "kv.safetensors")["kv"])
