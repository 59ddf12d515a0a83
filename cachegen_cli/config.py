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

from .errors import ConfigError
from .kernels.coding_params import MAX_ALPHABET, MAX_STREAM_SYMBOLS

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
            raise ConfigError(f"--bins: unknown target {target!r} (use k: or v:)")
        specs = []
        for item in filter(None, (r.strip() for r in ranges.split(","))):
            match = _RANGE.match(item)
            if not match:
                raise ConfigError(f"--bins: cannot read {item!r}; expected START-END=BINS, e.g. 0-10=32")
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
        raise ConfigError("--bins: give ranges for both keys (k:) and values (v:), or one number")
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
class EncodeSettings:
    """What a config file may set: a table (or preset) and a chunk size."""

    quantization: QuantizationConfig | None = None
    preset: str | None = None
    chunk_tokens: int | None = None


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
    unknown = set(data) - {"key", "value", "preset", "chunk_tokens"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown field(s) {', '.join(sorted(unknown))}")
    chunk = data.get("chunk_tokens")
    if chunk is not None:
        chunk = validate_chunk_tokens(chunk)
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
    quantization: QuantizationConfig | None = None,
    preset_name: str | None = None,
    bins: str | int | None = None,
) -> QuantizationConfig:
    """The table to use: at most one of an explicit table, a preset or a --bins string."""
    given = [x is not None for x in (quantization, preset_name, bins)]
    if sum(given) > 1:
        raise ConfigError("give only one of a quantization table, a preset or --bins")
    if quantization is not None:
        return quantization
    if bins is not None:
        return parse_bins(str(bins))
    return preset(preset_name or DEFAULT_PRESET, num_layers)
