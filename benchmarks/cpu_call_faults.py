"""Page faults and kernel time of repeated CPU calls: encode and decode of one method, four calls
each after a warm-up, on one thread, printing each call's wall time, MB/s of bf16 input, minor
page faults and user / system CPU seconds (getrusage).  A fresh large array costs the kernel a
zeroed page at its first touch: this shows how much of a call that is, and what glibc's
allocator settings (e.g. ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...``, which keep freed
memory mapped for the next call) change.

    NUMBA_NUM_THREADS=1 python benchmarks/cpu_call_faults.py high+cal/head+rope 1024

The cache is bench.py's (tiled from the real sample); the calibration is the method's as
bench_all.py fits it on the other sample (+cal: one rotation per plane; +cal/head: one block per
KV head; +cal/head+rope: per head, without SmolLM2's RoPE).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench import build_cache  # noqa: E402
from bench_all import cal_kind, decode_kwargs, encode_kwargs, tile_calibration_cache  # noqa: E402
from bench_device import SMOL_ROPE  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import calibration  # noqa: E402
from cachegen_cli.model.calibrate import fit_samples  # noqa: E402


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "high+cal/head+rope"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    torch.set_num_threads(1)
    cal = None
    if "+cal" in method:  # the method's own calibration, fitted as bench_all.py fits it
        kind, sample = cal_kind(method), tile_calibration_cache()
        cal = (fit_samples([sample], 8, [SMOL_ROPE]) if kind == "head_rope"
               else calibration.fit([sample], blocks=8 if kind == "head" else 1))
    kv = build_cache(tokens)
    n = kv.numel() * kv.element_size()
    ekw, dkw = encode_kwargs(method, cal), decode_kwargs(method, cal)
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "(no MALLOC_ variables)"
    print(f"# {method}, {tokens} tokens ({n / 1e6:.0f} MB bf16), one thread; {env}")
    blob = cg.encode(kv, **ekw)
    cg.decode(blob, **dkw)
    for name, fn in (("encode", lambda: cg.encode(kv, **ekw)), ("decode", lambda: cg.decode(blob, **dkw))):
        for _ in range(4):
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            print(f"{name}: {dt * 1e3:6.0f} ms {n / dt / 1e6:6.1f} MB/s  minor faults {r1.ru_minflt - r0.ru_minflt:6d}  "
                  f"user {r1.ru_utime - r0.ru_utime:.2f} s  system {r1.ru_stime - r0.ru_stime:.2f} s", flush=True)


if __name__ == "__main__":
    main()
