"""The CPU decoder's inverse fixed-point rotation of a bfloat16 cache: the two passes it made
until 2026-12-03 (fixed_values to float32, then rope.store_values' rounding to bfloat16) against
the fused pass (fixed_values_bf16), on random levels of a Llama-8B-shaped slab (per-head blocks);
checks that both give the same words, then prints min / median ms over interleaved repeats.

    NUMBA_NUM_THREADS=1 python benchmarks/unrotate_cpu.py --tokens 512 --repeats 9
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from cachegen_cli.kernels import fixed_rotation as fr
from cachegen_cli.kernels import rope as rope_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    L, T, C, H = args.layers, args.tokens, args.channels, args.heads
    D = C // H
    z = np.round(rng.standard_normal((L, 2, T, C)) * 20).astype(np.float32)  # levels q'
    rint_t = torch.from_numpy(np.round(rng.standard_normal((L, 2, H, D, D)) * 2.0 ** 10))
    steps = np.full((L, 2), 2.0 ** -6)
    b = rng.standard_normal((L, 2, C))
    sink = 1
    tmp = np.empty_like(z)
    out = np.zeros((L, 2, T, C), np.uint16)

    def two_passes():
        tmp[...] = z
        fr.unrotate_values(tmp, rint_t, steps, b, sink, tmp)
        rope_kernels.store_values(tmp, sink, out, 0, rope_kernels.KIND_BFLOAT16)

    def fused():
        tmp[...] = z
        fr.unrotate_values(tmp, rint_t, steps, b, sink, out, 0)

    two_passes()
    want = out.copy()
    fused()
    assert (want == out).all(), "the fused pass gave other words"
    times = {"two passes": [], "fused": []}
    for _ in range(args.repeats):
        for name, fn in (("two passes", two_passes), ("fused", fused)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    mb = L * 2 * T * C * 2 / 1e6
    print(f"# {L} layers x {T} tokens x {C} channels ({mb:.0f} MB of bfloat16), {H} blocks, "
          f"torch threads 1, numba threads {__import__('numba').get_num_threads()}")
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"{name:10s}  min {ts[0] * 1e3:7.1f} ms  median {ts[len(ts) // 2] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
