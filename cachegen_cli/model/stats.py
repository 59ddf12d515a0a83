"""What a .cgen file holds and costs; with a reference, how far the decoded cache is from it.

``file_stats`` returns plain JSON-able data; the CLI renders it with Rich or
prints it as JSON.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..pipeline import codec
from ..storage import kvio
from ..errors import InputError

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def file_stats(path: str | Path, reference: str | Path | None = None, device: str = "cpu",
               calibration=None) -> dict:
    path = Path(path)
    from ..storage.outputs import check_input

    check_input(path)
    f, closer = codec.open_input(path)
    h, header_end, offsets, size = codec.read_header_and_index(f)
    L = h.num_layers
    payload = np.zeros((L, 2), np.int64)
    for chunk in codec.iter_chunks(f, h, offsets, size):
        payload += chunk.lengths.sum(axis=2)
    del f
    values = L * 2 * h.num_tokens * h.num_channels
    original = values * _ITEMSIZE[h.dtype]
    total_payload = int(payload.sum())
    if h.version == 1:
        # Side information attributable to each (layer, K/V): its scales, CDF codes and stream lengths.
        cdf_per_chunk = h.num_channels * ((h.alphabets + 1) // 2)
        side_lk = 2 * h.num_tokens + h.num_chunks * (cdf_per_chunk + 2 * h.groups)
    else:
        # Its tables (and, method 2, step, offsets and sink tokens) and its stream lengths; the raw
        # low bytes of the lossless method count as payload of their layer.
        p = h.params
        side_lk = (3 + (p.alphabet + 1) // 2).sum(axis=2) + h.num_chunks * 2 * h.groups
        if p.method == 2:
            side_lk = side_lk + 2 + 2 * h.num_channels + h.sink_tokens * h.num_channels * _ITEMSIZE[h.dtype]
        raw = h.num_tokens * h.num_channels * h.raw_bytes_per_value
        if p.refine_tokens:  # the refinement bits of the last tokens count as their layer's payload
            raw += (p.refine_tokens * h.num_channels * p.refine_bits) // 8
        payload = payload + raw
        total_payload = int(payload.sum())
    layers = []
    for l in range(L):
        row = {"layer": l}
        for kv, name in enumerate(("key", "value")):
            n = h.num_tokens * h.num_channels
            if h.version == 1:
                row[f"{name}_bins"] = int(h.bins[l, kv])
            elif h.params.method == 2:
                row[f"{name}_step"] = float(_bf16(h.params.steps[l, kv]))
            row[f"{name}_payload_bytes"] = int(payload[l, kv])
            row[f"{name}_side_bytes"] = int(side_lk[l, kv])
            row[f"{name}_bits_per_value"] = (8 * (int(payload[l, kv]) + int(side_lk[l, kv])) / n) if n else 0.0
        layers.append(row)
    side = size - total_payload
    out = {
        "file": str(path),
        "format_version": h.version,
        "method": {1: "per-token abs-max (LMCache table)", 2: "transform" + (" + rotation" if h.rotated else ""),
                   3: "lossless"}[h.method],
        "layout": h.layout,
        "dtype": h.dtype,
        "num_layers": L,
        "num_tokens": h.num_tokens,
        "num_kv_heads": h.descriptor["num_kv_heads"],
        "head_dim": h.descriptor["head_dim"],
        "chunk_tokens": h.chunk_tokens,
        "num_chunks": h.num_chunks,
        "channels_per_stream": h.group,
        "original_bytes": original,
        "compressed_bytes": size,
        "ratio": (original / size) if size else 0.0,
        "bits_per_value": (8 * size / values) if values else 0.0,
        "payload_bytes": total_payload,
        "side_bytes": side,
        "side_fraction": side / size if size else 0.0,
        "sink_tokens": h.sink_tokens,
        "refined_tokens": int(h.params.refine_tokens) if h.params is not None else 0,
        "refine_bits": int(h.params.refine_bits) if h.params is not None else 0,
        "layers": layers,
    }
    if reference is not None:
        out["reference"] = str(reference)
        out["error"] = reconstruction_error(path, reference, device, calibration)
    return out


def _bf16(bits) -> float:
    return float(np.array([int(bits) << 16], np.uint32).view(np.float32)[0])


def reconstruction_error(path: Path, reference: str | Path, device: str = "cpu", calibration=None) -> dict:
    """Per layer and K/V: relative MSE ||x - x'||^2 / ||x||^2 and max |x - x'|."""
    from ..api import _calibration

    ref = kvio.read_safetensors(reference)
    cal = _calibration(calibration)
    with open(path, "rb") as f:
        h, decoded = codec.decode_from_stream(f, device=device, calibration=cal)
    if tuple(ref.data.shape) != tuple(decoded.shape):
        raise InputError(
            f"reference has shape {list(ref.data.shape)} (layers, 2, tokens, channels), "
            f"the .cgen file {list(decoded.shape)}"
        )
    x = ref.data.to(torch.float64)
    y = decoded.cpu().to(torch.float64)
    diff = y - x
    err2 = diff.pow(2).sum(dim=(2, 3))
    ref2 = x.pow(2).sum(dim=(2, 3))
    rel = torch.where(ref2 > 0, err2 / ref2.clamp_min(1e-300), err2)
    maxabs = diff.abs().amax(dim=(2, 3)) if diff.numel() else torch.zeros(diff.shape[:2], dtype=torch.float64)
    layers = []
    for l in range(h.num_layers):
        layers.append(
            {
                "layer": l,
                "key_rel_mse": float(rel[l, 0]),
                "value_rel_mse": float(rel[l, 1]),
                "key_max_abs": float(maxabs[l, 0]),
                "value_max_abs": float(maxabs[l, 1]),
            }
        )
    total_ref = float(ref2.sum())
    return {
        "rel_mse": float(err2.sum()) / total_ref if total_ref > 0 else float(err2.sum()),
        "key_rel_mse": float(err2[:, 0].sum() / ref2[:, 0].sum()) if float(ref2[:, 0].sum()) > 0 else 0.0,
        "value_rel_mse": float(err2[:, 1].sum() / ref2[:, 1].sum()) if float(ref2[:, 1].sum()) > 0 else 0.0,
        "max_abs": float(maxabs.max()) if maxabs.numel() else 0.0,
        "layers": layers,
    }
