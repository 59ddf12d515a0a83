"""Encode / decode throughput on the CPU and the GPU, in GB/s of uncompressed KV.

The cache is Llama-3.1-8B-shaped (32 layers x 8 KV heads x 128 dims, bf16) and
built by tiling the real SmolLM2 sample (sample_data/), not random numbers:
layer l, channel c, token t take sample layer (l + c // 192) % 30, channel
c % 192, token t % 520, so every value is a captured one.

Timings follow the device tool's METHOD.md: a warm-up run first, then the
median of --repeats runs; GPU kernel times come from CUDA events, end-to-end
times from the host clock after a device synchronisation.

    python benchmarks/bench.py --tokens 8192 --cpu-tokens 1024 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data" / "smollm2_pydoc_520.safetensors"
#: LMCache's table (format version 1): this script times the v1 paths; the library's default,
#: format version 2 (--quality), runs on the CPU and the GPU alike and bench_device.py times it.
PRESET = "lmcache"


def build_cache(tokens: int, layers: int = 32, heads: int = 8, head_dim: int = 128) -> torch.Tensor:
    from safetensors.torch import load_file

    src = load_file(str(SAMPLE))["kv"]  # [30, 2, 520, 3, 64]
    sl, _, st, sh, sd = src.shape
    flat = src.reshape(sl, 2, st, sh * sd)
    sc = sh * sd
    C = heads * head_dim
    c = torch.arange(C)
    out = torch.empty(layers, 2, tokens, C, dtype=src.dtype)
    t_idx = torch.arange(tokens) % st
    for l in range(layers):
        src_layer = (l + c // sc) % sl
        src_chan = c % sc
        plane = flat[src_layer, :, :, src_chan]  # [C, 2, st]
        out[l] = plane.permute(1, 2, 0)[:, t_idx]
    return out.reshape(layers, 2, tokens, heads, head_dim).contiguous()


def median_time(fn, repeats: int, sync=None) -> float:
    fn()  # warm-up
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gpu_event_times(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of fn after a warm-up one, timed by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def gpu_event_time(fn, repeats: int) -> float:
    return statistics.median(gpu_event_times(fn, repeats))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = gpu_event_time(lambda: b.copy_(a), 10)
    return 2 * a.numel() / t


def gpu_kernel_times(kv_gpu: torch.Tensor, repeats: int) -> dict:
    """Kernels only, data resident on the GPU: encode = f32 cast + quantize + histogram/CDF +
    range coding + stream packing; decode = CDF from codes + range decoding + dequantize + bf16 cast."""
    from numba import cuda

    from cachegen_cli.pipeline import codec
    from cachegen_cli.storage import kvio
    from cachegen_cli.methods.config import lmcache_rule
    from cachegen_cli.kernels import cuda as K
    from cachegen_cli.kernels.coding_params import max_stream_bytes

    cache = kvio.from_tensors(kv_gpu)
    h = codec.make_header(cache, lmcache_rule(cache.num_layers), 256)
    L, _, T, C = cache.data.shape
    ct, Kc, S = h.chunk_tokens, h.num_chunks, int(h.alphabets.max())
    n = Kc * h.streams_per_chunk
    dev = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="cuda")
    maxq = torch.as_tensor(h.maxq, device="cuda")
    symbols = dev((L, 2, T, C), torch.uint8)
    codes = dev((Kc, L, 2, C, S), torch.uint8)
    cum = dev((Kc, L, 2, C, S + 1), torch.int32)
    slots, lengths = dev((n, max_stream_bytes(ct * h.group)), torch.uint8), dev((n,), torch.int32)
    offsets = dev((n + 1,), torch.int64)
    payload = dev((n * max_stream_bytes(ct * h.group),), torch.uint8)
    symbols2, out = dev((L, 2, T, C), torch.uint8), dev((L, 2, T, C), torch.float32)
    a = K.as_device
    scales_u = cuda.device_array((L, 2, T), np.uint16)  # torch has no CUDA-array-interface uint16

    def encode():
        x = cache.data.to(torch.float32)
        K.quantize(a(x), a(maxq), scales_u, a(symbols))
        K.histogram_cdf(a(symbols), ct, a(maxq), a(codes), a(cum))
        K.encode_streams(a(symbols), a(cum), ct, h.group, a(slots), a(lengths))
        offsets[1:] = torch.cumsum(lengths, 0)
        offsets[0] = 0
        K.pack_streams(a(slots), a(lengths), a(offsets), a(payload))

    stages = {}
    x = cache.data.to(torch.float32)
    stages["cast_f32"] = gpu_event_time(lambda: cache.data.to(torch.float32), repeats)
    stages["quantize"] = gpu_event_time(lambda: K.quantize(a(x), a(maxq), scales_u, a(symbols)), repeats)
    stages["histogram_cdf"] = gpu_event_time(lambda: K.histogram_cdf(a(symbols), ct, a(maxq), a(codes), a(cum)), repeats)
    stages["encode_streams"] = gpu_event_time(
        lambda: K.encode_streams(a(symbols), a(cum), ct, h.group, a(slots), a(lengths)), repeats)
    total_encode = gpu_event_time(encode, repeats)
    stages["cum_from_codes"] = gpu_event_time(lambda: K.cum_from_codes(a(codes), a(maxq), a(cum)), repeats)
    stages["decode_streams"] = gpu_event_time(
        lambda: K.decode_streams(a(payload), a(offsets), a(lengths), a(cum), a(maxq), ct, h.group, a(symbols2)), repeats)
    stages["dequantize"] = gpu_event_time(lambda: K.dequantize(a(symbols2), scales_u, a(maxq), a(out)), repeats)

    def decode():
        K.cum_from_codes(a(codes), a(maxq), a(cum))
        K.decode_streams(a(payload), a(offsets), a(lengths), a(cum), a(maxq), ct, h.group, a(symbols2))
        K.dequantize(a(symbols2), scales_u, a(maxq), a(out))
        out.to(torch.bfloat16)

    total_decode = gpu_event_time(decode, repeats)
    torch.cuda.synchronize()
    assert torch.equal(symbols, symbols2), "GPU decode kernels did not reproduce the symbols"
    return {"stages_s": stages, "encode_s": total_encode, "decode_s": total_decode}


def device_stage_times(kv: torch.Tensor, on_device: torch.Tensor, repeats: int) -> dict:
    """Per-stage milliseconds of encode_to_device and of decode(GPU bytes), from CUDA events
    recorded after each stage's launches (lmcache_device.STAGE_HOOK); medians over the repeats."""
    import cachegen_cli as cg
    from cachegen_cli.pipeline import lmcache_device

    out = {}
    for label, fn in (("encode", lambda: cg.encode_to_device(kv, preset=PRESET)), ("decode", lambda: cg.decode(on_device, device="cuda"))):
        runs = []
        for _ in range(repeats):
            marks = []

            def hook(name, marks=marks):
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append((name, e))

            lmcache_device.STAGE_HOOK = hook
            try:
                fn()
            finally:
                lmcache_device.STAGE_HOOK = None
            torch.cuda.synchronize()
            runs.append({name: marks[i - 1][1].elapsed_time(e) for i, (name, e) in enumerate(marks) if i})
        out[label] = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    return out


def end_to_end(kv: torch.Tensor, device: str, repeats: int) -> dict:
    import cachegen_cli as cg

    sync = torch.cuda.synchronize if device == "cuda" else None
    out = {}
    if device == "cuda":
        import io

        from cachegen_cli.pipeline import codec
        from cachegen_cli.storage import kvio
        from cachegen_cli.methods.config import lmcache_rule

        # The GPU-resident paths first, before the host-bytes paths churn host memory; they
        # take ~10 ms, so twice the repeats.
        on_device = cg.encode_to_device(kv, preset=PRESET)
        out["encode_to_device_s"] = median_time(lambda: cg.encode_to_device(kv, preset=PRESET), 2 * repeats, sync)
        out["decode_device_s"] = median_time(lambda: cg.decode(on_device, device="cuda"), 2 * repeats, sync)
        out["device_stages_ms"] = device_stage_times(kv, on_device, 2 * repeats)
    blob = cg.encode(kv, device=device, preset=PRESET)
    out["encode_s"] = median_time(lambda: cg.encode(kv, device=device, preset=PRESET), repeats, sync)
    out["decode_s"] = median_time(lambda: cg.decode(blob, device=device), repeats, sync)
    out["compressed_bytes"] = len(blob)
    out["blob"] = blob
    if device == "cuda":
        out["identical_device_bytes"] = on_device.cpu().numpy().tobytes() == blob
        # The earlier GPU path (per-slab kernels, host-side records) as an independent check.
        cache = kvio.from_tensors(kv)
        old = io.BytesIO()
        codec.encode_to_stream(cache, old, lmcache_rule(cache.num_layers), 256, device="cuda")
        out["identical_to_slab_path"] = old.getvalue() == blob
        decoded = cg.decode(on_device, device="cuda")["kv"]
        _, reference = codec.decode_from_stream(io.BytesIO(blob), device="cuda")  # host-checked path
        out["decode_matches_slab_path"] = bool(torch.equal(decoded.reshape(reference.shape), reference))
    return out


def file_to_file(kv: torch.Tensor, device: str, repeats: int) -> dict:
    import cachegen_cli as cg
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        src, dst, back = Path(tmp) / "kv.safetensors", Path(tmp) / "kv.cgen", Path(tmp) / "back.safetensors"
        save_file({"kv": kv.cpu()}, str(src))
        enc = median_time(lambda: cg.encode_file(src, dst, force=True, device=device, preset=PRESET), repeats)
        dec = median_time(lambda: cg.decode_file(dst, back, force=True, device=device), repeats)
    return {"encode_s": enc, "decode_s": dec}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the GPU cache")
    p.add_argument("--cpu-tokens", type=int, default=1024, help="tokens of the CPU cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--devices", default="cpu,cuda")
    p.add_argument("--check-identical", action="store_true", help="also encode the GPU cache on the CPU and compare bytes")
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", action="store_true", help="print where the host time of one in-memory encode and decode goes")
    p.add_argument("--device-only", action="store_true",
                   help="only time encode_to_device and decode(GPU bytes) (e.g. to compare kernel settings)")
    p.add_argument("--once", action="store_true",
                   help="only run encode_to_device and decode(GPU bytes) once each (for a profiler such as ncu)")
    args = p.parse_args()
    if args.device_only:  # the two in-memory GPU paths and their stages, nothing else
        import cachegen_cli as cg

        kv = build_cache(args.tokens).cuda()
        nbytes = kv.numel() * kv.element_size()
        sync = torch.cuda.synchronize
        on_device = cg.encode_to_device(kv, preset=PRESET)
        enc = median_time(lambda: cg.encode_to_device(kv, preset=PRESET), args.repeats, sync)
        dec = median_time(lambda: cg.decode(on_device, device="cuda"), args.repeats, sync)
        stages = device_stage_times(kv, on_device, args.repeats)
        print(f"# {' '.join(sys.argv)}: encode_to_device {nbytes / enc / 1e9:.1f} GB/s ({enc * 1e3:.2f} ms), "
              f"decode(GPU bytes) {nbytes / dec / 1e9:.1f} GB/s ({dec * 1e3:.2f} ms); stages (ms): "
              + "; ".join(f"{label}: " + ", ".join(f"{n} {t:.2f}" for n, t in st.items()) for label, st in stages.items()))
        return
    if args.once:
        import cachegen_cli as cg

        kv = build_cache(args.tokens).cuda()
        blob = cg.encode_to_device(kv, preset=PRESET)
        cg.decode(blob, device="cuda")
        torch.cuda.synchronize()
        return
    import numba

    from cachegen_cli.pipeline.codec import resolve_device

    devices = [d for d in args.devices.split(",") if d]
    if "cuda" in devices and resolve_device("auto") != "cuda":
        print("no CUDA GPU: skipping cuda", file=sys.stderr)
        devices.remove("cuda")
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine()),
        "cpu_threads": numba.get_num_threads(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "command": " ".join(sys.argv),
    }
    rows, results = [], {"info": info}
    for device in devices:
        tokens = args.tokens if device == "cuda" else args.cpu_tokens
        kv = build_cache(tokens)
        nbytes = kv.numel() * kv.element_size()
        res = {"tokens": tokens, "bytes": nbytes}
        if device == "cuda":
            info["gpu"] = torch.cuda.get_device_name()
            copy_bw = copy_bandwidth()
            res["copy_GBps"] = copy_bw / 1e9
            kv_dev = kv.cuda()
            k = gpu_kernel_times(kv_dev, args.repeats)
            res["kernels"] = k
            rows.append((device, "kernels only", nbytes / k["encode_s"], nbytes / k["decode_s"], copy_bw))
        else:
            kv_dev = kv
            copy_bw = None
        e2e = end_to_end(kv_dev, device, args.repeats)
        blob = e2e.pop("blob")
        if args.profile:
            import cProfile
            import pstats

            import cachegen_cli as cg

            for label, stmt in (("encode", lambda: cg.encode(kv_dev, device=device, preset=PRESET)),
                                ("decode", lambda: cg.decode(blob, device=device))):
                prof = cProfile.Profile()
                prof.runcall(stmt)
                print(f"## host profile: {device} {label}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        res["end_to_end"] = e2e
        res["ratio"] = nbytes / e2e["compressed_bytes"]
        rows.append((device, "in memory (host bytes)", nbytes / e2e["encode_s"], nbytes / e2e["decode_s"], copy_bw))
        if "encode_to_device_s" in e2e:
            rows.append((device, "in memory, GPU tensor -> GPU bytes -> GPU tensor (encode_to_device, decode)",
                         nbytes / e2e["encode_to_device_s"], nbytes / e2e["decode_device_s"], copy_bw))
        f2f = file_to_file(kv, device, max(1, args.repeats // 2))
        res["file_to_file"] = f2f
        rows.append((device, "file to file", nbytes / f2f["encode_s"], nbytes / f2f["decode_s"], copy_bw))
        if device == "cuda" and args.check_identical:
            import cachegen_cli as cg

            res["identical_to_cpu"] = cg.encode(kv, device="cpu", preset=PRESET) == blob
        results[device] = res
    print(f"# {info['date']}  CPU: {info['cpu']} ({info['cpu_threads']} threads)  GPU: {info.get('gpu', '-')}  torch {info['torch']}")
    print(f"# {info['command']}")
    for device in devices:
        r = results[device]
        print(f"# {device}: Llama-3.1-8B-shaped cache, {r['tokens']} tokens, {r['bytes'] / 1e9:.3f} GB bf16, "
              f"ratio {r['ratio']:.2f}x" + (f", identical to CPU bytes: {r['identical_to_cpu']}" if "identical_to_cpu" in r else "")
              + (f", encode_to_device bytes identical: {r['end_to_end']['identical_device_bytes']}" if "identical_device_bytes" in r["end_to_end"] else "")
              + (f", identical to the slab path's bytes: {r['end_to_end']['identical_to_slab_path']}, decode equals the slab path's: "
                 f"{r['end_to_end']['decode_matches_slab_path']}" if "identical_to_slab_path" in r["end_to_end"] else ""))
    print("| device | path | encode GB/s | decode GB/s | per core (CPU) / of copy bw (GPU) |")
    print("|---|---|---:|---:|---:|")
    for device, path, enc, dec, bw in rows:
        extra = (f"{enc / 1e9 / info['cpu_threads'] * 1e3:.0f} / {dec / 1e9 / info['cpu_threads'] * 1e3:.0f} MB/s per core"
                 if device == "cpu" else f"{100 * enc / bw:.2f}% / {100 * dec / bw:.2f}%")
        print(f"| {device} | {path} | {enc / 1e9:.3f} | {dec / 1e9:.3f} | {extra} |")
    if "cuda" in results:
        st = results["cuda"]["kernels"]["stages_s"]
        print("| GPU stage (kernels only) | ms |\n|---|---:|")
        for name, t in st.items():
            print(f"| {name} | {t * 1e3:.3f} |")
        for label, st in results["cuda"]["end_to_end"]["device_stages_ms"].items():
            print(f"| {label} in memory on the GPU: stage | ms |\n|---|---:|")
            for name, t in st.items():
                print(f"| {name} | {t:.3f} |")
            print(f"| (sum) | {sum(st.values()):.3f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
