"""The Python API: tensors <-> bytes, files <-> files.  The CLI is a thin layer on this.

    >>> import torch, cachegen_cli as cg
    >>> blob = cg.encode(kv)                  # kv: [layers, 2, tokens, heads, head_dim]
    >>> tensors = cg.decode(blob)             # {"kv": tensor of the same shape and dtype}
    >>> cg.encode_file("kv.safetensors", "kv.cgen")
    >>> cg.decode_file("kv.cgen", "kv.decoded.safetensors")
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import torch

from . import codec, kvio
from .config import DEFAULT_CHUNK_TOKENS, QuantizationConfig, resolve_quantization
from .errors import InputNotFoundError
from .fileio import atomic_output, check_output

__all__ = ["encode", "encode_to_device", "decode", "encode_file", "decode_file", "default_encoded_path", "default_decoded_path"]


def encode(
    kv: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    preset: str | None = None,
    bins: str | int | None = None,
    quantization: QuantizationConfig | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    metadata: Mapping[str, str] | None = None,
    device: str = "auto",
) -> bytes:
    """Compress a KV cache to the bytes of a .cgen file.

    ``kv`` is one tensor [layers, 2, tokens, kv_heads, head_dim] or a mapping of
    names to tensors in either layout (see ``kvio``).  The quantization table is
    a preset name, a ``--bins`` string, or a QuantizationConfig (default: LMCache's).
    ``device``: "auto" (the GPU when one is present), "cpu" or "cuda"; tensors may
    live on the GPU already, and the bytes are the same on every device.
    """
    cache = kvio.from_tensors(kv, layout, metadata)
    quant = resolve_quantization(cache.num_layers, quantization=quantization, preset_name=preset, bins=bins)
    buf = _Collector()
    codec.encode_to_stream(cache, buf, quant, chunk_tokens, device=device)
    return buf.getvalue()


def encode_to_device(
    kv: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    preset: str | None = None,
    bins: str | int | None = None,
    quantization: QuantizationConfig | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    metadata: Mapping[str, str] | None = None,
) -> torch.Tensor:
    """Like encode(), on a CUDA GPU, but the .cgen bytes stay on the GPU: returns a uint8
    CUDA tensor (byte for byte what encode() returns), e.g. to send over NVLink/NCCL.
    ``decode`` accepts such a tensor."""
    from . import gpu_codec
    from .errors import ConfigError

    if codec.resolve_device("cuda") != "cuda" or not gpu_codec.torch_cuda_ok():
        raise ConfigError("encode_to_device needs a CUDA GPU that torch can use")
    from . import container

    cache = kvio.from_tensors(kv, layout, metadata)
    quant = resolve_quantization(cache.num_layers, quantization=quantization, preset_name=preset, bins=bins)
    h = codec.make_header(cache, quant, chunk_tokens)
    head = container.pack_file_header(h)
    parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8).to("cuda")]
    offsets: list[int] = []
    pos = len(head)
    for slab in codec.iter_slabs(h, codec.GPU_SLAB_BYTES):
        records, sizes = gpu_codec.encode_records(h, cache.data[:, :, slab.t0 : slab.t1, :], slab.first_chunk)
        for size in sizes:
            offsets.append(pos)
            pos += size
        parts.append(records)
    tail = container.pack_index(offsets) + container.pack_trailer(pos)
    parts.append(torch.frombuffer(bytearray(tail), dtype=torch.uint8).to("cuda"))
    return torch.cat(parts)


class _Collector:
    """A write-only sink that keeps references to the parts and joins them once at the end.

    (io.BytesIO regrows and copies its buffer over and over: on a 150 MB result that
    costs more than all the GPU kernels.)  Parts of a slab may view a staging buffer
    that the next slab reuses, so the codec calls ``slab_done`` after each slab and the
    parts written so far are joined before anything new arrives."""

    def __init__(self) -> None:
        self.parts: list = []
        self.sealed = True

    def write(self, part) -> int:
        if not self.sealed:
            self.parts = [b"".join(self.parts)]
            self.sealed = True
        self.parts.append(part)
        return len(part)

    def slab_done(self) -> None:
        self.sealed = False

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


def decode(data: bytes | bytearray | memoryview | torch.Tensor, *, device: str = "auto") -> dict[str, torch.Tensor]:
    """Decompress .cgen bytes to the original tensor names, shapes and dtype.

    With ``device="auto"`` (the default) the GPU decodes when one is present and the
    tensors are returned on it; ``device="cpu"`` keeps everything on the CPU."""
    if isinstance(data, torch.Tensor):  # .cgen bytes in a uint8 tensor, e.g. from encode_to_device
        if data.dtype != torch.uint8 or data.dim() != 1:
            from .errors import FormatError

            raise FormatError("a .cgen tensor must be one-dimensional uint8")
        data = memoryview(data.cpu().numpy())  # the checks run on the host; the GPU reads a copy it uploads
    reader, _ = codec.open_input(data)
    header, tensor = codec.decode_from_stream(reader, device=device)
    return kvio.to_tensors(tensor, header.descriptor)


def _close_quietly(closer) -> None:
    """Close an mmap or file; an mmap still viewed by a live array stays open until it goes."""
    if closer is None:
        return
    try:
        closer.close()
    except BufferError:
        pass


def default_encoded_path(src: Path) -> Path:
    return src.with_suffix(".cgen")


def default_decoded_path(src: Path) -> Path:
    return src.with_name(src.stem + ".decoded.safetensors")


def encode_file(
    src: str | Path,
    dst: str | Path | None = None,
    *,
    force: bool = False,
    preset: str | None = None,
    bins: str | int | None = None,
    quantization: QuantizationConfig | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    device: str = "auto",
    progress: codec.ProgressFn | None = None,
) -> codec.EncodeSummary:
    """Compress a safetensors KV file to a .cgen file (atomically; never over the input)."""
    src = Path(src)
    dst = Path(dst) if dst is not None else default_encoded_path(src)
    if not src.is_file():
        raise InputNotFoundError(f"no such file: {src}")
    check_output(dst, [src], force)
    cache = kvio.read_safetensors(src, layout)
    quant = resolve_quantization(cache.num_layers, quantization=quantization, preset_name=preset, bins=bins)
    with atomic_output(dst) as tmp, open(tmp, "wb") as out:
        summary = codec.encode_to_stream(cache, out, quant, chunk_tokens, progress, device)
    return summary


def decode_file(
    src: str | Path,
    dst: str | Path | None = None,
    *,
    force: bool = False,
    device: str = "auto",
    progress: codec.ProgressFn | None = None,
) -> Path:
    """Decompress a .cgen file to safetensors in the original layout (atomically)."""
    src = Path(src)
    dst = Path(dst) if dst is not None else default_decoded_path(src)
    if not src.is_file():
        raise InputNotFoundError(f"no such file: {src}")
    check_output(dst, [src], force)
    reader, closer = codec.open_input(src)
    try:
        header, tensor = codec.decode_from_stream(reader, progress, device)
    finally:
        del reader
        _close_quietly(closer)
    tensors = kvio.to_tensors(tensor, header.descriptor)
    kvio.write_safetensors_atomic(tensors, header.descriptor.get("metadata", {}), dst)
    return dst
