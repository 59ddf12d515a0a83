"""The Python API: tensors <-> bytes, files <-> files.  The CLI is a thin layer on this.

    >>> import torch, cachegen_cli as cg
    >>> blob = cg.encode(kv)                  # kv: [layers, 2, tokens, heads, head_dim]
    >>> tensors = cg.decode(blob)             # {"kv": tensor of the same shape and dtype}
    >>> cg.encode_file("kv.safetensors", "kv.cgen")
    >>> cg.decode_file("kv.cgen", "kv.decoded.safetensors")
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .pipeline import codec
from .storage import kvio
from .methods.calibration import Calibration
from .methods.config import DEFAULT_CHUNK_TOKENS, QuantizationConfig, TransformConfig, resolve_quantization
from .errors import FormatError
from .format.container import FORMAT_VERSION_2, check_decoded_size
from .storage.outputs import atomic_output, check_input, check_output

__all__ = ["encode", "encode_to_device", "decode", "encode_file", "decode_file", "default_encoded_path", "default_decoded_path",
           "max_encoded_size",
           "using_threads"]


def encode(
    kv: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    preset: str | None = None,
    bins: str | int | None = None,
    quantization: QuantizationConfig | TransformConfig | None = None,
    quality: str | None = None,
    calibration: Calibration | str | Path | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    metadata: Mapping[str, str] | None = None,
    device: str = "auto",
    names: str | None = None,
    extras: str = "keep",
    rope=None,
) -> bytes:
    """Compress a KV cache to the bytes of a .cgen file.

    ``kv`` is one tensor [layers, 2, tokens, kv_heads, head_dim] or a mapping of
    names to tensors in either layout (see ``kvio``).  What to encode with: a
    ``quality`` ("lossless", "high", "balanced" — the default — or "small"), an
    LMCache-style ``preset`` name, a ``--bins`` string, or a config object;
    ``calibration`` (a file or Calibration) adds the rotation of the transform
    qualities.  ``device``: "auto" (the GPU when one is present), "cpu" or "cuda";
    every method runs on either with the same bytes.

    Caches of any other shape (docs/shapes.md) — windowed layers with fewer tokens, K and V of
    different sizes, MLA latents, a batch, other naming schemes, extra tensors such as
    input_ids — and a transformers ``Cache`` (e.g. DynamicCache) are written as a multi-part
    file (format version 3).  ``names``: a regular expression naming the K / V / latent
    tensors (groups ``layer``, ``kind``, ``seq``); ``extras``: "keep" (stored exactly) or
    "drop" the tensors that are not K / V / latent.

    ``rope`` (a ``methods.rope.Rope``, e.g. ``rope.from_theta(500000.0, head_dim=128)`` or
    ``rope.from_model(model)``): code the keys without this rotary embedding (a transform
    quality; smaller at the same error, docs/config.md).  A cache captured by ``cachegen
    capture`` carries its RoPE in its metadata: ``TransformConfig(rope_keys=True)`` uses it.
    """
    cache, parts = _analyse(kv, layout, metadata, names, extras)
    if parts is not None:
        quant = resolve_quantization(parts.model_layers, quantization=quantization, preset_name=preset, bins=bins,
                                     quality=quality)
        buf = codec.ByteCollector()
        from .pipeline import parts as parts_codec

        parts_codec.encode_parts(parts, buf, quant, chunk_tokens, None, device, _calibration(calibration, True))
        return buf.getvalue()
    quant = resolve_quantization(cache.num_layers, quantization=quantization, preset_name=preset, bins=bins,
                                 quality=quality)
    if rope is not None:
        quant = _with_rope(cache, quant, rope)
    cal = _calibration(calibration)
    if codec.resolve_device(device) == "cuda":
        from .pipeline import lmcache_device as gpu_codec

        if gpu_codec.torch_cuda_ok() and _device_resident(cache, quant, cal):
            # the whole file is assembled on the GPU, then copied once
            data = gpu_codec.to_host_bytes(_encode_on_device(cache, quant, cal, chunk_tokens, copy_out=False))
            return codec.smallest_encoding(cache, data, chunk_tokens)[0]  # the rule encode_to_stream applies
    buf = codec.ByteCollector()
    codec.encode_to_stream(cache, buf, quant, chunk_tokens, device=device, calibration=cal)
    return buf.getvalue()


def _with_rope(cache: kvio.KVCache, quant, rope):
    """``quant`` coding the keys without ``rope`` (set on the cache), checked against it."""
    import dataclasses

    from .errors import ConfigError
    from .methods import rope as rope_methods

    if not isinstance(quant, TransformConfig) or quant.method != "transform":
        raise ConfigError("rope applies to the transform qualities (high, balanced, small)",
                          cli="--rope-theta applies to --quality high/balanced/small")
    if rope is not None:
        cache.rope = rope_methods.for_cache(rope, cache.num_layers, cache.num_channels, cache.num_tokens)
    return dataclasses.replace(quant, rope_keys=True)


def _analyse(kv, layout: str, metadata, names, extras: str, hints=None):
    """(KVCache, None) for a cache in one of the regular layouts (encoded as today: format v1 /
    v2, the same bytes), else (None, PartsCache) for the multi-part format (version 3)."""
    from .errors import DTypeError, LayoutError, ShapeError
    from .storage import kvparts

    if _is_hf_cache(kv):
        from .storage import hf_cache

        kv, cache_hints = hf_cache.tensors_of(kv)
        if cache_hints is not None:  # windowed layers: their windows and positions go into the file
            return None, kvparts.analyse(kv, metadata, names, extras, cache_hints)
    if names is None:
        try:
            return kvio.from_tensors(kv, layout, metadata), None
        except (LayoutError, ShapeError, DTypeError):
            if layout != "auto":
                raise
    elif layout != "auto":
        from .errors import ConfigError

        raise ConfigError("names applies to layout 'auto'", cli="--names applies to --layout auto")
    tensors = {"kv": kv} if isinstance(kv, torch.Tensor) else kv
    return None, kvparts.analyse(tensors, metadata, names, extras, hints)


def _is_hf_cache(kv) -> bool:
    """A transformers Cache object (DynamicCache and kin), without importing transformers."""
    return any(c.__module__.startswith("transformers.") and c.__name__.endswith("Cache") for c in type(kv).__mro__)


def _device_resident(cache: kvio.KVCache, quant, calibration) -> bool:
    """True when a device-resident pipeline encodes this: every method (format version 2 with or
    without a rotation; version 1 without one), caches of at least one token."""
    from .pipeline import transform_resident as device_pipeline

    if cache.num_tokens == 0:
        return False
    if isinstance(quant, TransformConfig):
        return device_pipeline.supports(quant, calibration)
    return calibration is None


def _encode_on_device(cache: kvio.KVCache, quant, calibration, chunk_tokens: int, checked: bool = True,
                      copy_out: bool = True) -> torch.Tensor:
    """The .cgen bytes as a uint8 CUDA tensor, by the device-resident pipelines; ``checked``:
    whether the cache's values were checked finite (else this checks them); ``copy_out=False``:
    the bytes may be a view of a larger buffer (the caller copies them to the host at once)."""
    from .pipeline import lmcache_device as gpu_codec

    if isinstance(quant, TransformConfig):
        from .pipeline import transform_resident as device_pipeline
        from .methods.config import validate_chunk_tokens

        if quant.method == "lossless" and calibration is not None:
            from .errors import ConfigError

            raise ConfigError("a calibration does not apply to quality 'lossless'",
                              cli="--calibration does not apply to --quality lossless")
        return device_pipeline.encode(cache, quant, validate_chunk_tokens(chunk_tokens), calibration,
                                      checked=checked, copy_out=copy_out)[0]
    if not checked:
        kvio.check_finite(cache.data)
    return gpu_codec.encode_file_device(codec.make_header(cache, quant, chunk_tokens), codec.fp16_headroom(cache.data))


def encode_to_device(
    kv: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    preset: str | None = None,
    bins: str | int | None = None,
    quantization: QuantizationConfig | TransformConfig | None = None,
    quality: str | None = None,
    calibration: Calibration | str | Path | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    metadata: Mapping[str, str] | None = None,
    rope=None,
) -> torch.Tensor:
    """Like encode(), on a CUDA GPU, but the .cgen bytes stay on the GPU: returns a uint8
    CUDA tensor (byte for byte what encode() returns), e.g. to send over NVLink/NCCL.
    ``decode`` accepts such a tensor.  Every method, with or without a ``calibration``; a cache
    of no tokens is coded on the host."""
    from .pipeline import lmcache_device as gpu_codec
    from .errors import ConfigError

    if codec.resolve_device("cuda") != "cuda" or not gpu_codec.torch_cuda_ok():
        raise ConfigError("encode_to_device needs a CUDA GPU that torch can use")
    # unchecked: the device pipeline of format version 2 makes the finiteness check in its own
    # pass over the values (a pass over the cache less); every other path checks first
    cache = kvio.from_tensors(kv, layout, metadata, check=False)
    quant = resolve_quantization(cache.num_layers, quantization=quantization, preset_name=preset, bins=bins,
                                 quality=quality)
    if rope is not None:
        quant = _with_rope(cache, quant, rope)
    cal = _calibration(calibration)
    if _device_resident(cache, quant, cal):
        blob = _encode_on_device(cache, quant, cal, chunk_tokens, checked=False)
        if cache.num_tokens > codec.SMALL_CACHE_TOKENS:  # the small-cache rule never applies
            return blob
        # the small-cache rule, as encode() (byte for byte): a few tokens, so one copy each way
        data = gpu_codec.to_host_bytes(blob)
        best = codec.smallest_encoding(cache, data, chunk_tokens)[0]
        return blob if best is data else gpu_codec.device_bytes(best)
    kvio.check_finite(cache.data)
    blob = encode(kv, preset=preset, bins=bins, quantization=quantization, quality=quality, calibration=cal,
                  chunk_tokens=chunk_tokens, layout=layout, metadata=metadata, device="cuda", rope=rope)
    return gpu_codec.device_bytes(blob)


def _calibration(calibration, multi_part: bool = False):
    """The Calibration (or, for a multi-part cache or file, a version-3 PartsCalibration) of a
    file or object; a version-3 one given for a regular cache is refused here, before any work."""
    from .methods.parts_calibration import PartsCalibration, load_any

    cal = calibration if calibration is None or isinstance(calibration, (Calibration, PartsCalibration)) \
        else load_any(calibration)
    if isinstance(cal, PartsCalibration) and not multi_part:
        from .methods.calibration import CalibrationError

        raise CalibrationError("this calibration (version 3) is for caches of several shapes (multi-part files); "
                               "this cache or file is of one regular shape: use a calibration made from such caches")
    return cal


def decode(data: bytes | bytearray | memoryview | torch.Tensor | str | os.PathLike, *, device: str = "auto",
           calibration: Calibration | str | Path | None = None,
           max_output_size: int | None = None, as_cache: bool = False, config=None):
    """Decompress .cgen bytes to the original tensor names, shapes and dtype.

    ``data``: the bytes, a one-dimensional uint8 tensor holding them (e.g. from
    encode_to_device), or the path of a .cgen file (str or os.PathLike).  With ``device="auto"`` (the default) the GPU decodes when one is
    present and the tensors are returned on it; ``device="cpu"`` keeps everything on the
    CPU.  ``calibration``: the calibration file a rotated file was encoded with.
    ``max_output_size``: refuse (OutputTooLargeError) a file whose decoded tensors would take
    more than this many bytes, from its 64-byte header, before anything is allocated; None
    (the default): no limit beyond the format's own checks (pass one for untrusted input).
    ``as_cache=True``: a transformers DynamicCache instead of the tensors, ready for
    ``model.generate(past_key_values=...)`` (windowed layers as DynamicSlidingWindowLayer;
    ``config``: a model config whose layer types to use)."""
    tensors, entries = _decode_tensors(data, device, calibration, max_output_size)
    if not as_cache:
        return tensors
    from .storage import hf_cache

    return hf_cache.to_cache(tensors, entries, config)


def _decode_tensors(data, device: str, calibration, max_output_size):
    """(named tensors, their manifest-style entries) of .cgen bytes (decode's arguments)."""
    from .errors import FormatError, InputError, InputNotFoundError

    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise InputNotFoundError(f"no such file: {path}")
        data = path.read_bytes()
    elif not isinstance(data, (bytes, bytearray, memoryview, torch.Tensor)):
        raise InputError(f"decode takes the bytes of a .cgen file, a uint8 tensor or a file path, "
                         f"not {type(data).__name__}")
    cal = _calibration(calibration, multi_part=True)  # a version-3 one is refused below for a v1 / v2 file
    if isinstance(data, torch.Tensor) and (data.dtype != torch.uint8 or data.dim() != 1):
        raise FormatError("a .cgen tensor must be one-dimensional uint8")
    _check_limit(max_output_size)
    if max_output_size is not None:  # host-side, also for bytes on the GPU: 64 bytes copied
        head = bytes(data[:64].cpu().numpy()) if isinstance(data, torch.Tensor) else bytes(memoryview(data)[:64])
        check_decoded_size(head, max_output_size)
    version = _version(data)  # (a tensor on the GPU: one copy of 10 bytes, one wait)
    if version == 3:  # a multi-part file: its groups decode through the paths below
        from .pipeline import parts as parts_codec

        buf = memoryview(data.cpu().numpy()) if isinstance(data, torch.Tensor) else data
        resolved = codec.resolve_device(device)
        manifest, tensors = parts_codec.decode_parts(buf, resolved, cal)
        if resolved == "cuda":
            tensors = {k: v.to("cuda") for k, v in tensors.items()}
        return tensors, _with_positions(manifest)
    cal = _calibration(cal)
    if codec.resolve_device(device) == "cuda":
        from .pipeline import lmcache_device as gpu_codec

        if gpu_codec.torch_cuda_ok():  # checked and decoded on the GPU, from a device copy of the bytes
            blob = gpu_codec.device_bytes(data)
            if version == FORMAT_VERSION_2:
                from .pipeline import transform_resident as device_pipeline

                header, offsets, size = device_pipeline.read_header(blob)
                if device_pipeline.decodable(header):
                    tensor = device_pipeline.decode(blob, header, offsets, size, cal)
                    if codec.saturates(header):
                        codec.saturate_(tensor)
                    return kvio.to_tensors(tensor, header.descriptor), _entries(header.descriptor)
            else:
                header, tensor = gpu_codec.decode_device(blob)
                if header.dtype == "float16":  # a file from before the encoder's clamp (codec.fp16_headroom)
                    codec.saturate_(tensor)
                return kvio.to_tensors(tensor, header.descriptor), _entries(header.descriptor)
    if isinstance(data, torch.Tensor):
        data = memoryview(data.cpu().numpy())
    reader, _ = codec.open_input(data)
    header, tensor = codec.decode_from_stream(reader, device=device, calibration=cal)
    return kvio.to_tensors(tensor, header.descriptor), _entries(header.descriptor)


def _version(data) -> int | None:
    """The format version the bytes announce (None when they do not start with the magic)."""
    import struct

    from .format.container import MAGIC

    head = bytes(data[:10].cpu().numpy()) if isinstance(data, torch.Tensor) else bytes(memoryview(data)[:10])
    return struct.unpack_from("<H", head, 8)[0] if len(head) == 10 and head[:8] == MAGIC else None


def _entries(descriptor: dict) -> list[dict]:
    """A v1 / v2 descriptor's tensors as manifest-style entries (for as_cache)."""
    if descriptor["layout"] == "stacked":
        (e,) = descriptor["tensors"]
        return [{"name": e["name"], "role": "kv", "form": "L2THD", "shape": e["shape"]}]
    import re

    out = []
    for e in descriptor["tensors"]:
        m = re.match(r"^layers\.(\d+)\.(key|value)$", e["name"])
        out.append({"name": e["name"], "role": "kv", "form": "HTD" if len(e["shape"]) == 3 else "BHTD",
                    "layer": int(m.group(1)), "kind": m.group(2), "seq": 0, "shape": e["shape"]})
    return out


def _with_positions(manifest: dict) -> list[dict]:
    """The manifest's tensor entries, each K / V with the position of its first token (from its group)."""
    entries = [dict(e) for e in manifest["tensors"]]
    for g in manifest["groups"]:
        for member, first in zip(g["members"], g["first_positions"]):
            for ref in member:
                if len(ref) == 1 or ref[1:] == [0]:
                    entries[ref[0]].setdefault("first_position", first)
    return entries


def _check_limit(max_output_size) -> None:
    if max_output_size is not None and (not isinstance(max_output_size, int) or isinstance(max_output_size, bool)
                                        or max_output_size < 0):
        from .errors import ConfigError

        raise ConfigError(f"max_output_size must be a non-negative number of bytes or None, not {max_output_size!r}")


def _close_quietly(closer) -> None:
    """Close an mmap or file; an mmap still viewed by a live array stays open until it goes."""
    if closer is None:
        return
    try:
        closer.close()
    except BufferError:
        pass


@contextlib.contextmanager
def using_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` numba and torch threads (then restore them); None or 0:
    leave them as they are (all cores, unless NUMBA_NUM_THREADS or the caller limited them).
    More threads than numba was started with are capped there."""
    if threads is None or threads == 0:
        yield
        return
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        from .errors import ConfigError

        raise ConfigError(f"threads must be a non-negative whole number, not {threads!r}")
    import numba

    n = min(threads, numba.config.NUMBA_NUM_THREADS)
    old_numba, old_torch = numba.get_num_threads(), torch.get_num_threads()
    numba.set_num_threads(n)
    torch.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(old_numba)
        torch.set_num_threads(old_torch)


def _as_path(value, what: str) -> Path:
    """A str or os.PathLike as a Path; anything else is an InputError naming the argument."""
    import os

    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        return Path(value)
    from .errors import InputError

    raise InputError(f"{what} takes a file path (str or os.PathLike), not {type(value).__name__}")


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
    quantization: QuantizationConfig | TransformConfig | None = None,
    quality: str | None = None,
    calibration: Calibration | str | Path | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    device: str = "auto",
    progress: codec.ProgressFn | None = None,
    threads: int | None = None,
    names: str | None = None,
    extras: str = "keep",
    rope_keys: bool = False,
    rope_theta: float | None = None,
    rope_start: int | None = None,
):
    """Compress a safetensors KV file to a .cgen file (atomically; never over the input).

    The input is read a slab (a run of whole chunks) at a time and the chunks are written as
    they are coded, so memory stays a few slabs whatever the cache's size.  ``threads``: numba
    and torch threads for the call (None or 0: all cores).  A cache of any other shape (see
    encode: ``names``, ``extras``) is written as a multi-part file (format version 3), read
    a plane slab at a time too (storage/kvparts_files.py); its summary is then a
    pipeline.parts.PartsSummary.  ``rope_keys``: code the keys without their RoPE, as the
    file's "rope" metadata (``cachegen capture``) or ``rope_theta`` (plain RoPE frequencies)
    describes it; ``rope_start``: the position of its first token.  On the GPU the whole cache
    is read into a page-locked buffer and the file leaves through another; the process keeps
    them for its next call (pipeline.staging.HOST_BUFFERS.release() frees them)."""
    from .errors import DTypeError, LayoutError, ShapeError

    src = Path(src)
    dst = Path(dst) if dst is not None else default_encoded_path(src)
    check_input(src)
    with using_threads(threads):
        source = None
        if names is None:
            try:
                source = kvio.SafetensorsSource(src, layout)
            except (LayoutError, ShapeError, DTypeError):
                if layout != "auto":
                    raise
        if source is None:
            return _encode_parts_file(src, dst, force, names, extras, quantization, preset, bins, quality,
                                      calibration, chunk_tokens, progress, device)
        with source:  # the input is checked before the output
            check_output(dst, [src], force)
            cal = _calibration(calibration)
            quant = resolve_quantization(source.cache.num_layers, quantization=quantization, preset_name=preset,
                                         bins=bins, quality=quality)
            if rope_keys or rope_theta is not None or rope_start is not None:
                quant = _with_rope(source.cache, quant, _file_rope(source.cache, rope_theta, rope_start))
            with atomic_output(dst) as tmp, open(tmp, "wb") as out:
                summary = codec.encode_to_stream(source, out, quant, chunk_tokens, progress, device, cal)
    return summary


def _file_rope(cache: kvio.KVCache, theta: float | None, start: int | None):
    """The RoPE encode_file removes: plain frequencies of ``theta``, else the cache's metadata's
    (or its calibration's, which methods/rope.resolve finds: None here), at ``start``."""
    import dataclasses

    from .methods import rope as rope_methods

    if theta is not None:
        return rope_methods.from_theta(theta, cache.head_dim, position_start=start or 0)
    if rope_methods.METADATA_KEY not in cache.metadata:
        return None
    found = rope_methods.from_metadata(cache.metadata[rope_methods.METADATA_KEY])
    return found if start is None else dataclasses.replace(found, position_start=int(start))


def _encode_parts_file(src: Path, dst: Path, force: bool, names, extras, quantization, preset, bins, quality,
                       calibration, chunk_tokens, progress, device):
    from .pipeline import parts as parts_codec
    from .storage.kvparts_files import PlanesFile

    # Read a plane slab at a time (the group files coded straight into the output): the memory of
    # a slab, not of the cache; the same bytes as encode() of the tensors.
    with PlanesFile(src, names, extras) as planes:
        planes.check_finite()  # the input is checked before the output
        pc = planes.pc
        check_output(dst, [src], force)
        cal = _calibration(calibration, True)
        quant = resolve_quantization(pc.model_layers, quantization=quantization, preset_name=preset, bins=bins,
                                     quality=quality)
        with atomic_output(dst) as tmp, open(tmp, "wb") as out:
            return parts_codec.encode_parts_file(planes, out, quant, chunk_tokens, progress, device, cal, checked=True)


def _file_version(path: Path) -> int | None:
    with open(path, "rb") as f:
        return _version(f.read(10))


def _decode_parts_file(src: Path, dst: Path, force: bool, device: str, calibration, progress, max_output_size) -> None:
    from .format import parts as parts_format
    from .pipeline import parts as parts_codec

    reader, closer = codec.open_input(src)
    try:
        pf = parts_format.PartsFile(reader.view if hasattr(reader, "view") else reader.read())
        check_decoded_size(bytes(pf.view[:64]), max_output_size, str(src))
        cal = _calibration(calibration, True)
        check_output(dst, [src], force)
        # group by group, slab by slab, straight into the output; a group's input pages are dropped
        # once it is done (a mapping's pages would stay in the process: the whole file by the end)
        with atomic_output(dst) as tmp:
            parts_codec.decode_parts_file(pf, tmp, device, cal, progress, _page_release(closer))
    finally:
        del reader
        pf = None
        _close_quietly(closer)


def _page_release(mapping):
    """release(offset, size) dropping a read-only file mapping's pages of that range from the
    process (they stay in the page cache), or None when ``mapping`` is not an mmap."""
    import mmap

    if not isinstance(mapping, mmap.mmap) or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return None

    def release(offset: int, size: int) -> None:
        start = offset - offset % mmap.PAGESIZE
        if size > 0:
            mapping.madvise(mmap.MADV_DONTNEED, start, offset + size - start)

    return release


def decode_file(
    src: str | Path,
    dst: str | Path | None = None,
    *,
    force: bool = False,
    device: str = "auto",
    calibration: Calibration | str | Path | None = None,
    progress: codec.ProgressFn | None = None,
    threads: int | None = None,
    max_output_size: int | None = None,
) -> Path:
    """Decompress a .cgen file to safetensors in the original layout (atomically).

    Decoded a slab at a time straight into the output file (the same bytes safetensors'
    save_file writes), so memory stays a slab whatever the cache's size.  ``threads``: numba
    and torch threads for the call (None or 0: all cores).  ``max_output_size``: as for
    decode(), checked from the header before the output is created (None: no limit; the
    CLI's --max-output-size defaults to 64 GiB).  On the GPU a version-2 file is decoded whole
    and written from a page-locked buffer the process keeps (see encode_file)."""
    src = Path(src)
    dst = Path(dst) if dst is not None else default_decoded_path(src)
    _check_limit(max_output_size)
    check_input(src)
    if src.is_file() and _file_version(src) == 3:
        with using_threads(threads):
            try:
                _decode_parts_file(src, dst, force, device, calibration, progress, max_output_size)
            except FormatError as exc:  # the message names the file
                if str(src) in str(exc):
                    raise
                raise type(exc)(f"{src}: {exc}", cli=f"{src}: {exc.cli_message}") from None
        return dst
    with using_threads(threads):
        # Plain reads, not a mapping: the decoder holds one slab of the input at a time.
        reader, closer = codec.open_input(src, mapped=False)
        try:
            cal = _calibration(calibration)
            dec = codec.SlabDecoder(reader, device, cal)  # header, index and calibration checked first,
            at = reader.tell()
            reader.seek(0)
            check_decoded_size(reader.read(64), max_output_size, str(src))  # then the size, before allocating,
            reader.seek(at)
            check_output(dst, [src], force)  # then the output
            with atomic_output(dst) as tmp:
                codec.decode_to_file(dec, tmp, progress)
        except FormatError as exc:  # the message names the file
            if str(src) in str(exc):
                raise
            raise type(exc)(f"{src}: {exc}", cli=f"{src}: {exc.cli_message}") from None
        finally:
            del reader
            _close_quietly(closer)
    return dst


def test_file(
    src: str | Path,
    *,
    device: str = "auto",
    calibration: Calibration | str | Path | None = None,
    threads: int | None = None,
    progress: codec.ProgressFn | None = None,
) -> dict:
    """Check a .cgen file as a decode does, writing nothing: the header, the index, every chunk's
    CRC-32 and sizes, and a full decode of every slab.  Returns a few facts about the file
    (format_version, num_tokens, num_chunks, bytes); raises the CacheGenError a decode would."""
    from .errors import InputNotFoundError

    src = _as_path(src, "test_file")
    if not src.is_file():
        raise InputNotFoundError(f"no such file: {src}")
    if _file_version(src) == 3:
        from .pipeline import parts as parts_codec

        with using_threads(threads):
            cal = _calibration(calibration, True)
            reader, closer = codec.open_input(src)
            try:
                info = parts_codec.test_parts(reader.view if hasattr(reader, "view") else reader.read(), device, cal,
                                              progress)
            finally:
                del reader
                _close_quietly(closer)
        info["compressed_bytes"] = src.stat().st_size
        return info
    with using_threads(threads):
        cal = _calibration(calibration)
        reader, closer = codec.open_input(src, mapped=False)
        try:
            dec = codec.SlabDecoder(reader, device, cal)
            for _ in dec.blocks(progress):
                pass
            h = dec.header
        finally:
            del reader
            _close_quietly(closer)
    return {"format_version": h.version, "num_tokens": h.num_tokens, "num_chunks": h.num_chunks,
            "compressed_bytes": src.stat().st_size}


def max_encoded_size(
    kv: torch.Tensor | Mapping[str, torch.Tensor] | tuple[int, ...] | list[int] | torch.Size,
    dtype: torch.dtype = torch.bfloat16,
    *,
    preset: str | None = None,
    bins: str | int | None = None,
    quantization: QuantizationConfig | TransformConfig | None = None,
    quality: str | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layout: str = "auto",
    metadata: Mapping[str, str] | None = None,
) -> int:
    """The most bytes encode() can return for a cache of this shape, dtype and names with these
    settings, whatever its values (pipeline/bounds.py says how it is derived).

    ``kv``: what encode() takes (its tensors may be on the ``meta`` device: only shapes, dtypes
    and names are read), or the shape [layers, 2, tokens, kv_heads, head_dim] of one stacked
    tensor of ``dtype``, named "kv" as encode() names a lone tensor."""
    from .pipeline import bounds

    if isinstance(kv, (tuple, list, torch.Size)):
        kv = torch.empty(tuple(int(n) for n in kv), dtype=dtype, device="meta")
    cache = kvio.from_tensors(kv, layout, metadata)
    quant = resolve_quantization(cache.num_layers, quantization=quantization, preset_name=preset, bins=bins,
                                 quality=quality)
    return bounds.max_encoded_size(cache, quant, chunk_tokens)
