"""Our .cgen size against LMCache's CacheGen output on the same KV cache.

Both use LMCache's default bins table and 256-token chunks; the LMCache size is
the exact byte count of its pickled output (benchmarks/lmcache_reference.py).

    python benchmarks/compare_lmcache.py sample_data/*.safetensors [--markdown]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.storage import kvio  # noqa: E402
from lmcache_reference import lmcache_cachegen_size  # noqa: E402


def compare(path: Path, chunk_tokens: int = 256) -> dict:
    cache = kvio.read_safetensors(path)
    tensors = kvio.to_tensors(cache.data, cache.descriptor())
    blob = cg.encode(tensors, preset="lmcache", chunk_tokens=chunk_tokens, device="cpu")
    decoded = kvio.from_tensors(cg.decode(blob, device="cpu")).data.double()
    x = cache.data.double()
    ours_mse = float(((decoded - x) ** 2).sum() / (x**2).sum())
    stacked = cache.data.reshape(cache.num_layers, 2, cache.num_tokens, cache.num_kv_heads, cache.head_dim)
    lmc = lmcache_cachegen_size(stacked, chunk_tokens=chunk_tokens)
    values = stacked.numel()
    return {
        "file": str(path),
        "shape": list(stacked.shape),
        "bf16_bytes": values * 2,
        "ours_bytes": len(blob),
        "ours_bits_per_value": 8 * len(blob) / values,
        "ours_rel_mse": ours_mse,
        "lmcache_bytes": int(lmc["total"]),
        "lmcache_bits_per_value": float(lmc["bits_per_value"]),
        "lmcache_rel_mse": float(lmc["rel_mse"]),
        "size_vs_lmcache": len(blob) / lmc["total"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"chunk {args.chunk_tokens} tokens, LMCache default bins table")
    print("| file | shape | bf16 bytes | LMCache bytes (bits/value) | cachegen bytes (bits/value) | cachegen / LMCache | rel MSE LMCache | rel MSE cachegen |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for path in args.files:
        r = compare(path, args.chunk_tokens)
        print(f"| {path.name} | {r['shape']} | {r['bf16_bytes']:,} | {r['lmcache_bytes']:,} ({r['lmcache_bits_per_value']:.3f}) | "
              f"{r['ours_bytes']:,} ({r['ours_bits_per_value']:.3f}) | {r['size_vs_lmcache']:.3f} | "
              f"{r['lmcache_rel_mse']:.4e} | {r['ours_rel_mse']:.4e} |")


if __name__ == "__main__":
    main()
