"""GPU-resident throughput of every method: a bf16 CUDA tensor -> .cgen bytes in a uint8 CUDA
tensor (``encode_to_device``) -> a bf16 CUDA tensor (``decode(tensor, device="cuda")``), with
per-stage times, CPU == GPU byte identity and the device-to-device copy ceiling.

    python benchmarks/bench_device.py --tokens 8192 --repeats 10 --json out.json

The cache is bench.py's Llama-3.1-8B-shaped one (32 layers x 8 KV heads x 128 dims, bf16,
tiled from the real SmolLM2 sample: 8192 tokens = 1.07 GB).  Timings follow the device
tool's METHOD.md: a warm-up call (compilation excluded), then the median (and min-max) of
--repeats calls, host clock after a device synchronisation; stage times from CUDA events
recorded after each stage's launches (transform_resident.STAGE_HOOK / lmcache_device.STAGE_HOOK),
so a stage includes the time the GPU waited for the host to launch it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.format import container  # noqa: E402
from cachegen_cli.pipeline import transform_resident, lmcache_device  # noqa: E402
from cachegen_cli.kernels import cuda_pipeline, launch  # noqa: E402
from cachegen_cli.methods import rope  # noqa: E402

METHODS = {
    "lossless": {"quality": "lossless"},
    "high": {"quality": "high"},
    "balanced": {"quality": "balanced"},
    "small": {"quality": "small"},
    "lmcache": {"preset": "lmcache"},
    # with a calibration fitted on another text (bench_all.tile_calibration_cache): one full
    # C x C rotation per (layer, K/V), or one block per KV head
    "high+cal": {"quality": "high", "calibration": "full"},
    "balanced+cal": {"quality": "balanced", "calibration": "full"},
    "small+cal": {"quality": "small", "calibration": "full"},
    "high+cal/head": {"quality": "high", "calibration": "head"},
    "balanced+cal/head": {"quality": "balanced", "calibration": "head"},
    "small+cal/head": {"quality": "small", "calibration": "head"},
    # keys without RoPE (format flags bit 2): SmolLM2's RoPE (theta 100000, heads of 64: the tiled
    # cache's 64-channel blocks are the sample's heads, bench.build_cache), alone and with a per-head
    # calibration fitted on keys without it.  Its positions repeat with the tiled tokens, so the
    # ratio here says nothing about the size gain (measured on real caches: docs/config.md).
    "high+rope": {"quality": "high", "rope": "smol"},
    "balanced+rope": {"quality": "balanced", "rope": "smol"},
    "small+rope": {"quality": "small", "rope": "smol"},
    "high+cal/head+rope": {"quality": "high", "calibration": "head+rope", "rope": "smol"},
    "balanced+cal/head+rope": {"quality": "balanced", "calibration": "head+rope", "rope": "smol"},
    "small+cal/head+rope": {"quality": "small", "calibration": "head+rope", "rope": "smol"},
}
DEFAULT_METHODS = "lossless,high,balanced,small,lmcache"
SMOL_ROPE = rope.from_theta(100000.0, 64)


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of fn() after one warm-up call, synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


class Stages:
    """CUDA events after each stage; medians of the stage durations over the calls."""

    def __init__(self) -> None:
        self.runs: list[list[tuple[str, torch.cuda.Event]]] = []

    def hook(self, name: str) -> None:
        if name == "start":
            self.runs.append([])
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.runs[-1].append((name, ev))

    def table(self) -> list[tuple[str, float]]:
        torch.cuda.synchronize()
        per: dict[str, list[float]] = {}
        for run in self.runs:
            for (_, a), (name, b) in zip(run, run[1:]):
                per.setdefault(name, []).append(a.elapsed_time(b))
        return [(name, statistics.median(v)) for name, v in per.items()]


def copy_ceiling() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    med, _, _ = timed(lambda: b.copy_(a), 10)
    return 2 * a.numel() / med


def method_options(name: str, kv: torch.Tensor, cals: dict | None = None) -> dict:
    """encode_to_device's keyword arguments for METHODS[name], fitting (once per kind, kept in
    cals) the calibration it names on another text (bench_all.tile_calibration_cache)."""
    cals = {} if cals is None else cals
    kw = dict(METHODS[name])
    if "calibration" in kw:
        kind = kw["calibration"]
        if kind not in cals:
            from bench_all import tile_calibration_cache
            from cachegen_cli.methods import calibration

            t = time.perf_counter()
            sample = tile_calibration_cache()
            if kind.endswith("+rope"):
                sample = rope.unturn(sample, SMOL_ROPE)
            cals[kind] = calibration.fit([sample], blocks=1 if kind == "full" else kv.shape[3])
            if kind.endswith("+rope"):
                cals[kind] = calibration.Calibration(cals[kind].rotation, dict(cals[kind].metadata,
                                                                                rope=rope.to_metadata(SMOL_ROPE)))
            print(f"# calibration ({kind}): fitted in {time.perf_counter() - t:.1f} s", flush=True)
        kw["calibration"] = cals[kind]
    if "rope" in kw:
        kw["rope"] = SMOL_ROPE
    return kw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--check-tokens", type=int, default=1024, help="tokens of the CPU == GPU byte check")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"of {', '.join(METHODS)}")
    p.add_argument("--json", type=Path)
    p.add_argument("--widths", default="",
                   help="kernel widths to time, e.g. 'levels=4,values=4;levels=2' (kernels/cuda_pipeline.WIDTH; "
                        "';' separates settings, each timed after the default one; the bytes do not change)")
    p.add_argument("--stream-symbols", type=int, default=None,
                   help="symbols per stream the version-2 writer aims at (container.STREAM_SYMBOLS_V2; the CPU == GPU "
                        "check then compares files written with it on both devices)")
    p.add_argument("--maxreg", default="",
                   help="register caps to time, e.g. 'quantize=64;quantize=80' (kernels/cuda_pipeline.REG_CAPS, 0: "
                        "none; ';' separates settings, each timed after the default one, on the kernels made per call "
                        "shape: quantize, dequantize; the bytes do not change)")
    p.add_argument("--rot-tiles", default="",
                   help="extra tilings of the rotation kernel to time on the calibrated methods: "
                        "'TM,TN,TK,RM,RN;...' (cuda_pipeline.ROT_*; the bytes do not depend on them)")
    args = p.parse_args()
    if args.stream_symbols:
        container.STREAM_SYMBOLS_V2 = args.stream_symbols
    commit = os.environ.get("CACHEGEN_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                 text=True).stdout.strip()
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {started:%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, commit {commit[:12]}, command: {' '.join(sys.argv)}", flush=True)
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
    kv = build_cache(args.tokens).cuda()
    nbytes = kv.numel() * kv.element_size()
    small = build_cache(args.check_tokens)
    rows = []
    cals = {}
    for name in args.methods.split(","):
        kw = method_options(name, kv, cals)
        blob = cg.encode_to_device(kv, **kw)
        dkw = {"calibration": kw["calibration"]} if "calibration" in kw else {}
        out = cg.decode(blob, device="cuda", **dkw)["kv"]
        exact = torch.equal(out.view(torch.int16), kv.view(torch.int16))
        enc = timed(lambda: cg.encode_to_device(kv, **kw), args.repeats)
        dec = timed(lambda: cg.decode(blob, device="cuda", **dkw), args.repeats)
        st_e, st_d = Stages(), Stages()
        transform_resident.STAGE_HOOK = lmcache_device.STAGE_HOOK = st_e.hook
        for _ in range(3):
            cg.encode_to_device(kv, **kw)
        transform_resident.STAGE_HOOK = lmcache_device.STAGE_HOOK = st_d.hook
        for _ in range(3):
            cg.decode(blob, device="cuda", **dkw)
        transform_resident.STAGE_HOOK = lmcache_device.STAGE_HOOK = None
        # identity: the CPU's bytes and values for a smaller cache
        cpu_blob = cg.encode(small, device="cpu", **kw)
        gpu_blob = cg.encode_to_device(small.cuda(), **kw).cpu().numpy().tobytes()
        same = cpu_blob == gpu_blob
        a = cg.decode(cpu_blob, device="cpu", **dkw)["kv"]
        b = cg.decode(lmcache_device.device_bytes(cpu_blob), device="cuda", **dkw)["kv"].cpu()
        same_values = torch.equal(a.view(torch.int16), b.view(torch.int16))
        row = {"method": name, "bytes": nbytes, "file_bytes": int(blob.numel()), "ratio": nbytes / blob.numel(),
               "encode_GBps": nbytes / enc[0] / 1e9, "encode_GBps_range": [nbytes / enc[2] / 1e9, nbytes / enc[1] / 1e9],
               "decode_GBps": nbytes / dec[0] / 1e9, "decode_GBps_range": [nbytes / dec[2] / 1e9, nbytes / dec[1] / 1e9],
               "bit_exact": exact, "identical_cpu_gpu_bytes": same, "identical_cpu_gpu_values": same_values,
               "encode_stages_ms": st_e.table(), "decode_stages_ms": st_d.table()}
        rows.append(row)
        print(f"{name:9s} ratio {row['ratio']:.2f}x  encode {row['encode_GBps']:.1f} GB/s "
              f"({row['encode_GBps_range'][0]:.1f}-{row['encode_GBps_range'][1]:.1f})  decode {row['decode_GBps']:.1f} "
              f"GB/s ({row['decode_GBps_range'][0]:.1f}-{row['decode_GBps_range'][1]:.1f})  "
              f"of ceiling {nbytes / enc[0] / ceiling:.1%}/{nbytes / dec[0] / ceiling:.1%}  "
              f"cpu==gpu bytes {same} values {same_values}" + ("  bit-exact" if exact else ""), flush=True)
        for label, st in (("  encode", row["encode_stages_ms"]), ("  decode", row["decode_stages_ms"])):
            print(label + ": " + ", ".join(f"{n} {ms:.2f}" for n, ms in st) + f"  (sum {sum(ms for _, ms in st):.2f} ms)")
        row["widths"] = []
        default = dict(cuda_pipeline.WIDTH)
        for setting in filter(None, args.widths.split(";")):
            cuda_pipeline.WIDTH.update({k: int(v) for k, v in (kv_.split("=") for kv_ in setting.split(","))})
            e = timed(lambda: cg.encode_to_device(kv, **kw), args.repeats)
            d = timed(lambda: cg.decode(blob, device="cuda", **dkw), args.repeats)
            same_w = cg.encode_to_device(kv, **kw).equal(blob)
            row["widths"].append({"width": dict(cuda_pipeline.WIDTH), "encode_GBps": nbytes / e[0] / 1e9,
                                  "decode_GBps": nbytes / d[0] / 1e9, "same_bytes": same_w})
            print(f"  widths {cuda_pipeline.WIDTH}: encode {nbytes / e[0] / 1e9:.1f} GB/s, decode "
                  f"{nbytes / d[0] / 1e9:.1f} GB/s, same bytes {same_w}", flush=True)
            cuda_pipeline.WIDTH.clear()
            cuda_pipeline.WIDTH.update(default)
        row["maxreg"] = []
        default_caps = dict(cuda_pipeline.REG_CAPS)
        disk_cache = launch.DISK_CACHE
        # numba's disk cache keys a kernel on its source, not its compile options: kernels made
        # under other caps are compiled here, not served the default caps' binaries
        launch.DISK_CACHE = False
        for setting in filter(None, args.maxreg.split(";")):
            cuda_pipeline.REG_CAPS.update({k: int(v) for k, v in (kv_.split("=") for kv_ in setting.split(","))})
            cuda_pipeline._MADE.clear()  # made again under the new caps (compiled at the first call)
            cg.encode_to_device(kv, **kw)
            cg.decode(blob, device="cuda", **dkw)
            e = timed(lambda: cg.encode_to_device(kv, **kw), args.repeats)
            d = timed(lambda: cg.decode(blob, device="cuda", **dkw), args.repeats)
            st_c = Stages()
            transform_resident.STAGE_HOOK = st_c.hook
            for _ in range(3):
                cg.encode_to_device(kv, **kw)
            transform_resident.STAGE_HOOK = None
            same_c = cg.encode_to_device(kv, **kw).equal(blob)
            row["maxreg"].append({"caps": dict(cuda_pipeline.REG_CAPS), "encode_GBps": nbytes / e[0] / 1e9,
                                  "encode_GBps_range": [nbytes / e[2] / 1e9, nbytes / e[1] / 1e9],
                                  "decode_GBps": nbytes / d[0] / 1e9, "encode_stages_ms": st_c.table(),
                                  "same_bytes": same_c})
            print(f"  caps {cuda_pipeline.REG_CAPS}: encode {nbytes / e[0] / 1e9:.1f} GB/s, decode "
                  f"{nbytes / d[0] / 1e9:.1f} GB/s, same bytes {same_c}; encode: "
                  + ", ".join(f"{n} {ms:.2f}" for n, ms in st_c.table()), flush=True)
            cuda_pipeline.REG_CAPS.clear()
            cuda_pipeline.REG_CAPS.update(default_caps)
            cuda_pipeline._MADE.clear()
        launch.DISK_CACHE = disk_cache
        row["rotation_tiles"] = []
        default_tiles = (cuda_pipeline.ROT_TM, cuda_pipeline.ROT_TN, cuda_pipeline.ROT_TK, cuda_pipeline.ROT_RM,
                         cuda_pipeline.ROT_RN)
        for setting in filter(None, args.rot_tiles.split(";")) if "calibration" in kw else []:
            tiles = tuple(int(v) for v in setting.split(","))
            (cuda_pipeline.ROT_TM, cuda_pipeline.ROT_TN, cuda_pipeline.ROT_TK, cuda_pipeline.ROT_RM,
             cuda_pipeline.ROT_RN) = tiles
            e = timed(lambda: cg.encode_to_device(kv, **kw), args.repeats)
            d = timed(lambda: cg.decode(blob, device="cuda", **dkw), args.repeats)
            same_t = cg.encode_to_device(kv, **kw).equal(blob)
            row["rotation_tiles"].append({"tiles": tiles, "encode_GBps": nbytes / e[0] / 1e9,
                                          "decode_GBps": nbytes / d[0] / 1e9, "same_bytes": same_t})
            print(f"  rotation tiles {tiles}: encode {nbytes / e[0] / 1e9:.1f} GB/s, decode {nbytes / d[0] / 1e9:.1f} "
                  f"GB/s, same bytes {same_t}", flush=True)
        (cuda_pipeline.ROT_TM, cuda_pipeline.ROT_TN, cuda_pipeline.ROT_TK, cuda_pipeline.ROT_RM,
         cuda_pipeline.ROT_RN) = default_tiles
        del blob, out
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "command": sys.argv, "device": torch.cuda.get_device_name(),
                                         "info": run_info(started), "copy_ceiling_Bps": ceiling, "rows": rows},
                                        indent=1))


def run_info(started: datetime.datetime) -> dict:
    """When and on what the run happened, for benchmarks/report.py's table of runs (files
    written before 2026-12-02 lack it, and the page says so)."""
    import platform

    import numba
    import numpy

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import numba_cuda
        nc = getattr(numba_cuda, "__version__", None)
    except ImportError:
        nc = None
    return {"date": f"{started:%Y-%m-%d %H:%M} UTC", "cpu": cpu, "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "numba": numba.__version__,
            "numba_cuda": nc, "numpy": numpy.__version__, "python": platform.python_version()}


if __name__ == "__main__":
    main()
