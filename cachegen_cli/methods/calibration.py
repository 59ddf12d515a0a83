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

File: safetensors with one tensor ``rotation`` float32 [L, 2, C, C] (column d is
the d-th principal axis, by decreasing variance), optionally ``sensitivity``
float32 [L, 2] (positive, geometric mean 1), and metadata
``format = cachegen-calibration``, ``version = 1``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CacheGenError, ConfigError, InputNotFoundError

FORMAT_NAME = "cachegen-calibration"
FORMAT_VERSION = "1"
MAX_CALIBRATION_BYTES = 4 << 30


class CalibrationError(CacheGenError):
    """A calibration file is missing, unreadable, or not the one a .cgen file was encoded with."""


@dataclass(frozen=True)
class Calibration:
    rotation: np.ndarray  # float32 [L, 2, C, C], C-contiguous
    metadata: dict
    sensitivity: np.ndarray | None = None  # float64 [L, 2], positive, geometric mean 1; None: not measured

    @property
    def num_layers(self) -> int:
        return int(self.rotation.shape[0])

    @property
    def num_channels(self) -> int:
        return int(self.rotation.shape[2])

    @property
    def sha256(self) -> bytes:
        """Identity of the rotation: SHA-256 of its little-endian float32 bytes."""
        # Hashed through a buffer view: a tobytes() copy of a Llama-sized rotation costs more than the hash.
        return hashlib.sha256(memoryview(np.ascontiguousarray(self.rotation, "<f4")).cast("B")).digest()

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

    def check_shape(self, num_layers: int, num_channels: int) -> None:
        if (self.num_layers, self.num_channels) != (num_layers, num_channels):
            raise CalibrationError(
                f"the calibration is for {self.num_layers} layers x {self.num_channels} channels, "
                f"the cache has {num_layers} x {num_channels}")


def fit(samples: list[torch.Tensor], skip_tokens: int = 1) -> Calibration:
    """PCA rotation per (layer, K/V) from caches [L, 2, T, C]; the first ``skip_tokens``
    tokens of each (attention sinks, kept raw by the codec) are left out."""
    if not samples:
        raise ConfigError("calibration needs at least one sample cache")
    L, _, _, C = samples[0].shape
    cov = torch.zeros(L, 2, C, C, dtype=torch.float64)
    total = torch.zeros(L, 2, C, dtype=torch.float64)
    n = 0
    for s in samples:
        if s.shape[0] != L or s.shape[3] != C:
            raise ConfigError(f"sample caches differ in shape: {list(s.shape)} vs [{L}, 2, *, {C}]")
        x = s[:, :, skip_tokens:].to(torch.float64)
        cov += torch.einsum("lktc,lktd->lkcd", x, x)
        total += x.sum(dim=2)
        n += x.shape[2]
    if n < 2:
        raise ConfigError("calibration needs at least 2 tokens beyond the sink tokens")
    mean = total / n
    cov = cov / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
    rotation = vectors.flip(-1).to(torch.float32).contiguous().numpy()
    return Calibration(rotation, {"format": FORMAT_NAME, "version": FORMAT_VERSION, "num_layers": str(L),
                                  "num_channels": str(C), "sample_tokens": str(n)})


def save(cal: Calibration, path: str | Path) -> None:
    from safetensors.torch import save

    from ..storage.outputs import atomic_output

    tensors = {"rotation": torch.from_numpy(cal.rotation)}
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
    if metadata.get("version") != FORMAT_VERSION:
        raise CalibrationError(f"{path}: calibration version {metadata.get('version')!r} is not supported")
    rot = tensors.get("rotation")
    if rot is None or rot.dtype != torch.float32 or rot.dim() != 4 or rot.shape[1] != 2 or rot.shape[2] != rot.shape[3]:
        raise CalibrationError(f"{path}: needs a float32 tensor 'rotation' [layers, 2, C, C]")
    rot = rot.numpy()
    if not np.isfinite(rot).all():
        raise CalibrationError(f"{path}: the rotation holds NaN or Inf")
    rot = np.ascontiguousarray(rot)
    # The decoder applies the transpose as the inverse: the matrices must be orthonormal.
    gram = np.einsum("lkcd,lkce->lkde", rot.astype(np.float64), rot.astype(np.float64))
    if np.abs(gram - np.eye(rot.shape[2])).max(initial=0.0) > 1e-4:
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
