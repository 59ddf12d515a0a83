"""Profile one encode and one decode of the device-resident pipeline (format version 2) under
Nsight Compute, and report which kernels contract multiply-adds (fused FMA in their PTX).

    python benchmarks/profile_pipeline.py --quality balanced --tokens 8192
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python benchmarks/profile_pipeline.py

The cache is bench.py's Llama-3.1-8B-shaped bf16 cache tiled from the real SmolLM2 sample.
Warm-up calls (compilation) run outside the profiled range; the profiled range
(torch.cuda.profiler start / stop) holds exactly one encode_to_device and one decode.
``--ptx``: print, for each compiled pipeline kernel, how many fma.rn.f64 / fma.rn.f32 its PTX has.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cachegen_cli as cg  # noqa: E402
from bench import build_cache  # noqa: E402


def ptx_fma_report() -> None:
    from cachegen_cli.kernels import cuda as k1
    from cachegen_cli.kernels import cuda_pipeline as k

    kernels = {}
    for (make, key), kern in k._MADE.items():
        kernels[f"{make.__name__}{key}"] = kern
    for mod in (k, k1):
        for name in dir(mod):
            obj = getattr(mod, name)
            if hasattr(obj, "inspect_asm") and hasattr(obj, "overloads") and obj.overloads:
                kernels[f"{mod.__name__.rsplit('.', 1)[-1]}.{name}"] = obj
    for name, kern in sorted(kernels.items()):
        try:
            asm = kern.inspect_asm()
        except Exception as e:  # noqa: BLE001 - a report, not a check
            print(f"{name}: no PTX ({e})")
            continue
        text = "\n".join(asm.values()) if isinstance(asm, dict) else str(asm)
        f64 = text.count("fma.rn.f64")
        f32 = text.count("fma.rn.f32")
        if f64 or f32:
            print(f"{name}: fma.rn.f64 x{f64}, fma.rn.f32 x{f32}")
    print(f"({len(kernels)} kernels inspected)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quality", default="balanced")
    p.add_argument("--preset", default=None)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ptx", action="store_true")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile N encodes and N decodes with cProfile (the host's side) and print the top functions")
    a = p.parse_args()
    kw = {"preset": a.preset} if a.preset else {"quality": a.quality}
    kv = build_cache(a.tokens).cuda()
    blob = cg.encode_to_device(kv, **kw)
    for _ in range(2):
        cg.decode(blob, device="cuda")
        cg.encode_to_device(kv, **kw)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    t = time.perf_counter()
    cg.encode_to_device(kv, **kw)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    cg.decode(blob, device="cuda")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    torch.cuda.profiler.stop()
    print(f"{kw}: encode {1000 * (t1 - t):.2f} ms, decode {1000 * (t2 - t1):.2f} ms (under the profiler if any)")
    if a.ptx:
        ptx_fma_report()
    if a.cprofile:
        import cProfile
        import pstats

        for what, fn in (("encode", lambda: cg.encode_to_device(kv, **kw)), ("decode", lambda: cg.decode(blob, device="cuda"))):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.cprofile):
                fn()
                torch.cuda.synchronize()
            prof.disable()
            print(f"# host profile of {a.cprofile} x {what} (tottime, per call = / {a.cprofile})")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
