"""Where a GPU-resident decode's host time goes: the host clock at each stage mark of the GPU
decoder (pipeline/transform_resident.STAGE_HOOK), from the call to its return, medians of seven
calls after three warm ones; then the API's version probe and ``read_header`` timed alone, and a
cProfile of five calls (own times):

    python benchmarks/decode_prologue.py high high+cal/head+rope

The cache is bench.py's Llama-3.1-8B-shaped one (8192 tokens, as bench_device.py); methods are
bench_device.py's names.  "call->start" is the host's work before the decoder's first stage
(the version probe, read_header, the calibration check); the stage rows are host time between
marks, so the one that waits for the device (the CRC-32s' copy back) holds the GPU's time.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache  # noqa: E402
from bench_device import METHODS, method_options  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli import api  # noqa: E402
from cachegen_cli.pipeline import transform_resident  # noqa: E402

CALLS = 7


def host_steps(decode) -> list[tuple[str, float]]:
    """(step, seconds) of one decode call on the host clock."""
    marks: list[tuple[str, float]] = []
    transform_resident.STAGE_HOOK = lambda name: marks.append((name, time.perf_counter()))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        decode()
        t1 = time.perf_counter()
    finally:
        transform_resident.STAGE_HOOK = None
    if not marks:
        raise SystemExit("the decode did not go through the GPU pipeline's stages")
    steps = [("call->start", marks[0][1] - t0)]
    steps += [(marks[i][0], marks[i][1] - marks[i - 1][1]) for i in range(1, len(marks))]
    return steps + [("last mark->return", t1 - marks[-1][1]), ("wall", t1 - t0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("methods", nargs="+", help=f"of {', '.join(METHODS)}")
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: needs a CUDA GPU")
    kv = build_cache(args.tokens).cuda()
    cals: dict = {}
    for name in args.methods:
        kw = method_options(name, kv, cals)
        blob = cg.encode_to_device(kv, **kw)
        cal = kw.get("calibration")

        def decode():
            return cg.decode(blob, device="cuda", calibration=cal)

        for _ in range(3):
            decode()
        rows = [host_steps(decode) for _ in range(CALLS)]
        print(f"== {name}: host ms per step (median of {CALLS})")
        for j, (step, _) in enumerate(rows[0]):
            print(f"  {step:32s} {1e3 * statistics.median(r[j][1] for r in rows):8.3f}")
        probe, header = [], []
        for _ in range(CALLS):
            torch.cuda.synchronize()
            a = time.perf_counter()
            api._version(blob)
            b = time.perf_counter()
            transform_resident.read_header(blob)
            c = time.perf_counter()
            probe.append(b - a)
            header.append(c - b)
        print(f"  version probe {1e3 * statistics.median(probe):.3f} ms, "
              f"read_header {1e3 * statistics.median(header):.3f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            decode()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


if __name__ == "__main__":
    main()
