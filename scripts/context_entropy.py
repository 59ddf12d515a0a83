#!/usr/bin/env python3
"""Would a context in the level symbols' model pay (issue "Smaller at the same quality on every
cache", item 3: entropy coding that uses context where it pays)?  Version 2 files code each
(layer, K/V, channel)'s symbols -- its levels, or their token deltas -- with one static table
for the whole file, stored in the header.  A context model would keep one table per (channel,
context class); this counts, for each cache, what the symbols cost under each model: the
empirical entropy (a static code's floor) plus the tables as cachegen stores them (3 bytes and a
4-bit code per symbol of the table's range), for

- one table per channel (today's model),
- per channel and class of the same channel's previous symbol value (|v| = 0, 1, >= 2; the
  chunk's first token: class 0),
- per channel and class of the previous channel's value at the same token,
- per channel and both (9 classes).

The caches are scripts/preset_targets.py's (SmolLM2-135M-Instruct; seven texts at each context),
coded as ``--quality`` with its steps times ``--step-scale`` (no calibration), 256-token chunks.
The entropies do not depend on the machine.

    python scripts/context_entropy.py --contexts 1024,4096 --step-scale 2 --json docs/results/DATE_context_entropy.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import replace

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit  # noqa: E402

from cachegen_cli.methods import transform as transform_methods  # noqa: E402
from cachegen_cli.methods.config import QUALITY_PRESETS  # noqa: E402
from cachegen_cli.model import capture  # noqa: E402
from cachegen_cli.storage.kvio import KVCache, TensorSource  # noqa: E402
import preset_targets  # noqa: E402
import rope_gain  # noqa: E402

CHUNK_TOKENS = 256
#: classes of a neighbour's value: |v| = 0, 1, ..., CLASSES - 1 or more
CLASSES = 3
#: the models compared: (label, first context slot, slots)
MODELS = (("per channel", 0, 1), ("+ previous token", 1, CLASSES), ("+ previous channel", 1 + CLASSES, CLASSES),
          ("+ both", 1 + 2 * CLASSES, CLASSES * CLASSES))
SLOTS = 1 + 2 * CLASSES + CLASSES * CLASSES


@njit(cache=False)
def _value(q, modes, l, kv, t, c, ct):
    """The value a symbol codes: the level, or its delta from the token before within the chunk."""
    v = np.int64(q[l, kv, t, c])
    if modes[l, kv, c] == 1 and t % ct != 0:
        v -= q[l, kv, t - 1, c]
    return v


@njit(cache=False)
def tally(q, modes, lo, sink, ct, out):
    """out[l, kv, c, slot, symbol] += 1 for every coded symbol (tokens from ``sink`` on): slot 0
    alone, 1 + a for the previous token's class a (0 at a chunk's first token), 1 + CLASSES + b
    for the previous channel's class b (0 for channel 0), 1 + 2 CLASSES + a CLASSES + b for both."""
    L, _, T, C = q.shape
    for l in range(L):
        for kv in range(2):
            for t in range(sink, T):
                first = t % ct == 0
                for c in range(C):
                    s = _value(q, modes, l, kv, t, c, ct) - lo[l, kv, c]
                    a = 0
                    if t > sink and not first:
                        a = min(abs(_value(q, modes, l, kv, t - 1, c, ct)), CLASSES - 1)
                    b = 0
                    if c > 0:
                        b = min(abs(_value(q, modes, l, kv, t, c - 1, ct)), CLASSES - 1)
                    out[l, kv, c, 0, s] += 1
                    out[l, kv, c, 1 + a, s] += 1
                    out[l, kv, c, 1 + CLASSES + b, s] += 1
                    out[l, kv, c, 1 + 2 * CLASSES + a * CLASSES + b, s] += 1


def static_bits(counts: np.ndarray) -> tuple[float, float]:
    """(the empirical entropy in bits of every table's symbols, summed; the tables' cost in bits
    as cachegen stores a table: 3 bytes and a 4-bit code per symbol of its used range) of
    ``counts`` [..., symbols], one table per row; unused rows cost nothing."""
    n = counts.sum(-1, keepdims=True)
    p = np.where(counts > 0, counts / np.maximum(n, 1), 1.0)
    entropy = float(-(counts * np.log2(p)).sum())
    used = counts > 0
    idx = np.arange(counts.shape[-1])
    lo = np.where(used, idx, counts.shape[-1]).min(-1)
    hi = np.where(used, idx, -1).max(-1)
    width = np.where(hi >= lo, hi - lo + 1, 0)
    return entropy, float(np.where(width > 0, 24 + 4 * width, 0).sum())


def measure(ref, cfg) -> dict:
    """One cache's bits per value under each model (entropy alone and with the tables)."""
    L, _, T, C = ref.cache.shape
    cache = KVCache(data=ref.cache.to(torch.bfloat16), layout="stacked", num_kv_heads=ref.num_kv_heads,
                    head_dim=ref.head_dim)
    enc = transform_methods._SlabEncoder(TensorSource(cache), cfg, CHUNK_TOKENS, None, [(0, T)])
    q, _ = enc._levels(0, T)
    p = enc.header.params
    out = np.zeros((L, 2, C, SLOTS, int(p.alphabet.max()) + 1), np.int64)
    tally(q, p.modes.astype(np.int64), p.lo.astype(np.int64), enc.header.sink_tokens, CHUNK_TOKENS, out)
    n = L * 2 * T * C
    row = {}
    for label, first, slots in MODELS:
        entropy, tables = static_bits(out[:, :, :, first:first + slots])
        row[label] = dict(entropy=entropy / n, tables=tables / n)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--quality", default="balanced")
    ap.add_argument("--step-scale", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = capture.load_model(capture.find_default_model())
    refs = rope_gain.references(model, tok, [int(c) for c in args.contexts.split(",")], preset_targets.CONTINUATION,
                                preset_targets.texts())
    base = QUALITY_PRESETS[args.quality]
    cfg = replace(base, key_step=tuple(args.step_scale * v for v in base.key_step),
                  value_step=tuple(args.step_scale * v for v in base.value_step))
    info = rope_gain.run_info("context_entropy.py")
    print(f"Generated by `{info['command']}` at commit {info['commit']}, {info['date']}.\n")
    print("Bits per value: entropy + tables (entropy alone), and against one table per channel.\n")
    print("| cache | " + " | ".join(label for label, _, _ in MODELS) + " |")
    print("|---|" + "---:|" * len(MODELS))
    rows = []
    for (name, ctx), ref in sorted(refs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = dict(text=name, context=ctx, **measure(ref, cfg))
        rows.append(row)
        base_bits = row["per channel"]["entropy"] + row["per channel"]["tables"]
        cells = []
        for label, _, _ in MODELS:
            m = row[label]
            total = m["entropy"] + m["tables"]
            cells.append(f"{total:.3f} ({m['entropy']:.3f}){'' if label == 'per channel' else f', {total / base_bits - 1:+.1%}'}")
        print(f"| {name} {ctx} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
