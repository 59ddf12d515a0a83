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

import json
import math
import os
import re
import stat
import struct
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import (
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

#: \d also matches other scripts' digits: such a name is routed here and refused with its own
#: message (docs/format.md: `{i}` is ASCII digits); \Z, unlike $, refuses a trailing newline.
_PER_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(key|value)\Z")


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
    #: The RoPE of the keys (format.params.Rope) when given explicitly (api.encode(rope=...), the CLI's
    #: --rope-theta); otherwise methods/rope.resolve reads the metadata's "rope" entry.  Not stored as such.
    rope: object = field(default=None, compare=False)

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
    check: bool = True,
) -> KVCache:
    """Validate tensors in either layout and bring them to the internal form.  ``check=False``
    leaves out the finiteness check (check_finite), for a caller whose own pass over the
    values makes it (the GPU encoder)."""
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
    if check:
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
        if not match.group(1).isascii():
            raise LayoutError(f"tensor {name[:40]!r}: the layer number must be written in ASCII digits 0-9")
        if len(match.group(1)) > 9:
            raise LayoutError(f"tensor {name[:40]!r}...: layer number out of range (at most {MAX_LAYERS - 1})")
        slot = (int(match.group(1)), match.group(2))
        if slot in found:  # layers.0.key and layers.00.key: which one is layer 0's key?
            raise LayoutError(f"tensors {found[slot][0]!r} and {name!r} both name layer {slot[0]}'s {slot[1]}")
        found[slot] = (name, t)
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
    if data.numel() == 0 or data.device.type == "meta":  # meta: a file's shapes only (SafetensorsSource)
        return
    if data.device.type == "cpu":
        from ..kernels.checks import first_nonfinite_row

        view, mask = {
            torch.bfloat16: (torch.int16, 0x7F80),
            torch.float16: (torch.int16, 0x7C00),
            torch.float32: (torch.int32, 0x7F800000),
        }[data.dtype]
        words = data.contiguous().view(view).numpy()
        words = words.view(np.uint16 if view == torch.int16 else np.uint32).reshape(data.shape[0], -1)
        if first_nonfinite_row(words, mask) < 0:
            return
    elif data.is_cuda:
        if not _cuda_nonfinite_layers(data).any():  # one pass over the words and one sync
            return
    elif bool(torch.isfinite(data).all()):
        return
    for layer in range(data.shape[0]):
        plane = data[layer]
        if not bool(torch.isfinite(plane).all()):
            kinds = []
            if bool(torch.isnan(plane).any()):
                kinds.append("NaN")
            if bool(torch.isinf(plane).any()):
                kinds.append("Inf")
            raise NonFiniteError(_nonfinite_message(layer, kinds))


def _cuda_nonfinite_layers(data: torch.Tensor) -> np.ndarray:
    """uint8 [L]: 1 for each layer of a CUDA cache that holds a NaN or an Inf (exponent bits
    all ones), from one kernel over its raw words (torch.isfinite(...).all() takes five
    passes over the cache)."""
    from ..kernels.cuda_pipeline import nonfinite_layers

    view, mask = EXPONENT_WORDS[data.dtype]
    L = data.shape[0]
    flat = data.contiguous().view(view).reshape(L, -1)
    if (flat.shape[1] * flat.element_size()) % 8 == 0:
        flat = flat.view(torch.int64)  # 8 bytes of values per thread
    flags = torch.zeros(L, dtype=torch.uint8, device=data.device)
    nonfinite_layers(flat.reshape(-1), flat.shape[1], mask, data.element_size(), flags)
    return flags.cpu().numpy()


def _nonfinite_message(layer: int, kinds: list[str]) -> str:
    return f"layer {layer} holds {' and '.join(kinds)} values; cachegen encodes finite values only"


EXPONENT_WORDS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


class FiniteCheck:
    """check_finite over a cache read slab by slab (``add`` each [L, 2, Ts, C] CPU block):
    ``raise_if_bad`` then raises exactly the error check_finite raises on the whole cache
    (the first layer with NaN or Inf anywhere, and which of the two it holds)."""

    def __init__(self, num_layers: int) -> None:
        self.nan = np.zeros(num_layers, np.bool_)
        self.inf = np.zeros(num_layers, np.bool_)

    def add(self, block: torch.Tensor) -> None:
        from ..kernels.checks import first_nonfinite_row

        if block.numel() == 0:
            return
        view, mask = EXPONENT_WORDS[block.dtype]
        words = block.contiguous().view(view).numpy()
        words = words.view(np.uint16 if view == torch.int16 else np.uint32).reshape(block.shape[0], -1)
        if first_nonfinite_row(words, mask) < 0:
            return
        for layer in range(block.shape[0]):  # the rare bad slab: which layers, and what they hold
            plane = block[layer]
            self.nan[layer] |= bool(torch.isnan(plane).any())
            self.inf[layer] |= bool(torch.isinf(plane).any())

    @property
    def bad(self) -> bool:
        return bool(self.nan.any() or self.inf.any())

    def raise_if_bad(self) -> None:
        if not self.bad:
            return
        layer = int(np.flatnonzero(self.nan | self.inf)[0])
        kinds = [k for k, hit in (("NaN", self.nan[layer]), ("Inf", self.inf[layer])) if hit]
        raise NonFiniteError(_nonfinite_message(layer, kinds))


def read_safetensors(path: str | Path, layout: str = "auto") -> KVCache:
    """Read and validate a KV safetensors file."""
    tensors, metadata = read_tensors(path)
    return from_tensors(tensors, layout, metadata)


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file (in the file's order) and its metadata, unchecked."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    from .outputs import check_input

    check_input(path)
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
    return tensors, metadata


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
    """Check a descriptor read from a file against the header; returns it.  Raises ValueError.

    Integers must be JSON integers: true / false (Python bools, equal to 1 / 0) and numbers
    with a fraction or exponent (floats) are refused wherever a count or a size is expected."""

    def is_int(v: object) -> bool:
        return type(v) is int

    if not isinstance(descriptor, dict):
        raise ValueError("descriptor is not an object")
    layout = descriptor.get("layout")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    H, D = descriptor.get("num_kv_heads"), descriptor.get("head_dim")
    if not (is_int(H) and is_int(D) and H >= 1 and D >= 1 and H * D == num_channels):
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
        if not all(is_int(s) and s >= 0 for s in shape):
            raise ValueError("bad tensor shape")
    if layout == "stacked":
        if len(tensors) != 1 or tensors[0]["shape"] != [num_layers, 2, num_tokens, H, D]:
            raise ValueError("stacked tensor shape does not match the header")
    else:
        if len(tensors) != 2 * num_layers:
            raise ValueError("per-layer tensor count does not match the layer count")
        slots: dict[tuple[int, str], str] = {}
        for entry in tensors:
            match = _PER_LAYER_NAME.match(entry["name"])
            if (not match or not match.group(1).isascii() or len(match.group(1)) > 9
                    or int(match.group(1)) >= num_layers):
                raise ValueError(f"bad per-layer tensor name {entry['name'][:60]!r}")
            slot = (int(match.group(1)), match.group(2))
            if slot in slots:  # with 2 x L distinct slots, every layer's key and value is listed
                raise ValueError(f"layer {slot[0]}'s {slot[1]} is listed twice ({slots[slot]!r}, {entry['name']!r})")
            slots[slot] = entry["name"]
            if entry["shape"] not in ([H, num_tokens, D], [1, H, num_tokens, D]):
                raise ValueError(f"shape of {entry['name']!r} does not match the header")
    return descriptor


def write_safetensors_atomic(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """Write tensors to ``path`` through a temporary file in the same folder."""
    from safetensors.torch import save_file

    from .outputs import atomic_output

    with atomic_output(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata or None)


def values_count(cache_shape: tuple[int, ...]) -> int:
    return math.prod(cache_shape)


# ---------------------------------------------------------------- slab-by-slab file I/O
#
# Encoding or decoding a file never needs the whole cache in memory: the codec reads and
# writes runs of whole chunks (slabs).  The input is read with positioned reads into one
# slab's buffer, and the output's tensor bytes are written with positioned writes, so the
# process holds O(slab) of both (the page cache holds the file, not the process).

#: safetensors' dtype names <-> torch (for the error messages about foreign dtypes).
_ST_TORCH = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _ST_TORCH[_name] = getattr(torch, _attr)
ST_DTYPE_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4}
_WORD_TYPES = {2: (np.uint16, np.int16, torch.int16), 4: (np.uint32, np.int32, torch.int32)}


def _words(block: torch.Tensor | np.ndarray) -> np.ndarray:
    """The raw little-endian words (uint16 / uint32) of a CPU tensor or word array."""
    if isinstance(block, np.ndarray):
        return block
    block = block.detach().cpu().contiguous()
    _, _, tview = _WORD_TYPES[block.element_size()]
    w = block.view(tview).numpy()
    return w.view(np.uint16 if w.dtype == np.int16 else np.uint32)


def _read_exactly(fd: int, fh, offset: int, out: np.ndarray) -> None:
    """Fill the contiguous array ``out`` with the file's bytes at ``offset``."""
    view = memoryview(out).cast("B")
    while len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view], offset)
        else:
            fh.seek(offset)
            n = fh.readinto(view)
        if not n:
            raise NotSafetensorsError("the safetensors file ends inside its tensor data (it changed while being read?)")
        view = view[n:]
        offset += n


def _write_exactly(fd: int, fh, offset: int, data: np.ndarray) -> None:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    while len(view):
        if hasattr(os, "pwrite"):
            n = os.pwrite(fd, view, offset)
        else:
            fh.seek(offset)
            n = fh.write(view)
        view = view[n:]
        offset += n


class SlabBuffers:
    """Buffers reused from slab to slab.  A fresh slab-sized array costs a page fault per 4 KiB
    on its first write, more than filling it; ``get`` hands out the same memory each slab, so
    what it returned last time for that name must no longer be in use."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.size < n:
            buf = self._bufs[name] = np.empty(max(n, 1), np.uint8)
        return buf[:n].view(dtype).reshape(shape)


class TensorSource:
    """A cache already in memory, as a source for the slab-by-slab encoders (already checked)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def read(self, t0: int, t1: int, buffers: SlabBuffers | None = None) -> torch.Tensor:
        data = self.cache.data
        if t0 == 0 and t1 == data.shape[2]:
            return data.detach().cpu().contiguous()
        return data[:, :, t0:t1].detach().cpu().contiguous()

    def finite_check(self) -> FiniteCheck | None:
        return None  # from_tensors checked it


class SafetensorsSource:
    """A KV safetensors file read a run of tokens at a time.

    ``cache`` is the validated KVCache of the file with its data on the meta device (shapes,
    dtype, layout, names, metadata: every check ``read_safetensors`` makes but the finite
    one, which the encoders run on each slab, see FiniteCheck); ``read(t0, t1)`` returns the
    tokens [t0, t1) as a CPU tensor [L, 2, t1 - t0, C], read straight from the file."""

    def __init__(self, path: str | Path, layout: str = "auto") -> None:
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        from .outputs import check_input

        check_input(path)
        if not path.is_file():
            raise InputNotFoundError(f"not a file: {path}")
        shapes: dict[str, torch.Tensor] = {}
        try:
            # safe_open validates the header (sizes, offsets, dtypes) and maps the file without
            # touching its data; the data offsets are then read from the validated header.
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    dtype = _ST_TORCH.get(sl.get_dtype())
                    if dtype is None:  # a dtype torch names differently: ask the tensor itself
                        dtype = f.get_tensor(name).dtype
                    shapes[name] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, struct.error) as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise NotSafetensorsError(f"{path} is not a readable safetensors file ({detail})") from None
        self.path = path
        self.cache = from_tensors(shapes, layout, metadata)
        self._data_start = 8 + n
        self._offsets = {name: int(header[name]["data_offsets"][0]) for name in shapes}
        self._fh = open(path, "rb", buffering=0)
        self._fd = self._fh.fileno()
        c = self.cache
        self._per_layer = {}
        if c.layout == "per-layer":
            for entry in c.tensors:
                match = _PER_LAYER_NAME.match(entry["name"])
                self._per_layer[(int(match.group(1)), 0 if match.group(2) == "key" else 1)] = entry["name"]

    def read(self, t0: int, t1: int, buffers: SlabBuffers | None = None) -> torch.Tensor:
        """Tokens [t0, t1) as a CPU tensor [L, 2, t1 - t0, C]; with ``buffers``, in its "read"
        buffer (valid until the next read with them)."""
        c = self.cache
        L, T, C = c.num_layers, c.num_tokens, c.num_channels
        H, D = c.num_kv_heads, c.head_dim
        Ts = t1 - t0
        w = ITEMSIZES[c.dtype_name]
        unsigned, signed, tview = _WORD_TYPES[w]
        shape = (L, 2, Ts, C)
        out = np.empty(shape, unsigned) if buffers is None else buffers.get("read", shape, unsigned)
        if Ts > 0:
            if c.layout == "stacked":
                base = self._data_start + self._offsets[c.tensors[0]["name"]]
                if Ts == T:  # the whole tensor: one read
                    _read_exactly(self._fd, self._fh, base, out)
                else:  # [L, 2, T, C]: one run of Ts x C words per (layer, K/V)
                    for l in range(L):
                        for kv in range(2):
                            _read_exactly(self._fd, self._fh, base + ((l * 2 + kv) * T + t0) * C * w, out[l, kv])
            else:  # [H, T, D] per tensor: one run of Ts x D words per head, then heads interleaved per token
                heads = np.empty((H, Ts, D), unsigned) if buffers is None else buffers.get("heads", (H, Ts, D), unsigned)
                for (l, kv), name in self._per_layer.items():
                    base = self._data_start + self._offsets[name]
                    if Ts == T:
                        _read_exactly(self._fd, self._fh, base, heads)
                    else:
                        for h in range(H):
                            _read_exactly(self._fd, self._fh, base + (h * T + t0) * D * w, heads[h])
                    out[l, kv].reshape(Ts, H, D)[...] = heads.transpose(1, 0, 2)
        return torch.from_numpy(out.view(signed)).view(c.data.dtype)

    def finite_check(self) -> FiniteCheck:
        return FiniteCheck(self.cache.num_layers)

    def load(self, buffers: SlabBuffers | None = None, check: bool = True) -> KVCache:
        """The whole cache in memory, for the paths that need it at once (v2 on a GPU).
        ``buffers``: read into its "read" buffer (as read); ``check=False``: its values are
        not checked finite here (for a caller whose first pass checks them: the GPU's)."""
        c = self.cache
        data = self.read(0, c.num_tokens, buffers)
        if check:
            check_finite(data)
        return KVCache(data, c.layout, c.num_kv_heads, c.head_dim, c.tensors, c.metadata, c.rope)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def safetensors_header(descriptor: Mapping, dtype_name: str) -> tuple[bytes, dict[str, int]]:
    """The header safetensors' save_file writes for the descriptor's tensors in ``dtype_name``
    (8-byte length, JSON, spaces to a multiple of 8), and each tensor's data offset in the file.

    Byte for byte what safetensors writes: tensors in name order (it sorts by dtype, then
    name; one dtype here), compact JSON with UTF-8 kept, no ``__metadata__`` when there is
    none.  Metadata keys are written sorted: safetensors writes them in hash order, which
    changes from run to run, so only with at most one key is its file reproducible at all."""
    w = ITEMSIZES[dtype_name]
    entries = sorted((e["name"], [int(s) for s in e["shape"]]) for e in descriptor["tensors"])
    head: dict = {}
    metadata = descriptor.get("metadata") or {}
    if metadata:
        head["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    starts = {}
    for name, shape in entries:
        n = math.prod(shape) * w
        head[name] = {"dtype": ST_DTYPE_NAMES[dtype_name], "shape": shape, "data_offsets": [offset, offset + n]}
        starts[name] = offset
        offset += n
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    data_start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: data_start + o for name, o in starts.items()}


class SafetensorsWriter:
    """Writes a decoded cache to a safetensors file in the descriptor's layout, a run of
    tokens at a time (``write(t0, block)``, block [L, 2, Ts, C] of the dtype): the same bytes
    as ``write_safetensors_atomic(to_tensors(data, descriptor), ...)``.  The caller gives a
    temporary path (fileio.atomic_output) and must write every token once."""

    def __init__(self, path: str | Path, descriptor: Mapping, dtype_name: str) -> None:
        self.descriptor = descriptor
        self.dtype_name = dtype_name
        self.itemsize = ITEMSIZES[dtype_name]
        self.layout = descriptor["layout"]
        self.H, self.D = int(descriptor["num_kv_heads"]), int(descriptor["head_dim"])
        header, self.starts = safetensors_header(descriptor, dtype_name)
        tensors = descriptor["tensors"]
        if self.layout == "stacked":
            L, _, T = tensors[0]["shape"][:3]
        else:
            L, T = len(tensors) // 2, tensors[0]["shape"][-2]
        self.L, self.T = int(L), int(T)
        self._names = {}
        if self.layout == "per-layer":
            for e in tensors:
                match = _PER_LAYER_NAME.match(e["name"])
                self._names[(int(match.group(1)), 0 if match.group(2) == "key" else 1)] = e["name"]
        total = len(header) + self.L * 2 * self.T * self.H * self.D * self.itemsize
        self._fh = open(path, "wb")
        self._target = None
        st = os.fstat(self._fh.fileno())
        if not stat.S_ISREG(st.st_mode) and not self._fh.seekable():
            # A FIFO or socket, written in place (storage.outputs): the blocks come in token
            # order, not file order, so they are put together in an unnamed temporary file
            # (gone with the process, whatever kills it) and copied over in order at the end.
            self._target = self._fh
            self._fh = tempfile.TemporaryFile()
        self._fd = self._fh.fileno()
        self._fh.write(header)
        self._fh.flush()
        if stat.S_ISREG(os.fstat(self._fd).st_mode):  # a device (/dev/null) has no size to set
            self._fh.truncate(total)
        self._total = total

    def write(self, t0: int, block: torch.Tensor | np.ndarray) -> None:
        words = _words(block)
        L, _, Ts, C = words.shape
        if Ts == 0:
            return
        if sys.byteorder != "little":
            words = words.astype(words.dtype.newbyteorder("<"))
        w, T = self.itemsize, self.T
        if self.layout == "stacked":
            base = self.starts[self.descriptor["tensors"][0]["name"]]
            if Ts == T:
                _write_exactly(self._fd, self._fh, base, words)
                return
            for l in range(L):
                for kv in range(2):
                    _write_exactly(self._fd, self._fh, base + ((l * 2 + kv) * T + t0) * C * w, words[l, kv])
            return
        H, D = self.H, self.D
        # [L, 2, Ts, H, D] -> [L, 2, H, Ts, D]: torch's copy runs on every core.
        _, signed, tview = _WORD_TYPES[w]
        heads = (torch.from_numpy(np.ascontiguousarray(words).view(signed)).view(L, 2, Ts, H, D)
                 .permute(0, 1, 3, 2, 4).contiguous().numpy())
        for (l, kv), name in self._names.items():
            base = self.starts[name]
            if Ts == T:
                _write_exactly(self._fd, self._fh, base, heads[l, kv])
                continue
            for h in range(H):
                _write_exactly(self._fd, self._fh, base + (h * T + t0) * D * w, heads[l, kv, h])

    def close(self, complete: bool = True) -> None:
        try:
            if self._target is not None and complete:
                self._fh.seek(0)
                left = self._total
                while left > 0:
                    part = self._fh.read(min(left, 1 << 24)) or b"\0" * min(left, 1 << 24)
                    self._target.write(part)
                    left -= len(part)
                self._target.flush()
        finally:
            self._fh.close()
            if self._target is not None:
                self._target.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(complete=exc_type is None)

