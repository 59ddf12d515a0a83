"""One CPU thread's encode / decode speed of bench_device.py's methods on bench.py's Llama-shaped
cache, and where each call's time goes (cProfile, the largest own times):

    NUMBA_NUM_THREADS=1 taskset -c 3 python benchmarks/profile_cpu_methods.py 512 balanced+cal/head balanced+cal/head+rope

MB/s of bf16 input, the median of three timed calls after a warm-up (min-max ms in brackets);
the calibrations are fitted on another text as bench_device.py fits them.  Run it under
NUMBA_NUM_THREADS=1 and pinned to one CPU for a one-core figure (bench_all.py's "1 core" cells
come from the same calls).
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

TIMED_CALLS = 3
PROFILE_ROWS = 12


def own_times(fn) -> str:
    """The PROFILE_ROWS largest own times of one call of fn, as pstats prints them."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(PROFILE_ROWS)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip() and ("/" in line or "{" in line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tokens", type=int, help="tokens of the cache (32 layers x 8 heads x 128 dims, bf16)")
    ap.add_argument("methods", nargs="+", help=f"of {', '.join(METHODS)}")
    a = ap.parse_args()
    torch.set_num_threads(1)
    kv = build_cache(a.tokens)
    megabytes = kv.numel() * kv.element_size() / 1e6
    cals: dict = {}
    for name in a.methods:
        options = method_options(name, kv, cals)
        decode_options = {"calibration": options["calibration"]} if "calibration" in options else {}
        encode = lambda: cg.encode(kv, device="cpu", **options)  # noqa: E731
        blob = encode()  # the warm-up
        decode = lambda: cg.decode(blob, device="cpu", **decode_options)  # noqa: E731
        decode()
        enc, dec = [], []
        for _ in range(TIMED_CALLS):
            t = time.perf_counter()
            encode()
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            decode()
            dec.append(time.perf_counter() - t)
        print(f"{name}: {megabytes:.0f} MB  encode {megabytes / statistics.median(enc):.0f} MB/s "
              f"({min(enc) * 1e3:.0f}-{max(enc) * 1e3:.0f} ms)  decode {megabytes / statistics.median(dec):.0f} MB/s "
              f"({min(dec) * 1e3:.0f}-{max(dec) * 1e3:.0f} ms)  size {len(blob)}", flush=True)
        for what, fn in (("encode", encode), ("decode", decode)):
            print(f"--- {name} {what}\n{own_times(fn)}", flush=True)


if __name__ == "__main__":
    main()
