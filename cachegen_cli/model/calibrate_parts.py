"""``cachegen calibrate`` on caches of several shapes (format version 3: windowed layers, K and V
of different sizes, MLA latents, batches): a version-3 calibration (methods/parts_calibration.py),
one rotation per plane kind of each layer, of that plane's own width.

model/calibrate.py hands its inputs here when one of them is not a regular cache; the fitting
of regular caches (methods/calibration.py, model/calibrate.py) is not involved."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, DTypeError, LayoutError, ShapeError
from ..methods.parts_calibration import PartsCalibration, fit_parts, save


def read_samples(paths: list[Path], layout: str = "auto") -> list | None:
    """The sample caches as storage.kvparts.PartsCache when at least one is not a regular cache
    (every one then goes through the multi-part fit, regular ones included), else None."""
    from ..storage import kvio, kvparts

    if layout != "auto":  # a forced layout names a regular cache
        return None
    read = [kvio.read_tensors(p) for p in paths]
    irregular = False
    for tensors, metadata in read:
        try:
            kvio.from_tensors(tensors, "auto", metadata)
        except (LayoutError, ShapeError, DTypeError):
            irregular = True
            break
    if not irregular:
        return None
    return [kvparts.analyse(tensors, metadata, None, "drop") for tensors, metadata in read]


def calibrate_parts(samples: list, output, *, sensitivity: bool = False, per_head: bool = False) -> PartsCalibration:
    """Fit and write (atomically) the version-3 calibration of ``samples`` (read_samples)."""
    if sensitivity:
        what = "applies to caches of one regular shape; a calibration of caches of several shapes holds rotations only"
        raise ConfigError(f"sensitivity= {what}", cli=f"--sensitivity {what}")
    fitted = fit_parts(samples, per_head=per_head)
    save(fitted, output)
    return fitted
