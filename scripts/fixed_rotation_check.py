#!/usr/bin/env python3
"""Sizes and errors of the two rotation arithmetics of format version 2 on the sample caches:
flags bit 0 alone (float64 sums in order) against bit 3 (the fixed-point rotation,
docs/format.md).  The calibration (one full rotation, and one block per KV head) is fitted on
one real SmolLM2 sample and applied to the other; each row encodes the same cache both ways.

    python scripts/fixed_rotation_check.py [--json out.json]

Prints, per calibration form and --quality: file bytes and the RMS error of the decoded
values for each arithmetic, and their relative differences.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import calibration, transform  # noqa: E402


def stacked(path: Path) -> torch.Tensor:
    """A per-layer sample file as [L, 2, T, C] (heads side by side)."""
    d = load_file(str(path))
    L = len(d) // 2
    rows = []
    for l in range(L):
        kv = [d[f"layers.{l}.{k}"][0] for k in ("key", "value")]  # [H, T, D]
        rows.append(torch.stack([t.permute(1, 0, 2).reshape(t.shape[1], -1) for t in kv]))
    return torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    kv = load_file(str(ROOT / "sample_data/smollm2_pydoc_520.safetensors"))["kv"]  # [L, 2, T, H, D]
    other = stacked(ROOT / "sample_data/smollm2_code_96.safetensors")
    rows = []
    for blocks in (1, kv.shape[3]):
        cal = calibration.fit([other], blocks=blocks)
        for quality in ("high", "balanced", "small"):
            got = {}
            for fixed in (False, True):
                transform.FIXED_ROTATION = fixed
                blob = cg.encode(kv, quality=quality, calibration=cal, device="cpu")
                out = cg.decode(blob, calibration=cal, device="cpu")["kv"]
                err = float(((out.float() - kv.float()) ** 2).mean().sqrt())
                got[fixed] = (len(blob), err)
            transform.FIXED_ROTATION = True
            row = {"blocks": blocks, "quality": quality, "bytes_bit0": got[False][0], "bytes_bit3": got[True][0],
                   "rmse_bit0": got[False][1], "rmse_bit3": got[True][1],
                   "size_change": got[True][0] / got[False][0] - 1, "error_change": got[True][1] / got[False][1] - 1}
            rows.append(row)
            print(f"{'full' if blocks == 1 else 'per head':8s} {quality:8s} bytes {row['bytes_bit0']:>9,} -> "
                  f"{row['bytes_bit3']:>9,} ({row['size_change']:+.4%})  RMS error {row['rmse_bit0']:.5f} -> "
                  f"{row['rmse_bit3']:.5f} ({row['error_change']:+.4%})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
