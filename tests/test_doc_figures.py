"""The figures the README and docs/benchmarks.md quote agree with the committed raw results
they name (docs/results/*.json): no GPU, no model, only the JSON files and the pages."""

from __future__ import annotations

import glob
import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _report():
    return load_script("benchmarks/report.py", "bench_report_under_test")


def _paragraph(start: str) -> str:
    """The README paragraph that begins with ``start``, as one line."""
    i = README.index(start)
    j = README.find("\n\n", i)
    return " ".join(README[i:j].split())


def _load(pattern: str) -> list[dict]:
    paths = sorted(glob.glob(str(ROOT / pattern)))
    assert paths, f"the README names {pattern}, which matches no committed file"
    return [json.loads(Path(p).read_text()) for p in paths]


def _int(x: float) -> str:
    return f"{x:.0f}"


def _span(xs) -> str:
    lo, hi = _int(min(xs)), _int(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


SPEED = _paragraph("Speed ([docs/benchmarks.md]")


def test_benchmarks_page_current_section_is_what_its_results_render():
    report = _report()
    page = report.PAGE.read_text(encoding="utf-8")
    assert report.BEGIN in page and report.END in page
    section = page[page.index(report.BEGIN):page.index(report.END)]
    m = re.search(r"Rendered by `python benchmarks/report.py ([^`]+)`", section)
    assert m, "the current section does not say which results it was rendered from"
    files = [ROOT / f for f in shlex.split(m.group(1))]
    assert report.splice(page, report.render(files)) == page, (
        "docs/benchmarks.md's current section is stale: rerun the command it names")


def test_readme_gpu_figures_are_the_cited_device_runs():
    m = re.search(r"`(docs/results/[^`]*bench_device_[^`]*\*\.json)`", SPEED)
    assert m, "the README's speed paragraph does not name its device results"
    runs = _load(m.group(1))
    medians: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            s = medians.setdefault(row["method"], {"enc": [], "dec": []})
            s["enc"].append(row["encode_GBps"])
            s["dec"].append(row["decode_GBps"])
    quoted = dict((name, (enc, dec)) for name, enc, dec in re.findall(
        r"`(?:--quality |--preset )?([a-z]+)` (\d+(?:-\d+)?) / (\d+(?:-\d+)?)(?: GB/s)?[,.]? ", SPEED))
    assert set(quoted) == {"lossless", "balanced", "high", "small", "lmcache"}, quoted
    for name, (enc, dec) in quoted.items():
        assert (enc, dec) == (_span(medians[name]["enc"]), _span(medians[name]["dec"])), name
    commits = sorted({r["commit"][:7] for r in runs})
    lo, hi = re.search(r"commits? (\w+)(?:-(\w+))?", SPEED).groups()
    assert lo in commits and (hi or lo) in commits


def test_readme_calibrated_gpu_figures_are_the_cited_run():
    m = re.search(r"With a calibration[^`]*`(docs/results/[^`]*bench_device[^`]*\.json)`", SPEED)
    assert m
    (run,) = _load(m.group(1))
    rows = {r["method"]: r for r in run["rows"]}
    quoted = re.findall(r"`(balanced\+cal(?:/head)?)` ([\d.]+) / ([\d.]+) GB/s", SPEED)
    assert {q[0] for q in quoted} == {"balanced+cal", "balanced+cal/head"}
    for name, enc, dec in quoted:
        assert (enc, dec) == (f"{rows[name]['encode_GBps']:.1f}", f"{rows[name]['decode_GBps']:.1f}"), name


def test_readme_cpu_figures_are_the_cited_run():
    m = re.search(r"`(docs/results/[^`]*bench_all_cpu[^`]*\.json)`", SPEED)
    assert m
    (run,) = _load(m.group(1))
    one, every = {}, {}
    for meas in run["measurements"]:
        host = next(p for p in meas["paths"] if p["path"] == "host")
        (one if meas["threads"] == 1 else every)[meas["method"]] = host
    quality = ("lossless", "high", "balanced", "small")
    got = re.search(r"one core gives (\S+) MB/s encode and (\S+) MB/s decode for every `--quality` method "
                    r"\(`lmcache` (\d+) / (\d+)\), (\d+) threads ([\d.]+)-([\d.]+) GB/s\.", SPEED)
    assert got, "the README's CPU sentence changed shape: update this test with it"
    enc, dec, lm_e, lm_d, threads, lo, hi = got.groups()
    assert enc == _span([one[q]["encode"]["median_Bps"] / 1e6 for q in quality])
    assert dec == _span([one[q]["decode"]["median_Bps"] / 1e6 for q in quality])
    assert (lm_e, lm_d) == (_int(one["lmcache"]["encode"]["median_Bps"] / 1e6),
                            _int(one["lmcache"]["decode"]["median_Bps"] / 1e6))
    assert int(threads) == run["info"]["cpus_usable"]
    allq = [every[q][k]["median_Bps"] / 1e9 for q in quality for k in ("encode", "decode")]
    assert (lo, hi) == (f"{min(allq):.1f}", f"{max(allq):.1f}")


def test_readme_calibrated_cpu_figures_are_the_cited_run():
    got = re.search(r"Calibrated files \(the same 16-core Xeon,\s+`(docs/results/[^`]*bench_all_cpu[^`]*\.json)`, "
                    r"(\d+) tokens\): per head\s+\(`balanced\+cal/head`\) (\d+) / (\d+) MB/s per core, with a full "
                    r"rotation \(`balanced\+cal`\) (\d+) / (\d+)", SPEED)
    assert got, "the README's calibrated CPU sentence changed shape: update this test with it"
    path, tokens, head_e, head_d, full_e, full_d = got.groups()
    (run,) = _load(path)
    one = {m["method"]: next(p for p in m["paths"] if p["path"] == "host")
           for m in run["measurements"] if m["threads"] == 1}
    assert int(tokens) == next(m["tokens"] for m in run["measurements"] if m["method"] == "balanced+cal")
    for name, (e, d) in {"balanced+cal/head": (head_e, head_d), "balanced+cal": (full_e, full_d)}.items():
        assert (e, d) == (_int(one[name]["encode"]["median_Bps"] / 1e6), _int(one[name]["decode"]["median_Bps"] / 1e6))


def test_report_refuses_a_file_that_is_not_a_benchmark(tmp_path):
    report = _report()
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(report.ReportError):
        report.render([bad])
    assert report.main([str(bad), "--page", str(tmp_path / "p.md")]) == 1


def test_report_says_what_a_run_did_not_record(tmp_path):
    report = _report()
    run = {"commit": "a" * 40, "command": ["benchmarks/bench_device.py", "--tokens", "64"], "device": "GPU X",
           "copy_ceiling_Bps": 1e12,
           "rows": [{"method": "balanced", "bytes": 100, "file_bytes": 20, "ratio": 5.0, "encode_GBps": 50.0,
                     "encode_GBps_range": [40.0, 60.0], "decode_GBps": 70.0, "decode_GBps_range": [65.0, 75.0],
                     "identical_cpu_gpu_bytes": True, "identical_cpu_gpu_values": False}]}
    f = tmp_path / "2026-01-02_bench_device_aaaaaaa.json"
    f.write_text(json.dumps(run))
    text = report.render([f])
    assert "2026-01-02 (file name; the run did not record its date)" in text
    assert "| not recorded |" in text  # host and versions
    assert "50.0 (40.0-60.0)" in text and "70.0 (65.0-75.0)" in text
    assert "yes / NO" in text
    page = tmp_path / "p.md"
    page.write_text("# T\n\nold text\n")
    assert report.main([str(f), "--page", str(page)]) == 0
    assert report.main([str(f), "--page", str(page), "--check"]) == 0
    assert page.read_text().endswith("old text\n")
    run["rows"][0]["encode_GBps"] = 51.0
    f.write_text(json.dumps(run))
    assert report.main([str(f), "--page", str(page), "--check"]) == 1  # stale


#: README row label -> quality_report.py method key.
QUALITY_ROWS = {
    "LMCache CacheGen (its own output)": "lmcache",
    "`--preset lmcache` (LMCache's quantization, our container)": "preset:lmcache",
    "int4 per-token abs-max, no entropy coding": "int4",
    "`--quality lossless` (bit-exact)": "quality:lossless",
    "`--quality high`": "quality:high",
    "`--quality balanced` (default)": "quality:balanced",
    "`--quality small`": "quality:small",
    "`--quality small --calibration`": "quality:small+cal",
    "`--quality small --calibration` (calibrated `--sensitivity`)": "quality:small+cal+sens",
    "`cachegen tune --target-kl 0.03` on another text's cache, `--calibration`": "tuned+cal",
}


def _kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def test_readme_quality_table_is_the_cited_results_file():
    intro = _paragraph("Model-level quality on SmolLM2")
    m = re.search(r"`(docs/results/[^`]*_quality_[^`]*\.json)`", intro)
    assert m, "the README's quality table does not name its results file"
    (results,) = _load(m.group(1))
    ctx = int(re.search(r"(\d+)-token contexts", intro).group(1))
    cases = [c for c in results["cases"].values() if c["context"] == ctx]
    assert len(cases) == 3
    assert results["info"]["git"]["commit"][:7] in intro  # the commit that made it is named
    table = README[README.index("| method | bits/value |", README.index("Model-level quality on SmolLM2")):]
    rows = [line for line in table.split("\n\n")[0].splitlines()[2:]]
    assert len(rows) == len(QUALITY_ROWS)
    for line in rows:
        label, bits, ratio, vs, kl, top1 = [c.strip() for c in line.strip("|").split("|")]
        key = QUALITY_ROWS[label]
        rs = [c["rows"][key] for c in cases]
        mean = lambda f: sum(r[f] for r in rs) / len(rs)  # noqa: E731
        b = mean("bits_per_value")
        rel = sum(c["rows"][key]["bits_per_value"] / c["rows"]["lmcache"]["bits_per_value"] for c in cases) / 3
        assert (bits, ratio, vs, kl, top1) == (f"{b:.2f}", f"{16 / b:.2f}×", f"{rel:.3f}", _kl(mean("kl_mean")),
                                               f"{mean('top1_agreement'):.3f}"), label


def test_readme_long_context_paragraph_is_the_cited_full_run():
    para = _paragraph("At 4096 tokens (the full page")
    m = re.search(r"`(docs/results/[^`]*_quality_[^`]*\.json)`; means", para)
    assert m
    (results,) = _load(m.group(1))
    assert results["info"]["git"]["commit"][:7] in para
    by_ctx = {n: [c for c in results["cases"].values() if c["context"] == n] for n in (1024, 4096)}
    assert all(len(v) == 3 for v in by_ctx.values())
    long = by_ctx[4096]

    def mean(key, field, cases=long):
        return sum(c["rows"][key][field] for c in cases) / len(cases)

    def vs(c, key):
        return c["rows"][key]["bits_per_value"] / c["rows"]["lmcache"]["bits_per_value"]

    got = re.search(r"LMCache (\S+) bits/value at KL (\S+)\): `--quality high` (\S+)× at KL (\S+), top-1 (\S+); "
                    r"`--quality small --calibration` with sensitivities (\S+)× LMCache's size at KL (\S+); "
                    r"the tuned row (\S+)× at KL (\S+)\.", para)
    assert got, "the 4096-token sentence changed shape: update this test with it"
    sens, tuned = "quality:small+cal+sens", "tuned+cal"
    assert got.groups() == (
        f"{mean('lmcache', 'bits_per_value'):.2f}", f"{mean('lmcache', 'kl_mean'):.1e}",
        f"{16 / mean('quality:high', 'bits_per_value'):.2f}", f"{mean('quality:high', 'kl_mean'):.1e}",
        f"{mean('quality:high', 'top1_agreement'):.3f}",
        f"{sum(vs(c, sens) for c in long) / 3:.3f}", f"{mean(sens, 'kl_mean'):.1e}",
        f"{sum(vs(c, tuned) for c in long) / 3:.3f}", f"{mean(tuned, 'kl_mean'):.1e}")
    every = by_ctx[1024] + long
    # the bar: at most 0.4x LMCache's size at a KL at or below LMCache's, per cache
    meets = lambda c, k: vs(c, k) <= 0.4 and c["rows"][k]["kl_mean"] <= c["rows"]["lmcache"]["kl_mean"]  # noqa: E731
    met = [c for c in every if meets(c, tuned)]
    missed = [c for c in every if not meets(c, tuned)]
    assert re.search(r"on five of the six caches: the tuned row", para) and (len(met), len(missed)) == (5, 1)
    lo, hi = re.search(r"meets it on five \((\S+)–(\S+)×\)", para).groups()
    assert (lo, hi) == (f"{min(vs(c, tuned) for c in met):.3f}", f"{max(vs(c, tuned) for c in met):.3f}")
    (miss,) = missed
    kl_ratio = miss["rows"][tuned]["kl_mean"] / miss["rows"]["lmcache"]["kl_mean"]
    assert kl_ratio <= 1.0 and vs(miss, tuned) > 0.4  # it misses on size alone
    assert (f"({miss['text']}, {miss['context']} tokens) it is below LMCache's KL ({kl_ratio:.2f}×) at "
            f"{vs(miss, tuned):.3f}× its size") in para
    sens_long = [c for c in long if meets(c, sens)]
    assert len(sens_long) == 1 and "meets it on one of the 4096-token caches" in para
    lo, hi = re.search(r"caches \((\S+)–(\S+)× there\)", para).groups()
    assert (lo, hi) == (f"{min(vs(c, sens) for c in long):.3f}", f"{max(vs(c, sens) for c in long):.3f}")
    short = by_ctx[1024]
    assert all(c["rows"][sens]["kl_mean"] <= 0.5 * c["rows"]["lmcache"]["kl_mean"] for c in short)
    lo, hi = re.search(r"at 1024 tokens \((\S+)–(\S+)×\)", para).groups()
    assert (lo, hi) == (f"{min(vs(c, sens) for c in short):.3f}", f"{max(vs(c, sens) for c in short):.3f}")
