"""Time the encoder's fixed-point product with and without its statistics (rotate_rows of
kernels/fixed_rotation_matmul with stats=...) on a Llama-3.1-8B-shaped cache (32 layers x 2 x
TOKENS x 1024 channels, blocks of 128, bfloat16 in), against the product followed by the
separate statistics pass over its float32 values (cuda_pipeline.transform_stats(tree=True),
the path the pipeline takes past RESIDENT_BLOCK), checking that both give the same sums.

    python benchmarks/rotation_stats.py --tokens 8192

Random rows and digits (timing only).  Lines: the product alone, the product and the pass, the
product with its sums, the sums without the values written (what the float32 values' store
costs); median (min-max) ms of --repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_fixed_rotation import timed_ms  # noqa: E402

from cachegen_cli.kernels import cuda_pipeline as cp  # noqa: E402
from cachegen_cli.kernels import fixed_rotation_matmul as fm  # noqa: E402
from cachegen_cli.kernels.transform import STATS_BLOCK  # noqa: E402
from cachegen_cli.pipeline.transform_resident import _FMT, _TORCH_WORD, _nb  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    dev = torch.device("cuda")
    L, T, C, H, D, S = 32, a.tokens, 1024, 8, 128, 4
    g = torch.Generator(device=dev).manual_seed(1)
    x = (torch.randn((L, 2, T, C), device=dev, generator=g) * 3).to(torch.bfloat16).view(torch.int16)
    digits = torch.stack([torch.randint(-128, 128, (L, 2, H, D, D), device=dev, generator=g),
                          torch.randint(-64, 65, (L, 2, H, D, D), device=dev, generator=g)]).to(torch.int8)
    y = torch.zeros((L, 2, T, C), device=dev)
    NB = -(-T // STATS_BLOCK)
    fused = torch.zeros((2, L, 2, NB, C), dtype=torch.float64, device=dev)
    apart = torch.zeros_like(fused)
    alone = torch.zeros_like(fused)
    sums = torch.zeros((2, L, 2, C), dtype=torch.float64, device=dev)
    V = cp.lanes(C, 4, cp.WIDTH["levels"])
    words = y.view(torch.int32).view(_TORCH_WORD[V * 4])

    def product_then_pass():
        fm.rotate_rows(x, digits, S, y)
        cp.transform_stats(_nb(words), 4, _FMT["float32"], S, _nb(apart[0]), _nb(apart[1]), _nb(sums[0]),
                           _nb(sums[1]), tree=True)

    rows = [("product alone", lambda: fm.rotate_rows(x, digits, S, y)),
            ("product, then the statistics pass", product_then_pass),
            ("product with its sums", lambda: fm.rotate_rows(x, digits, S, y, stats=(fused[0], fused[1]))),
            ("its sums alone (no values written)",
             lambda: fm.rotate_rows(x, digits, S, y, stats=(alone[0], alone[1]), values=False))]
    print(f"# {torch.cuda.get_device_name(dev)}, {L} x 2 x {T} x {C} bfloat16, blocks of {D}, "
          f"{a.repeats} repeats")
    for name, fn in rows:
        med, lo, hi = timed_ms(fn, a.repeats)
        print(f"{name:36s} {med:7.3f} ms ({lo:.3f}-{hi:.3f})")
    print("same block sums:", torch.equal(fused, apart), torch.equal(fused, alone))


if __name__ == "__main__":
    main()
