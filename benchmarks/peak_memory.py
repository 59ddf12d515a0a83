"""Peak memory (maximum resident set size) of file -> file encode and decode through the CLI.

Builds a Llama-3.1-8B-shaped cache (bench.py's build_cache: 32 layers x 8 KV heads x 128
dims, bf16; 8192 tokens = 1.07 GB), writes it with safetensors, then runs
`cachegen encode` and `cachegen decode` on it for each method under `/usr/bin/time -v`
and prints, for each, the peak RSS and whether it stays below N + 256 MB, N the cache's
bytes.  Every run is a fresh process, so its peak includes the interpreter, torch and
numba (the "startup" row: `cachegen --help`).  A lossless decode must give back the
input file byte for byte; the script checks it.

    python benchmarks/peak_memory.py --device cpu [--tokens 8192] [--methods lmcache,balanced,lossless]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = {"lmcache": ["--preset", "lmcache"], "lossless": ["--quality", "lossless"], "high": ["--quality", "high"],
           "balanced": ["--quality", "balanced"], "small": ["--quality", "small"]}
MARGIN = 256 << 20


def cachegen() -> str:
    here = Path(sys.executable).parent / "cachegen"
    found = str(here) if here.exists() else shutil.which("cachegen")
    if not found:
        sys.exit("cachegen is not installed next to this Python (make demo, or pip install -e .)")
    return found


def timed(cmd: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of a command under /usr/bin/time -v."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    if not m:
        sys.exit("no 'Maximum resident set size' in /usr/bin/time -v's output")
    return int(m.group(1)) * 1024, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the cache (8192: 1.07 GB)")
    p.add_argument("--methods", default="lmcache,balanced,lossless", help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--device", default="cpu", help="--device of the runs (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="-T of the runs (0: all cores)")
    p.add_argument("--workdir", type=Path, default=None, help="where the files go (default: a temporary folder, removed)")
    args = p.parse_args()
    if not Path("/usr/bin/time").exists():
        sys.exit("needs /usr/bin/time (GNU time: apt-get install time)")
    tool = cachegen()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cachegen-peak-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = work / "kv.safetensors"
        import torch
        from bench import build_cache
        from safetensors.torch import save_file

        kv = build_cache(args.tokens)
        N = kv.numel() * kv.element_size()
        save_file({"kv": kv}, str(src))
        del kv
        startup, _ = timed([tool, "--help"])
        print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}; cache [layers, heads, head_dim] = {list(build_cache.__defaults__)} "
              f"x {args.tokens} tokens bf16: N = {N:,} bytes ({N / 1e9:.3f} GB), file {src.stat().st_size:,} bytes")
        print(f"# limit N + 256 MB = {(N + MARGIN) / 2**20:,.0f} MiB; startup (cachegen --help) {startup / 2**20:,.0f} MiB")
        print(f"{'method':10s} {'step':6s} {'peak RSS MiB':>12s} {'peak - N MiB':>12s} {'< N+256MB':>9s} {'seconds':>8s} "
              f"{'output bytes':>14s}")
        common = ["--device", args.device, "--force", "-q"] + (["-T", str(args.threads)] if args.threads else [])
        ok = True
        for name in args.methods.split(","):
            cgen = work / f"kv.{name}.cgen"
            back = work / f"kv.{name}.decoded.safetensors"
            for step, cmd, out in (("encode", [tool, "encode", str(src), "-o", str(cgen), *METHODS[name], *common], cgen),
                                   ("decode", [tool, "decode", str(cgen), "-o", str(back), *common], back)):
                peak, wall = timed(cmd)
                below = peak < N + MARGIN
                ok &= below
                print(f"{name:10s} {step:6s} {peak / 2**20:12,.0f} {(peak - N) / 2**20:12,.0f} {'yes' if below else 'NO':>9s} "
                      f"{wall:8.1f} {out.stat().st_size:14,}", flush=True)
            if name == "lossless":
                same = filecmp.cmp(src, back, shallow=False)
                ok &= same
                print(f"{'':10s} lossless decode identical to the input file: {'yes' if same else 'NO'}")
            cgen.unlink()
            back.unlink()
        print("all below N + 256 MB" if ok else "NOT all below N + 256 MB (or a lossless mismatch)")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
