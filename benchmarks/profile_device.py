"""One GPU-resident encode and decode of each method under a CUDA profiler range, for Nsight
Compute: every kernel launch of the profiled calls (compilation and warm-up excluded).

    ncu --clock-control none --profile-from-start off --csv --page raw \
        --metrics gpu__time_duration.sum,launch__registers_per_thread \
        python benchmarks/profile_device.py --tokens 8192 --methods balanced

The cache is bench.py's Llama-3.1-8B-shaped one (as bench_device.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache  # noqa: E402
from bench_device import METHODS  # noqa: E402

import cachegen_cli as cg  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--methods", default="balanced")
    args = ap.parse_args(argv)
    x = build_cache(args.tokens).cuda()
    for name in args.methods.split(","):
        opts = METHODS[name]
        blob = cg.encode_to_device(x, **opts)  # warm-up: compiles every kernel
        cg.decode(blob, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        blob = cg.encode_to_device(x, **opts)
        out = cg.decode(blob, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(name, "bytes", int(blob.numel()), "equal" if name == "lossless" and torch.equal(out, x) else "")


if __name__ == "__main__":
    main()
