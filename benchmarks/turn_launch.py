"""Time the RoPE turning pass alone (kernels/fixed_rotation_matmul.turn_rows), both directions,
at each of --configs of fm.TURN_LAUNCH, on a Llama-3.1-8B-shaped cache (32 layers x 2 x TOKENS x
1024 channels, heads of 128, bfloat16 in): back (the encoder's: the cache's words -> float32 keys
and their rows' exponents) and forward (the decoder's: float32 keys -> bfloat16 words), checking
that every launch gives the first one's bits.

    python benchmarks/turn_launch.py --tokens 8192 --configs "4,64,4;1,512,4;1,256,4"

Random rows (timing only).  The pass moves the keys' bfloat16 words in and their float32 values
out (1.61 GB at 8192 tokens): the line prints that over the time as well.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_fixed_rotation import timed_ms  # noqa: E402

from cachegen_cli.kernels import fixed_rotation_matmul as fm  # noqa: E402
from cachegen_cli.methods import rope as rope_methods  # noqa: E402
from cachegen_cli.pipeline.transform_resident import _rope_angles  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--configs", default="4,64,4;1,512,4;1,512,2;1,512,8;1,256,4;1,256,2;2,512,4;2,256,4;1,128,4",
                   help="rows,pairs,warps;... (fm.TURN_LAUNCH's keys)")
    a = p.parse_args()
    dev = torch.device("cuda")
    L, T, C, S = 32, a.tokens, 1024, 4
    g = torch.Generator(device=dev).manual_seed(1)
    words = (torch.randn((L, 2, T, C), device=dev, generator=g) * 3).to(torch.bfloat16).view(torch.int16)
    n = T - S
    ang = _rope_angles(rope_methods.from_theta(500000.0, 128), S, T, dev)
    keys = torch.zeros((L, 1, T, C), device=dev)
    e = torch.zeros((L * 2, n), dtype=torch.int32, device=dev)
    out = torch.zeros((L, 2, T, C), dtype=torch.int16, device=dev)
    moved = L * n * C * (2 + 4)
    print(f"# {torch.cuda.get_device_name()}, {L} x 2 x {T} x {C}, {moved / 1e9:.2f} GB moved a pass", flush=True)
    ref = None
    for item in a.configs.split(";"):
        cfg = tuple(int(v) for v in item.split(","))
        fm.TURN_LAUNCH = dict(zip(("rows", "pairs", "warps"), cfg))
        back = timed_ms(lambda: fm.turn_rows(words, ang, S, keys, False, e), a.repeats)
        fwd = timed_ms(lambda: fm.turn_rows(keys, ang, S, out, True), a.repeats)
        got = (keys.clone(), out.clone(), e.clone())
        ref = ref or got
        same = all(torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x, y.view(torch.int32)
                               if y.dtype == torch.float32 else y) for x, y in zip(got, ref))
        print(f"turn {cfg}: back {back[0]:.3f} ms ({back[1]:.3f}-{back[2]:.3f}) {moved / back[0] / 1e6:.0f} GB/s  "
              f"forward {fwd[0]:.3f} ms ({fwd[1]:.3f}-{fwd[2]:.3f})  same bits {same}", flush=True)


if __name__ == "__main__":
    main()
