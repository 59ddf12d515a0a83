"""Quantization tables: how many bins each layer's keys and values get.

A table is a list of ranges per K and V (``QuantizationSpec``); presets build
LMCache's CacheGen table for any number of layers; ``--bins`` strings and
TOML / JSON files give custom tables.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..kernels.coding_params import MAX_ALPHABET, MAX_STREAM_SYMBOLS

MIN_BINS = 3
MAX_BINS = MAX_ALPHABET  # bins b give 2*((b-1)//2)+1 symbols, stored in a uint8
DEFAULT_CHUNK_TOKENS = 256
MAX_CHUNK_TOKENS = MAX_STREAM_SYMBOLS


@dataclass(frozen=True)
class QuantizationSpec:
    """Layers [start_layer, end_layer) get ``bins`` bins; end_layer None means "to the last layer"."""

    start_layer: int
    end_layer: int | None
    bins: int

    def __post_init__(self) -> None:
        if self.start_layer < 0:
            raise ConfigError(f"start_layer must be >= 0, got {self.start_layer}")
        if self.end_layer is not None and self.end_layer <= self.start_layer:
            raise ConfigError(f"empty layer range [{self.start_layer}, {self.end_layer})")
        if not MIN_BINS <= self.bins <= MAX_BINS:
            raise ConfigError(f"bins must be between {MIN_BINS} and {MAX_BINS}, got {self.bins}")


@dataclass(frozen=True)
class QuantizationConfig:
    """Bins for keys and for values, as ranges of layers.  Later ranges override earlier ones."""

    key: tuple[QuantizationSpec, ...]
    value: tuple[QuantizationSpec, ...]
    name: str = field(default="custom", compare=False)

    def bins_table(self, num_layers: int) -> np.ndarray:
        """int32 [num_layers, 2]: bins of layer l for K (column 0) and V (column 1)."""
        table = np.zeros((num_layers, 2), dtype=np.int32)
        for column, specs, label in ((0, self.key, "key"), (1, self.value, "value")):
            for spec in specs:
                end = num_layers if spec.end_layer is None else min(spec.end_layer, num_layers)
                if spec.start_layer < end:
                    table[spec.start_layer : end, column] = spec.bins
            missing = np.flatnonzero(table[:, column] == 0)
            if missing.size:
                raise ConfigError(
                    f"the {label} table does not cover layer {int(missing[0])} of {num_layers}"
                )
        return table


def lmcache_rule(num_layers: int, name: str = "lmcache") -> QuantizationConfig:
    """LMCache's CacheGen table: K layers [0,10) 32 bins, V layers [0,2) 32, the rest 16;
    32 bins everywhere for models of fewer than 10 layers."""
    if num_layers < 10:
        return QuantizationConfig((QuantizationSpec(0, None, 32),), (QuantizationSpec(0, None, 32),), name)
    return QuantizationConfig(
        (QuantizationSpec(0, 10, 32), QuantizationSpec(10, None, 16)),
        (QuantizationSpec(0, 2, 32), QuantizationSpec(2, None, 16)),
        name,
    )


#: Preset name -> layer count the table was written for (None: any).  All follow
#: LMCache's rule; the model presets exist so a user can name their model.
PRESETS: dict[str, int | None] = {
    "lmcache": None,
    "mistral-7b": 32,
    "llama-3.1-8b": 32,
    "qwen-7b": 28,
    "longchat-7b": 32,
    "glm-4-9b": 40,
}
DEFAULT_PRESET = "lmcache"
DEFAULT_QUALITY = "balanced"


def preset(name: str, num_layers: int) -> QuantizationConfig:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return lmcache_rule(num_layers, key)


_RANGE = re.compile(r"^\s*(\d+)?\s*-\s*(\d+)?\s*=\s*(\d+)\s*$")


def parse_bins(text: str) -> QuantizationConfig:
    """Parse a ``--bins`` string.

    ``"32"``: 32 bins for every layer, K and V.  ``"k:0-10=32,10-=16;v:0-2=32,2-=16"``:
    ranges per K and V (``a-b`` is layers [a, b), an open end runs to the first
    or last layer).  A part without ``k:``/``v:`` applies to both.
    """
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        spec = (QuantizationSpec(0, None, int(text)),)
        return QuantizationConfig(spec, spec, f"bins={text}")
    key: list[QuantizationSpec] = []
    value: list[QuantizationSpec] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        target, _, ranges = part.rpartition(":")
        target = target.strip().lower()
        if target not in ("", "k", "v", "key", "value", "kv"):
            raise ConfigError(f"bins: unknown target {target!r} (use k: or v:)", cli=f"--bins: unknown target {target!r} (use k: or v:)")
        specs = []
        for item in filter(None, (r.strip() for r in ranges.split(","))):
            match = _RANGE.match(item)
            if not match:
                raise ConfigError(f"bins: cannot read {item!r}; expected START-END=BINS, e.g. 0-10=32",
                                  cli=f"--bins: cannot read {item!r}; expected START-END=BINS, e.g. 0-10=32")
            start, end, bins = match.groups()
            specs.append(QuantizationSpec(int(start or 0), int(end) if end else None, int(bins)))
        if target in ("", "kv"):
            key.extend(specs)
            value.extend(specs)
        elif target in ("k", "key"):
            key.extend(specs)
        else:
            value.extend(specs)
    if not key or not value:
        raise ConfigError("bins: give ranges for both keys (k:) and values (v:), or one number",
                          cli="--bins: give ranges for both keys (k:) and values (v:), or one number")
    return QuantizationConfig(tuple(key), tuple(value), "custom")


def _specs_from(items: object, label: str) -> tuple[QuantizationSpec, ...]:
    if not isinstance(items, list) or not items:
        raise ConfigError(f"config: '{label}' must be a non-empty list of ranges")
    specs = []
    for item in items:
        if not isinstance(item, dict) or "bins" not in item:
            raise ConfigError(f"config: each '{label}' range needs start_layer, end_layer and bins")
        try:
            specs.append(
                QuantizationSpec(
                    int(item.get("start_layer", 0)),
                    None if item.get("end_layer") in (None, -1) else int(item["end_layer"]),
                    int(item["bins"]),
                )
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config: bad '{label}' range {item!r}: {exc}") from None
    return tuple(specs)


@dataclass(frozen=True)
class TransformConfig:
    """Format version 2 settings: the transform method (relative step per layer and K/V) or lossless.

    ``key_step`` / ``value_step``: the quantization step of each layer's keys / values as a
    fraction of that (layer, K/V)'s RMS around the channel means; one number applies to
    every layer, a list gives one per layer.  Smaller steps: larger files, better quality.
    """

    method: str = "transform"  # "transform" or "lossless"
    key_step: tuple[float, ...] = (1.0,)
    value_step: tuple[float, ...] = (1.0,)
    sink_tokens: int = 1
    token_delta: bool = True
    rounding: float = 0.5  # round away from zero from this fractional part on (encoder only)
    #: The last ``recent_tokens`` tokens (past the sink tokens) get ``recent_bits`` more bits each: the
    #: tokens a continuation attends to most (docs/config.md); 0 bits: none.
    recent_tokens: int = 64
    recent_bits: int = 2
    #: "sensitivity": with a calibration that holds per-plane sensitivities, each (layer, K/V)
    #: step is scaled by its allocation factor (methods/transform.py step_params); "none": the steps
    #: as given (what `cachegen tune` writes: its steps are already allocated).
    allocation: str = "sensitivity"
    #: Code the keys without their rotary embedding (format flags bit 2, methods/rope.py): the RoPE
    #: comes from the cache (its "rope" metadata, or given) or from a calibration fitted that way.
    rope_keys: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.method not in ("transform", "lossless"):
            raise ConfigError(f"method must be 'transform' or 'lossless', got {self.method!r}")
        for label, steps in (("key_step", self.key_step), ("value_step", self.value_step)):
            if not steps:
                raise ConfigError(f"{label} needs at least one value")
            for v in steps:
                if not (isinstance(v, (int, float)) and MIN_STEP <= float(v) <= MAX_STEP):
                    raise ConfigError(f"{label} values must be numbers between {MIN_STEP} and {MAX_STEP}, got {v!r}")
        if not 0.5 <= float(self.rounding) < 1.0:
            raise ConfigError(f"rounding must be in [0.5, 1), got {self.rounding}")
        if not 0 <= self.sink_tokens <= MAX_SINK_TOKENS:
            raise ConfigError(f"sink_tokens must be between 0 and {MAX_SINK_TOKENS}, got {self.sink_tokens}")
        if not isinstance(self.recent_tokens, int) or not 0 <= self.recent_tokens <= MAX_RECENT_TOKENS:
            raise ConfigError(f"recent_tokens must be an integer between 0 and {MAX_RECENT_TOKENS}, got {self.recent_tokens!r}")
        if not isinstance(self.recent_bits, int) or not 0 <= self.recent_bits <= MAX_RECENT_BITS:
            raise ConfigError(f"recent_bits must be an integer between 0 and {MAX_RECENT_BITS}, got {self.recent_bits!r}")
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")

    def steps_table(self, num_layers: int) -> np.ndarray:
        """float64 [num_layers, 2]: relative step of layer l for K (column 0) and V (column 1)."""
        table = np.empty((num_layers, 2), np.float64)
        for column, steps, label in ((0, self.key_step, "key_step"), (1, self.value_step, "value_step")):
            if len(steps) == 1:
                table[:, column] = float(steps[0])
            elif len(steps) == num_layers:
                table[:, column] = np.asarray(steps, np.float64)
            else:
                raise ConfigError(f"{label} has {len(steps)} values; give 1 or one per layer ({num_layers})")
        return table


MIN_STEP = 1e-3
MAX_STEP = 64.0
ALLOCATIONS = ("sensitivity", "none")
#: How far the steps follow a calibration's sensitivities: step_i ~ (rms_i^2 s_i)^(-strength/2).
#: 1 would be the optimum of the quadratic (small-error) model; in exploratory leave-one-out
#: simulations during development (not in the repository) 0.75 needed fewer bits than 0.5 or 1
#: to reach LMCache's KL on the 4096-token SmolLM2 caches (the estimates come from other caches).
ALLOCATION_STRENGTH = 0.75
#: Largest relative step the allocation hands out (as the tuner's --max-step: beyond ~2 x RMS
#: a plane loses its structure and the small-error model no longer holds).
ALLOCATION_MAX_STEP = 2.0
MAX_SINK_TOKENS = 1024
MAX_RECENT_TOKENS = 1 << 20
MAX_RECENT_BITS = 8

#: --quality presets (format version 2).  The relative steps were chosen from
#: measurements with `cachegen eval` on SmolLM2-135M caches (docs/quality.md).
QUALITY_PRESETS: dict[str, TransformConfig] = {
    "lossless": TransformConfig("lossless", name="lossless"),
    "high": TransformConfig("transform", (0.27,), (0.27,), name="high"),
    "balanced": TransformConfig("transform", (0.5,), (0.5,), name="balanced"),
    "small": TransformConfig("transform", (0.92,), (0.92,), name="small"),
}


def quality_preset(name: str) -> TransformConfig:
    key = name.strip().lower()
    if key not in QUALITY_PRESETS:
        raise ConfigError(f"unknown quality {name!r}; choose one of: {', '.join(QUALITY_PRESETS)}")
    return QUALITY_PRESETS[key]


def _steps_from(value: object, label: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),)
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    raise ConfigError(f"config: '{label}' must be a number or a non-empty list of numbers")


@dataclass(frozen=True)
class EncodeSettings:
    """What a config file may set: a table (or preset) and a chunk size."""

    quantization: "QuantizationConfig | TransformConfig | None" = None
    preset: str | None = None
    chunk_tokens: int | None = None
    quality: str | None = None


def load_config_file(path: str | Path) -> EncodeSettings:
    """Read a TOML (.toml) or JSON file with ``key`` / ``value`` ranges or a ``preset``,
    and optionally ``chunk_tokens``.  See docs/config.md."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(raw) > 1 << 20:
        raise ConfigError(f"config file {path} is larger than 1 MiB")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/object at the top level")
    transform_fields = {"method", "key_step", "value_step", "sink_tokens", "token_delta", "allocation", "recent_tokens",
                        "recent_bits"}
    unknown = set(data) - {"key", "value", "preset", "chunk_tokens", "quality", "comment"} - transform_fields
    if unknown:
        raise ConfigError(f"config file {path}: unknown field(s) {', '.join(sorted(unknown))}")
    chunk = data.get("chunk_tokens")
    if chunk is not None:
        chunk = validate_chunk_tokens(chunk)
    chosen = [name for name, present in (("preset", "preset" in data), ("quality", "quality" in data),
                                         ("key/value ranges", "key" in data or "value" in data),
                                         ("method/steps", bool(transform_fields & set(data)))) if present]
    if len(chosen) > 1:
        raise ConfigError(f"config file {path}: give only one of {', '.join(chosen)}")
    if "quality" in data:
        name = str(data["quality"])
        quality_preset(name)
        return EncodeSettings(quality=name, chunk_tokens=chunk)
    if transform_fields & set(data):
        method = str(data.get("method", "transform"))
        sink = data.get("sink_tokens", 1)
        delta = data.get("token_delta", True)
        if not isinstance(sink, int) or isinstance(sink, bool):
            raise ConfigError(f"config file {path}: sink_tokens must be an integer")
        if not isinstance(delta, bool):
            raise ConfigError(f"config file {path}: token_delta must be true or false")
        allocation = data.get("allocation", "sensitivity")
        if allocation not in ALLOCATIONS:
            raise ConfigError(f"config file {path}: allocation must be one of {', '.join(ALLOCATIONS)}")
        recent = {k: data[k] for k in ("recent_tokens", "recent_bits") if k in data}
        for k, v in recent.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"config file {path}: {k} must be an integer")
        cfg = TransformConfig(method, _steps_from(data.get("key_step", 1.0), "key_step"),
                              _steps_from(data.get("value_step", 1.0), "value_step"), sink_tokens=sink,
                              token_delta=delta, allocation=allocation, name=path.name, **recent)
        return EncodeSettings(quantization=cfg, chunk_tokens=chunk)
    if "preset" in data:
        if "key" in data or "value" in data:
            raise ConfigError(f"config file {path}: give either a preset or key/value ranges, not both")
        name = str(data["preset"])
        preset(name, 1)  # validates the name
        return EncodeSettings(preset=name, chunk_tokens=chunk)
    if "key" not in data or "value" not in data:
        raise ConfigError(f"config file {path}: needs 'key' and 'value' ranges (or a 'preset')")
    table = QuantizationConfig(_specs_from(data["key"], "key"), _specs_from(data["value"], "value"), path.name)
    return EncodeSettings(quantization=table, chunk_tokens=chunk)


def validate_chunk_tokens(value: object) -> int:
    try:
        chunk = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"chunk_tokens must be an integer, got {value!r}") from None
    if not 1 <= chunk <= MAX_CHUNK_TOKENS:
        raise ConfigError(f"chunk_tokens must be between 1 and {MAX_CHUNK_TOKENS}, got {chunk}")
    return chunk


def resolve_quantization(
    num_layers: int,
    *,
    quantization: QuantizationConfig | TransformConfig | None = None,
    preset_name: str | None = None,
    bins: str | int | None = None,
    quality: str | None = None,
) -> QuantizationConfig | TransformConfig:
    """What to encode with: at most one of an explicit config, a --preset, a --bins string or a
    --quality; none of them gives the default quality."""
    given = [x is not None for x in (quantization, preset_name, bins, quality)]
    if sum(given) > 1:
        raise ConfigError("give only one of quantization, preset, bins or quality",
                          cli="give only one of a quantization config, --preset, --bins or --quality")
    if quantization is not None:
        return quantization
    if bins is not None:
        return parse_bins(str(bins))
    if preset_name is not None:
        return preset(preset_name, num_layers)
    return quality_preset(quality or DEFAULT_QUALITY)
