"""Calibrations of caches of any shape (calibration version 3, for format version 3 files).

A multi-part cache (windowed layers, K and V of different sizes, MLA latents, batches:
storage/kvparts.py) has planes of many widths, so the one [L, 2, C, C] rotation of
methods/calibration.py does not fit it.  A version-3 calibration holds one rotation per
*plane kind of a layer* instead, ``rotation.{layer}.{key|value|latent}``, float32
[B, D, D]: B orthonormal diagonal blocks of D channels over the plane's *coded width*

  * C, the plane's channels, for the K and V planes of a "kv" group (K and V of one size);
    B = 1 (one full rotation) or the heads (``per_head``);
  * 2 x ceil(C / 2) for a plane of a "planes" group (a latent, or a K / V whose partner has
    another size), which the group file holds as two halves (format.md, "Manifest"): B = 2,
    block 0 for the half in the K slot, block 1 for the half in the V slot.  An odd C's
    padding channel (the last of block 1) is mapped to itself, so it stays zero.

Every member of a group then has its rotations in the group file's own (layer, K/V) order:
``group_calibration`` builds that group's [members, 2, B', D, D] rotation (a plain
methods.calibration.Calibration: the v2 codec rotates the group exactly as a regular file, and
the group file records its SHA-256).  Which plane is which comes from the manifest's ``layer``
and ``kind`` (an L2THD tensor: its layer index, k = 0 key, 1 value), so the same calibration
serves every cache of the model, whatever its token counts or batch.

The fit is the PCA of methods.calibration.fit, per plane and block, over every sample cache
and sequence (the first token of each plane left out: the codec keeps it verbatim).  Kept in
its own module so the regular calibration's fitting code (methods/calibration.py) is untouched.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, InputNotFoundError
from .calibration import (
    FORMAT_NAME,
    MAX_CALIBRATION_BYTES,
    Calibration,
    CalibrationError,
    load as load_regular,
)

FORMAT_VERSION_PARTS = "3"
_NAME = re.compile(r"^rotation\.(0|[1-9][0-9]{0,3})\.(key|value|latent)$")


@dataclass(frozen=True)
class PartsCalibration:
    """Rotations per (layer, plane kind): float32 [B, D, D] each (see the module docstring)."""

    planes: dict  # (layer, kind) -> float32 [B, D, D], C-contiguous
    metadata: dict = field(default_factory=dict)

    def width(self, layer: int, kind: str) -> int:
        r = self.planes[(layer, kind)]
        return int(r.shape[0] * r.shape[1])

    @property
    def num_layers(self) -> int:
        return 1 + max((l for l, _ in self.planes), default=-1)

    @property
    def sha256(self) -> bytes:
        """An identity of the whole calibration (for messages and the CLI): SHA-256 over its
        tensors' names and bytes in name order.  Files record their groups' rotations' SHA-256s."""
        h = hashlib.sha256()
        for name in sorted(_tensor_name(*key) for key in self.planes):
            layer, kind = _NAME.match(name).groups()
            h.update(name.encode() + b"\0")
            h.update(memoryview(np.ascontiguousarray(self.planes[(int(layer), kind)], "<f4")).cast("B"))
        return h.digest()


def _tensor_name(layer: int, kind: str) -> str:
    return f"rotation.{layer}.{kind}"


# ---------------------------------------------------------------- groups


def member_slots(manifest_group: dict, tensors: list[dict]) -> list[list[tuple[int, str]]]:
    """The (layer, kind) of each plane of each member of a manifest group (format/parts.py's
    checked manifest): the tensor's ``layer`` and ``kind``, or for an L2THD tensor its selectors."""
    out = []
    for member in manifest_group["members"]:
        slots = []
        for ti, *sel in member:
            e = tensors[ti]
            if e["form"] == "L2THD":
                slots.append((int(sel[0]), ("key", "value")[int(sel[1])]))
            else:
                slots.append((int(e["layer"]), e["kind"]))
        out.append(slots)
    return out


def slots_of_group(g) -> list[list[tuple[int, str]]]:
    """member_slots for a storage.kvparts.Group (the encoder's side)."""
    if g.kind == "kv":
        return [[(k.layer, k.kind), (v.layer, v.kind)] for k, v in g.members]
    return [[(p.layer, p.kind)] for p in g.members]


def group_calibration(cal: PartsCalibration, kind: str, channels: int,
                      slots: list[list[tuple[int, str]]]) -> Calibration:
    """The rotation of one group's file, [members, 2, B', D, D], from ``cal``; CalibrationError
    when a plane has no rotation or one of another width, or the members' blocks differ."""
    coded = channels if kind == "kv" else 2 * (-(-channels // 2))
    rows = []
    for member in slots:
        pair = []
        for layer, pkind in member:
            r = cal.planes.get((layer, pkind))
            if r is None:
                raise CalibrationError(f"the calibration has no rotation for layer {layer}'s {pkind} (its planes: "
                                       f"{_listing(cal)})")
            if r.shape[0] * r.shape[1] != coded:
                raise CalibrationError(f"the calibration's rotation of layer {layer}'s {pkind} is for {cal.width(layer, pkind)} "
                                       f"coded channels, the cache's plane has {coded}")
            if kind == "kv":
                pair.append(r)
            else:
                if r.shape[0] % 2:
                    raise CalibrationError(f"the calibration's rotation of layer {layer}'s {pkind} has {r.shape[0]} "
                                           "blocks; a plane coded in halves needs an even number")
                half = r.shape[0] // 2
                pair += [r[:half], r[half:]]
        rows.append(pair)
    shapes = {p.shape for pair in rows for p in pair}
    if len(shapes) != 1:
        raise CalibrationError(f"the calibration's rotations of one group differ in blocks: {sorted(shapes)}")
    rot = np.ascontiguousarray(np.stack([np.stack(pair) for pair in rows]), np.float32)
    return Calibration(rot, {"format": FORMAT_NAME, "from": "multi-part calibration"})


def _listing(cal: PartsCalibration) -> str:
    keys = sorted(cal.planes)
    shown = ", ".join(f"{l}.{k}" for l, k in keys[:6])
    return shown + (", ..." if len(keys) > 6 else "") if keys else "none"


# ---------------------------------------------------------------- fitting


class _Moments:
    """Running sums for a PCA of one block: sum x, sum x x^T, count."""

    def __init__(self, d: int) -> None:
        self.s = torch.zeros(d, dtype=torch.float64)
        self.ss = torch.zeros(d, d, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.to(torch.float64)
        self.s += x.sum(dim=0)
        self.ss += x.T @ x
        self.n += int(x.shape[0])

    def axes(self) -> np.ndarray:
        """The principal axes (columns, by decreasing variance), float32 [d, d]."""
        mean = self.s / self.n
        cov = self.ss / self.n - torch.outer(mean, mean)
        _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
        return vectors.flip(-1).to(torch.float32).numpy()


def fit_parts(caches: list, skip_tokens: int = 1, per_head: bool = False) -> PartsCalibration:
    """A version-3 calibration from sample caches (storage.kvparts.PartsCache, one model's): for
    each plane kind of each layer, the PCA of its values in every sample and sequence.  The
    blocks: "kv" planes one full rotation, or one per head with ``per_head``; planes coded in
    halves (kvparts' "planes" groups) one block per half."""
    if not caches:
        raise ConfigError("calibration needs at least one sample cache")
    layout: dict[tuple[int, str], tuple[str, int, int]] = {}  # (layer, kind) -> (group kind, channels, heads)
    moments: dict[tuple[int, str], list[_Moments]] = {}
    for ci, pc in enumerate(caches):
        for g in pc.groups:
            for member in g.members:
                planes = member if g.kind == "kv" else (member,)
                for p in planes:
                    key = (p.layer, p.kind)
                    heads = _heads(pc.entries[p.tensor], p)
                    want = (g.kind, p.channels, heads)
                    if layout.setdefault(key, want) != want:
                        raise ConfigError(f"sample caches differ in shape: layer {p.layer}'s {p.kind} is "
                                          f"{_describe(layout[key])} in one and {_describe(want)} in sample {ci + 1}")
                    x = pc._values(p)[skip_tokens:]
                    blocks = _block_ranges(*want, per_head)
                    acc = moments.setdefault(key, [_Moments(b - a) for a, b in blocks])
                    for m, (a, b) in zip(acc, blocks):
                        m.add(x[:, a:min(b, p.channels)] if b <= p.channels else _padded(x[:, a:], b - a))
    planes = {}
    n_min = None
    unfitted = []
    for key, acc in moments.items():
        gkind, C, heads = layout[key]
        rots = []
        for m, (a, b) in zip(acc, _block_ranges(gkind, C, heads, per_head)):
            if m.n < 2:  # no statistics (a layer of 0 or 1 tokens): the identity, so that encode still has one
                unfitted.append(f"{key[0]}.{key[1]}")
                rots.append(np.eye(b - a, dtype=np.float32))
                continue
            n_min = m.n if n_min is None else min(n_min, m.n)
            axes = m.axes()
            if b > C:  # the padding channel of an odd plane: kept on its own axis, so it stays zero
                axes = _pad_axis(_axes_without_last(m))
            rots.append(axes)
        planes[key] = np.ascontiguousarray(np.stack(rots), np.float32)
    if n_min is None:
        raise ConfigError("calibration needs at least 2 tokens beyond the sink tokens")
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION_PARTS, "planes": str(len(planes)),
            "sample_tokens": str(n_min), "samples": str(len(caches))}
    if unfitted:
        meta["identity_planes"] = ",".join(sorted(set(unfitted)))
    if per_head:
        meta["per_head"] = "1"
    return PartsCalibration(planes, meta)


def _heads(entry: dict, p) -> int:
    form, shape = entry["form"], entry["shape"]
    if form == "HTD":
        return int(shape[0])
    if form == "BHTD":
        return int(shape[1])
    if form == "L2THD":
        return int(shape[3])
    return 1


def _describe(layout: tuple[str, int, int]) -> str:
    gkind, C, heads = layout
    return f"{C} channels ({heads} head(s){', coded in halves' if gkind == 'planes' else ''})"


def _block_ranges(gkind: str, C: int, heads: int, per_head: bool) -> list[tuple[int, int]]:
    """Channel ranges [a, b) of the blocks of a plane's coded width (b may pass C by the padding)."""
    if gkind == "planes":
        H = -(-C // 2)
        return [(0, H), (H, 2 * H)]
    n = heads if per_head and heads > 1 and C % heads == 0 else 1
    D = C // n
    return [(i * D, (i + 1) * D) for i in range(n)]


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(x.shape[0], width, dtype=torch.float64)
    out[:, : x.shape[1]] = x.to(torch.float64)
    return out


def _axes_without_last(m: _Moments) -> np.ndarray:
    """The axes of a block's moments leaving out its last channel (the padding)."""
    sub = _Moments(m.s.shape[0] - 1)
    sub.s, sub.ss, sub.n = m.s[:-1], m.ss[:-1, :-1], m.n
    return sub.axes()


def _pad_axis(axes: np.ndarray) -> np.ndarray:
    d = axes.shape[0] + 1
    out = np.zeros((d, d), np.float32)
    out[:-1, :-1] = axes
    out[-1, -1] = 1.0
    return out


# ---------------------------------------------------------------- files


def save(cal: PartsCalibration, path: str | Path) -> None:
    from safetensors.torch import save as save_bytes

    from ..storage.outputs import atomic_output

    tensors = {_tensor_name(l, k): torch.from_numpy(np.ascontiguousarray(r, np.float32)) for (l, k), r in cal.planes.items()}
    blob = save_bytes(tensors, metadata={str(k): str(v) for k, v in cal.metadata.items()})
    with atomic_output(Path(path)) as tmp:
        tmp.write_bytes(blob)


def load_any(path: str | Path) -> Calibration | PartsCalibration:
    """A calibration file of any version: versions 1 and 2 by methods.calibration.load, version 3 here."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"no such calibration file: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, ValueError, OSError) as exc:
        raise CalibrationError(f"{path} is not a safetensors calibration file ({str(exc).splitlines()[0]})") from None
    if metadata.get("format") != FORMAT_NAME or metadata.get("version") != FORMAT_VERSION_PARTS:
        return load_regular(path)
    return _load_parts(path)


def _load_parts(path: Path) -> PartsCalibration:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load as load_torch

    if path.stat().st_size > MAX_CALIBRATION_BYTES:
        raise CalibrationError(f"calibration file {path} is larger than {MAX_CALIBRATION_BYTES >> 30} GiB")
    try:
        tensors = load_torch(path.read_bytes())
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, ValueError, OSError, KeyError) as exc:
        raise CalibrationError(f"{path} is not a safetensors calibration file ({str(exc).splitlines()[0]})") from None
    planes = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if m is None:
            raise CalibrationError(f"{path}: unknown tensor {name[:80]!r} (a version 3 calibration holds "
                                   "rotation.{layer}.{key|value|latent})")
        if t.dtype != torch.float32 or t.dim() != 3 or t.shape[1] != t.shape[2] or 0 in t.shape:
            raise CalibrationError(f"{path}: {name} must be float32 [blocks, D, D]")
        r = np.ascontiguousarray(t.numpy())
        if not np.isfinite(r).all():
            raise CalibrationError(f"{path}: {name} holds NaN or Inf")
        r64 = r.astype(np.float64)
        if np.abs(np.einsum("bcd,bce->bde", r64, r64) - np.eye(r.shape[-1])).max(initial=0.0) > 1e-4:
            raise CalibrationError(f"{path}: {name} is not orthonormal")
        planes[(int(m.group(1)), m.group(2))] = r
    if not planes:
        raise CalibrationError(f"{path}: a version 3 calibration holds at least one rotation")
    return PartsCalibration(planes, dict(metadata))
