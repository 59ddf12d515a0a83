"""KV tensors in and out: the two safetensors layouts and one internal form.

Layouts:
  stacked    one tensor [num_layers, 2, num_tokens, num_kv_heads, head_dim]
             (LMCache / vLLM chunk layout; K at index 0 of dim 1)
  per-layer  tensors ``layers.{i}.key`` and ``layers.{i}.value``, each
             [num_kv_heads, num_tokens, head_dim] or [1, num_kv_heads, num_tokens, head_dim]
             (HF transformers' DynamicCache)

Internally a cache is one tensor [num_layers, 2, num_tokens, channels] in the
source dtype (channels = num_kv_heads * head_dim), plus a ``descriptor``: the
JSON-able description of the original tensors that ``decode`` uses to write
back the same layout, names, shapes, dtype and safetensors metadata.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import (
    DTypeError,
    InputNotFoundError,
    LayoutError,
    NonFiniteError,
    NotSafetensorsError,
    ShapeError,
)

LAYOUTS = ("stacked", "per-layer")
DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPE_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

MAX_LAYERS = 4096
MAX_CHANNELS = 1 << 16
MAX_TOKENS = (1 << 32) - 1

_PER_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(key|value)$")


@dataclass
class KVCache:
    """A KV cache in the internal form.

    data: [num_layers, 2, num_tokens, num_kv_heads * head_dim], dtype float16 / bfloat16 / float32.
    """

    data: torch.Tensor
    layout: str
    num_kv_heads: int
    head_dim: int
    tensors: list[dict] = field(default_factory=list)  # [{"name": ..., "shape": [...]}] in file order
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.data.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.data.shape[2])

    @property
    def num_channels(self) -> int:
        return int(self.data.shape[3])

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.data.dtype]

    def descriptor(self) -> dict:
        """What the .cgen file records about the original tensors."""
        return {
            "layout": self.layout,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tensors": self.tensors,
            "metadata": self.metadata,
        }


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in DTYPES:
        raise DTypeError(
            f"tensor {name!r} has dtype {str(tensor.dtype).replace('torch.', '')}; "
            "cachegen reads float16, bfloat16 and float32"
        )


def _check_limits(num_layers: int, num_tokens: int, channels: int) -> None:
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ShapeError(f"{num_layers} layers; cachegen handles 1 to {MAX_LAYERS}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ShapeError(f"{channels} channels per token (heads x head_dim); cachegen handles 1 to {MAX_CHANNELS}")
    if num_tokens > MAX_TOKENS:
        raise ShapeError(f"{num_tokens} tokens; cachegen handles at most {MAX_TOKENS}")


def detect_layout(tensors: Mapping[str, torch.Tensor]) -> str:
    """'stacked' or 'per-layer', from the tensor names and ranks."""
    if not tensors:
        raise LayoutError("the file holds no tensors")
    names = list(tensors)
    if all(_PER_LAYER_NAME.match(n) for n in names):
        return "per-layer"
    if len(names) == 1:
        t = tensors[names[0]]
        if t.dim() == 5 and t.shape[1] == 2:
            return "stacked"
        raise LayoutError(
            f"one tensor {names[0]!r} of shape {list(t.shape)}; the stacked layout needs "
            "[num_layers, 2, num_tokens, num_kv_heads, head_dim]"
        )
    odd = next(n for n in names if not _PER_LAYER_NAME.match(n))
    raise LayoutError(
        f"unknown layout: expected one tensor [layers, 2, tokens, heads, head_dim] or tensors "
        f"named layers.{{i}}.key / layers.{{i}}.value, found {len(names)} tensors including {odd!r}"
    )


def from_tensors(
    tensors: Mapping[str, torch.Tensor] | torch.Tensor,
    layout: str = "auto",
    metadata: Mapping[str, str] | None = None,
) -> KVCache:
    """Validate tensors in either layout and bring them to the internal form."""
    if isinstance(tensors, torch.Tensor):
        tensors = {"kv": tensors}
    if not isinstance(tensors, Mapping):
        raise LayoutError("expected a tensor or a mapping of names to tensors")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name!r} is not a tensor")
        _check_dtype(name, tensor)
    if layout == "auto":
        layout = detect_layout(tensors)
    elif layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; choose auto, stacked or per-layer")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if layout == "stacked":
        cache = _from_stacked(tensors, meta)
    else:
        cache = _from_per_layer(tensors, meta)
    check_finite(cache.data)
    return cache


def _from_stacked(tensors: Mapping[str, torch.Tensor], meta: dict[str, str]) -> KVCache:
    if len(tensors) != 1:
        raise LayoutError(f"the stacked layout holds one tensor, found {len(tensors)}")
    (name, t), = tensors.items()
    if t.dim() != 5 or t.shape[1] != 2:
        raise ShapeError(
            f"tensor {name!r} has shape {list(t.shape)}; the stacked layout needs "
            "[num_layers, 2, num_tokens, num_kv_heads, head_dim]"
        )
    L, _, T, H, D = (int(s) for s in t.shape)
    _check_limits(L, T, H * D)
    data = t.detach().reshape(L, 2, T, H * D)
    return KVCache(data, "stacked", H, D, [{"name": name, "shape": [L, 2, T, H, D]}], meta)


def _from_per_layer(tensors: Mapping[str, torch.Tensor], meta: dict[str, str]) -> KVCache:
    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        match = _PER_LAYER_NAME.match(name)
        if not match:
            raise LayoutError(f"tensor {name!r} is not named layers.{{i}}.key or layers.{{i}}.value")
        found[(int(match.group(1)), match.group(2))] = (name, t)
    num_layers = max(i for i, _ in found) + 1
    for i in range(num_layers):
        for kind in ("key", "value"):
            if (i, kind) not in found:
                raise LayoutError(f"layers.{i}.{kind} is missing (found layers up to {num_layers - 1})")
    first_name, first = found[(0, "key")]
    shape = list(first.shape)
    if first.dim() == 4 and shape[0] != 1:
        raise ShapeError(f"tensor {first_name!r} has batch size {shape[0]}; cachegen reads batch size 1")
    if first.dim() not in (3, 4):
        raise ShapeError(
            f"tensor {first_name!r} has shape {shape}; per-layer tensors are "
            "[num_kv_heads, num_tokens, head_dim] or [1, num_kv_heads, num_tokens, head_dim]"
        )
    dtype = first.dtype
    for (i, kind), (name, t) in found.items():
        if list(t.shape) != shape:
            raise ShapeError(f"tensor {name!r} has shape {list(t.shape)}, but {first_name!r} has {shape}")
        if t.dtype != dtype:
            raise DTypeError(f"tensor {name!r} is {t.dtype}, but {first_name!r} is {dtype}; all must match")
    H, T, D = shape[-3:]
    _check_limits(num_layers, T, H * D)
    data = torch.empty((num_layers, 2, T, H * D), dtype=dtype, device=first.device)
    for i in range(num_layers):
        for kv, kind in enumerate(("key", "value")):
            t = found[(i, kind)][1].detach().reshape(H, T, D)
            data[i, kv].copy_(t.permute(1, 0, 2).reshape(T, H * D))
    order = [{"name": name, "shape": list(t.shape)} for name, t in tensors.items()]
    return KVCache(data, "per-layer", H, D, order, meta)


def check_finite(data: torch.Tensor) -> None:
    """Raise NonFiniteError naming the first layer with NaN or Inf."""
    if data.numel() == 0:
        return
    if data.device.type == "cpu":
        from .kernels.checks import first_nonfinite_row

        view, mask = {
            torch.bfloat16: (torch.int16, 0x7F80),
            torch.float16: (torch.int16, 0x7C00),
            torch.float32: (torch.int32, 0x7F800000),
        }[data.dtype]
        words = data.contiguous().view(view).numpy()
        words = words.view(np.uint16 if view == torch.int16 else np.uint32).reshape(data.shape[0], -1)
        if first_nonfinite_row(words, mask) < 0:
            return
    elif bool(torch.isfinite(data).all()):  # one pass and one sync on a GPU
        return
    for layer in range(data.shape[0]):
        plane = data[layer]
        if not bool(torch.isfinite(plane).all()):
            kinds = []
            if bool(torch.isnan(plane).any()):
                kinds.append("NaN")
            if bool(torch.isinf(plane).any()):
                kinds.append("Inf")
            raise NonFiniteError(f"layer {layer} holds {' and '.join(kinds)} values; cachegen encodes finite values only")


def read_safetensors(path: str | Path, layout: str = "auto") -> KVCache:
    """Read and validate a KV safetensors file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise InputNotFoundError(f"no such file: {path}")
    if not path.is_file():
        raise InputNotFoundError(f"not a file: {path}")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NotSafetensorsError(f"{path} is not a readable safetensors file ({detail})") from None
    return from_tensors(tensors, layout, metadata)


def to_tensors(data: torch.Tensor, descriptor: Mapping) -> dict[str, torch.Tensor]:
    """Internal [L, 2, T, C] -> the original named tensors, per the descriptor."""
    L, _, T, C = data.shape
    H, D = int(descriptor["num_kv_heads"]), int(descriptor["head_dim"])
    if H * D != C:
        raise ShapeError(f"descriptor says {H} heads x {D} dims but the data has {C} channels")
    out: dict[str, torch.Tensor] = {}
    if descriptor["layout"] == "stacked":
        (entry,) = descriptor["tensors"]
        out[entry["name"]] = data.reshape(L, 2, T, H, D)
        return out
    for entry in descriptor["tensors"]:
        match = _PER_LAYER_NAME.match(entry["name"])
        layer, kv = int(match.group(1)), 0 if match.group(2) == "key" else 1
        t = data[layer, kv].reshape(T, H, D).permute(1, 0, 2).contiguous()
        out[entry["name"]] = t.reshape(entry["shape"])
    return out


def validate_descriptor(descriptor: object, num_layers: int, num_tokens: int, num_channels: int) -> dict:
    """Check a descriptor read from a file against the header; returns it.  Raises ValueError."""
    if not isinstance(descriptor, dict):
        raise ValueError("descriptor is not an object")
    layout = descriptor.get("layout")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    H, D = descriptor.get("num_kv_heads"), descriptor.get("head_dim")
    if not (isinstance(H, int) and isinstance(D, int) and H >= 1 and D >= 1 and H * D == num_channels):
        raise ValueError("num_kv_heads x head_dim does not match the channel count")
    meta = descriptor.get("metadata", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("metadata must map strings to strings")
    tensors = descriptor.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise ValueError("no tensors listed")
    names = set()
    for entry in tensors:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("shape"), list)):
            raise ValueError("bad tensor entry")
        if entry["name"] in names:
            raise ValueError(f"tensor {entry['name']!r} listed twice")
        names.add(entry["name"])
        shape = entry["shape"]
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError("bad tensor shape")
    if layout == "stacked":
        if len(tensors) != 1 or tensors[0]["shape"] != [num_layers, 2, num_tokens, H, D]:
            raise ValueError("stacked tensor shape does not match the header")
    else:
        if len(tensors) != 2 * num_layers:
            raise ValueError("per-layer tensor count does not match the layer count")
        for entry in tensors:
            match = _PER_LAYER_NAME.match(entry["name"])
            if not match or int(match.group(1)) >= num_layers:
                raise ValueError(f"bad per-layer tensor name {entry['name']!r}")
            if entry["shape"] not in ([H, num_tokens, D], [1, H, num_tokens, D]):
                raise ValueError(f"shape of {entry['name']!r} does not match the header")
    return descriptor


def write_safetensors_atomic(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """Write tensors to ``path`` through a temporary file in the same folder."""
    from safetensors.torch import save_file

    from .fileio import atomic_output

    with atomic_output(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata or None)


def values_count(cache_shape: tuple[int, ...]) -> int:
    return math.prod(cache_shape)
