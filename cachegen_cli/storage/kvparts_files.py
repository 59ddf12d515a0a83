"""Caches of any shape (storage/kvparts.py) read from and written to safetensors files a plane
slab at a time: a run of tokens of one K / V / latent plane, straight from or to its bytes in
the file, so that format version 3 files are encoded and decoded file to file with the memory
of a slab, not of the cache (pipeline/parts.py).

A plane's tokens [t0, t1) are, by the tensor's form (kvparts' module docstring):

  HTD  [H, T, D]         one run of (t1 - t0) x D words per head h, at (h T + t0) D
  BHTD [B, H, T, D]      the same in sequence b's [H, T, D]
  TC   [T, C]            one run of (t1 - t0) x C words at t0 C
  BTC  [B, T, C]         the same in sequence b's [T, C]
  L2THD [L, 2, T, H, D]  one run of (t1 - t0) x H D words at ((l 2 + k) T + t0) H D

and the plane's [tokens, channels] is x[t, h D + d] = T[h, t, d] (the token-major order)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import InputNotFoundError, NotSafetensorsError
from . import kvparts
from .kvio import _read_exactly, _write_exactly

#: numpy word types by item size (the bits of 2- and 4-byte floats moved as integers)
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # the types torch.from_numpy takes
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ST_TO_TORCH = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                "F64": torch.float64, "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
                "U64": getattr(torch, "uint64", None), "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
                "F8_E5M2": getattr(torch, "float8_e5m2", None)}
#: bytes of one plane read at a time by the finite check
CHECK_BYTES = 64 << 20


def _geometry(entry: dict, select: tuple) -> tuple[int, int, int, int]:
    """(byte offset of the plane's sequence / (layer, K/V) in its tensor, heads, tokens, head size):
    a plane's tokens [t0, t1) are heads runs of (t1 - t0) x head size words; a head's run starts
    at offset + (h tokens + t0) head size words (one head for TC / BTC / L2THD)."""
    form, s = entry["form"], [int(x) for x in entry["shape"]]
    w = kvparts._itemsize(entry["dtype"])
    if form == "HTD":
        return 0, s[0], s[1], s[2]
    if form == "BHTD":
        return select[0] * s[1] * s[2] * s[3] * w, s[1], s[2], s[3]
    if form == "TC":
        return 0, 1, s[0], s[1]
    if form == "BTC":
        return select[0] * s[1] * s[2] * w, 1, s[1], s[2]
    l, kv = select
    return (l * 2 + kv) * s[2] * s[3] * s[4] * w, 1, s[2], s[3] * s[4]


class PlanesFile:
    """A safetensors KV file of any shape: its kvparts.PartsCache (the tensors on the meta
    device: shapes, dtypes, names) and its planes read a run of tokens at a time."""

    def __init__(self, path, names=None, extras: str = "keep", hints=None) -> None:
        from safetensors import SafetensorError, safe_open

        from .outputs import check_input

        path = Path(path)
        check_input(path)
        if not path.is_file():
            raise InputNotFoundError(f"not a file: {path}")
        try:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            with safe_open(str(path), framework="pt") as f:  # validates the header (sizes, offsets, dtypes)
                metadata = f.metadata() or {}
                tensors = {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    dtype = _ST_TO_TORCH.get(sl.get_dtype())
                    if dtype is None:  # a dtype torch names differently: ask the tensor itself
                        dtype = f.get_tensor(name).dtype
                    tensors[name] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, struct.error) as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise NotSafetensorsError(f"{path} is not a readable safetensors file ({detail})") from None
        self.path = path
        # the tensors in safe_open's order, as kvio.read_tensors gives them (the same manifest)
        self.pc = kvparts.analyse(tensors, metadata, names, extras, hints, check_values=False)
        self._offsets = {name: 8 + n + int(header[name]["data_offsets"][0]) for name in tensors}
        self._fh = open(path, "rb", buffering=0)
        self._fd = self._fh.fileno()

    def plane(self, p: "kvparts.Plane", t0: int, t1: int) -> torch.Tensor:
        """Tokens [t0, t1) of plane ``p`` as a CPU tensor [t1 - t0, channels] of its dtype."""
        e = self.pc.entries[p.tensor]
        base, H, T, D = _geometry(e, p.select)
        w = kvparts._itemsize(e["dtype"])
        Ts = t1 - t0
        words = np.empty((H, Ts, D), _WORDS[w])
        if Ts and D:
            start = self._offsets[e["name"]] + base
            if H == 1:
                _read_exactly(self._fd, self._fh, start + t0 * D * w, words[0])
            else:
                for h in range(H):
                    _read_exactly(self._fd, self._fh, start + (h * T + t0) * D * w, words[h])
        rows = np.ascontiguousarray(words.transpose(1, 0, 2).reshape(Ts, H * D)).view(_SIGNED[w])
        return torch.from_numpy(rows).view(kvparts.KV_DTYPE_BY_NAME[e["dtype"]])

    def check_finite(self) -> None:
        """The finite check kvparts.analyse makes on values in memory, plane by plane in its
        order (the same first tensor named), CHECK_BYTES of a plane at a time."""
        for p in _planes_in_order(self.pc):
            step = max(1, CHECK_BYTES // max(p.channels * kvparts._itemsize(p.dtype), 1))
            for t0 in range(0, p.tokens, step):
                kvparts._check_finite(self.pc.entries[p.tensor]["name"], self.plane(p, t0, min(p.tokens, t0 + step)))

    def raw(self, entry: dict, block: int = 16 << 20):
        """An extra tensor's bytes, ``block`` bytes at a time."""
        size = kvparts._numel(entry["shape"]) * kvparts._itemsize(entry["dtype"])
        start = self._offsets[entry["name"]]
        for at in range(0, size, block):
            buf = np.empty(min(block, size - at), np.uint8)
            _read_exactly(self._fd, self._fh, start + at, buf)
            yield memoryview(buf)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "PlanesFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _planes_in_order(pc: "kvparts.PartsCache") -> list:
    """The planes in analyse's order (by tensor, then selector): the order of its finite check."""
    planes = [q for g in pc.groups for m in g.members for q in (m if g.kind == "kv" else (m,))]
    return sorted(planes, key=lambda q: (q.tensor, q.select))


class PlanesWriter:
    """The safetensors file of a version-3 manifest's tensors, written plane slab by plane slab
    (``write_plane``) and extra by extra (``write_raw``): the bytes of
    kvparts.safetensors_parts(tensors_from_groups(...), metadata).  The caller gives a temporary
    path (outputs.atomic_output) and writes every plane and extra once."""

    def __init__(self, path, manifest: dict) -> None:
        self.entries = manifest["tensors"]
        head, self.offsets, size = kvparts.safetensors_layout(self.entries, manifest["metadata"])
        self._fh = open(path, "wb")
        self._fd = self._fh.fileno()
        self._fh.write(head)
        self._fh.flush()
        os.ftruncate(self._fd, size)

    def write_plane(self, ti: int, select: tuple, t0: int, values: torch.Tensor) -> None:
        """Tokens [t0, t0 + len(values)) of tensor ``ti``'s plane ``select``: values [Ts, channels]."""
        e = self.entries[ti]
        base, H, T, D = _geometry(e, tuple(select))
        w = kvparts._itemsize(e["dtype"])
        Ts = values.shape[0]
        if not Ts or not D:
            return
        words = values.detach().cpu().contiguous().view(_TORCH_INT[w]).numpy()
        start = self.offsets[e["name"]] + base
        if H == 1:
            _write_exactly(self._fd, self._fh, start + t0 * D * w, words)
            return
        heads = np.ascontiguousarray(words.reshape(Ts, H, D).transpose(1, 0, 2))
        for h in range(H):
            _write_exactly(self._fd, self._fh, start + (h * T + t0) * D * w, heads[h])

    def write_raw(self, ti: int, data) -> None:
        view = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        if len(view):
            _write_exactly(self._fd, self._fh, self.offsets[self.entries[ti]["name"]], view)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "PlanesWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
