"""What a .cgen file holds and costs; with a reference, how far the decoded cache is from it.

``file_stats`` returns plain JSON-able data; the CLI renders it with Rich or
prints it as JSON.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..format import parts as parts_format
from ..pipeline import codec
from ..storage import kvio
from ..errors import InputError

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def file_stats(path: str | Path, reference: str | Path | None = None, device: str = "cpu",
               calibration=None) -> dict:
    path = Path(path)
    from ..storage.outputs import check_input

    check_input(path)
    with open(path, "rb") as fh:
        if parts_format.is_parts_file(fh.read(10)):
            return parts_stats(path, reference, device, calibration)
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
        "method": {1: "per-token abs-max (LMCache table)", 2: "transform" + ((" + rotation (fixed-point)" if h.fixed_rotation else " + rotation")
                                                                   if h.rotated else "")
                   + (" + keys without RoPE" if h.params is not None and h.params.rope is not None else ""),
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


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(out)


def parts_stats(path: Path, reference: str | Path | None = None, device: str = "cpu", calibration=None) -> dict:
    """stats of a multi-part file (format v3): per group, its shape, method and bytes; with a
    reference (the original .safetensors), the error per group and whether the extras are identical."""
    from ..format.container import BufferReader, read_header_and_index
    from ..storage import kvparts

    blob = Path(path).read_bytes()
    pf = parts_format.PartsFile(blob)
    m = pf.manifest
    groups = []
    for i, g in enumerate(m["groups"]):
        part = pf.part(i)
        h = read_header_and_index(BufferReader(part))[0]
        values = len(g["members"]) * (2 if g["kind"] == "kv" else 1) * g["tokens"] * g["channels"]
        layers = sorted({m["tensors"][ref[0]].get("layer", ref[1] if len(ref) > 1 else 0)
                         for member in g["members"] for ref in member})
        groups.append({"group": i, "kind": g["kind"], "sequence": g["seq"], "layers": _layer_ranges(layers),
                       "num_layers": len(g["members"]), "tokens": g["tokens"], "channels": g["channels"],
                       "dtype": g["dtype"], "format_version": h.version,
                       "method": {1: "abs-max", 2: "transform", 3: "lossless"}[h.method],
                       "compressed_bytes": len(part), "values": values,
                       "bits_per_value": 8 * len(part) / values if values else 0.0})
    kv = [e for e in m["tensors"] if e["role"] == "kv"]
    values = sum(kvparts._numel(e["shape"]) for e in kv)
    size = len(blob)
    out = {
        "file": str(path), "format_version": 3, "num_tensors": len(m["tensors"]),
        "extras": [e["name"] for e in m["tensors"] if e["role"] == "extra"],
        "original_bytes": pf.decoded_bytes, "compressed_bytes": size,
        "ratio": pf.decoded_bytes / size if size else 0.0, "bits_per_value": 8 * size / values if values else 0.0,
        "groups": groups, "metadata_keys": sorted(m["metadata"]),
    }
    if reference is not None:
        out["reference"] = str(reference)
        out["error"] = _parts_error(blob, m, reference, device, calibration)
    return out


def _parts_error(blob: bytes, m: dict, reference, device: str, calibration) -> dict:
    from ..api import _calibration, decode

    ref_tensors, _ = kvio.read_tensors(reference)
    decoded = decode(blob, device=device, calibration=_calibration(calibration))
    for e in m["tensors"]:
        r = ref_tensors.get(e["name"])
        if r is None or list(r.shape) != e["shape"]:
            raise InputError(f"the reference has no tensor {e['name'][:60]!r} of shape {e['shape']}: "
                             "is it the file this .cgen was encoded from?")
    from ..storage import kvparts

    per_group = []
    tot_err = tot_ref = 0.0
    worst = 0.0
    for g in m["groups"]:
        err = ref2 = mx = 0.0
        for member in g["members"]:
            for ref in member:
                e = m["tensors"][ref[0]]
                x = kvparts.plane_values(ref_tensors[e["name"]], e["form"], tuple(ref[1:])).double()
                y = kvparts.plane_values(decoded[e["name"]].cpu(), e["form"], tuple(ref[1:])).double()
                d = y - x
                err += float(d.pow(2).sum())
                ref2 += float(x.pow(2).sum())
                mx = max(mx, float(d.abs().max()) if d.numel() else 0.0)
        per_group.append({"rel_mse": err / ref2 if ref2 > 0 else err, "max_abs": mx})
        tot_err, tot_ref, worst = tot_err + err, tot_ref + ref2, max(worst, mx)
    extras_same = all(torch.equal(ref_tensors[e["name"]], decoded[e["name"]].cpu())
                      for e in m["tensors"] if e["role"] == "extra")
    return {"rel_mse": tot_err / tot_ref if tot_ref > 0 else tot_err, "max_abs": worst, "groups": per_group,
            "extras_identical": extras_same}
