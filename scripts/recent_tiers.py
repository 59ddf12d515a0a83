#!/usr/bin/env python3
"""Would a graded recent-token refinement pay (issue "Smaller at the same quality on every cache",
item 3: better use of the bits)?  Today's files refine one span: the last ``recent_tokens`` (64)
tokens get ``recent_bits`` (2) more bits a value.  The model's sensitivity falls off smoothly with
a token's distance from the end of the context (scripts/recency.py: the last 64 of 1024 tokens
hold 40-74% of it), so tiers -- the nearest tokens more bits, farther ones fewer -- with a coarser
step for the rest might reach the same KL in fewer bits.  This measures it before any format
change: the format has one span, but a token's refinement depends only on its own values and its
base level (the same at any recent_tokens / recent_bits: the steps, token deltas and tables
come from the base levels), so a tiered file decodes to exactly the splice of one-span files'
decodes, token by token, and its size is the one-span-free file's plus each refined value's raw
bits (the refinement is stored packed, uncoded; docs/format.md).  ``--check`` compares that
accounting with real one-span files.

For each cache of scripts/preset_targets.py's seven texts (the page's three chose the presets'
constants; the four of scripts/rope_gain.py are held out) at each context, each schedule (tiers
of "distance:bits", a token at distance d from the end taking the bits of the first tier with d
<= distance, beyond the last none) and each scale of ``--quality``'s steps, with a calibration
fitted leave one out on the other texts' 1024-token caches and their sensitivities (calibrate's
default kind with ``--sensitivity``, as preset_targets.py's "cal+sens"): bits per value, the
model's KL and top-1 over the next 128 tokens, and LMCache's KL and exact size on the same cache.

    python scripts/recent_tiers.py --contexts 1024,4096 --threads 2 --json docs/results/DATE_recent_tiers.json
    python scripts/recent_tiers.py --report docs/results/DATE_recent_tiers.json
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
from cachegen_cli.methods.config import QUALITY_PRESETS  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402
import preset_targets  # noqa: E402
import rope_gain  # noqa: E402

CHUNK_TOKENS = preset_targets.CHUNK_TOKENS
#: today's span, and tiered schedules ("distance:bits,..."), nearest first
DEFAULT_SCHEDULES = "64:2;16:3,64:2;16:3,64:2,256:1;8:4,32:3,128:2,512:1;32:3,128:2,512:1;16:4,64:3,256:2,1024:1"


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """"16:3,64:2" -> [(16, 3), (64, 2)]: distances increasing, bits decreasing."""
    tiers = [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part]
    if any(d2 <= d1 or b2 > b1 for (d1, b1), (d2, b2) in zip(tiers, tiers[1:])):
        raise SystemExit(f"schedule {text!r}: distances must increase and bits not grow")
    return tiers


def token_bits(tiers: list[tuple[int, int]], T: int, sink: int) -> list[int]:
    """The refinement bits of each token 0..T-1 (distance T - t from the end; sink tokens none)."""
    out = []
    for t in range(T):
        d = T - t
        out.append(0 if t < sink else next((b for dist, b in tiers if d <= dist), 0))
    return out


def tiered(kv, cfg, cal, tiers, sink: int) -> tuple[torch.Tensor, float, int]:
    """(the decoded cache in evaluate's layout, its bits, the bytes of the refinement-free file)
    of ``cfg`` with ``tiers``: the splice of one-span files (see the module docstring)."""
    L, _, T, H, D = kv.shape
    bits = token_bits(tiers, T, sink)
    base = cg.encode(kv, quantization=replace(cfg, recent_bits=0), calibration=cal, chunk_tokens=CHUNK_TOKENS,
                     device="cpu")
    out = evaluate.tensors_to_internal(cg.decode(base, device="cpu", calibration=cal)).clone()
    for b in sorted({b for b in bits if b}):
        toks = [t for t in range(T) if bits[t] == b]
        span = T - toks[0]
        blob = cg.encode(kv, quantization=replace(cfg, recent_tokens=span, recent_bits=b), calibration=cal,
                         chunk_tokens=CHUNK_TOKENS, device="cpu")
        dec = evaluate.tensors_to_internal(cg.decode(blob, device="cpu", calibration=cal))
        idx = torch.tensor(toks)
        out[:, :, idx] = dec[:, :, idx]
    total = 8 * len(base) + sum(bits) * L * 2 * H * D
    return out, total, len(base)


def check(kv, cfg, cal, sink: int, log) -> None:
    """The accounting against real one-span files: bits of a 64 x 2 file and a 256 x 1 file."""
    L, _, T, H, D = kv.shape
    for span, b in ((64, 2), (256, 1)):
        real = cg.encode(kv, quantization=replace(cfg, recent_tokens=span, recent_bits=b), calibration=cal,
                         chunk_tokens=CHUNK_TOKENS, device="cpu")
        dec, total, _ = tiered(kv, cfg, cal, [(span, b)], sink)
        same = torch.equal(dec, evaluate.tensors_to_internal(cg.decode(real, device="cpu", calibration=cal)))
        log(f"# check {span} x {b}: file {8 * len(real)} bits, accounted {total} ({8 * len(real) / total - 1:+.4%}), "
            f"same decode: {same}")


def measure(contexts, quality, schedules, scales, log, do_check: bool) -> list[dict]:
    model, tok = capture.load_model(capture.find_default_model())
    refs = rope_gain.references(model, tok, sorted(set(contexts) | {1024}), preset_targets.CONTINUATION,
                                preset_targets.texts())
    cals = preset_targets._calibrations(model, refs, True, log)
    rows = []
    for (name, ctx), ref in refs.items():
        if ctx not in contexts:
            continue
        L, _, T, C = ref.cache.shape
        kv = ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim)
        cal = cals[name]["cal+sens"]
        t0 = time.perf_counter()
        lm = preset_targets.lmcache_scores(ref, kv)
        log(f"# {name} {ctx} LMCache {lm['lmcache_bits_per_value']:.3f} bits KL {lm['lmcache_kl']:.2e} "
            f"({time.perf_counter() - t0:.0f} s)")
        base = QUALITY_PRESETS[quality]
        if do_check:
            check(kv, base, cal, base.sink_tokens, log)
        for sched in schedules:
            tiers = parse_schedule(sched)
            for scale in scales:
                t0 = time.perf_counter()
                cfg = replace(base, key_step=tuple(scale * v for v in base.key_step),
                              value_step=tuple(scale * v for v in base.value_step))
                data, total, _ = tiered(kv, cfg, cal, tiers, base.sink_tokens)
                s = evaluate.score(ref, data)
                row = dict(text=name, context=ctx, quality=quality, variant="cal+sens", schedule=sched,
                           step_scale=scale, bits_per_value=total / ref.cache.numel(), kl=s["kl_mean"],
                           top1=s["top1_agreement"], seconds=time.perf_counter() - t0, **lm)
                rows.append(row)
                log(f"# {name} {ctx} [{sched}] x{scale:g}: {row['bits_per_value']:.3f} bits "
                    f"({row['bits_per_value'] / lm['lmcache_bits_per_value']:.3f} of LMCache) KL {row['kl']:.2e} "
                    f"({row['kl'] / lm['lmcache_kl']:.2f} of LMCache) top1 {row['top1']:.3f}")
    return rows


def _interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """The piecewise-linear value at x of points (x, y), or None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def equal_bits(rows: list[dict], reference: str = "64:2") -> list[tuple[str, int, float, float, float]]:
    """Per schedule other than ``reference``: (schedule, points, geometric mean, smallest, largest)
    of its KL over the reference's KL at the same bits on the same cache, each reference row
    against the schedule's log KL interpolated over its step scales (rows outside the bits the
    schedule's scales span are left out)."""
    curves: dict = {}
    for r in rows:
        curves.setdefault((r["text"], r["context"], r["schedule"]), []).append((r["bits_per_value"], math.log(r["kl"])))
    out = []
    for sched in dict.fromkeys(r["schedule"] for r in rows):
        if sched == reference:
            continue
        ratios = []
        for (text, ctx, s), ref_points in curves.items():
            if s != reference or (text, ctx, sched) not in curves:
                continue
            for bits, log_kl in ref_points:
                v = _interpolate(curves[(text, ctx, sched)], bits)
                if v is not None:
                    ratios.append(math.exp(v - log_kl))
        if ratios:
            out.append((sched, len(ratios), math.exp(sum(map(math.log, ratios)) / len(ratios)), min(ratios),
                        max(ratios)))
    return out


def report(rows: list[dict], factor: float, reference: str = "64:2") -> None:
    """Per (schedule, scale): the page caches' mean bits and worst KL / LMCache KL; the rule fixed
    before the held-out rows are read (preset_targets.py's: the smallest page mean bits with every
    page cache at KL <= factor x LMCache's) and the chosen table's every cache; and the tables
    meeting the issue's bar on every cache."""
    tables: dict = {}
    for r in rows:
        tables.setdefault((r["schedule"], r["step_scale"]), []).append(r)
    print("| schedule | scale | page mean bits | page max KL/LM | all: max KL/LM | all: size/LM | eligible |")
    print("|---|---:|---:|---:|---:|---:|---|")
    eligible = []
    for (sched, sc), rs in tables.items():
        _, bits, worst = preset_targets.page_standing(rs, all_without_page=True)
        ok = worst <= factor
        if ok:
            eligible.append((bits, (sched, sc)))
        print(f"| {sched} | {sc:g} | {bits:.3f} | {worst:.2f} | {max(r['kl'] / r['lmcache_kl'] for r in rs):.2f} | "
              f"{min(r['bits_per_value'] / r['lmcache_bits_per_value'] for r in rs):.3f}-"
              f"{max(r['bits_per_value'] / r['lmcache_bits_per_value'] for r in rs):.3f} | {'yes' if ok else 'no'} |")
    if eligible:
        bits, key = min(eligible)
        print(f"\nChosen by the rule (page caches at KL <= {factor:g} x LMCache's, smallest page mean): "
              f"[{key[0]}] steps x {key[1]:g}\n")
        print("| text | context | set | bits/value | size / LMCache | KL | KL / LMCache KL | top-1 |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        for r in tables[key]:
            print(f"| {r['text']} | {r['context']} | {'page' if preset_targets._is_page(r) else 'held-out'} | "
                  f"{r['bits_per_value']:.3f} | {r['bits_per_value'] / r['lmcache_bits_per_value']:.3f} | {r['kl']:.2e} | "
                  f"{r['kl'] / r['lmcache_kl']:.2f} | {r['top1']:.3f} |")
    bar = [k for k, rs in tables.items() if preset_targets.meets_bar(rs)]
    print(f"\nKL against {reference} at the same bits on the same cache (log KL interpolated over each "
          "schedule's step scales):\n")
    print("| schedule | points | geometric mean | range |")
    print("|---|---:|---:|---|")
    for sched, n, g, lo, hi in equal_bits(rows, reference):
        print(f"| {sched} | {n} | {g:.2f} | {lo:.2f}-{hi:.2f} |")
    print(f"\nTables meeting KL <= LMCache's, >= 10x smaller than bf16 and <= 0.35x LMCache's size on every cache: "
          f"{', '.join(f'[{s}] x{sc:g}' for s, sc in bar) or 'none'}.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--quality", default="balanced")
    ap.add_argument("--schedules", default=DEFAULT_SCHEDULES, help="';'-separated schedules of distance:bits tiers")
    ap.add_argument("--step-scales", default="2,2.5,3")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--check", action="store_true", help="also compare the accounting with real one-span files")
    ap.add_argument("--choose-factor", type=float, default=0.7)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--report", type=pathlib.Path, nargs="+", default=None, metavar="RESULTS",
                    help="no measuring: the report of earlier results files' rows together")
    args = ap.parse_args()
    if args.report:
        rows = []
        for path in args.report:
            old = json.loads(path.read_text())
            print(f"Rows of `{old['info']['command']}` (commit {old['info']['commit']}, {old['info']['date']}).")
            rows += old["rows"]
        print()
        report(rows, args.choose_factor)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    rows = measure([int(c) for c in args.contexts.split(",")], args.quality, args.schedules.split(";"),
                   [float(x) for x in args.step_scales.split(",")], log, args.check)
    info = rope_gain.run_info("recent_tiers.py")
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"Generated by `{info['command']}` at commit {info['commit']}, {info['date']}, {info['threads']} threads.\n")
    report(rows, args.choose_factor)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
