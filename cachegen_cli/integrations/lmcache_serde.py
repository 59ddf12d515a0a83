"""A ``cachegen`` serde for LMCache's multiprocess mode (LMCache 0.5.x).

LMCache's distributed storage manager runs a serde around an L2 adapter when the adapter's
JSON spec has a ``"serde"`` entry (``lmcache.v1.distributed.l2_adapters.config``): every KV
chunk is serialized into a byte buffer of ``estimate_serialized_size`` bytes before it is
stored, and deserialized into a KV buffer after it is loaded.  Importing this module (or
calling :func:`register`) registers ``"cachegen"`` in that registry
(``lmcache.v1.distributed.serde.register_serde_factory``), so that

    --l2-adapter '{"type": "fs", "base_path": "/cache", "serde": {"type": "cachegen", "quality": "balanced"}}'

stores each chunk as a .cgen file.  LMCache imports only its own serdes, so the server is
started through this module, which registers the serde and then runs LMCache's CLI:

    python -m cachegen_cli.integrations.lmcache_serde server --l2-adapter '...'

Options (the ``"serde"`` object's keys besides ``type``): ``quality`` (lossless, high,
balanced, small; the default balanced), or ``preset`` (lmcache, ...) or ``bins`` (a --bins
string) instead; ``calibration`` (a calibration file from ``cachegen calibrate``: the
rotation of the transform qualities; the same file must be given wherever the chunks are
loaded); ``chunk_tokens`` (tokens per .cgen chunk, 256); ``device`` (auto, cpu, cuda: where
the codec runs; auto: the GPU when one is present); ``max_workers`` (LMCache's serde
threads, 1).  docs/lmcache.md has the whole story.

Chunks: LMCache's KV chunk memory objects, ``[2, num_layers, num_tokens, hidden]`` (K at
index 0; ``MemoryFormat.KV_2LTD``; hidden = kv_heads x head_dim), float16, bfloat16 or
float32, on the CPU or a CUDA GPU; an object of several groups (kernel groups of a hybrid
model) is coded group by group.  MLA groups are ``[1, num_layers, num_tokens, head_size]``
(``kv_size`` 1 in lmcache.v1.kv_layer_groups and metadata.get_shapes; ``MemoryFormat.KV_MLA_FMT``
``[1, num_layers, num_tokens, aligned_head_size]``: one latent of kv_lora_rank + rope
channels per layer and token, e.g. 576 for DeepSeek-V3): each layer's latent is coded as an
MLA latent plane, the group as a multi-part .cgen file (format version 3, docs/shapes.md);
its calibration, if any, is a version 3 one (``cachegen calibrate`` on such latents).  The
older 3-D ``[num_layers, num_tokens, hidden]`` form is refused with a clear error.

Serialized bytes (little-endian): the 4 bytes ``CGLM``, u16 envelope version (1), u16
number of groups G, G x u64 byte counts, then the G .cgen files back to back.  The
deserializer reads the counts from the bytes, checks them against the buffer it is given
(LMCache loads into a buffer of the estimated size, longer than what was stored) and checks
each .cgen file's decoded size against the destination before decoding it.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import api
from ..errors import ConfigError, DTypeError, FormatError, ShapeError, SizeError
from ..methods.calibration import Calibration
from ..methods.parts_calibration import PartsCalibration
from ..methods.parts_calibration import load_any as load_calibration
from ..methods.config import (
    DEFAULT_CHUNK_TOKENS,
    QuantizationConfig,
    TransformConfig,
    resolve_quantization,
    validate_chunk_tokens,
)

try:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde import (
        AsyncSerdeProcessor,
        Deserializer,
        SerdeProcessor,
        Serializer,
        get_registered_serde_types,
        register_serde_factory,
    )
    from lmcache.v1.memory_management import MemoryObj
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"the cachegen serde for LMCache needs the lmcache package (pip install 'cachegen[lmcache]'); "
                      f"importing it failed: {exc}") from exc

SERDE_NAME = "cachegen"
ENVELOPE_MAGIC = b"CGLM"
ENVELOPE_VERSION = 1
ENVELOPE = struct.Struct("<4sHH")
GROUP_LENGTH = struct.Struct("<Q")
#: LMCache hands over one object per chunk; a hybrid model's object holds one group per
#: kernel group.  A cap keeps a corrupt envelope from announcing millions of groups.
MAX_GROUPS = 1024
OPTIONS = ("quality", "preset", "bins", "calibration", "chunk_tokens", "device", "max_workers")
DEVICES = ("auto", "cpu", "cuda")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def envelope_size(groups: int) -> int:
    return ENVELOPE.size + groups * GROUP_LENGTH.size


@dataclass(frozen=True)
class CacheGenSerdeConfig:
    """What the ``"serde"`` object of an L2 adapter spec says (validated by ``from_kwargs``)."""

    quality: str | None = None
    preset: str | None = None
    bins: str | None = None
    calibration: Calibration | PartsCalibration | None = None  # version 3: for MLA chunks
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    device: str = "auto"

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, object]) -> "CacheGenSerdeConfig":
        unknown = sorted(set(kwargs) - set(OPTIONS) - {"type"})
        if unknown:
            raise ConfigError(f"cachegen serde: unknown option(s) {', '.join(unknown)}; "
                              f"known: {', '.join(OPTIONS)}")
        text = {k: None if kwargs.get(k) is None else str(kwargs[k]) for k in ("quality", "preset", "bins")}
        device = str(kwargs.get("device", "auto"))
        if device not in DEVICES:
            raise ConfigError(f"cachegen serde: device must be one of {', '.join(DEVICES)}, not {device!r}")
        calibration = kwargs.get("calibration")
        cal = None
        if calibration is not None:
            cal = calibration if isinstance(calibration, (Calibration, PartsCalibration)) \
                else load_calibration(Path(str(calibration)))
        cfg = cls(text["quality"], text["preset"], text["bins"], cal,
                  validate_chunk_tokens(kwargs.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)), device)
        cfg.quantization(1)  # the name, the table and "only one of them" are checked now, not at the first chunk
        if cal is not None and not isinstance(cfg.quantization(1), TransformConfig):
            raise ConfigError("cachegen serde: a calibration applies to the transform qualities (high, balanced, "
                              "small), not to a preset or bins")
        if cal is not None and cfg.quantization(1).method == "lossless":
            raise ConfigError("cachegen serde: a calibration does not apply to quality 'lossless'")
        return cfg

    def quantization(self, num_layers: int) -> QuantizationConfig | TransformConfig:
        return resolve_quantization(num_layers, preset_name=self.preset, bins=self.bins, quality=self.quality)


def _check_chunk_layout(shape, dtype, what: str) -> tuple[int, int, int]:
    """(layers, tokens, hidden) of a KV chunk [2, L, T, hidden] or an MLA chunk [1, L, T, hidden];
    a clear error for anything else."""
    shape = tuple(int(n) for n in shape)
    if len(shape) == 3:
        raise ShapeError(f"cachegen serde: {what} has shape {list(shape)}, a 3-D MLA chunk [num_layers, num_tokens, "
                         "hidden]; the cachegen serde codes LMCache 0.5's chunks [2, num_layers, num_tokens, hidden] "
                         "(K/V) and [1, num_layers, num_tokens, hidden] (MLA)")
    if len(shape) != 4 or shape[0] not in (1, 2):
        raise ShapeError(f"cachegen serde: {what} has shape {list(shape)}; LMCache's chunks are "
                         "[2, num_layers, num_tokens, hidden] (K/V) or [1, num_layers, num_tokens, hidden] (MLA)")
    if dtype not in _DTYPES:
        raise DTypeError(f"cachegen serde: {what} is {str(dtype).replace('torch.', '')}; the cachegen serde codes "
                         "float16, bfloat16 and float32 chunks")
    return shape[1], shape[2], shape[3]


def _is_mla(shape) -> bool:
    return int(shape[0]) == 1


def _latents(kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """An MLA chunk [1, L, T, hidden] as the latents layers.{l}.latent [T, hidden] (views)."""
    return {f"layers.{l}.latent": kv[0, l] for l in range(kv.shape[1])}


def _mla_parts(shape, dtype):
    """The storage.kvparts.PartsCache of an MLA chunk's shape (zeros with stride 0: only the
    shapes, dtype and names matter to the bound)."""
    from ..storage import kvparts

    _, L, T, C = (int(n) for n in shape)
    zero = torch.zeros((), dtype=dtype).expand(T, C)
    return kvparts.analyse({f"layers.{l}.latent": zero for l in range(L)})


def _stacked_shape(shape) -> tuple[int, int, int, int, int]:
    """The .cgen stacked layout [L, 2, T, 1, hidden] of a chunk [2, L, T, hidden] (the codec
    only sees the hidden channels; heads x head_dim is not needed to code them)."""
    _, L, T, C = (int(n) for n in shape)
    return (L, 2, T, 1, C)


def _groups(obj: MemoryObj, what: str) -> list[torch.Tensor]:
    """The KV tensors of a chunk object: one per group (most models: one)."""
    shapes = obj.get_shapes()
    if len(shapes) > 1:
        tensors = [obj.get_tensor(i) for i in range(len(shapes))]
    else:
        tensors = [obj.tensor]
    if any(t is None for t in tensors):
        raise ShapeError(f"cachegen serde: the {what} memory object holds no tensor")
    for i, t in enumerate(tensors):
        _check_chunk_layout(t.shape, t.dtype, what if len(tensors) == 1 else f"{what} group {i}")
    return tensors


def _byte_buffer(obj: MemoryObj, what: str) -> torch.Tensor:
    t = obj.tensor
    if t is None:
        raise ShapeError(f"cachegen serde: the {what} memory object holds no tensor")
    if t.dtype != torch.uint8:
        raise DTypeError(f"cachegen serde: the {what} byte buffer is {str(t.dtype).replace('torch.', '')}, "
                         "not uint8")
    return t.reshape(-1)


def _copy_bytes(out: torch.Tensor, blob: "bytes | torch.Tensor") -> None:
    """Copy ``blob`` (bytes, or a uint8 tensor on any device) into the uint8 slice ``out``."""
    if isinstance(blob, torch.Tensor):
        out.copy_(blob)
    elif out.is_cuda:
        out.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))  # host copy -> device
    else:
        out.numpy()[:] = memoryview(blob)  # straight into LMCache's buffer (no tensor of read-only bytes)


class CacheGenSerializer(Serializer):
    """LMCache KV chunk -> .cgen bytes (one file per group, in the envelope above)."""

    def __init__(self, cfg: CacheGenSerdeConfig) -> None:
        self.cfg = cfg

    def _options(self, num_layers: int) -> dict:
        return {"quantization": self.cfg.quantization(num_layers), "chunk_tokens": self.cfg.chunk_tokens}

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The envelope plus, per group, api.max_encoded_size of its shape: an upper bound that
        no chunk exceeds (most chunks take a fraction: LMCache stores only the bytes written)."""
        total = envelope_size(len(layout_desc.shapes))
        for i, (shape, dtype) in enumerate(zip(layout_desc.shapes, layout_desc.dtypes, strict=True)):
            L, _, _ = _check_chunk_layout(shape, dtype, f"layout group {i}")
            if _is_mla(shape):
                from ..pipeline.parts import max_encoded_size_parts

                opts = self._options(L)
                total += max_encoded_size_parts(_mla_parts(shape, dtype), opts["quantization"], opts["chunk_tokens"])
            else:
                total += api.max_encoded_size(_stacked_shape(shape), dtype, **self._options(L))
        return total

    def _encode(self, kv: torch.Tensor, on_device: bool):
        """.cgen bytes of one group: a uint8 CUDA tensor when ``on_device`` (the GPU-resident
        pipeline: nothing goes through the host), else bytes."""
        if _is_mla(kv.shape):  # a multi-part file of latents, coded on the host or by the device's group coder
            opts = self._options(kv.shape[1])
            latents = _latents(kv.cpu() if self.cfg.device == "cpu" else kv)
            return api.encode(latents, calibration=self.cfg.calibration, device=self.cfg.device, **opts)
        stacked = kv.permute(1, 0, 2, 3).unsqueeze(3)  # [2, L, T, C] -> [L, 2, T, 1, C]
        opts = self._options(stacked.shape[0])
        if on_device:
            return api.encode_to_device(stacked, calibration=self.cfg.calibration, **opts)
        if self.cfg.device == "cpu" and stacked.is_cuda:
            stacked = stacked.cpu()
        return api.encode(stacked, calibration=self.cfg.calibration, device=self.cfg.device, **opts)

    def serialize(self, src: MemoryObj, dst: MemoryObj) -> int:
        groups = _groups(src, "source")
        out = _byte_buffer(dst, "destination")
        # Both ends on the GPU: the codec's device-resident path writes the bytes there.
        on_device = out.is_cuda and all(g.is_cuda for g in groups) and self.cfg.device != "cpu"
        blobs = [self._encode(g, on_device) for g in groups]
        sizes = [b.numel() if isinstance(b, torch.Tensor) else len(b) for b in blobs]
        head = ENVELOPE.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, len(blobs)) + b"".join(
            GROUP_LENGTH.pack(n) for n in sizes)
        total = len(head) + sum(sizes)
        if total > out.numel():  # cannot happen with a buffer of estimate_serialized_size bytes
            raise SizeError(f"cachegen serde: the destination buffer holds {out.numel():,} bytes; the chunk needs "
                            f"{total:,} (allocate estimate_serialized_size bytes)")
        _copy_bytes(out[: len(head)], head)
        at = len(head)
        for blob, n in zip(blobs, sizes):
            if n:
                _copy_bytes(out[at : at + n], blob)
            at += n
        return total


class CacheGenDeserializer(Deserializer):
    """.cgen bytes (the envelope above) -> LMCache KV chunk, checked before anything is decoded."""

    def __init__(self, cfg: CacheGenSerdeConfig) -> None:
        self.cfg = cfg

    def deserialize(self, src: MemoryObj, dst: MemoryObj) -> None:
        buf = _byte_buffer(src, "source")
        targets = _groups(dst, "destination")
        head = bytes(buf[: ENVELOPE.size].cpu().numpy())
        if len(head) < ENVELOPE.size or head[:4] != ENVELOPE_MAGIC:
            raise FormatError("cachegen serde: the stored bytes do not start with the cachegen envelope (CGLM): "
                              "not written by the cachegen serde")
        _, version, count = ENVELOPE.unpack(head)
        if version != ENVELOPE_VERSION:
            raise FormatError(f"cachegen serde: envelope version {version}; this cachegen reads version "
                              f"{ENVELOPE_VERSION}")
        if count != len(targets) or count > MAX_GROUPS:
            raise SizeError(f"cachegen serde: the stored chunk has {count} group(s), the destination "
                            f"{len(targets)}")
        at = envelope_size(count)
        if at > buf.numel():
            raise SizeError("cachegen serde: the stored bytes end inside the envelope")
        sizes = [GROUP_LENGTH.unpack_from(bytes(buf[ENVELOPE.size : at].cpu().numpy()), i * GROUP_LENGTH.size)[0]
                 for i in range(count)]
        if sum(sizes) > buf.numel() - at:
            raise SizeError(f"cachegen serde: the envelope announces {sum(sizes):,} bytes of .cgen data, the "
                            f"buffer holds {buf.numel() - at:,}")
        for i, (target, n) in enumerate(zip(targets, sizes)):
            limit = target.numel() * target.element_size()
            tensors = api.decode(buf[at : at + n], device="cpu" if self.cfg.device == "cpu" else "auto",
                                 calibration=self.cfg.calibration, max_output_size=limit)
            at += n
            if _is_mla(target.shape):
                want = {n: (list(t.shape), t.dtype) for n, t in _latents(target).items()}
                got = {n: (list(t.shape), t.dtype) for n, t in tensors.items()}
                if got != want:
                    shown = ", ".join(f"{n} {s}" for n, (s, _) in list(got.items())[:2])
                    raise ShapeError(f"cachegen serde: stored group {i} decodes to {shown}{', ...' if len(got) > 2 else ''}"
                                     f", the destination needs {target.shape[1]} latents layers.{{l}}.latent "
                                     f"[{target.shape[2]}, {target.shape[3]}] {str(target.dtype).replace('torch.', '')}"
                                     f" ([1, L, T, hidden] {list(target.shape)})")
                for l in range(target.shape[1]):
                    target[0, l].copy_(tensors[f"layers.{l}.latent"])
                continue
            want = list(_stacked_shape(target.shape))
            got = [(name, list(t.shape), t.dtype) for name, t in tensors.items()]
            if len(got) != 1 or got[0][1] != want or got[0][2] != target.dtype:
                raise ShapeError(f"cachegen serde: stored group {i} decodes to {got[0][1] if got else []} "
                                 f"{str(got[0][2]).replace('torch.', '') if got else ''}, the destination needs "
                                 f"{want} {str(target.dtype).replace('torch.', '')} ([2, L, T, hidden] "
                                 f"{list(target.shape)})")
            (kv,) = tensors.values()
            target.copy_(kv.squeeze(3).permute(1, 0, 2, 3))


def create_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache's factory signature: the ``"serde"`` object's keys (less ``type``) -> a processor."""
    cfg = CacheGenSerdeConfig.from_kwargs({k: v for k, v in kwargs.items() if k != "max_workers"})
    workers = kwargs.get("max_workers", 1)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"cachegen serde: max_workers must be a whole number >= 1, not {workers!r}")
    return AsyncSerdeProcessor(CacheGenSerializer(cfg), CacheGenDeserializer(cfg), max_workers=workers)


def register() -> None:
    """Register ``"cachegen"`` with LMCache's serde registry (once; a second call does nothing)."""
    if SERDE_NAME not in get_registered_serde_types():
        register_serde_factory(SERDE_NAME, create_serde)


register()


def main(argv: list[str] | None = None) -> None:
    """``python -m cachegen_cli.integrations.lmcache_serde ARGS``: LMCache's ``lmcache ARGS`` with
    the cachegen serde registered, e.g. ``... server --l2-adapter '{"type": "fs", ...,
    "serde": {"type": "cachegen"}}'``."""
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache"] + list(sys.argv[1:] if argv is None else argv)
    lmcache_main()


if __name__ == "__main__":
    main()
