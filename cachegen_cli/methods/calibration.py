"""Calibration files: a decorrelating rotation per (layer, K/V), learnt from sample caches.

KV channels are strongly correlated (KVTC, 2024): rotating each token's channel
vector onto the principal axes of sample caches concentrates the energy in few
coordinates, and the uniform quantizer then spends almost nothing on the rest.
``cachegen calibrate`` computes the rotation (PCA of the sample caches, per layer
and K/V) and writes it as a safetensors file; ``encode --calibration`` uses it and
records its SHA-256 in the .cgen file; ``decode`` needs the same file.

Calibrated with the model (``cachegen calibrate --sensitivity``), the file also
says how much each (layer, K/V) plane matters to the model: the mean Fisher
information per value, measured on the samples' own held-out tokens
(``tune.sensitivity_from_caches``).  ``encode`` then gives each plane its own step
(``methods.transform.step_params``): planes whose errors cost the model little get
coarser steps, at the same mean log step, so about the same size for a lower KL.
The sensitivities only steer the encoder (the steps it chose are in the .cgen
file), so they are not part of the file's identity.

The rotation of a (layer, K/V) is block diagonal: one orthonormal D x D block per group of
D adjacent channels (``fit(..., blocks=H)``; H = the KV heads gives one block per head,
H = 1 one full C x C matrix).  A per-head rotation keeps most of what a full one gains
(the channels of different heads are far less correlated than those of one head: measured
by scripts/rotation_blocks.py, docs/config.md) at 1/H of the arithmetic and of the file:
for Llama-3.1-8B (8 heads of 128) a full rotation is 1024 multiply-adds per value, too many
for the encoder's speed targets, a per-head one 128.

File: safetensors with one tensor ``rotation`` float32, either [L, 2, C, C] (version 1: one
block) or [L, 2, H, D, D] (version 2: H blocks of D channels, C = H x D), column d of a block
the d-th principal axis of its channels, by decreasing variance; optionally ``sensitivity``
float32 [L, 2] (positive, geometric mean 1); and metadata ``format = cachegen-calibration``,
``version = 1`` or ``2``.  The identity of a calibration (the SHA-256 a rotated .cgen file
records) is the SHA-256 of the ``rotation`` tensor's little-endian bytes as stored, which
are the same bytes for [L, 2, C, C] and [L, 2, 1, C, C].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CacheGenError, ConfigError, InputNotFoundError

FORMAT_NAME = "cachegen-calibration"
FORMAT_VERSION = "1"  # a full rotation, [L, 2, C, C]
FORMAT_VERSION_BLOCKS = "2"  # a block-diagonal rotation, [L, 2, H, D, D]
MAX_CALIBRATION_BYTES = 4 << 30


class CalibrationError(CacheGenError):
    """A calibration file is missing, unreadable, or not the one a .cgen file was encoded with."""


@dataclass(frozen=True)
class Calibration:
    rotation: np.ndarray  # float32 [L, 2, H, D, D], C-contiguous (a [L, 2, C, C] given is one block)
    metadata: dict
    sensitivity: np.ndarray | None = None  # float64 [L, 2], positive, geometric mean 1; None: not measured

    def __post_init__(self):
        r = np.ascontiguousarray(self.rotation, np.float32)
        if r.ndim == 4:
            r = r.reshape(r.shape[0], r.shape[1], 1, r.shape[2], r.shape[3])
        if r.ndim != 5 or r.shape[1] != 2 or r.shape[3] != r.shape[4]:
            raise CalibrationError(f"a rotation is [layers, 2, blocks, D, D] (or [layers, 2, C, C]), got "
                                   f"{list(self.rotation.shape)}")
        object.__setattr__(self, "rotation", r)

    @property
    def num_layers(self) -> int:
        return int(self.rotation.shape[0])

    @property
    def blocks(self) -> int:
        """Diagonal blocks per (layer, K/V) rotation (1: a full C x C matrix)."""
        return int(self.rotation.shape[2])

    @property
    def block_channels(self) -> int:
        return int(self.rotation.shape[3])

    @property
    def num_channels(self) -> int:
        return self.blocks * self.block_channels

    def dense(self, layer: int, kv: int) -> np.ndarray:
        """The full C x C float32 matrix of one (layer, K/V): its blocks on the diagonal."""
        H, D = self.blocks, self.block_channels
        out = np.zeros((H * D, H * D), np.float32)
        for h in range(H):
            out[h * D : (h + 1) * D, h * D : (h + 1) * D] = self.rotation[layer, kv, h]
        return out

    @property
    def sha256(self) -> bytes:
        """Identity of the rotation: SHA-256 of its little-endian float32 bytes (computed once:
        a full Llama-sized rotation is 268 MB, which would otherwise be hashed again by every encode
        or decode)."""
        digest = self.__dict__.get("_sha256")
        if digest is None:
            # Hashed through a buffer view: a tobytes() copy costs more than the hash.
            digest = hashlib.sha256(memoryview(np.ascontiguousarray(self.rotation, "<f4")).cast("B")).digest()
            object.__setattr__(self, "_sha256", digest)  # the rotation never changes (frozen)
        return digest

    def with_sensitivity(self, sensitivity: np.ndarray, note: str = "") -> "Calibration":
        """This calibration with per-plane sensitivities [L, 2] (normalized here to a geometric mean of 1)."""
        s = np.asarray(sensitivity, np.float64)
        if s.shape != (self.num_layers, 2) or not np.isfinite(s).all() or not (s > 0).all():
            raise CalibrationError(f"sensitivities must be positive finite numbers [{self.num_layers}, 2], got shape "
                                   f"{list(s.shape)}")
        s = s / np.exp(np.log(s).mean())
        meta = dict(self.metadata)
        if note:
            meta["sensitivity"] = note
        return Calibration(self.rotation, meta, s)

    @property
    def rope(self):
        """The RoPE removed from the sample keys before fitting (format.params.Rope at position 0),
        or None: the encoder then removes it too (methods/rope.resolve)."""
        if "rope" not in self.metadata:
            return None
        from .rope import from_metadata

        return from_metadata(self.metadata["rope"])

    def check_shape(self, num_layers: int, num_channels: int) -> None:
        if (self.num_layers, self.num_channels) != (num_layers, num_channels):
            raise CalibrationError(
                f"the calibration is for {self.num_layers} layers x {self.num_channels} channels, "
                f"the cache has {num_layers} x {num_channels}")


def fit(samples: list[torch.Tensor], skip_tokens: int = 1, blocks: int = 1) -> Calibration:
    """PCA rotation per (layer, K/V) from caches [L, 2, T, C], in ``blocks`` diagonal blocks of
    C / blocks adjacent channels (the KV heads: one per head; 1: one full C x C rotation); the
    first ``skip_tokens`` tokens of each (attention sinks, kept raw by the codec) are left out."""
    if not samples:
        raise ConfigError("calibration needs at least one sample cache")
    L, _, _, C = samples[0].shape
    if blocks < 1 or C % blocks:
        raise ConfigError(f"{C} channels do not split into {blocks} rotation blocks")
    H, D = blocks, C // blocks
    cov = torch.zeros(L, 2, H, D, D, dtype=torch.float64)
    total = torch.zeros(L, 2, H, D, dtype=torch.float64)
    n = 0
    for s in samples:
        if s.shape[0] != L or s.shape[3] != C:
            raise ConfigError(f"sample caches differ in shape: {list(s.shape)} vs [{L}, 2, *, {C}]")
        x = s[:, :, skip_tokens:].to(torch.float64)
        xb = x.reshape(L, 2, x.shape[2], H, D)
        cov += torch.einsum("lkthc,lkthd->lkhcd", xb, xb)
        total += xb.sum(dim=2)
        n += x.shape[2]
    if n < 2:
        raise ConfigError("calibration needs at least 2 tokens beyond the sink tokens")
    mean = total / n
    cov = cov / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
    rotation = vectors.flip(-1).to(torch.float32).contiguous().numpy()
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION if H == 1 else FORMAT_VERSION_BLOCKS,
            "num_layers": str(L), "num_channels": str(C), "sample_tokens": str(n)}
    if H > 1:
        meta["blocks"] = str(H)
    return Calibration(rotation, meta)


def save(cal: Calibration, path: str | Path) -> None:
    from safetensors.torch import save

    from ..storage.outputs import atomic_output

    # One block is stored as [L, 2, C, C] (calibration version 1, which older readers take).
    rot = cal.rotation[:, :, 0] if cal.blocks == 1 else cal.rotation
    tensors = {"rotation": torch.from_numpy(np.ascontiguousarray(rot))}
    if cal.sensitivity is not None:
        tensors["sensitivity"] = torch.from_numpy(cal.sensitivity.astype(np.float32))
    blob = save(tensors, metadata=cal.metadata)
    with atomic_output(Path(path)) as tmp:
        tmp.write_bytes(blob)


def load(path: str | Path) -> Calibration:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load as load_torch

    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"no such calibration file: {path}")
    if path.stat().st_size > MAX_CALIBRATION_BYTES:
        raise CalibrationError(f"calibration file {path} is larger than {MAX_CALIBRATION_BYTES >> 30} GiB")
    raw = path.read_bytes()
    try:
        tensors = load_torch(raw)
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, ValueError, OSError, KeyError) as exc:
        raise CalibrationError(f"{path} is not a safetensors calibration file ({str(exc).splitlines()[0]})") from None
    if metadata.get("format") != FORMAT_NAME:
        raise CalibrationError(f"{path} is not a cachegen calibration file (no format={FORMAT_NAME} metadata)")
    version = metadata.get("version")
    if version not in (FORMAT_VERSION, FORMAT_VERSION_BLOCKS):
        raise CalibrationError(f"{path}: calibration version {version!r} is not supported")
    rot = tensors.get("rotation")
    rank = 4 if version == FORMAT_VERSION else 5
    if (rot is None or rot.dtype != torch.float32 or rot.dim() != rank or rot.shape[1] != 2
            or rot.shape[-1] != rot.shape[-2] or 0 in rot.shape):
        raise CalibrationError(f"{path}: needs a float32 tensor 'rotation' "
                               + ("[layers, 2, C, C]" if rank == 4 else "[layers, 2, blocks, D, D]"))
    rot = rot.numpy()
    if not np.isfinite(rot).all():
        raise CalibrationError(f"{path}: the rotation holds NaN or Inf")
    rot = np.ascontiguousarray(rot)
    # The decoder applies the transpose as the inverse: the matrices must be orthonormal.
    r64 = rot.astype(np.float64)
    gram = np.einsum("...cd,...ce->...de", r64, r64)
    if np.abs(gram - np.eye(rot.shape[-1])).max(initial=0.0) > 1e-4:
        raise CalibrationError(f"{path}: the rotation matrices are not orthonormal")
    sens = tensors.get("sensitivity")
    if sens is not None:
        L = rot.shape[0]
        if sens.dtype != torch.float32 or tuple(sens.shape) != (L, 2):
            raise CalibrationError(f"{path}: 'sensitivity' must be float32 [{L}, 2]")
        sens = sens.numpy().astype(np.float64)
        if not np.isfinite(sens).all() or not (sens > 0).all():
            raise CalibrationError(f"{path}: the sensitivities must be positive finite numbers")
    unknown = sorted(set(tensors) - {"rotation", "sensitivity"})
    if unknown:
        raise CalibrationError(f"{path}: unknown tensor(s) {', '.join(unknown)}")
    return Calibration(rot, dict(metadata), sens)
