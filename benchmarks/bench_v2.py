"""Format version 2 (--quality) throughput on the CPU and the GPU, in GB/s of uncompressed KV,
and a byte-identity check between the two devices.

Same cache as bench.py: Llama-3.1-8B-shaped (32 layers x 8 KV heads x 128 dims, bf16),
tiled from the real SmolLM2 sample.  In memory: tensor -> .cgen bytes (host) -> tensor.
Timings per the device tool's METHOD.md: one warm-up run (compilation excluded), then
the median of --repeats runs, host clock after a device synchronisation.

    python benchmarks/bench_v2.py --tokens 8192 --cpu-tokens 1024 --qualities balanced,lossless
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_cache, median_time  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import calibration as calib  # noqa: E402


def run(kv: torch.Tensor, quality: str, device: str, repeats: int, cal=None) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else None
    kw = {"quality": quality} if quality != "rotated" else {"quality": "balanced", "calibration": cal}
    blob = cg.encode(kv, device=device, **kw)
    out = cg.decode(blob, device=device, calibration=kw.get("calibration"))["kv"]
    enc = median_time(lambda: cg.encode(kv, device=device, **kw), repeats, sync)
    dec = median_time(lambda: cg.decode(blob, device=device, calibration=kw.get("calibration")), repeats, sync)
    nbytes = kv.numel() * kv.element_size()
    exact = bool(torch.equal(out.cpu().view(torch.int16), kv.cpu().view(torch.int16)))
    return {"quality": quality, "device": device, "tokens": int(kv.shape[2]), "bytes": nbytes, "file_bytes": len(blob),
            "ratio": nbytes / len(blob), "encode_GBps": nbytes / enc / 1e9, "decode_GBps": nbytes / dec / 1e9,
            "bit_exact": exact, "blob": blob}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the GPU cache")
    p.add_argument("--cpu-tokens", type=int, default=1024, help="tokens of the CPU cache")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--qualities", default="balanced,lossless,rotated")
    p.add_argument("--devices", default="cpu,cuda")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    qualities = args.qualities.split(",")
    devices = args.devices.split(",")
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, threads {torch.get_num_threads()}"
          + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    rows = []
    cal = None
    for device in devices:
        tokens = args.tokens if device == "cuda" else args.cpu_tokens
        kv = build_cache(tokens)
        if device == "cuda":
            kv = kv.cuda()
        for q in qualities:
            if q == "rotated":
                if cal is None or cal.num_channels != kv.shape[3] * kv.shape[4]:
                    flat = kv.cpu().reshape(kv.shape[0], 2, kv.shape[2], -1)
                    cal = calib.fit([flat[:, :, : min(1024, kv.shape[2])]])
                if device == "cpu" and tokens > 256:  # C x C float64 dot products per value: slow on a CPU
                    continue
            r = run(kv, q, device, args.repeats, cal)
            rows.append(r)
            print(f"{device:4s} {q:9s} {tokens:6d} tokens  {r['bytes'] / 1e9:.3f} GB  ratio {r['ratio']:.2f}x  "
                  f"encode {r['encode_GBps']:.3f} GB/s  decode {r['decode_GBps']:.3f} GB/s"
                  + ("  bit-exact" if r["bit_exact"] else ""), flush=True)
    # Byte identity: the CPU's file of the GPU's cache (first cpu-tokens tokens, to keep the CPU run short).
    if "cuda" in devices and "cpu" in devices:
        n = min(args.cpu_tokens, args.tokens)
        kv = build_cache(n)
        for q in qualities:
            kw = {"quality": q} if q != "rotated" else {"quality": "balanced", "calibration": cal}
            if q == "rotated" and n > 256:
                kv_r = kv[:, :, :256].contiguous()
                same = cg.encode(kv_r, device="cpu", **kw) == cg.encode(kv_r.cuda(), device="cuda", **kw)
            else:
                same = cg.encode(kv, device="cpu", **kw) == cg.encode(kv.cuda(), device="cuda", **kw)
            print(f"identical CPU and GPU bytes, {q}: {same}", flush=True)
            rows.append({"quality": q, "identical_cpu_gpu_bytes": same})
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "blob"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
