"""The host side of GPU-resident calls: cProfile over a few encode_to_device / decode calls
(after a warm-up), the functions with the most time of their own.  What the GPU waits for
when benchmarks/timeline_device.py reports it idle.

    python benchmarks/profile_host.py --tokens 8192 --methods balanced,high --calls 5 --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache  # noqa: E402
from bench_device import method_options  # noqa: E402

import cachegen_cli as cg  # noqa: E402


def report(fn, calls: int, top: int, sort: str = "tottime") -> str:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--methods", default="balanced,high")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", help="pstats order: tottime (time of their own) or cumulative")
    args = ap.parse_args()
    x = build_cache(args.tokens).cuda()
    for name in args.methods.split(","):
        opts = method_options(name, x)
        blob = cg.encode_to_device(x, **opts)
        dec = {k: v for k, v in opts.items() if k == "calibration"}
        print(f"=== {name} encode ({args.calls} calls)")
        print(report(lambda: cg.encode_to_device(x, **opts), args.calls, args.top, args.sort))
        print(f"=== {name} decode ({args.calls} calls)")
        print(report(lambda: cg.decode(blob, device="cuda", **dec), args.calls, args.top, args.sort))


if __name__ == "__main__":
    main()
