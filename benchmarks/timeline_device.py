"""Where a GPU-resident encode / decode spends its wall time: every kernel and copy of a few calls
recorded by torch.profiler (CUPTI sees the numba kernels too), reported as the wall time per
call, the time the GPU was busy (union of its activity intervals), the idle rest (the host:
Python, launches, synchronisations) and the kernels that take the most device time.

    python benchmarks/timeline_device.py --tokens 8192 --methods balanced,high --calls 3 --json out.json

The cache is bench.py's Llama-3.1-8B-shaped one (as bench_device.py); a warm-up call of each
direction (compilation) runs before the profiled calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache  # noqa: E402
from bench_device import METHODS, method_options  # noqa: E402

import cachegen_cli as cg  # noqa: E402


def _device_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device-side activity (kernels, copies, memsets)."""
    out = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            start = ev.time_range.start
            end = ev.time_range.end
            out.append((ev.name, float(start), float(end)))
    return out


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def profile_calls(fn, calls: int) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / calls
    evs = _device_events(prof)
    per: dict[str, list[float]] = {}
    for name, s, e in evs:
        per.setdefault(name, []).append(e - s)
    top = sorted(((sum(v) / calls / 1000.0, len(v) // calls, name) for name, v in per.items()), reverse=True)
    busy = _busy([(s, e) for _, s, e in evs]) / calls / 1000.0
    return {
        "wall_ms": wall * 1000.0,
        "gpu_busy_ms": busy,
        "idle_ms": wall * 1000.0 - busy,
        "activities_per_call": len(evs) // calls,
        "top": [{"ms": round(ms, 3), "count": n, "name": name[:90]} for ms, n, name in top[:14]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--methods", default="lossless,high,balanced,small")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    x = build_cache(args.tokens).cuda()
    gb = x.numel() * x.element_size() / 1e9
    rows = {}
    for name in args.methods.split(","):
        opts = method_options(name, x)
        blob = cg.encode_to_device(x, **opts)
        dec_opts = {k: v for k, v in opts.items() if k == "calibration"}
        enc = profile_calls(lambda: cg.encode_to_device(x, **opts), args.calls)
        dec = profile_calls(lambda: cg.decode(blob, device="cuda", **dec_opts), args.calls)
        rows[name] = {"encode": enc, "decode": dec}
        for d, r in (("encode", enc), ("decode", dec)):
            print(f"{name} {d}: wall {r['wall_ms']:.2f} ms ({gb / r['wall_ms'] * 1e3:.1f} GB/s), GPU busy "
                  f"{r['gpu_busy_ms']:.2f} ms, idle {r['idle_ms']:.2f} ms, {r['activities_per_call']} activities")
            for t in r["top"]:
                print(f"    {t['ms']:7.3f} ms x{t['count']:<3d} {t['name']}")
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "gb": gb, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
