"""Where a GPU-resident call's host time goes, without a profiler's overhead: wall-clock
timestamps (time.perf_counter) at each stage mark of the device pipelines (the STAGE_HOOK of
pipeline/transform_resident and pipeline/lmcache_device) and around the functions that run
before the first mark (reading the header, the version checks), medians over the calls.

A stage's host time is what the host spent from the previous mark to this one: launching the
stage's kernels, or waiting where the stage synchronises ("(sync)" in its name).  The GPU runs
dry while the host works before the first long kernel is queued and after the last wait, so
the host time before the first mark plus the host time of the stages before the first long
kernel is what a call loses to Python (benchmarks/timeline_device.py gives the GPU's side).

    python benchmarks/host_stages.py --tokens 8192 --methods balanced,balanced+cal/head --calls 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache  # noqa: E402
from bench_device import method_options  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli import api  # noqa: E402
from cachegen_cli.pipeline import lmcache_device, transform_resident  # noqa: E402

_EVENTS: list[tuple[str, float]] = []


def _hook(name: str) -> None:
    _EVENTS.append((name, time.perf_counter()))


def _timed(owner, attr: str, label: str) -> None:
    """Replace owner.attr by a wrapper that records when it starts and returns."""
    fn = getattr(owner, attr)

    def wrapper(*a, **kw):
        _EVENTS.append((f"[{label} called]", time.perf_counter()))
        try:
            return fn(*a, **kw)
        finally:
            _EVENTS.append((f"[{label} returned]", time.perf_counter()))

    setattr(owner, attr, wrapper)


def stages(fn, calls: int) -> tuple[list[tuple[str, float]], float]:
    """(stage name, median host ms since the previous event) in call order, and the median wall ms."""
    fn()
    torch.cuda.synchronize()
    per_call, walls = [], []
    for _ in range(calls):
        _EVENTS.clear()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        prev, rows = t0, []
        for name, t in _EVENTS:
            rows.append((name, (t - prev) * 1e3))
            prev = t
        rows.append(("(return)", (t1 - prev) * 1e3))
        per_call.append(rows)
        walls.append((t1 - t0) * 1e3)
    names = [n for n, _ in per_call[0]]
    same = [r for r in per_call if [n for n, _ in r] == names]
    out = [(n, statistics.median(r[i][1] for r in same)) for i, n in enumerate(names)]
    return out, statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--methods", default="balanced,balanced+cal/head")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    transform_resident.STAGE_HOOK = lmcache_device.STAGE_HOOK = _hook
    _timed(api, "_version", "api._version")
    _timed(lmcache_device, "device_bytes", "device_bytes")
    _timed(transform_resident, "read_header", "read_header")
    _timed(transform_resident, "decode", "transform_resident.decode")
    _timed(transform_resident, "encode", "transform_resident.encode")
    x = build_cache(args.tokens).cuda()
    nbytes = x.numel() * x.element_size()
    for name in args.methods.split(","):
        opts = method_options(name, x)
        blob = cg.encode_to_device(x, **opts)
        dec = {k: v for k, v in opts.items() if k == "calibration"}
        for what, fn in (("encode", lambda: cg.encode_to_device(x, **opts)),
                         ("decode", lambda: cg.decode(blob, device="cuda", **dec))):
            rows, wall = stages(fn, args.calls)
            print(f"=== {name} {what}: median wall {wall:.2f} ms ({nbytes / wall / 1e6:.1f} GB/s), {args.calls} calls; "
                  f"host ms since the previous event:")
            for n, ms in rows:
                print(f"  {ms:7.3f}  {n}")
    transform_resident.STAGE_HOOK = lmcache_device.STAGE_HOOK = None


if __name__ == "__main__":
    main()
