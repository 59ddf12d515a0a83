"""Every method, every path: ratio, GPU / host-bytes / file / CPU speeds and peak memory in one table.

    python benchmarks/bench_all.py                      # all methods on the devices this machine has
    python benchmarks/bench_all.py --devices cpu --tokens 512 --cpu-tokens 256 --repeats 2   # quick, CPU only
    python benchmarks/bench_all.py --qualities balanced,lmcache --json all.json

Methods: each ``--quality`` (lossless, high, balanced, small), the same with a calibration
("+cal": a PCA rotation from ``cachegen_cli.methods.calibration.fit`` fitted on *another* cache, the
second sample -- another text -- tiled to the same shape), and ``--preset lmcache``.

The cache is ``bench.build_cache(tokens)``: Llama-3.1-8B-shaped (32 layers x 8 KV heads x 128
dims, bf16), tiled from the real SmolLM2 sample; 8192 tokens = 1.07 GB for the GPU rows,
--cpu-tokens (1024) for the CPU rows, which are slower.  Paths, for each method:

- GPU resident: a CUDA tensor -> ``.cgen`` bytes in a uint8 CUDA tensor (``encode_to_device``)
  -> a CUDA tensor (``decode(tensor, device="cuda")``), and the fraction of the device-to-device
  copy ceiling (bytes read + written per second of a 1 GiB torch copy) it reaches;
- host bytes: ``encode(kv, device=...)`` -> Python ``bytes`` -> ``decode(blob, device=...)``;
- file -> file: ``encode_file`` / ``decode_file`` in a temporary directory;
- CPU, all cores and one core (a child pinned to one CPU, NUMBA_NUM_THREADS=1, one torch thread).

Method (docs/benchmarks.md "Method"): one warm-up run first (kernel compilation and loading
excluded), then the median of --repeats runs (twice that for the GPU-resident path, which
takes milliseconds), with the min-max spread; GPU times on the host clock with a device
synchronisation before each clock reading.  Rates count uncompressed bf16 bytes (1 GB = 1e9 B).

Every (method, device, thread count) runs in its own child process, so that its peak memory
is its own: the peak resident set (VmHWM, reset before each path through
/proc/self/clear_refs) and, on the GPU, torch.cuda.max_memory_allocated (torch's allocator
only: numba-cuda's own device arrays are not in it).  Cells that cannot run here (GPU cells
without a GPU, a method a path does not support) say "n/a", never a number.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: The calibration is fitted on this cache (another text than the benchmarked one), never on the
#: benchmarked cache itself: fitted on itself, the PCA finds the tiling's repetition (docs/benchmarks.md ¹).
CAL_SAMPLE = ROOT / "sample_data" / "smollm2_code_96.safetensors"
QUALITIES = ("lossless", "high", "balanced", "small")
#: lossless+cal is left out of the default: the library refuses a rotation there (it would not be
#: bit-exact); asked for explicitly, it prints n/a with the library's reason.
DEFAULT_METHODS = (*QUALITIES, "high+cal", "balanced+cal", "small+cal", "lmcache")
IDENTITY_TOKENS = 256
COPY_BYTES = 1 << 30
GPU_PATHS = ("resident", "host", "file")
PATH_LABEL = {"resident": "GPU resident", "host": "host bytes", "file": "file -> file"}


# ---------------------------------------------------------------- methods

CAL_SUFFIXES = ("cal", "cal/head", "cal/head+rope")


def split_method(method: str) -> tuple[str, bool]:
    base, _, suffix = method.partition("+")
    return base, suffix in CAL_SUFFIXES


def cal_kind(method: str) -> str:
    """Which calibration a method uses: "full" (+cal: one C x C rotation per (layer, K/V)),
    "head" (+cal/head: one block per KV head) or "head_rope" (+cal/head+rope: one block per KV
    head fitted on keys without SmolLM2's RoPE, which the encoder then removes: what `cachegen
    calibrate` fits by default on captured caches; bench_device.py's row of that name)."""
    if method.endswith("+cal/head+rope"):
        return "head_rope"
    return "head" if method.endswith("+cal/head") else "full"


def check_method(method: str) -> str:
    base, _, suffix = method.partition("+")
    if base not in (*QUALITIES, "lmcache") or suffix not in ("", *CAL_SUFFIXES):
        raise argparse.ArgumentTypeError(
            f"unknown method {method!r}: choose {', '.join(QUALITIES)} or lmcache, optionally with "
            f"+{', +'.join(CAL_SUFFIXES)}")
    return method


def encode_kwargs(method: str, cal) -> dict:
    """Keyword arguments of encode / encode_to_device / encode_file for a method.  A calibration is
    only passed when the method has one, so that an API without the ``calibration`` argument still
    runs the other methods."""
    base, with_cal = split_method(method)
    kw = {"preset": "lmcache"} if base == "lmcache" else {"quality": base}
    if with_cal:
        kw["calibration"] = cal
    return kw


def decode_kwargs(method: str, cal) -> dict:
    return {"calibration": cal} if split_method(method)[1] else {}


# ---------------------------------------------------------------- machine facts

def _cpuinfo(field: str) -> str | None:
    """The first CPU's ``field`` in /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


#: /proc/cpuinfo flags that decide how fast the CPU's int8 rotation product runs (oneDNN's int8 GEMM
#: behind torch._int_mm uses VNNI or AMX where the CPU has them)
MATRIX_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")


def cpu_matrix_flags() -> list[str]:
    """The MATRIX_FLAGS this machine's first CPU lists."""
    have = set((_cpuinfo("flags") or "").split())
    return [f for f in MATRIX_FLAGS if f in have]


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """HEAD, and whether the tracked files differ from it (other work in the tree changes numbers).
    CACHEGEN_COMMIT names it for a tree exported without its git folder (``git archive``, as
    benchmarks run on a lent machine), and a tree that is not its own git top level (exported
    into another checkout, whose HEAD says nothing about this code) is "unknown".
    --no-optional-locks: never take the index lock another git command may be holding."""
    if os.environ.get("CACHEGEN_COMMIT"):
        return os.environ["CACHEGEN_COMMIT"] + " (CACHEGEN_COMMIT)"

    def git(*args):
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=30).stdout.strip()
    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != ROOT.resolve():
            return "unknown"
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")


# ---------------------------------------------------------------- memory of this process

def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """The high-water mark since the last reset.  VmHWM rather than getrusage's ru_maxrss: the
    latter also keeps the peak of exited threads, which clear_refs does not reset."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


# ---------------------------------------------------------------- timing

def timed_runs(fn, repeats: int, sync):
    """One warm-up call (compilation, loading), then the seconds of ``repeats`` calls, and the last
    call's result.  A sync before each clock reading, so that no GPU work of an earlier call is
    counted and none of this one is missed; the previous result is dropped before each call (not
    timed), so that the peak memory is that of one call, not of two results side by side."""
    result = fn()
    sync()
    times = []
    for _ in range(repeats):
        result = None
        sync()
        t = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - t)
    return times, result


# ---------------------------------------------------------------- child jobs (run in child processes)

def tile_calibration_cache(layers: int = 32, heads: int = 8, head_dim: int = 128):
    """The second sample (another text) tiled to the benchmarked shape [layers, 2, tokens, C] exactly
    as bench.build_cache tiles the first: layer l, channel c take sample layer (l + c // 192) % 30,
    channel c % 192.  Its own 96 tokens only: repeating tokens adds nothing to a covariance."""
    import torch

    from cachegen_cli.storage import kvio

    src = kvio.read_safetensors(CAL_SAMPLE).data  # [30, 2, 96, 192]
    sl, _, st, sc = src.shape
    c = torch.arange(heads * head_dim)
    out = torch.empty(layers, 2, st, heads * head_dim, dtype=src.dtype)
    for layer in range(layers):
        out[layer] = src[(layer + c // sc) % sl, :, :, c % sc].permute(1, 2, 0)
    return out


def job_fit(spec: dict) -> dict:
    """Fit the calibration once and leave it as .npy + JSON for the other children: loading it
    with calibration.load would re-check the orthonormality of 64 1024x1024 matrices in each."""
    import numpy as np

    from cachegen_cli.methods import calibration

    t = time.perf_counter()
    cache = tile_calibration_cache()
    cal = calibration.fit([cache])
    out = Path(spec["cal_dir"])
    np.save(out / "rotation.npy", cal.rotation)
    (out / "metadata.json").write_text(json.dumps(cal.metadata))
    per_head = calibration.fit([cache], blocks=8)  # one block per KV head of the benchmarked shape
    np.save(out / "rotation_head.npy", per_head.rotation)
    (out / "metadata_head.json").write_text(json.dumps(per_head.metadata))
    from bench_device import SMOL_ROPE

    from cachegen_cli.model.calibrate import fit_samples

    head_rope = fit_samples([cache], 8, [SMOL_ROPE])  # as bench_device's "head+rope"
    np.save(out / "rotation_head_rope.npy", head_rope.rotation)
    (out / "metadata_head_rope.json").write_text(json.dumps(head_rope.metadata))
    return {"seconds": time.perf_counter() - t, "sample": CAL_SAMPLE.name, "sample_tokens": int(cache.shape[2]),
            "num_channels": cal.num_channels, "sha256": cal.sha256.hex()}


def load_calibration(cal_dir: str | None, kind: str = "full"):
    if cal_dir is None:
        return None
    import numpy as np

    from cachegen_cli.methods.calibration import Calibration

    tail = "" if kind == "full" else f"_{kind}"
    meta = json.loads((Path(cal_dir) / f"metadata{tail}.json").read_text())
    return Calibration(np.ascontiguousarray(np.load(Path(cal_dir) / f"rotation{tail}.npy")), meta)


def job_copy(spec: dict) -> dict:
    """The device-to-device copy ceiling: a 1 GiB torch copy, bytes read + written per second
    (CUDA events, median of 10 after a warm-up: the ceiling of the hardware, not of the host)."""
    import torch

    a = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    props = torch.cuda.get_device_properties(0)
    return {"copy_Bps": 2 * COPY_BYTES / statistics.median(times), "copy_s": times, "gpu": props.name,
            "gpu_memory_bytes": int(props.total_memory), "cuda": torch.version.cuda}


def path_calls(path: str, kv, device: str, ekw: dict, dkw: dict, tmp: Path):
    """(encode(), decode(encoded), size(encoded), bytes_of(encoded)) for one path."""
    import cachegen_cli as cg

    if path == "resident":
        return (lambda: cg.encode_to_device(kv, **ekw),
                lambda blob: cg.decode(blob, device="cuda", **dkw)["kv"],
                lambda blob: int(blob.numel()),
                lambda blob: blob.cpu().numpy().tobytes())
    if path == "host":
        return (lambda: cg.encode(kv, device=device, **ekw),
                lambda blob: cg.decode(blob, device=device, **dkw)["kv"],
                len,
                lambda blob: blob)
    if path == "file":
        src, dst, back = tmp / "kv.safetensors", tmp / "kv.cgen", tmp / "back.safetensors"

        def encode():
            cg.encode_file(src, dst, force=True, device=device, **ekw)
            return dst

        return (encode,
                lambda _: cg.decode_file(dst, back, force=True, device=device, **dkw),
                lambda p: p.stat().st_size,
                lambda p: p.read_bytes())
    raise ValueError(path)


def measure_path(path: str, kv, method: str, cal, device: str, repeats: int, tmp: Path) -> dict:
    """Warm-up, then the timed encodes and decodes of one path, and its peak memory."""
    import torch

    from cachegen_cli.errors import ConfigError

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if path == "resident":
        repeats *= 2  # ~10 ms a call: more runs for the same confidence (docs/benchmarks.md)
    rec = {"path": path}
    reset_ok = reset_peak_rss()
    rec["rss_before_bytes"], rec["peak_rss_is_whole_child"] = rss_bytes(), not reset_ok
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        rec["gpu_allocated_before_bytes"] = int(torch.cuda.memory_allocated())
    try:
        encode, decode, size, bytes_of = path_calls(path, kv, device, encode_kwargs(method, cal),
                                                     decode_kwargs(method, cal), tmp)
        rec["encode_s"], blob = timed_runs(encode, repeats, sync)
        rec["decode_s"], out = timed_runs(lambda: decode(blob), repeats, sync)
    except (TypeError, ConfigError) as exc:  # this API or method does not offer that path
        return {"path": path, "na": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - a failure is a result: printed, never a number
        return {"path": path, "error": f"{type(exc).__name__}: {exc}"}
    rec["peak_rss_bytes"] = peak_rss_bytes()
    if cuda:
        rec["gpu_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    # Checks after the peaks were read: they copy.
    rec["file_bytes"] = size(blob)
    rec["sha256"] = hashlib.sha256(bytes_of(blob)).hexdigest()
    if isinstance(out, torch.Tensor):
        rec["bit_exact"] = bool(torch.equal(out.to(kv.device).view(torch.int16), kv.view(torch.int16)))
    return rec


def job_measure(spec: dict) -> dict:
    import numba
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(HERE))
    from bench import build_cache

    if spec["threads"] == 1:  # the parent pinned this process and set NUMBA_NUM_THREADS=1
        torch.set_num_threads(1)
    method, device = spec["method"], spec["device"]
    cal = load_calibration(spec["cal_dir"], cal_kind(method)) if split_method(method)[1] else None
    kv = build_cache(spec["tokens"])
    nbytes = kv.numel() * kv.element_size()
    paths = []
    with tempfile.TemporaryDirectory(prefix="bench_all_") as tmp:
        tmp = Path(tmp)
        if "file" in spec["paths"]:
            save_file({"kv": kv}, str(tmp / "kv.safetensors"))
        if device == "cuda":
            kv = kv.cuda()  # the host copy goes: the GPU rows' host memory is the codec's, not the input's
            torch.cuda.synchronize()
        for path in spec["paths"]:
            paths.append(measure_path(path, kv, method, cal, device, spec["repeats"], tmp))
    return {"bytes": nbytes, "paths": paths, "numba_threads": numba.get_num_threads(),
            "torch_threads": torch.get_num_threads(), "cpus_usable": len(usable_cpus()),
            "whole_child_maxrss_bytes": _whole_child_maxrss()}


def _whole_child_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def job_identity(spec: dict) -> dict:
    """CPU and GPU bytes of each method on the first tokens of the cache, and the decoded tensors."""
    import torch

    import cachegen_cli as cg
    from cachegen_cli.errors import ConfigError

    sys.path.insert(0, str(HERE))
    from bench import build_cache

    kv = build_cache(spec["tokens"])  # the tiling is periodic in t: the first tokens of any larger cache
    kv_gpu = kv.cuda()
    out = []
    for method in spec["methods"]:
        cal = load_calibration(spec["cal_dir"], cal_kind(method)) if split_method(method)[1] else None
        ekw, dkw = encode_kwargs(method, cal), decode_kwargs(method, cal)
        rec = {"method": method}
        try:
            cpu_b = cg.encode(kv, device="cpu", **ekw)
            gpu_b = cg.encode(kv_gpu, device="cuda", **ekw)
            rec["identical_bytes"] = cpu_b == gpu_b
            a = cg.decode(cpu_b, device="cpu", **dkw)["kv"]
            b = cg.decode(gpu_b, device="cuda", **dkw)["kv"].cpu()
            rec["identical_decoded"] = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        except (TypeError, ConfigError) as exc:
            rec["na"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
        if "identical_bytes" in rec:
            try:
                rec["identical_resident_bytes"] = cg.encode_to_device(kv_gpu, **ekw).cpu().numpy().tobytes() == cpu_b
            except (TypeError, ConfigError) as exc:
                rec["resident_na"] = f"{type(exc).__name__}: {exc}"
        out.append(rec)
    return {"tokens": spec["tokens"], "methods": out}


JOBS = {"fit": job_fit, "copy": job_copy, "measure": job_measure, "identity": job_identity}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = JOBS[spec["kind"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))


# ---------------------------------------------------------------- the parent: children, lines, table

def run_child(spec: dict, workdir: Path, *, single_core: bool = False, verbose: bool = False) -> dict:
    """Run one job in a fresh interpreter and return its result (or {"error": ...})."""
    n = len(list(workdir.glob("spec*.json")))
    spec = dict(spec, result=str(workdir / f"result{n}.json"))
    spec_path = workdir / f"spec{n}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    preexec = None
    if single_core:
        env.update(NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cpu = usable_cpus()[-1]
        preexec = lambda: os.sched_setaffinity(0, {cpu})  # noqa: E731 - runs in the child before exec
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                          env=env, preexec_fn=preexec, capture_output=True, text=True)
    if verbose or proc.returncode:
        sys.stderr.write(proc.stderr)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"child exited with {proc.returncode}: {last}"}
    return json.loads(Path(spec["result"]).read_text())


def rate_stats(nbytes: int, times: list[float]) -> dict:
    med = statistics.median(times)
    return {"median_Bps": nbytes / med, "min_Bps": nbytes / max(times), "max_Bps": nbytes / min(times),
            "median_s": med}


def fmt_rate(bps: float, unit: str) -> str:
    v = bps / (1e9 if unit == "GB/s" else 1e6)
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def fmt_pct(fraction: float) -> str:
    return f"{100 * fraction:.2g}%"


def one_line(msg: str) -> str:
    """The first line of an error (numba's run to pages; the JSON keeps them whole)."""
    return (msg.strip().splitlines() or [""])[0]


def fmt_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB"


def summarize_path(rec: dict, nbytes: int, copy_bps: float | None) -> dict:
    """Rates, spread and ratio of one path's raw times (kept with them in the JSON)."""
    if "encode_s" not in rec:
        return rec
    rec = dict(rec, bytes=nbytes, ratio=nbytes / rec["file_bytes"],
               encode=rate_stats(nbytes, rec["encode_s"]), decode=rate_stats(nbytes, rec["decode_s"]))
    if copy_bps:  # GPU paths only (the caller passes None for the CPU)
        rec["encode"]["of_copy_ceiling"] = rec["encode"]["median_Bps"] / copy_bps
        rec["decode"]["of_copy_ceiling"] = rec["decode"]["median_Bps"] / copy_bps
    return rec


def path_line(m: dict, rec: dict) -> str:
    """One progress line: what ran, median and spread, memory."""
    unit = "GB/s" if m["device"] == "cuda" else "MB/s"
    where = "GPU" if m["device"] == "cuda" else ("CPU 1 core" if m["threads"] == 1 else "CPU all cores")
    head = f"{where:13s} {m['method']:13s} {PATH_LABEL[rec['path']]:12s} {m['tokens']:6d} tokens"
    if "na" in rec or "error" in rec:
        return f"{head}  {'n/a' if 'na' in rec else 'ERROR'}: {one_line(rec.get('na') or rec.get('error'))}"
    parts = [head, f"{rec['bytes'] / 1e9:.3f} GB", f"ratio {rec['ratio']:.2f}x"]
    for side in ("encode", "decode"):
        s = rec[side]
        parts.append(f"{side} {fmt_rate(s['median_Bps'], unit)} {unit} "
                     f"[{fmt_rate(s['min_Bps'], unit)}-{fmt_rate(s['max_Bps'], unit)}]")
    if "of_copy_ceiling" in rec["encode"]:
        parts.append(f"{fmt_pct(rec['encode']['of_copy_ceiling'])} / {fmt_pct(rec['decode']['of_copy_ceiling'])} of copy")
    mem = f"peak RSS {fmt_bytes(rec['peak_rss_bytes'])}" + (" (whole child)" if rec["peak_rss_is_whole_child"] else "")
    if "gpu_peak_allocated_bytes" in rec:
        mem += f", GPU {fmt_bytes(rec['gpu_peak_allocated_bytes'])} (torch)"
    parts.append(mem)
    if rec.get("bit_exact"):
        parts.append("bit-exact")
    return "  ".join(parts)


def plan(args, devices: list[str]) -> list[dict]:
    """The measurement children: per method, the GPU paths, CPU all cores, CPU one core."""
    jobs = []
    for method in args.qualities:
        cpu_tokens = args.cpu_tokens
        if split_method(method)[1]:
            # C float64 multiply-adds per value each way (C = 1024): minutes a run on a CPU at 1024 tokens.
            cpu_tokens = min(cpu_tokens, args.cpu_cal_tokens)
        if "cuda" in devices:
            jobs.append({"method": method, "device": "cuda", "threads": "all", "tokens": args.tokens,
                         "paths": list(GPU_PATHS)})
        if "cpu" in devices:
            jobs.append({"method": method, "device": "cpu", "threads": "all", "tokens": cpu_tokens,
                         "paths": ["host", "file"]})
            if not args.no_cpu_single_core:
                jobs.append({"method": method, "device": "cpu", "threads": 1, "tokens": cpu_tokens,
                             "paths": ["host"]})
    return jobs


def find(measurements: list[dict], method: str, device: str, threads, path: str) -> dict | None:
    for m in measurements:
        if (m["method"], m["device"], m["threads"]) == (method, device, threads):
            for rec in m.get("paths", []):
                if rec["path"] == path:
                    return rec
    return None


def cell(rec: dict | None, unit: str) -> str:
    if rec is None or "encode" not in rec:
        return "n/a" if rec is None or "na" in rec else "error"
    return f"{fmt_rate(rec['encode']['median_Bps'], unit)} / {fmt_rate(rec['decode']['median_Bps'], unit)}"


def table(methods: list[str], measurements: list[dict], ncpu: int) -> list[str]:
    rows = [f"| method | tokens GPU / CPU | ratio | GPU resident GB/s | of copy ceiling | GPU host bytes GB/s | GPU file→file GB/s "
            f"| CPU {ncpu} cores MB/s | CPU 1 core MB/s | CPU file→file MB/s | peak RSS GB (GPU / CPU) | peak GPU GB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method in methods:
        g = {p: find(measurements, method, "cuda", "all", p) for p in GPU_PATHS}
        c_all, c_file = find(measurements, method, "cpu", "all", "host"), find(measurements, method, "cpu", "all", "file")
        c_one = find(measurements, method, "cpu", 1, "host")
        ratio_rec = next((r for r in (g["host"], g["resident"], g["file"], c_all, c_file, c_one)
                          if r is not None and "ratio" in r), None)
        res = g["resident"]
        ceiling = (f"{fmt_pct(res['encode']['of_copy_ceiling'])} / {fmt_pct(res['decode']['of_copy_ceiling'])}"
                   if res is not None and "of_copy_ceiling" in res.get("encode", {}) else "n/a")

        def peak(recs, key):
            vals = [r[key] for r in recs if r is not None and r.get(key) is not None]
            return f"{max(vals) / 1e9:.2f}" if vals else "n/a"

        tokens = [next((m["tokens"] for m in measurements if (m["method"], m["device"]) == (method, d)), None)
                  for d in ("cuda", "cpu")]
        rows.append(" | ".join([
            f"| {method}", " / ".join("-" if t is None else str(t) for t in tokens),
            f"{ratio_rec['ratio']:.2f}×" if ratio_rec else "n/a",
            cell(res, "GB/s"), ceiling, cell(g["host"], "GB/s"), cell(g["file"], "GB/s"),
            cell(c_all, "MB/s"), cell(c_one, "MB/s"), cell(c_file, "MB/s"),
            f"{peak(g.values(), 'peak_rss_bytes')} / {peak([c_all, c_file], 'peak_rss_bytes')}",
            peak(g.values(), "gpu_peak_allocated_bytes") + " |"]))
    return rows


def parse_args(argv):
    import torch

    p = argparse.ArgumentParser(prog="bench_all", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the GPU cache (default 8192: 1.07 GB)")
    p.add_argument("--cpu-tokens", type=int, default=1024, help="tokens of the CPU cache (default 1024)")
    p.add_argument("--cpu-cal-tokens", type=int, default=256,
                   help="at most this many tokens for the CPU rows of +cal methods (default 256: the rotation "
                        "costs 1024 multiply-adds per value on the CPU)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs after the warm-up (default 5)")
    p.add_argument("--qualities", default=",".join(DEFAULT_METHODS),
                   type=lambda s: [check_method(m) for m in s.split(",") if m],
                   help=f"comma list of methods (default: {','.join(DEFAULT_METHODS)})")
    # The CPU columns and the CPU/GPU byte check need the CPU, so a GPU machine measures both by default.
    p.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu",
                   help="comma list of cpu, cuda (default: cpu,cuda with a GPU, else cpu)")
    p.add_argument("--no-cpu-single-core", action="store_true", help="skip the pinned one-core CPU runs")
    p.add_argument("--json", type=Path, help="write every raw number and the machine facts there")
    p.add_argument("--verbose", action="store_true", help="show the children's stderr (warnings) too")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        if min(args.tokens, args.cpu_tokens, args.cpu_cal_tokens) < 2 or args.repeats < 1:
            p.error("--tokens, --cpu-tokens, --cpu-cal-tokens need >= 2 and --repeats >= 1")
        bad = set(args.devices.split(",")) - {"cpu", "cuda", ""}
        if bad:
            p.error(f"--devices: unknown {', '.join(sorted(bad))} (choose cpu, cuda)")
    return args


def gpu_unavailable_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU that torch can use"
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM is on: numba's simulator, not the GPU"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        child_main(args.child)
        return 0
    import torch

    from cachegen_cli.kernels.fixed_rotation import int8_products

    devices = [d for d in args.devices.split(",") if d]
    gpu_na = gpu_unavailable_reason() if "cuda" in devices else None
    if gpu_na:
        devices.remove("cuda")
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": cpu_model(), "cpus": os.cpu_count(), "cpus_usable": len(usable_cpus()),
            "load_avg_before": os.getloadavg(), "python": platform.python_version(), "torch": torch.__version__,
            "numba": package_version("numba"), "numba_cuda": package_version("numba-cuda"),
            "numpy": package_version("numpy"), "git_commit": git_commit(), "command": shlex.join(sys.argv),
            "argv": list(sys.argv[1:] if argv is None else argv), "gpu": None,
            # whether torch backs large CPU tensors with huge pages (read at its start; the children inherit it)
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            # which product the CPU's fixed-point rotation uses here (int8 digits, else float64)
            "cpu_matrix_flags": cpu_matrix_flags(), "cpu_int8_product": bool(int8_products())}
    results = {"info": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "devices": devices, "gpu_na": gpu_na, "measurements": []}
    with tempfile.TemporaryDirectory(prefix="bench_all_") as work:
        work = Path(work)
        copy_bps = None
        if "cuda" in devices:
            copy = results["copy"] = run_child({"kind": "copy"}, work, verbose=args.verbose)
            copy_bps = copy.get("copy_Bps")
            info["gpu"] = copy.get("gpu")
        print(f"# {info['date']}  {info['host']}  CPU: {info['cpu']} ({info['cpus_usable']} of {info['cpus']} CPUs usable, "
              f"load avg {' '.join(f'{x:.2f}' for x in info['load_avg_before'])})  GPU: {info['gpu'] or 'none'}"
              + (f" ({gpu_na})" if gpu_na else "")
              + f"  torch {info['torch']}, numba {info['numba']}, numba-cuda {info['numba_cuda'] or '-'}")
        print(f"# commit {info['git_commit']}")
        print(f"# {info['command']}")
        if "cuda" in devices:
            print(f"# device-to-device copy ceiling: " + (f"{copy_bps / 1e12:.2f} TB/s (bytes read + written)"
                                                         if copy_bps else f"n/a ({results['copy'].get('error')})"))
        cal_dir = None
        if any(split_method(m)[1] for m in args.qualities):
            cal_dir = work / "cal"
            cal_dir.mkdir()
            fit = results["calibration"] = run_child({"kind": "fit", "cal_dir": str(cal_dir)}, work, verbose=args.verbose)
            if "error" in fit:
                print(f"# calibration: ERROR {fit['error']}")
            else:
                print(f"# calibration for +cal: calibration.fit on {fit['sample']} (another text), tiled to the "
                      f"same shape, {fit['sample_tokens']} tokens ({fit['seconds']:.0f} s)")
        print(f"# GPU cache: {args.tokens} tokens; CPU cache: {args.cpu_tokens} tokens "
              f"(+cal: {min(args.cpu_tokens, args.cpu_cal_tokens)}); median of {args.repeats} runs after a warm-up "
              f"[min-max]; rates in bf16 bytes per second", flush=True)
        for job in plan(args, devices):
            spec = dict(job, kind="measure", repeats=args.repeats, cal_dir=str(cal_dir) if cal_dir else None)
            res = run_child(spec, work, single_core=job["threads"] == 1, verbose=args.verbose)
            m = dict(job, **{k: v for k, v in res.items() if k != "paths"})
            if "error" in res:  # the child died: every path it had to measure is an error
                m["paths"] = [{"path": p, "error": res["error"]} for p in job["paths"]]
            else:
                ceiling = copy_bps if job["device"] == "cuda" else None
                m["paths"] = [summarize_path(rec, res["bytes"], ceiling) for rec in res["paths"]]
            results["measurements"].append(m)
            for rec in m["paths"]:
                print(path_line(m, rec), flush=True)
        for line in same_bytes_lines(args.qualities, results["measurements"]):
            print(line)
        if "cuda" in devices and "cpu" in devices:
            ident = results["identity"] = run_child(
                {"kind": "identity", "tokens": min(IDENTITY_TOKENS, args.tokens), "methods": args.qualities,
                 "cal_dir": str(cal_dir) if cal_dir else None}, work, verbose=args.verbose)
            print_identity(ident)
        else:
            print(f"# identical CPU and GPU bytes: n/a ({gpu_na or 'needs --devices cpu,cuda'})")
    print("\n# ratio: of the GPU cache where it ran, else of the CPU cache; cells: encode / decode, medians; "
          "peak RSS: the method's GPU child / CPU all-cores child; peak GPU: torch's allocator only")
    for line in table(args.qualities, results["measurements"], len(usable_cpus())):
        print(line)
    if args.json:
        info["load_avg_after"] = os.getloadavg()
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def same_bytes_lines(methods: list[str], measurements: list[dict]) -> list[str]:
    """Whether every path and thread count of a method wrote the same file for the same cache
    (the .cgen bytes may not depend on how they were produced)."""
    lines = []
    for method in methods:
        by_tokens: dict[int, list[str]] = {}
        for m in measurements:
            if m["method"] == method:
                by_tokens.setdefault(m["tokens"], []).extend(r["sha256"] for r in m["paths"] if "sha256" in r)
        parts = [f"{t} tokens: {len(set(h)) == 1} ({len(h)} files)" for t, h in sorted(by_tokens.items()) if h]
        if parts:
            lines.append(f"# same bytes from every path and thread count, {method}: " + ", ".join(parts))
    return lines


def print_identity(ident: dict) -> None:
    if "error" in ident:
        print(f"# identical CPU and GPU bytes: ERROR {one_line(ident['error'])}")
        return
    for rec in ident["methods"]:
        if "na" in rec or "error" in rec:
            print(f"# identical CPU and GPU bytes, {rec['method']}, first {ident['tokens']} tokens: "
                  f"{'n/a' if 'na' in rec else 'ERROR'} ({one_line(rec.get('na') or rec.get('error'))})")
            continue
        resident = rec.get("identical_resident_bytes", f"n/a ({one_line(rec.get('resident_na', ''))})")
        print(f"# identical CPU and GPU bytes, {rec['method']}, first {ident['tokens']} tokens: {rec['identical_bytes']}; "
              f"encode_to_device bytes identical: {resident}; decoded tensors identical: {rec['identical_decoded']}")


if __name__ == "__main__":
    sys.exit(main())
