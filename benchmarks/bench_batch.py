"""Batch throughput: files/s and GB/s of a batch of Llama-shaped caches, local and Ray backends.

Builds N caches (Llama-3.1-8B-shaped by default: 32 layers x 8 KV heads x 128 dims, bf16)
by tiling the real SmolLM2 sample as benchmarks/bench.py does (file k starts k * 37 tokens
further into the sample, so the files differ), writes them to --dir, then times:

- the disk: reading every input, and writing as many bytes (each file fsync'ed), serially: a
  batch's floor is its input bytes at that read speed plus its output bytes at that write
  speed (``disk_floor_s``; ``of_disk`` = floor / the batch's seconds, 1.0 = at the disk's speed);
- each backend x pool asked for: an encode of the whole batch into a fresh output folder
  (--force), then a decode of those outputs.  A warm-up batch of --warmup files runs first:
  it compiles or loads the kernels in this process and starts Ray's workers, which later
  batches reuse; each local batch starts its own worker processes (as one `cachegen` run
  does), so their start is in the local process pool's time.

GB/s counts the uncompressed bytes (the encode's input, the decode's output); ``first_file_s``
is when the first file of a batch finished (the pool's start, worker processes and kernels
loaded, is in it).

    python benchmarks/bench_batch.py --files 100 --tokens 8192 --backends local,ray --device cuda
    python benchmarks/bench_batch.py --files 8 --tokens 256 --layers 4 --pools thread,process   # a smoke run

``--profile N`` first codes N files one after another in this process (the worker's own
function, batch.work.process_file) under cProfile, and prints each file's time and where it
went (reading, coding, writing, fsync): what one worker spends per file, apart from the pool.
Its median file -> file GB/s (read, code, write and fsync of one file, in a warm process) is
the single-file figure of docs/benchmarks.md; ``--backends ""`` runs only the profile.
The --json report is rewritten after every run, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def build_files(folder: Path, files: int, tokens: int, layers: int, heads: int, head_dim: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    from bench import build_cache

    folder.mkdir(parents=True, exist_ok=True)
    base = build_cache(tokens + 37 * files, layers, heads, head_dim)  # tokens beyond 520 wrap round the sample
    paths = []
    for k in range(files):
        path = folder / f"cache{k:05d}.safetensors"
        if not path.exists():
            save_file({"kv": base[:, :, 37 * k : 37 * k + tokens].contiguous()}, str(path))
        paths.append(path)
    del base, torch
    return paths


def disk_speed(paths: list[Path], scratch: Path) -> dict:
    """What the disk moves, serially: reading every input (from the page cache if it is there,
    as the batch would), and writing as many bytes to scratch, each file fsync'ed.  The
    batch's disk floor is its input bytes at the read speed plus its output bytes at the write
    speed (floor_seconds)."""
    scratch.mkdir(parents=True, exist_ok=True)
    moved = 0
    t = time.perf_counter()
    datas = []
    for path in paths:
        datas.append(path.read_bytes())
        moved += len(datas[-1])
        if len(datas) > 4:  # hold a few, not the batch
            datas.pop(0)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    data = paths[0].read_bytes()
    for k, path in enumerate(paths):
        size = path.stat().st_size
        with open(scratch / f"copy{k}", "wb") as f:
            f.write(memoryview(data)[:size] if size <= len(data) else data + bytes(size - len(data)))
            f.flush()
            os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    shutil.rmtree(scratch)
    return {"seconds": round(read_s + write_s, 3), "read_GBps": round(moved / read_s / 1e9, 3),
            "write_GBps": round(moved / write_s / 1e9, 3),
            "read_write_GBps": round(2 * moved / (read_s + write_s) / 1e9, 3)}


def floor_seconds(disk: dict, read_bytes: int, written_bytes: int) -> float:
    """The disk's time for a batch that reads ``read_bytes`` and writes ``written_bytes``."""
    return read_bytes / (disk["read_GBps"] * 1e9) + written_bytes / (disk["write_GBps"] * 1e9)


def run(paths, op, out_dir, backend, pool, workers, device, threads, extra, disk=None) -> dict:
    from cachegen_cli.batch import run_batch

    if out_dir.exists():
        shutil.rmtree(out_dir)
    first = []
    t = time.perf_counter()
    results = run_batch([str(p) for p in paths], op, output_dir=out_dir, backend=backend, pool=pool, workers=workers,
                        device=device, threads=threads, force=True,
                        on_result=lambda i, r: first or first.append(time.perf_counter()), **extra)
    took = time.perf_counter() - t
    failed = [r for r in results if r.status != "done"]
    if failed:
        raise SystemExit(f"{len(failed)} file(s) failed, e.g. {failed[0].input}: {failed[0].error}")
    raw = sum(r.input_bytes if op == "encode" else r.output_bytes for r in results)
    read, written = sum(r.input_bytes for r in results), sum(r.output_bytes for r in results)
    row = {"op": op, "backend": backend, "pool": pool if backend == "local" else None, "files": len(results),
           "seconds": round(took, 3), "files_per_s": round(len(results) / took, 3),
           "GBps": round(raw / took / 1e9, 4), "read_bytes": read, "written_bytes": written,
           "first_file_s": round(first[0] - t, 3) if first else None,
           "devices": sorted({r.device for r in results if r.device})}
    if disk:
        floor = floor_seconds(disk, read, written)
        row.update(disk_floor_s=round(floor, 3), of_disk=round(floor / took, 3))
    return row


def profile_worker(paths: list[Path], out_dir: Path, device: str, threads: int, extra: dict, top: int = 25) -> dict:
    """Encode, then decode, each of ``paths`` in this process through process_file, under
    cProfile; prints the per-file seconds and the functions that took the most cumulative time."""
    import cProfile
    import io
    import pstats

    from cachegen_cli.batch.work import BatchSettings, process_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    result = {}
    for op in ("encode", "decode"):
        settings = BatchSettings(op=op, device=device, threads=threads, force=True, options=extra if op == "encode" else {})
        srcs = paths if op == "encode" else [out_dir / (p.stem + ".cgen") for p in paths]
        dsts = [out_dir / (p.stem + ".cgen") for p in paths] if op == "encode" else \
            [out_dir / (p.stem + ".decoded.safetensors") for p in paths]
        process_file(str(srcs[0]), str(dsts[0]), settings)  # warm-up: kernels compiled or loaded
        prof = cProfile.Profile()
        rows = []
        prof.enable()
        for src, dst in zip(srcs, dsts):
            rows.append(process_file(str(src), str(dst), settings))
        prof.disable()
        failed = [r for r in rows if r["status"] != "done"]
        if failed:
            raise SystemExit(f"profile: {failed[0]['input']}: {failed[0]['error']}")
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
        seconds = [r["seconds"] for r in rows]
        raw = [r["input_bytes"] if op == "encode" else r["output_bytes"] for r in rows]
        rate = statistics.median(b / s / 1e9 for b, s in zip(raw, seconds))
        print(f"# profile {op}: {len(rows)} files one after another in one process, seconds per file "
              f"{', '.join(f'{x:.3f}' for x in seconds)}; file -> file {rate:.2f} GB/s (median)", flush=True)
        print(text.getvalue(), flush=True)
        result[op] = {"seconds_per_file": seconds, "file_to_file_GBps_median": round(rate, 3),
                      "ratio": rows[0]["ratio"], "profile": text.getvalue()}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=100)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dir", type=Path, default=ROOT / "build" / "bench_batch")
    p.add_argument("--backends", default="local", help="comma-separated: local, ray")
    p.add_argument("--pools", default="process", help="local pools, comma-separated: process, thread")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--quality", default=None)
    p.add_argument("--preset", default=None, help="e.g. lmcache (format v1)")
    p.add_argument("--warmup", type=int, default=2, help="files of a warm-up batch before each backend's timing")
    p.add_argument("--ray-cpus", type=int, default=None, help="num_cpus of a local Ray instance")
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="first profile one worker coding N files in this process (cProfile)")
    args = p.parse_args()

    paths = build_files(args.dir / "inputs", args.files, args.tokens, args.layers, args.heads, args.head_dim)
    size = sum(x.stat().st_size for x in paths)
    report = {
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
        "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                    platform.machine()),
        "files": args.files, "shape": [args.layers, 2, args.tokens, args.heads, args.head_dim], "bytes": size,
        "disk": disk_speed(paths, args.dir / "disk_scratch"), "runs": [],
    }
    print(json.dumps({k: report[k] for k in ("date", "cpus", "cpu", "files", "shape", "bytes", "disk")}), flush=True)
    extra = {k: v for k, v in (("quality", args.quality), ("preset", args.preset)) if v is not None}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))

    if args.profile:
        report["profile"] = profile_worker(paths[: args.profile], args.dir / "profiled", args.device, args.threads,
                                           extra)
        save()
    for backend in filter(None, args.backends.split(",")):  # --backends "": the profile only
        if backend == "ray":
            import ray

            ray.init(num_cpus=args.ray_cpus, log_to_driver=False)
        for pool in (args.pools.split(",") if backend == "local" else ["-"]):
            if args.warmup:  # both directions: a fresh kernel cache gets the decoder's kernels too
                run(paths[: args.warmup], "encode", args.dir / "warm", backend, pool, args.workers, args.device,
                    args.threads, extra)
                run(sorted((args.dir / "warm").glob("*.cgen")), "decode", args.dir / "warm_decoded", backend, pool,
                    args.workers, args.device, args.threads, {})
            enc = run(paths, "encode", args.dir / "encoded", backend, pool, args.workers, args.device, args.threads,
                      extra, report["disk"])
            dec = run(sorted((args.dir / "encoded").glob("*.cgen")), "decode", args.dir / "decoded", backend, pool,
                      args.workers, args.device, args.threads, {}, report["disk"])
            for row in (enc, dec):
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
