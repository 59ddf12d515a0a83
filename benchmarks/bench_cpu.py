"""CPU throughput of the whole codec: tensor -> bytes -> tensor, through the public API.

    python benchmarks/bench_cpu.py                # all cores, then one core
    python benchmarks/bench_cpu.py --threads 2    # only that run
    python benchmarks/bench_cpu.py --tile 4 --runs 7

Input: the committed real sample (SmolLM2-135M KV cache, bf16) tiled along the token
axis (`kv.repeat(1, 1, tile, 1, 1)`, 8x = 96 MB).  MB/s are megabytes (1e6) of the
uncompressed bf16 input per second of wall time: `cachegen_cli.encode(kv)` (tensor ->
.cgen bytes) and `cachegen_cli.decode(blob)` (bytes -> tensor), the median of --runs
runs after one warm-up run (which also loads or compiles the kernels).  "per core" is
the total divided by the number of numba threads.

Without --threads the script runs twice: in this process with every core, then in a
child process pinned to one CPU (sched_setaffinity) with NUMBA_NUM_THREADS=1 and one
torch thread: the true single-core numbers.  Each run prints a per-stage breakdown
(the median of --runs timings of each stage, run separately the way the codec runs it).
On a shared machine the load average is printed too: other work on the cores shows up
in the multi-threaded numbers first.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data" / "smollm2_pydoc_520.safetensors"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_time(fn, runs: int) -> tuple[float, float, object]:
    """(median, min) wall seconds of ``runs`` calls, and the last result."""
    times = []
    result = None
    for _ in range(runs):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), result


def stage_breakdown(kv, runs: int, nbytes: int) -> list[tuple[str, float]]:
    """Median seconds of each stage of one encode and one decode, run as the codec runs them
    (one slab: the sample fits in one)."""
    import numpy as np

    from cachegen_cli.pipeline import codec
    from cachegen_cli.format import container
    from cachegen_cli.storage import kvio
    from cachegen_cli.methods.config import resolve_quantization
    from cachegen_cli.kernels import cpu
    from cachegen_cli.kernels.coding_params import max_stream_bytes

    rows: list[tuple[str, float]] = []

    def stage(name, fn):
        m, _, r = median_time(fn, runs)
        rows.append((name, m))
        return r

    # ---- encode
    cache = stage("encode: from_tensors (layout, NaN/Inf check)", lambda: kvio.from_tensors(kv))
    quant = resolve_quantization(cache.num_layers)
    h = codec.make_header(cache, quant, 256)
    slabs = list(codec.iter_slabs(h))
    assert len(slabs) == 1, "the breakdown assumes one slab"
    words, shift = codec._cpu_source_words(cache.data)
    L, C, ct, G, T = h.num_layers, h.num_channels, h.chunk_tokens, h.group, h.num_tokens
    K, S = h.num_chunks, int(h.alphabets.max())
    n = K * L * 2
    scales = np.empty((L, 2, T), np.uint16)
    codes = np.empty((K, L, 2, C, S), np.uint8)
    lengths = np.empty((K, L, 2, h.groups), np.int32)
    plane_bytes = np.empty(n, np.int64)
    planes = np.empty((n, h.groups * max_stream_bytes(ct * G)), np.uint8)
    stage("encode: encode_planes (quantize+histogram+CDF+range code)",
          lambda: cpu.encode_planes(words, shift, 0, T, h.maxq, ct, G, scales, codes, lengths, plane_bytes, planes))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(plane_bytes, out=offsets[1:])
    payload = np.empty(int(offsets[-1]), np.uint8)
    stage("encode: pack_streams (planes -> payload)", lambda: cpu.pack_streams(planes, plane_bytes, offsets, payload))
    stage("encode: pack_codes (4-bit CDF codes)", lambda: container.pack_codes(codes, h))
    chunks = codec._encode_slab_cpu(h, words, shift, 0, T, 0)
    parts = stage("encode: chunk records (CRC-32, threads)",
                  lambda: list(codec._pool().map(container.chunk_parts, chunks)))
    stage("encode: join the bytes", lambda: b"".join(p for ps in parts for p in ps))

    # ---- decode
    import cachegen_cli as cg

    blob = cg.encode(kv, device="cpu")

    def read_all():
        f = container.BufferReader(blob)
        hh, _, offs, size = codec.read_header_and_index(f)
        return hh, list(codec.iter_chunks(f, hh, offs, size))

    hh, batch = stage("decode: header, index, chunks (CRC-32, checks)", read_all)

    def gather():
        cds = container.unpack_codes(np.stack([c.codes for c in batch]), hh, S)
        lens = np.concatenate([c.lengths.reshape(-1) for c in batch]).astype(np.int32)
        offs = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=offs[1:])
        pay = np.concatenate([c.payload for c in batch])
        scl = np.ascontiguousarray(np.concatenate([c.scales for c in batch], axis=2))
        return cds, lens, offs, pay, scl

    cds, lens, offs, pay, scl = stage("decode: gather (unpack codes, concatenate)", gather)
    import torch

    data = torch.empty((L, 2, T, C), dtype=torch.bfloat16)
    out = data.view(torch.int16).numpy().view(np.uint16)
    stage("decode: decode_planes (CDF+range decode+dequantize->bf16)",
          lambda: cpu.decode_planes(pay, offs, lens, cds, hh.maxq, ct, G, scl, out, 0, True))
    stage("decode: to_tensors", lambda: kvio.to_tensors(data, hh.descriptor))
    return rows


def run(tile: int, runs: int, threads: int | None, stages: bool) -> None:
    import numba
    import torch

    if threads is not None:
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
    from safetensors.torch import load_file

    import cachegen_cli as cg

    nthreads = numba.get_num_threads()
    kv = load_file(str(SAMPLE))["kv"].repeat(1, 1, tile, 1, 1).contiguous()
    nbytes = kv.numel() * kv.element_size()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"date        {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"cpu         {cpu_model()}  ({os.cpu_count()} logical CPUs, {affinity} usable by this process)")
    print(f"versions    python {platform.python_version()}, numba {numba.__version__}, torch {torch.__version__}")
    print(f"load avg    {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (before the runs)")
    print(f"input       {SAMPLE.name} x{tile}: {list(kv.shape)} {str(kv.dtype).replace('torch.', '')}, {nbytes / 1e6:.1f} MB")

    t = time.perf_counter()
    blob = cg.encode(kv, device="cpu")
    back = cg.decode(blob, device="cpu")["kv"]
    warm = time.perf_counter() - t
    assert back.shape == kv.shape and back.dtype == kv.dtype
    print(f"threads     numba {nthreads} (threading layer {numba.threading_layer()}), torch {torch.get_num_threads()}")
    print(f"warm-up     {warm:.2f} s (encode + decode, incl. loading or compiling the kernels)")
    print(f"compressed  {len(blob):,} B: ratio {nbytes / len(blob):.2f}x, {8 * len(blob) / kv.numel():.2f} bits/value")

    enc_med, enc_min, blob2 = median_time(lambda: cg.encode(kv, device="cpu"), runs)
    assert blob2 == blob, "encoding is not deterministic"
    dec_med, dec_min, _ = median_time(lambda: cg.decode(blob, device="cpu"), runs)
    print(f"\n{'':8s} {'median':>9s} {'MB/s':>8s} {'MB/s/core':>10s}   {'best':>9s} {'MB/s':>8s}   (median of {runs} runs)")
    for name, med, best in (("encode", enc_med, enc_min), ("decode", dec_med, dec_min)):
        print(f"{name:8s} {med * 1e3:7.0f} ms {nbytes / med / 1e6:8.1f} {nbytes / med / 1e6 / nthreads:10.1f}"
              f"   {best * 1e3:7.0f} ms {nbytes / best / 1e6:8.1f}")
    if stages:
        print(f"\nstages (median of {runs}; MB/s of the bf16 input through that stage alone)")
        for name, sec in stage_breakdown(kv, runs, nbytes):
            print(f"  {name:62s} {sec * 1e3:8.1f} ms {nbytes / sec / 1e6:9.0f} MB/s")
    print(f"load avg    {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (after the runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tile", type=int, default=8, help="repeat the sample this many times along tokens (default 8: 96 MB)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per measurement (default 5; at least 3)")
    ap.add_argument("--threads", type=int, default=None, help="only one run, with this many numba/torch threads")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    ap.add_argument("--single-core-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    runs = max(3, args.runs)
    if args.single_core_child:
        run(args.tile, runs, 1, not args.no_stages)
        return
    if args.threads is not None:
        run(args.tile, runs, args.threads, not args.no_stages)
        return
    print("=" * 24, "all cores", "=" * 24)
    run(args.tile, runs, None, not args.no_stages)
    sys.stdout.flush()
    print()
    print("=" * 24, "one core (pinned, NUMBA_NUM_THREADS=1)", "=" * 24, flush=True)
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--single-core-child", "--tile", str(args.tile), "--runs", str(runs)]
    if args.no_stages:
        cmd.append("--no-stages")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    preexec = (lambda: os.sched_setaffinity(0, {cpus[-1]})) if cpus else None
    subprocess.run(cmd, env=env, check=True, preexec_fn=preexec)


if __name__ == "__main__":
    main()
