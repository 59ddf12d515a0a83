"""The GPU encoder's bytes with the fixed-point product making the levels (the default) and
without it (CACHEGEN_PRODUCT_LEVELS=0: the product's float32 values, then quantize_levels), on
the benchmark's Llama-shaped cache: they must be the same file.  Prints one line per method.

    python benchmarks/product_levels_check.py --tokens 8192 --methods high+cal/head+rope,balanced+cal/head
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cachegen_cli as cg  # noqa: E402
from bench_device import build_cache, method_options  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--methods", default="high+cal/head+rope,balanced+cal/head+rope,small+cal/head")
    args = p.parse_args()
    kv = build_cache(args.tokens).cuda()
    cals: dict = {}
    for name in args.methods.split(","):
        kw = method_options(name, kv, cals)
        os.environ["CACHEGEN_PRODUCT_LEVELS"] = "1"
        fused = cg.encode_to_device(kv, **kw).cpu()
        os.environ["CACHEGEN_PRODUCT_LEVELS"] = "0"
        apart = cg.encode_to_device(kv, **kw).cpu()
        os.environ.pop("CACHEGEN_PRODUCT_LEVELS")
        same = torch.equal(fused, apart)
        print(f"{name}: {args.tokens} tokens, product's levels {fused.numel()} bytes, apart {apart.numel()} bytes, "
              f"same file {same}", flush=True)


if __name__ == "__main__":
    main()
