"""benchmarks/ab_trees.py's bookkeeping (no GPU): the run order, the table it prints from the
JSONs of bench_device.py, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


def _ab():
    return load_script("benchmarks/ab_trees.py", "ab_trees_under_test")


def _result(enc, dec, stats_ms, same=True):
    return {"rows": [{"method": "high", "encode_GBps": enc, "decode_GBps": dec, "identical_cpu_gpu_bytes": same,
                      "encode_stages_ms": [["statistics", stats_ms], ["levels", 1.0]],
                      "decode_stages_ms": [["range decoding", 4.0]]}]}


def test_runs_alternate_old_first():
    assert _ab().run_order(2) == [("old", 1), ("new", 1), ("old", 2), ("new", 2)]


def test_summary_lists_runs_and_the_stages_that_moved(tmp_path, capsys):
    ab = _ab()
    for name, res in {"old_r1": _result(100.0, 110.0, 1.15), "new_r1": _result(102.5, 111.0, 0.87),
                      "old_r2": _result(99.0, 109.0, 1.16), "new_r2": _result(103.0, 112.0, 0.88, same=False)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    (tmp_path / "notes_r1.json").write_text("{}")  # not a run of either tree: ignored
    assert ab.main(["--out", str(tmp_path), "--summarize"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "old 100.0/110.0 99.0/109.0" in first and "new 102.5/111.0 103.0/112.0" in first
    assert "CPU == GPU bytes NO" in first
    assert "encode: statistics" in out and "1.155 ->   0.875 ms" in out
    assert "levels" not in out and "range decoding" not in out  # unchanged stages are not listed


def test_refuses_missing_trees_and_empty_results(tmp_path, capsys):
    ab = _ab()
    assert ab.main(["--out", str(tmp_path), "--summarize"]) == 1
    assert "no run's JSON" in capsys.readouterr().err
    assert ab.main(["--out", str(tmp_path), "--old", str(tmp_path), "--new", str(ROOT)]) == 1
    assert "has no benchmarks/bench_device.py" in capsys.readouterr().err
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "cachegen_cli").mkdir()
    (tree / "kernels").mkdir()
    (tree / "benchmarks" / "bench_device.py").write_text("")
    assert ab.main(["--out", str(tmp_path / "o"), "--old", str(tree), "--new", str(tree)]) == 1
    assert "has no cachegen_cli/kernels: pass --link" in capsys.readouterr().err
    ab.link_kernels(tree)
    assert (tree / "cachegen_cli" / "kernels").resolve() == (tree / "kernels").resolve()
    assert ab.main(["--out", str(tmp_path / "o"), "--old", str(tree), "--new", str(tree)]) == 1
    assert "has no sample_data/" in capsys.readouterr().err
    ab.link_sample(tree, [tmp_path / "elsewhere", ROOT])
    assert (tree / "sample_data").resolve() == (ROOT / "sample_data").resolve()


def test_each_side_gets_its_own_switches(tmp_path, capsys):
    """--old-env / --new-env: NAME=VALUE set for one side's runs (a switch against its default on
    one tree), PYTHONPATH the tree; a malformed assignment is refused before any run."""
    ab = _ab()
    env = ab.run_env({"HOME": "/h", "CACHEGEN_PRODUCT_LEVELS": "0"}, ROOT, "CACHEGEN_PRODUCT_LEVELS=1 X=a=b")
    assert env == {"HOME": "/h", "CACHEGEN_PRODUCT_LEVELS": "1", "X": "a=b", "PYTHONPATH": str(ROOT)}
    assert ab.run_env({}, ROOT, "") == {"PYTHONPATH": str(ROOT)}
    assert ab.main(["--out", str(tmp_path), "--old", str(ROOT), "--new", str(ROOT), "--new-env", "NOVALUE"]) == 1
    assert "not NAME=VALUE: 'NOVALUE'" in capsys.readouterr().err
