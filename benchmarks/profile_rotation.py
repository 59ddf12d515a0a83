"""Time (and, under Nsight Compute, profile) the rotation kernel alone: kernels/cuda_pipeline.rotate_blocks
on a Llama-3.1-8B-shaped plane set (32 layers x 2 x TOKENS x 1024 channels, float32 in, float64 out),
with one 1024 x 1024 block or 8 blocks of 128 per (layer, K/V).

    python benchmarks/profile_rotation.py [--tokens 2048] [--blocks 8] [--tiles TM,TN,TK,RM,RN]
    ncu --section SpeedOfLight --section WarpStateStats python benchmarks/profile_rotation.py --repeats 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from cachegen_cli.kernels import cuda_pipeline as k
from cachegen_cli.pipeline.transform_resident import _nb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiles", default="")
    ap.add_argument("--compare", action="store_true", help="also time the 2-D shared-tile variant (ROT_FLAT off) "
                    "and check both give the same bits")
    a = ap.parse_args()
    if a.tiles:
        k.ROT_TM, k.ROT_TN, k.ROT_TK, k.ROT_RM, k.ROT_RN = (int(v) for v in a.tiles.split(","))
    L, C, H = 32, 1024, a.blocks
    D = C // H
    x = torch.randn(L, 2, a.tokens, C, device="cuda")
    rot = torch.randn(L, 2, H, D, D, device="cuda")
    y = torch.empty(L, 2, a.tokens, C, dtype=torch.float64, device="cuda")
    k.rotate_blocks(_nb(x), _nb(rot), 0, _nb(y))  # compile
    torch.cuda.synchronize()
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        k.rotate_blocks(_nb(x), _nb(rot), 0, _nb(y))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    fma = L * 2 * a.tokens * C * D
    s = float(np.median(times))
    print(f"rotation {H} blocks of {D}, {a.tokens} tokens, tiles {(k.ROT_TM, k.ROT_TN, k.ROT_TK, k.ROT_RM, k.ROT_RN)}, "
          f"flat {k.ROT_FLAT}: {s * 1e3:.2f} ms, {fma / s / 1e12:.2f} T multiply-adds/s (float64)")
    if a.compare:
        k.ROT_FLAT = not k.ROT_FLAT
        y2 = torch.empty_like(y)
        k.rotate_blocks(_nb(x), _nb(rot), 0, _nb(y2))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.repeats):
            k.rotate_blocks(_nb(x), _nb(rot), 0, _nb(y2))
        torch.cuda.synchronize()
        s2 = (time.perf_counter() - t) / a.repeats
        same = torch.equal(y.view(torch.int64), y2.view(torch.int64))
        print(f"  flat {k.ROT_FLAT}: {s2 * 1e3:.2f} ms, {fma / s2 / 1e12:.2f} T multiply-adds/s; same bits {same}")


if __name__ == "__main__":
    main()
