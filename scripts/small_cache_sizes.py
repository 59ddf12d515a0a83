#!/usr/bin/env python3
"""File sizes of the first T tokens of the real sample at every setting (docs/config.md,
"Small caches"): exact byte counts, the same on every machine.

    python scripts/small_cache_sizes.py [--tokens 0 1 2 8 64] [--json OUT]

Only the public API (``cg.encode(..., device="cpu")``) is used, so the same script also
measures an older commit's sizes when run against that commit's package
(``PYTHONPATH=/path/to/old/checkout python scripts/small_cache_sizes.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data" / "smollm2_pydoc_520.safetensors"
SETTINGS = {"lossless": {"quality": "lossless"}, "high": {"quality": "high"},
            "balanced": {"quality": "balanced"}, "small": {"quality": "small"},
            "--preset lmcache": {"preset": "lmcache"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[0, 1, 2, 8, 64])
    ap.add_argument("--json", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    import cachegen_cli as cg
    from safetensors.torch import load_file

    kv = load_file(str(SAMPLE))["kv"]
    pkg = pathlib.Path(cg.__file__).resolve().parent
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pkg, capture_output=True, text=True).stdout.strip()
    rows = []
    print(f"# package {pkg} (git HEAD there: {commit or 'unknown'})")
    print("| T | raw | " + " | ".join(f"`{s}`" for s in SETTINGS) + " |")
    print("|---:|---:|" + "---:|" * len(SETTINGS))
    for t in args.tokens:
        part = kv[:, :, :t].contiguous()
        raw = part.numel() * part.element_size()
        sizes = {name: len(cg.encode(part, device="cpu", **kw)) for name, kw in SETTINGS.items()}
        rows.append({"tokens": t, "raw": raw, "sizes": sizes})
        print(f"| {t} | {raw:,} | " + " | ".join(f"{sizes[s]:,}" for s in SETTINGS) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"package": str(pkg), "commit": commit, "sample": SAMPLE.name,
                                         "command": "python scripts/small_cache_sizes.py " + " ".join(
                                             sys.argv[1:] if argv is None else argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
