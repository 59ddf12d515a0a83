"""Batches (issue 14): directories and --output-dir, resuming, per-file failures, local worker
pools and the Ray backend on a local Ray instance (one per module: its start is slow).

The caches are small slices of the real SmolLM2 sample (a few layers and tokens each), in a
tree of two folders, plus the committed per-layer sample."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cachegen_cli import api
from cachegen_cli.batch import run_batch
from cachegen_cli.batch.plan import plan_batch
from cachegen_cli.batch.work import EXIT_ONCE_ENV
from cachegen_cli.cli import app
from cachegen_cli.errors import ConfigError

from conftest import SAMPLE_PER_LAYER, SAMPLE_STACKED, one_line

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    """The test-only hook's file (work.EXIT_ONCE_ENV): set before Ray starts, so that its
    workers and every worker process inherit it; a test arms it by creating the file."""
    path = tmp_path_factory.mktemp("hook") / "exit-once"
    old = os.environ.get(EXIT_ONCE_ENV)
    os.environ[EXIT_ONCE_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(EXIT_ONCE_ENV, None)
    else:
        os.environ[EXIT_ONCE_ENV] = old


@pytest.fixture(scope="module")
def ray_local(marker):
    import signal

    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'cachegen[ray]')")
    # ray.init installs its own handlers for terminating signals in this (the driver's) process and
    # shutdown leaves them: put back what the other tests expect (storage/outputs only takes over
    # signals left at their default action).
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> Path:
    """caches/{c0,c2,c4}.safetensors, caches/sub/{c1,c3}.safetensors (4 layers, 40-72 tokens of
    the sample each) and caches/sub/code96.safetensors (the per-layer sample)."""
    root = tmp_path_factory.mktemp("caches")
    (root / "sub").mkdir()
    kv = load_file(str(SAMPLE_STACKED))["kv"]  # [30, 2, 520, 3, 64] bf16
    for i in range(5):
        part = kv[3 * i : 3 * i + 4, :, 60 * i : 60 * i + 40 + 8 * i].contiguous()
        save_file({"kv": part}, str(root / ("sub" if i % 2 else ".") / f"c{i}.safetensors"))
    shutil.copyfile(SAMPLE_PER_LAYER, root / "sub" / "code96.safetensors")
    return root


NAMES = ["c0", "c2", "c4", "sub/c1", "sub/c3", "sub/code96"]


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def all_valid(folder: Path, names=NAMES) -> None:
    """Every output is there, passes `cachegen test` (every CRC and a full decode), and no
    temporary file is left anywhere."""
    for name in names:
        info = api.test_file(folder / f"{name}.cgen", device="cpu")
        assert info["num_chunks"] >= 1
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


def test_plan_mirrors_the_tree(caches, tmp_path):
    (caches / ".hidden.safetensors").write_bytes(b"x")
    (caches / "old.decoded.safetensors").write_bytes(b"x")
    try:
        flat = plan_batch([caches], "encode", tmp_path / "out")
        assert [i.src.name for i in flat] == ["c0.safetensors", "c2.safetensors", "c4.safetensors"]
        deep = plan_batch([caches], "encode", tmp_path / "out", recursive=True)
        assert [str(i.dst.relative_to(tmp_path / "out")) for i in deep] == [f"{n}.cgen" for n in NAMES]
        beside = plan_batch([caches / "sub"], "encode")
        assert [i.dst for i in beside] == [caches / "sub" / "c1.cgen", caches / "sub" / "c3.cgen",
                                           caches / "sub" / "code96.cgen"]
        named = plan_batch([caches / "sub" / "c1.safetensors", tmp_path / "missing.safetensors"], "decode", tmp_path)
        assert named[0].dst == tmp_path / "c1.decoded.safetensors" and named[0].problem is None
        assert "no such file" in named[1].problem
        twice = plan_batch([caches / "sub" / "c1.safetensors", caches / "sub"], "encode", tmp_path / "o")
        assert [i.src.name for i in twice] == ["c1.safetensors", "c3.safetensors", "code96.safetensors"]
    finally:
        (caches / ".hidden.safetensors").unlink()
        (caches / "old.decoded.safetensors").unlink()


def test_plan_refuses_two_inputs_with_one_output(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "kv.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="would both write"):
        plan_batch([tmp_path / "a", tmp_path / "b"], "encode", tmp_path / "out")


def test_cli_encode_and_decode_a_directory_tree(caches, tmp_path):
    out, dec = tmp_path / "out", tmp_path / "dec"
    r = cli("encode", caches, "-r", "--output-dir", out, "--json", "-j", "2")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [Path(row["output"]).relative_to(out).as_posix() for row in rows] == [f"{n}.cgen" for n in NAMES]
    assert {row["status"] for row in rows} == {"done"} and {row["device"] for row in rows} == {"cpu"}
    for row in rows:
        assert row["output_bytes"] == Path(row["output"]).stat().st_size
        assert row["ratio"] == pytest.approx(row["input_bytes"] / row["output_bytes"], rel=1e-3) and row["ratio"] > 1
        assert row["seconds"] >= 0 and row["error"] is None
    all_valid(out)
    r = cli("decode", out, "-r", "--output-dir", dec)
    assert r.exit_code == 0, r.output
    assert "done" in r.stdout and "6" in r.stdout  # the summary table
    for name in NAMES:
        original = load_file(str(caches / f"{name}.safetensors"))
        decoded = load_file(str(dec / f"{name}.decoded.safetensors"))
        assert {k: (v.shape, v.dtype) for k, v in decoded.items()} == {k: (v.shape, v.dtype) for k, v in original.items()}
        # the batch writes what the single-file decode writes
        single = tmp_path / "single.safetensors"
        api.decode_file(out / f"{name}.cgen", single, force=True, device="cpu")
        assert filecmp.cmp(single, dec / f"{name}.decoded.safetensors", shallow=False)


def test_batch_options_refuse_a_single_output(caches, tmp_path):
    for args in (["-o", tmp_path / "x.cgen"], ["-c"]):
        r = cli("encode", caches, *args)
        assert r.exit_code == 2
        assert one_line(r).startswith("error:")
    r = cli("decode", "-", "--output-dir", tmp_path)
    assert r.exit_code == 2 and "stdin" in one_line(r)


def test_an_interrupted_batch_resumes(caches, tmp_path):
    out = tmp_path / "out"
    seen = []

    def stop_after_two(i, result):
        seen.append(result)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch([caches], "encode", output_dir=out, recursive=True, workers=2, pool="thread", device="cpu",
                  on_result=stop_after_two)
    made = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.cgen"))
    assert 2 <= len(made) < len(NAMES)  # the files being coded when it stopped finish, atomically
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    # one complete output is cut short (as a copy interrupted by something else would be), and
    # a killed attempt's temporary file lies beside it
    victim = out / made[0]
    victim.write_bytes(victim.read_bytes()[:-20])
    stale = victim.with_name(f".{victim.name}.abc123.tmp")
    stale.write_bytes(b"partial")
    results = run_batch([caches], "encode", output_dir=out, recursive=True, device="cpu")
    status = {Path(r.output).relative_to(out).as_posix(): r for r in results}
    assert status[made[0]].status == "done" and "coded again" in status[made[0]].note
    assert all(status[m].status == "skipped" for m in made[1:])
    assert all(status[f"{n}.cgen"].status == "done" for n in NAMES if f"{n}.cgen" not in made)
    all_valid(out)
    again = run_batch([caches], "encode", output_dir=out, recursive=True, device="cpu")
    assert {r.status for r in again} == {"skipped"}
    forced = run_batch([caches], "encode", output_dir=out, recursive=True, device="cpu", force=True)
    assert {r.status for r in forced} == {"done"}


def test_a_cut_decoded_output_is_decoded_again(caches, tmp_path):
    out, dec = tmp_path / "out", tmp_path / "dec"
    run_batch([caches / "sub"], "encode", output_dir=out, device="cpu")
    first = run_batch([out], "decode", output_dir=dec, device="cpu")
    assert [r.status for r in first] == ["done"] * 3
    cut = dec / "c1.decoded.safetensors"
    whole = cut.read_bytes()
    cut.write_bytes(whole[:-2])
    second = run_batch([out], "decode", output_dir=dec, device="cpu")
    assert [r.status for r in second] == ["done", "skipped", "skipped"]
    assert "bytes" in second[0].note and cut.read_bytes() == whole


def test_a_corrupt_input_fails_alone(caches, tmp_path):
    src = copy_tree(caches / "sub", tmp_path / "in")
    (src / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    out = tmp_path / "out"
    r = cli("encode", src, "--output-dir", out, "--json")
    assert r.exit_code == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(src / "broken.safetensors") in errors[0], r.stderr
    assert "Traceback" not in r.output
    rows = {Path(row["input"]).name: row for row in json.loads(r.stdout)}
    assert rows["broken.safetensors"]["status"] == "failed" and rows["broken.safetensors"]["error_type"]
    assert all(rows[n]["status"] == "done" for n in ("c1.safetensors", "c3.safetensors", "code96.safetensors"))
    assert sorted(p.name for p in out.iterdir()) == ["c1.cgen", "c3.cgen", "code96.cgen"]
    all_valid(out, ["c1", "c3", "code96"])
    # the good files are skipped on a rerun; the bad one fails again, alone
    r = cli("encode", src, "--output-dir", out)
    assert r.exit_code == 1 and "skipped" in r.stdout and r.stderr.count("error:") == 1


@pytest.fixture
def armed(marker):
    """Arm the hook for one test; disarmed after it whatever happened (an armed hook would end
    this very process at the next file coded in it)."""
    marker.write_text("armed")
    yield marker
    marker.unlink(missing_ok=True)


def test_a_local_worker_process_killed_once_is_retried(caches, tmp_path, armed):
    marker = armed
    out = tmp_path / "out"
    results = run_batch([caches], "encode", output_dir=out, recursive=True, workers=2, pool="process", device="cpu")
    assert not marker.exists()  # a worker took the marker, so it ended its own process
    assert [r.status for r in results] == ["done"] * len(NAMES), [r.error for r in results]
    all_valid(out)


def test_ray_gives_the_local_backend_bytes(caches, tmp_path, ray_local):
    local, remote = tmp_path / "local", tmp_path / "ray"
    a = run_batch([caches], "encode", output_dir=local, recursive=True, device="cpu", quality="high")
    b = run_batch([caches], "encode", output_dir=remote, recursive=True, device="cpu", quality="high", backend="ray")
    assert [r.status for r in a] == [r.status for r in b] == ["done"] * len(NAMES), [r.error for r in b]
    assert len({r.worker for r in b} - {os.getpid()}) >= 1  # coded in Ray's workers, not here
    for name in NAMES:
        assert filecmp.cmp(local / f"{name}.cgen", remote / f"{name}.cgen", shallow=False), name
    d1 = run_batch([local], "decode", output_dir=tmp_path / "d1", recursive=True, device="cpu")
    d2 = run_batch([remote], "decode", output_dir=tmp_path / "d2", recursive=True, device="cpu", backend="ray")
    for x, y in zip(d1, d2):
        assert filecmp.cmp(x.output, y.output, shallow=False)


def test_ray_retries_a_task_whose_worker_died(caches, tmp_path, ray_local, armed):
    marker = armed
    out = tmp_path / "out"
    results = run_batch([caches], "encode", output_dir=out, recursive=True, device="cpu", backend="ray",
                        ray_options={"per_task": 2})
    assert not marker.exists()  # one task's worker ended its process while writing
    assert [r.status for r in results] == ["done"] * len(NAMES), [r.error for r in results]
    all_valid(out)


def test_ray_backend_through_the_cli(caches, tmp_path, ray_local):
    r = cli("encode", caches / "sub", "--output-dir", tmp_path / "out", "--backend", "ray", "--json")
    assert r.exit_code == 0, r.output
    assert [row["status"] for row in json.loads(r.stdout)] == ["done"] * 3


def test_without_ray_the_backend_says_what_to_install(caches, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    r = cli("encode", caches / "sub", "--output-dir", tmp_path / "out", "--backend", "ray")
    assert r.exit_code == 1
    assert one_line(r) == "error: --backend ray needs Ray: pip install 'cachegen[ray]'"
    assert not (tmp_path / "out").exists()


def test_ray_refuses_tasks_no_node_can_run(caches, tmp_path, ray_local):
    r = cli("encode", caches / "sub", "--output-dir", tmp_path / "out", "--backend", "ray", "--device", "cuda")
    assert r.exit_code == 2
    assert "no room for a task of 0.5 GPU(s)" in one_line(r)  # half a GPU a task by default


def test_ray_task_sizes():
    """CPU tasks: about two per slot (a slow node holds little of the batch); GPU tasks, each a
    process of its own: one per slot; never more than MAX_FILES_PER_TASK files."""
    from cachegen_cli.batch.ray_backend import MAX_FILES_PER_TASK, files_per_task

    assert files_per_task(100, 2) == 25 and files_per_task(100, 2, gpu=True) == 50
    assert files_per_task(3, 8) == 1 and files_per_task(3, 8, gpu=True) == 1
    assert files_per_task(10_000, 2, gpu=True) == MAX_FILES_PER_TASK
