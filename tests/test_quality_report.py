"""scripts/quality_report.py's bookkeeping (no model run): what the fingerprints cover, that
--resume keeps only rows the current code would make again, and that the page's header names
the one command, commit, mode and results file that produced it."""

from __future__ import annotations

import json

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def qr():
    pytest.importorskip("transformers")  # the script imports the eval modules
    return load_script("scripts/quality_report.py", "quality_report_under_test")


def test_sources_cover_package_kernels_and_script_once(qr):
    names = [n for n, _ in qr.source_files()]
    assert len(names) == len(set(names))  # the cachegen_cli/kernels symlink is not walked twice
    for must in ("cachegen_cli/api.py", "cachegen_cli/pipeline/codec.py", "cachegen_cli/model/evaluate.py",
                 "kernels/range_coder.py", "kernels/cpu_transform.py", "scripts/quality_report.py",
                 "benchmarks/lmcache_reference.py"):
        assert must in names, must
    assert not any(n.startswith("cachegen_cli/kernels/") for n in names)


def test_file_digest_sees_edits_renames_and_additions(qr, tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    base = qr._sha256_files([("a.py", a), ("b.py", b)])
    assert qr._sha256_files([("b.py", b), ("a.py", a)]) == base  # order of discovery does not matter
    a.write_text("x = 2\n")
    assert qr._sha256_files([("a.py", a), ("b.py", b)]) != base
    a.write_text("x = 1\n")
    assert qr._sha256_files([("c.py", a), ("b.py", b)]) != base  # renamed
    assert qr._sha256_files([("a.py", a)]) != base  # removed


def _case_fp(qr, **over):
    kw = {"code": "c0de", "env": {"versions": "torch 1", "torch_threads": 1, "model_sha256": "m"},
          "text_shas": {"prose": "p", "code": "k"}, "context": 1024}
    kw.update(over)
    return qr.case_fingerprint(kw["code"], kw["env"], kw["text_shas"], kw["context"])


def test_case_fingerprint_depends_on_what_decides_the_numbers(qr):
    base = _case_fp(qr)
    assert _case_fp(qr) == base
    env = {"versions": "torch 1", "torch_threads": 1, "model_sha256": "m"}
    assert _case_fp(qr, code="other") != base
    assert _case_fp(qr, env={**env, "torch_threads": 2}) != base  # float sums in another order
    assert _case_fp(qr, env={**env, "versions": "torch 2"}) != base
    assert _case_fp(qr, env={**env, "model_sha256": "n"}) != base
    assert _case_fp(qr, text_shas={"prose": "p", "code": "k2"}) != base  # the other texts feed calibrations
    assert _case_fp(qr, context=4096) != base


def test_row_fingerprints_differ_per_method(qr):
    fps = [qr.row_fingerprint("case", m) for m in qr.methods()]
    assert len(set(fps)) == len(fps)


def test_resume_keeps_only_rows_with_the_current_fingerprint(qr):
    ms = qr.methods()
    fp = _case_fp(qr)
    row_fps = {m["key"]: qr.row_fingerprint(fp, m) for m in ms}
    rows = {k: {"method": k, "fingerprint": f} for k, f in row_fps.items()}
    rows["int4"]["fingerprint"] = "made by older code"
    del rows["bf16"]["fingerprint"]  # a row saved before rows carried fingerprints
    old = {"fingerprint": fp, "rows": rows}
    kept = qr.reusable(old, fp, row_fps)
    assert set(kept) == set(row_fps) - {"int4", "bf16"}
    assert qr.reusable({**old, "fingerprint": _case_fp(qr, code="other")}, fp, row_fps) == {}
    assert qr.reusable({"rows": rows}, fp, row_fps) == {}  # a case without a fingerprint: nothing kept
    assert qr.reusable(None, fp, row_fps) == {}


def _row(key: str, i: int) -> dict:
    bits = 16.0 if key == "bf16" else 1.0 + (i % 9) * 0.5
    r = {"method": key, "bits_per_value": bits, "ratio": 16 / bits, "ppl_ratio": 1.0 + i / 1000,
         "kl_mean": 0.0 if key == "bf16" else 0.001 * (i + 1), "kl_max": 0.01 * (i + 1), "top1_agreement": 0.9,
         "greedy_agreement": 0.5, "greedy_prefix_agreement": 0.25, "cache_rel_mse": 0.01, "fingerprint": "f"}
    if key not in ("bf16", "int8", "int4", "lmcache"):
        r.update(sha256=f"{i:064x}", side_fraction=0.01, bytes=1000 + i)
    if key == "lmcache":
        r["bits_per_value"] = 4.6
    if key == "quality:lossless":
        r["bit_exact"] = True
    if key.startswith("tuned") or key.startswith("selftuned"):
        r.update(tuned_on="code", tuned_achieved=0.03, tuned_target=0.03)
    return r


def _results(qr, dirty: bool) -> dict:
    texts = ["prose", "code", "docs"]
    cases = {}
    for t in texts:
        cases[f"{t}|1024"] = {"text": t, "context": 1024, "text_tokens": 9000, "reference_seconds": 60.0,
                              "prefill_seconds": 20.0, "ppl_original": 7.0, "fingerprint": "c",
                              "float32_vs_bf16": {"kl_mean": 1e-4, "top1_agreement": 0.99, "ppl_ratio": 1.0,
                                                  "greedy_agreement": 1.0},
                              "rows": {m["key"]: _row(m["key"], i) for i, m in enumerate(qr.methods())}}
    info = {"command": "python scripts/quality_report.py --threads 1 --mode short", "date": "2026-12-02 01:00 UTC",
            "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": dirty},
            "code_fingerprint": "ab" * 32, "results_file": "docs/results/2026-12-02_quality_0123456.json",
            "machine": "test machine", "versions": "torch 0", "torch_threads": 1, "model": "m.gguf",
            "model_sha256": "cd" * 32, "contexts": [1024], "wall_seconds": 600.0, "kept_rows": {},
            "texts": {t: {"kind": t, "source": t, "sha256": "ef" * 32, "tokens": 9000} for t in texts}}
    return {"info": info, "cases": cases}


def test_page_header_names_one_command_commit_mode_and_results(qr, tmp_path):
    pytest.importorskip("matplotlib")
    results = _results(qr, dirty=False)
    out = tmp_path / "quality.md"
    qr.write_page(results, results["info"], out, out.with_suffix(".png"))
    head = out.read_text().split("## What is measured")[0]
    assert "`python scripts/quality_report.py --threads 1 --mode short`" in head
    assert "at commit `0123456789abcdef0123456789abcdef01234567`, clean tree" in head
    assert "Mode: `short` (1024-token contexts only" in head
    assert "`docs/results/2026-12-02_quality_0123456.json`" in head
    assert "then" not in head and "--resume" not in head  # one run, nothing kept from another
    assert out.with_suffix(".png").stat().st_size > 0


def test_dirty_tree_and_kept_rows_are_said(qr, tmp_path):
    pytest.importorskip("matplotlib")
    results = _results(qr, dirty=True)
    results["info"].update(kept_rows={"prose|1024": 5}, resumed_from="docs/results/old.json")
    out = tmp_path / "quality.md"
    qr.write_page(results, results["info"], out, out.with_suffix(".png"))
    head = out.read_text().split("## What is measured")[0]
    assert "**dirty**" in head
    assert "Rows kept by `--resume` from docs/results/old.json: 5 of" in head


def test_page_only_rerenders_from_the_results_file(qr, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_results(qr, dirty=False)))
    out = tmp_path / "page.md"
    assert qr.main(["--page-only", "--results", str(path), "--out", str(out)]) == 0
    head = out.read_text().split("## What is measured")[0]
    assert "re-rendered from those results by `python scripts/quality_report.py --page-only" in head
    assert "0123456789abcdef" in head


def test_custom_contexts_are_not_called_a_documented_mode(qr):
    info = {"contexts": [128], "texts": {"prose": {}}}
    assert qr.mode_description(info).startswith("custom")
    assert qr.mode_description({"contexts": [4096, 1024], "texts": dict.fromkeys(["prose", "code", "docs"])}
                               ).startswith("`full`")
