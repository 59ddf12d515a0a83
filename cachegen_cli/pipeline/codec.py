"""Codec orchestration: KV tensors <-> .cgen chunks, through the kernels.

Encoding walks the cache in slabs of whole chunks (bounded memory; the kernels
get enough streams to run in parallel), and for each slab runs
quantize -> histogram -> CDF -> range-code -> pack, then writes one
self-contained record per chunk.  Decoding reads chunk records, batches them
into slabs again and runs CDF-from-codes -> range-decode -> dequantize.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from ..format import container
from ..methods.config import QuantizationConfig, TransformConfig, validate_chunk_tokens
from ..format.container import Chunk, FileHeader, read_header_and_index
from ..format.params import METHOD_LOSSLESS
from ..errors import ChecksumError, ConfigError
from ..kernels import cpu as cpu_kernels
from ..kernels.coding_params import MAX_ALPHABET, max_stream_bytes
from ..storage.kvio import DTYPE_BY_NAME, KVCache
from . import staging, transform_resident
from .staging import PinnedSlabBuffers
from .slabs import GPU_SLAB_BYTES, SLAB_BYTES, Slab, iter_slabs

ProgressFn = Callable[[int, int], None]

_POOL = None


def _pool():
    """Threads for per-chunk host work (CRC-32, packing) that releases the GIL."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="cachegen")
    return _POOL


def _map(fn, items: list) -> list:
    """fn over items on the host threads, or in this thread when the kernels run on one
    (--threads 1 means one core for everything)."""
    import numba

    if len(items) <= 1 or numba.get_num_threads() <= 1:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


def resolve_device(device: str = "auto") -> str:
    """'cpu' or 'cuda'.  'auto' picks the GPU when a real one is present (never the simulator)."""
    from ..kernels import cuda as cuda_kernels

    if device == "cpu":
        return "cpu"
    if device == "cuda":
        if not cuda_kernels.is_available():
            raise ConfigError("device='cuda': no CUDA GPU is available (numba-cuda found no device)",
                              cli="--device cuda: no CUDA GPU is available (numba-cuda found no device)")
        return "cuda"
    if device == "auto":
        from numba import config

        return "cuda" if (not config.ENABLE_CUDASIM and cuda_kernels.is_available()) else "cpu"
    raise ConfigError(f"unknown device {device!r}; choose auto, cpu or cuda")


def get_kernels(device: str = "cpu"):
    """The CPU kernel module (the GPU path goes through gpu_codec)."""
    return cpu_kernels


def make_header(cache: KVCache, quant: QuantizationConfig, chunk_tokens: int) -> FileHeader:
    chunk_tokens = validate_chunk_tokens(chunk_tokens)
    bins = quant.bins_table(cache.num_layers)
    if bins.max() > MAX_ALPHABET:
        raise ConfigError(f"bins above {MAX_ALPHABET} are not supported")
    return FileHeader(
        num_tokens=cache.num_tokens,
        num_layers=cache.num_layers,
        num_channels=cache.num_channels,
        chunk_tokens=chunk_tokens,
        num_chunks=-(-cache.num_tokens // chunk_tokens),
        group=container.choose_group(chunk_tokens, cache.num_channels),
        dtype=cache.dtype_name,
        layout=cache.layout,
        bins=bins,
        descriptor=cache.descriptor(),
    )


def _code_width(h: FileHeader) -> int:
    return int(h.alphabets.max())


# ---------------------------------------------------------------- the largest finite values
#
# Every finite input decodes to a finite value (docs/format.md, "Saturation").  Method 1 on a
# float16 cache: a scale is the abs-max rounded up to a bfloat16, and float16's largest values
# (65280, 65504] round up to 65536, which decodes to Inf; the encoder clamps them to 65280, the
# largest bfloat16 a float16 holds (an error below half a quantization step).  Decoders
# saturate: a value beyond the output dtype's largest finite one decodes to it (files written
# before, and method 2's offsets + levels x steps near the top of a dtype).

#: The largest bfloat16 that a float16 holds: method 1's largest scale for a float16 cache.
FP16_SCALE_MAX = 65280.0
_FP16_SCALE_MAX_BITS = 0x477F  # its bfloat16 bits


def fp16_headroom(block: torch.Tensor) -> torch.Tensor:
    """A float16 block with |x| > FP16_SCALE_MAX clamped to it (method 1's encoder); the block
    itself when it holds no such value (every other dtype: unchanged)."""
    if block.dtype != torch.float16 or block.numel() == 0:
        return block
    if not bool((block.abs() > FP16_SCALE_MAX).any()):
        return block
    return block.clamp(-FP16_SCALE_MAX, FP16_SCALE_MAX)


def saturates(h: FileHeader) -> bool:
    """Whether a method-2 file's values may exceed its dtype's largest finite value (so the
    decoder's output needs saturate_): a bound from its steps, offsets and rotation."""
    if h.version != container.FORMAT_VERSION_2 or h.method != 2:
        return False
    from ..format.params import bf16_values

    p = h.params

    def largest(bits) -> float:
        # |value| of finite bfloat16 bits grows with (bits & 0x7FFF): one value converted, not all
        m = np.bitwise_and(np.asarray(bits, np.uint16), 0x7FFF).max(initial=0)
        return float(bf16_values(np.asarray([m], np.uint16))[0])

    top = 128.0 * largest(p.steps) + largest(p.offsets)
    if h.rotated:  # an orthonormal rotation: |x'| <= ||z|| <= sqrt(C) max |z|
        top *= float(np.sqrt(h.num_channels))
    return top >= float(torch.finfo(DTYPE_BY_NAME[h.dtype]).max)


def saturate_(t: torch.Tensor) -> torch.Tensor:
    """Clamp a decoded float tensor (any device, in place) to its dtype's finite range: an Inf
    that came from rounding a finite value beyond the largest one becomes that value."""
    big = float(torch.finfo(t.dtype).max)
    return t.clamp_(-big, big)


def saturate_words_(words: np.ndarray, dtype: torch.dtype) -> None:
    """saturate_ on the words (uint16 / uint32, any strides) of a decoded CPU block."""
    signed = words.view(np.int16 if words.dtype == np.uint16 else np.int32)
    saturate_(torch.from_numpy(signed).view(dtype))


def _v1_scales_overflow(h: FileHeader, chunks: list[Chunk]) -> bool:
    """True when a version-1 float16 slab has a scale above FP16_SCALE_MAX (written by an
    encoder before the clamp): its largest levels decode beyond float16's range."""
    return h.dtype == "float16" and any(int(c.scales.max(initial=0)) > _FP16_SCALE_MAX_BITS for c in chunks)


# ---------------------------------------------------------------- CPU fast path
#
# On the CPU a slab goes through two fused kernels (cpu.encode_planes / decode_planes)
# that give the bytes of the stage-by-stage kernels below: they read the cache's own
# bfloat16 / float32 words (no float32 copy of a bfloat16 cache) and decode straight
# into the output tensor (bfloat16 rounded to nearest even, as torch rounds).


def _cpu_source_words(data: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """The raw words of a CPU cache tensor [L, 2, T, C] for cpu.encode_planes, with the shift
    that makes them float32 bits: (uint16 bfloat16 words, 16) or (uint32 float32 words, 0).
    None for float16 (the caller converts to float32) or a tensor off the CPU."""
    if data.device.type != "cpu" or data.dtype not in (torch.bfloat16, torch.float32):
        return None
    data = data.contiguous()
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(np.uint16), 16
    return data.view(torch.int32).numpy().view(np.uint32), 0


def _cpu_output_words(data: torch.Tensor) -> np.ndarray | None:
    """A writable view of a CPU bfloat16 (uint16 words) or float32 tensor for
    cpu.decode_planes, or None (float16: decoded to float32 and converted)."""
    if data.device.type != "cpu" or not data.is_contiguous():
        return None
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(np.uint16)
    if data.dtype == torch.float32:
        return data.numpy()
    return None


def _encode_slab_cpu(h: FileHeader, words: np.ndarray, shift: int, t_first: int, num_tokens: int,
                     first_chunk: int) -> list[Chunk]:
    """encode_slab through cpu.encode_planes, on tokens [t_first, t_first + num_tokens) of
    ``words`` ([L, 2, >= t_first + num_tokens, C], see _cpu_source_words)."""
    L, C, ct, G = h.num_layers, h.num_channels, h.chunk_tokens, h.group
    T = num_tokens
    K = -(-T // ct)
    S = _code_width(h)
    planes_n = K * L * 2
    scales = np.empty((L, 2, T), np.uint16)
    codes = np.empty((K, L, 2, C, S), np.uint8)
    lengths = np.empty((K, L, 2, h.groups), np.int32)
    plane_bytes = np.empty(planes_n, np.int64)
    # One row per plane, big enough for its worst case; only the bytes written are touched.
    planes = np.empty((planes_n, h.groups * max_stream_bytes(ct * G)), np.uint8)
    cpu_kernels.encode_planes(words, shift, t_first, T, h.maxq, ct, G, scales, codes, lengths, plane_bytes, planes)
    offsets = np.zeros(planes_n + 1, np.int64)
    np.cumsum(plane_bytes, out=offsets[1:])
    payload = np.empty(int(offsets[-1]), np.uint8)
    cpu_kernels.pack_streams(planes, plane_bytes, offsets, payload)
    packed = container.pack_codes(codes, h)
    return container.slab_chunks(h, first_chunk, scales, packed, lengths, payload, offsets[:: L * 2])


def _decode_slab_cpu(h: FileHeader, chunks: list[Chunk], out: np.ndarray, t_first: int, to_bf16: bool) -> None:
    """decode_slab through cpu.decode_planes, into tokens t_first.. of ``out`` [L, 2, T, C]
    (float32, or uint16 bfloat16 words when to_bf16)."""
    if not chunks:
        return
    codes = container.unpack_codes(np.stack([c.codes for c in chunks]), h, _code_width(h))
    lengths = np.concatenate([c.lengths.reshape(-1) for c in chunks]).astype(np.int32)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.concatenate([c.payload for c in chunks])
    scales = np.ascontiguousarray(np.concatenate([c.scales for c in chunks], axis=2))
    cpu_kernels.decode_planes(payload, offsets, lengths, codes, h.maxq, h.chunk_tokens, h.group, scales, out,
                              t_first, to_bf16)


# ---------------------------------------------------------------- slabs


def encode_slab(h: FileHeader, x: np.ndarray, first_chunk: int, kernels=cpu_kernels) -> list[Chunk]:
    """Encode float32 x [L, 2, T_slab, C] holding whole chunks from ``first_chunk`` on."""
    L, _, T, C = x.shape
    if kernels is cpu_kernels:
        words = np.ascontiguousarray(x, np.float32).view(np.uint32)
        return _encode_slab_cpu(h, words, 0, 0, T, first_chunk)
    ct = h.chunk_tokens
    K = -(-T // ct)
    S = _code_width(h)
    maxq = h.maxq
    scales = np.empty((L, 2, T), np.uint16)
    symbols = np.empty((L, 2, T, C), np.uint8)
    kernels.quantize(x, maxq, scales, symbols)
    counts = np.empty((K, L, 2, C, S), np.int32)
    kernels.histogram(symbols, ct, counts)
    codes = np.empty((K, L, 2, C, S), np.uint8)
    cum = np.empty((K, L, 2, C, S + 1), np.int32)
    kernels.build_cdf(counts, maxq, codes, cum)
    per_chunk = h.streams_per_chunk
    slots = np.empty((K * per_chunk, max_stream_bytes(ct * h.group)), np.uint8)
    lengths = np.empty(K * per_chunk, np.int32)
    kernels.encode_streams(symbols, cum, ct, h.group, slots, lengths)
    offsets = np.zeros(K * per_chunk + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.empty(int(offsets[-1]), np.uint8)
    kernels.pack_streams(slots, lengths, offsets, payload)
    packed = container.pack_codes(codes, h)
    return container.slab_chunks(h, first_chunk, scales, packed, lengths, payload, offsets[::per_chunk])


def decode_slab(h: FileHeader, chunks: list[Chunk], kernels=cpu_kernels) -> np.ndarray:
    """Decode consecutive chunks into float32 [L, 2, T_slab, C]."""
    L, C = h.num_layers, h.num_channels
    K = len(chunks)
    T = sum(c.token_count for c in chunks)
    if kernels is cpu_kernels:
        out = np.empty((L, 2, T, C), np.float32)
        _decode_slab_cpu(h, chunks, out, 0, False)
        return out
    maxq = h.maxq
    S = _code_width(h)
    codes = container.unpack_codes(np.stack([c.codes for c in chunks]), h, S)
    cum = np.empty((K, L, 2, C, S + 1), np.int32)
    kernels.cum_from_codes(codes, maxq, cum)
    lengths = np.concatenate([c.lengths.reshape(-1) for c in chunks]).astype(np.int32)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.concatenate([c.payload for c in chunks]) if K else np.empty(0, np.uint8)
    symbols = np.empty((L, 2, T, C), np.uint8)
    kernels.decode_streams(payload, offsets, lengths, cum, maxq, h.chunk_tokens, h.group, symbols)
    scales = np.concatenate([c.scales for c in chunks], axis=2)
    out = np.empty((L, 2, T, C), np.float32)
    kernels.dequantize(symbols, np.ascontiguousarray(scales), maxq, out)
    return out


def _write_chunks(out: BinaryIO, h: FileHeader, chunks: list[Chunk], pos: int, offsets: list[int],
                  progress: ProgressFn | None) -> tuple[int, int]:
    """Write chunk records from ``pos`` on, appending their offsets; returns (new pos, payload bytes).
    The records' CRC-32s are computed in parallel threads (zlib releases the GIL on large buffers)."""
    payload = 0
    for chunk, parts in zip(chunks, _map(container.chunk_parts, chunks)):
        offsets.append(pos)
        for part in parts:
            out.write(part)
            pos += len(part)
        payload += int(chunk.payload.size)
        if progress:
            progress(chunk.index + 1, h.num_chunks)
    return pos, payload


@dataclass(repr=False)
class EncodeSummary:
    header: FileHeader
    file_bytes: int
    payload_bytes: int
    side_bytes: int
    #: None: the file holds the encoding asked for; else the exact alternative the small-cache
    #: rule wrote instead (smallest_encoding): "lossless", "lossless with one table per plane" or
    #: "version 1 (no tokens)".
    fallback: str | None = None

    def __repr__(self) -> str:  # the header holds whole tables: name only what a reader wants
        h = self.header
        return (f"EncodeSummary(format_version={h.version}, method={h.method}, dtype={h.dtype!r}, "
                f"num_layers={h.num_layers}, num_tokens={h.num_tokens}, num_channels={h.num_channels}, "
                f"num_chunks={h.num_chunks}, file_bytes={self.file_bytes}, payload_bytes={self.payload_bytes}, "
                f"side_bytes={self.side_bytes}, fallback={self.fallback!r})")


def encode_to_stream(
    cache: KVCache,
    out: BinaryIO,
    quant: QuantizationConfig,
    chunk_tokens: int,
    progress: ProgressFn | None = None,
    device: str = "cpu",
    calibration=None,
    fallback: bool = True,
) -> EncodeSummary:
    """Write a whole .cgen file for ``cache`` to ``out``.  ``cache``: a KVCache in memory, or a
    source read a slab at a time (kvio.SafetensorsSource: the cache is never whole in memory;
    its values are checked for NaN / Inf slab by slab, before the file is complete).
    ``fallback``: the small-cache rule (smallest_encoding: a cache of at most SMALL_CACHE_TOKENS
    tokens whose file would grow past its raw size is written in the shortest exact encoding);
    False: as asked."""
    meta = cache if isinstance(cache, KVCache) else cache.cache
    if fallback and meta.num_tokens <= SMALL_CACHE_TOKENS:
        if not isinstance(cache, KVCache):
            cache = cache.load()  # a few tokens: whole in memory
        buf = ByteCollector()
        summary = encode_to_stream(cache, buf, quant, chunk_tokens, progress, device, calibration, fallback=False)
        data, summary = smallest_encoding(cache, buf.getvalue(), chunk_tokens, summary)
        out.write(data)
        return summary
    if isinstance(quant, TransformConfig):
        return _encode_v2_to_stream(cache, out, quant, chunk_tokens, progress, device, calibration)
    if calibration is not None:
        raise ConfigError("a calibration applies to the transform qualities (quality 'high', 'balanced' or 'small'), "
                          "not to a preset or bins",
                          cli="--calibration applies to the transform qualities (--quality high/balanced/small), "
                          "not to --preset or --bins")
    device = resolve_device(device)
    kernels = get_kernels(device)
    source = None if isinstance(cache, KVCache) else cache
    meta = cache if source is None else source.cache
    h = make_header(meta, quant, chunk_tokens)
    head = container.pack_file_header(h)
    out.write(head)
    pos = len(head)
    offsets: list[int] = []
    payload_bytes = 0
    slabs = list(iter_slabs(h, GPU_SLAB_BYTES if device == "cuda" else SLAB_BYTES))
    fused = device == "cpu" and kernels is cpu_kernels
    words = _cpu_source_words(cache.data) if fused and source is None else None  # (bf16 / fp32 only)
    check = source.finite_check() if source is not None else None
    from ..storage.kvio import SlabBuffers

    buffers = SlabBuffers()
    for number, slab in enumerate(slabs):
        block = cache.data[:, :, slab.t0 : slab.t1, :] if source is None else source.read(slab.t0, slab.t1, buffers)
        if check is not None:
            check.add(block)
            if check.bad:  # name the first bad layer of the whole cache, as check_finite does
                for rest in slabs[number + 1 :]:
                    check.add(source.read(rest.t0, rest.t1, buffers))
                check.raise_if_bad()
        block = fp16_headroom(block)
        block_words = _cpu_source_words(block) if fused and source is not None else None
        if device == "cuda":
            from . import lmcache_device as gpu_codec

            chunks = gpu_codec.encode_slab(h, block, slab.first_chunk)
        elif words is not None:  # the fused CPU kernel reads the cache's own words
            chunks = _encode_slab_cpu(h, words[0], words[1], slab.t0, slab.t1 - slab.t0, slab.first_chunk)
        elif block_words is not None:  # ... or the slab's, as read from the file
            chunks = _encode_slab_cpu(h, block_words[0], block_words[1], 0, slab.t1 - slab.t0, slab.first_chunk)
        else:
            x = block.to(torch.float32).contiguous().numpy()
            chunks = encode_slab(h, x, slab.first_chunk, kernels)
        pos, written = _write_chunks(out, h, chunks, pos, offsets, progress)
        payload_bytes += written
        if number + 1 < len(slabs) and hasattr(out, "slab_done"):
            out.slab_done()  # the slab's buffers may be reused by the next one
    index = container.pack_index(offsets)
    out.write(index)
    out.write(container.pack_trailer(pos))
    pos += len(index) + container.TRAILER.size
    return EncodeSummary(h, pos, payload_bytes, pos - payload_bytes)


# ---------------------------------------------------------------- small caches
#
# A file carries side information whatever its number of tokens: version 2 one table entry per
# (layer, K/V, channel) (and method 2 an offset per channel, 2 bytes), version 1 a CDF code per
# symbol, channel and chunk.  For a few tokens that outweighs the payload: 1 token of
# SmolLM2-135M (23,040 bytes of bfloat16) gave a 61,425-byte file at every --quality, 119,665
# with --preset lmcache and 54,493 losslessly (docs/config.md, "Small caches").
#
# The rule: when a cache of at most SMALL_CACHE_TOKENS tokens gives a file larger than its raw
# values plus SMALL_FILE_SLACK bytes (not counting its Descriptor), the shortest of that file and its exact alternatives is
# written instead: the lossless file (method 3, as `--quality lossless` writes it), lossless
# with one table per (layer, K/V) plane (one "same table" byte per channel instead of a table
# of 4 bytes or more: what pays for a few tokens), and for a cache of no tokens a version-1
# file (no values to code and no per-channel tables).  Each decodes to the input exactly, so it
# is a valid answer to any request, and a better one than a lossy file.  The choice is made on
# byte lengths (ties: the encoding asked for, then the order above), which are the same on
# every device, as the bytes are: a file is the same whether it was encoded on a CPU or a GPU.
# No format change: every candidate is an ordinary version 1 / 2 file, read by every reader.
# A real "stored" chunk (raw words, no tables) would need a new flag; the one table byte per
# channel that version 2 needs is what the rule leaves over the raw size.

#: Caches of at most this many tokens get the small-cache rule.  Past a few tokens the side
#: information stops mattering: at 8 tokens of SmolLM2-135M --quality high was 1.03 x the raw
#: values and lossless (one table per plane) 0.77 x; at 64 tokens every file was under 0.7 x.
#: The alternatives are cheap at this size (the cache is read whole into memory for them).
SMALL_CACHE_TOKENS = 64

#: A file within this many bytes of the raw values (plus its Descriptor) is written as asked: the
#: fixed parts of any file (its headers, the index, a few tables) are of this order, and a
#: cache this small gains nothing worth changing its method for (the golden files and the
#: tests' small caches, which pin each method's bytes, are all below it).
SMALL_FILE_SLACK = 4096


def raw_bytes(cache: KVCache) -> int:
    """The bytes of a cache's values in its dtype (the size a file is compared with)."""
    return cache.num_layers * 2 * cache.num_tokens * cache.num_channels * cache.data.element_size()


def _host_cache(cache: KVCache) -> KVCache:
    if cache.data.device.type == "cpu":
        return cache
    return KVCache(cache.data.cpu(), cache.layout, cache.num_kv_heads, cache.head_dim, cache.tensors, cache.metadata,
                   cache.rope)


def smallest_encoding(cache: KVCache, data: bytes, chunk_tokens: int,
                      summary: EncodeSummary | None = None) -> tuple[bytes, EncodeSummary | None]:
    """The small-cache rule (above) on ``data``, the encoding asked for (with its ``summary`` if
    known): returns the bytes to write and their summary (its ``fallback`` names the alternative
    chosen; ``summary`` itself when ``data`` stays).  The alternatives are encoded on the host
    (the same bytes as on a GPU)."""
    from ..methods import transform as transform_codec
    from ..methods.config import resolve_quantization

    # The Descriptor (the tensor names and the metadata: `cachegen capture` stores the token ids
    # there) is the same in every encoding: only the coding is compared with the raw size.
    descriptor = int.from_bytes(data[12:16], "little")
    if cache.num_tokens > SMALL_CACHE_TOKENS or len(data) <= raw_bytes(cache) + descriptor + SMALL_FILE_SLACK:
        return data, summary

    def offer(label: str, alt: bytes, s: EncodeSummary) -> None:
        nonlocal data, summary
        if len(alt) < len(data):
            data, summary = alt, s
            summary.fallback = label

    host = _host_cache(cache)
    lossless = TransformConfig(method="lossless", name="lossless")
    asked_lossless = data[8:10] == container.FORMAT_VERSION_2.to_bytes(2, "little") and data[44] == METHOD_LOSSLESS
    if not asked_lossless:
        buf = ByteCollector()
        s = encode_to_stream(host, buf, lossless, chunk_tokens, None, "cpu", None, fallback=False)
        offer("lossless", buf.getvalue(), s)
    buf = ByteCollector()
    if cache.num_tokens:
        enc = transform_codec.encode_v2(host, lossless, chunk_tokens, None, plane_tables=True)
        s = _write_v2(buf, enc.header, [enc.chunks], None)
        offer("lossless with one table per plane", buf.getvalue(), s)
    else:
        quant = resolve_quantization(cache.num_layers, preset_name="lmcache")
        s = encode_to_stream(host, buf, quant, chunk_tokens, None, "cpu", None, fallback=False)
        offer("version 1 (no tokens)", buf.getvalue(), s)
    return data, summary


class ByteCollector:
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


def v2_device(device: str) -> str:
    """Where format version 2 runs: the device-resident pipeline (pipeline/transform_resident.py,
    kernels/cuda_pipeline.py) when a GPU is asked for or, with auto, present; the simulator is
    used only when asked for explicitly."""
    return resolve_device(device)


def _resident_upload(data) -> torch.Tensor:
    """File bytes as the resident pipeline's uint8 tensor: on the GPU, or on the CPU under
    numba's simulator."""
    from . import transform_resident, lmcache_device as gpu_codec

    if gpu_codec.torch_cuda_ok():
        return gpu_codec.upload_blob(data)
    return torch.from_numpy(np.frombuffer(bytes(data), np.uint8).copy()).to(transform_resident.device())


def _resident_bytes(blob: torch.Tensor) -> bytes:
    from . import lmcache_device as gpu_codec

    return gpu_codec.to_host_bytes(blob) if blob.is_cuda else blob.numpy().tobytes()


def _resident_host(blob: torch.Tensor) -> np.ndarray:
    """The file bytes of a resident encode on the host, without a copy to ``bytes``: in the
    thread's page-locked "output" buffer (valid until its next use), or the CPU tensor's own."""
    return staging.to_host(blob) if blob.is_cuda else blob.numpy()


def encode_v2(cache: KVCache, cfg: TransformConfig, chunk_tokens: int, calibration=None,
              device: str = "cpu"):
    """Encode a whole cache with method 2 or 3 on ``device``: the CPU (methods/transform.py) or
    the GPU (pipeline/transform_resident.py; a cache of no tokens is coded on the CPU);
    returns the header and the chunks."""
    from ..methods import transform as transform_codec

    if device == "cuda" and cache.num_tokens:
        from . import transform_resident

        data = _resident_bytes(transform_resident.encode(cache, cfg, chunk_tokens, calibration, copy_out=False)[0])
        reader, _ = open_input(data)
        h, _, offsets, size = read_header_and_index(reader)
        return transform_codec.EncodedV2(h, list(iter_chunks(reader, h, offsets, size)))
    return transform_codec.encode_v2(cache, cfg, chunk_tokens, calibration)


def decode_v2(h: FileHeader, chunks: list[Chunk], dtype: torch.dtype, calibration=None) -> torch.Tensor:
    """Decode all chunks of a version-2 file into [L, 2, T, C] of ``dtype`` on the CPU (the GPU
    decodes whole files: pipeline/transform_resident.decode)."""
    from ..methods import transform as transform_codec

    return transform_codec.decode_v2(h, chunks, dtype, calibration)


def _encode_v2_to_stream(cache: KVCache, out: BinaryIO, cfg: TransformConfig, chunk_tokens: int,
                         progress: ProgressFn | None, device: str, calibration) -> EncodeSummary:
    from ..methods import transform as transform_codec

    device = v2_device(device)
    chunk_tokens = validate_chunk_tokens(chunk_tokens)
    if cfg.method == "lossless" and calibration is not None:
        raise ConfigError("a calibration does not apply to quality 'lossless'",
                          cli="--calibration does not apply to --quality lossless")
    if device == "cuda":
        from . import transform_resident as device_pipeline

        checked = isinstance(cache, KVCache)
        if not checked:  # the GPU takes the whole cache at once, read into page-locked memory;
            # its first pass checks the values are finite (and words the error from them)
            cache = cache.load(PinnedSlabBuffers("input"), check=False)
        if cache.num_tokens:  # the whole file made on the GPU, written in one piece
            blob, payload_bytes = device_pipeline.encode(cache, cfg, chunk_tokens, calibration, checked=checked,
                                                         copy_out=False)
            data = memoryview(_resident_host(blob))
            out.write(data)
            if progress:
                progress(-(-cache.num_tokens // chunk_tokens), -(-cache.num_tokens // chunk_tokens))
            # the summary's header: its tables walked, not expanded (the GPU wrote them)
            h, _, _, _ = read_header_and_index(container.BufferReader(data), defer_tables=True)
            return EncodeSummary(h, len(data), payload_bytes, len(data) - payload_bytes)
    if isinstance(cache, KVCache):
        enc = transform_codec.encode_v2(cache, cfg, chunk_tokens, calibration)
        h, slabs = enc.header, [enc.chunks]
    else:  # a file: the statistics passes, then one slab coded and written at a time
        meta = cache.cache
        per = transform_codec.slab_chunks_count(meta.num_layers, meta.num_channels, chunk_tokens)
        h, slabs = transform_codec.encode_v2_slabs(cache, cfg, chunk_tokens, calibration, per * chunk_tokens)
    return _write_v2(out, h, slabs, progress)


def _write_v2(out: BinaryIO, h: FileHeader, slabs, progress: ProgressFn | None) -> EncodeSummary:
    """A version-2 file from its header and its chunks (an iterable of slabs' chunk lists)."""
    head = container.pack_file_header(h)
    out.write(head)
    pos = len(head)
    offsets: list[int] = []
    payload_bytes = 0
    for chunks in slabs:
        pos, written = _write_chunks(out, h, chunks, pos, offsets, progress)
        payload_bytes += written
    index = container.pack_index(offsets)
    out.write(index)
    out.write(container.pack_trailer(pos))
    pos += len(index) + container.TRAILER.size
    return EncodeSummary(h, pos, payload_bytes, pos - payload_bytes)


#: Chunks whose CRC-32s are checked together, in parallel threads.
CRC_BATCH = 16


def iter_chunks(f: BinaryIO, h: FileHeader, offsets: list[int], size: int, batch: int = CRC_BATCH) -> Iterator[Chunk]:
    """Read every chunk in order, checking each sits where the index says and its CRC-32
    (``batch`` chunks at a time, on several threads) before anything else is read from it."""
    width = _code_width(h)
    index_offset = size - container.TRAILER.size - (12 + 8 * h.num_chunks)
    for first in range(0, h.num_chunks, batch):
        records = []
        for i in range(first, min(h.num_chunks, first + batch)):
            pos = f.tell()
            if pos != offsets[i]:
                raise container.SizeError(f"chunk {i} is at byte {pos}, the index says {offsets[i]}")
            records.append(container.read_chunk_record(f, h, i, index_offset - pos))
        checks = _map(container.ChunkRecord.crc_ok, records)
        for rec, ok in zip(records, checks):
            if not ok:
                raise ChecksumError(f"chunk {rec.index} CRC mismatch: the file is corrupted")
            yield container.parse_chunk(h, rec, width)
    if f.tell() != index_offset:
        raise container.SizeError("bytes between the last chunk and the index")


def open_input(source, mapped: bool = True) -> tuple[BinaryIO, object]:
    """A zero-copy reader over bytes, a buffer, or a file path (memory-mapped); returns
    (reader, closer) where closer must be closed after the reader's views are dropped.
    ``mapped=False``: a path is read with plain reads instead, so that a slab-by-slab
    decoder holds one slab of it at a time (a mapping's pages would stay in the process)."""
    import mmap

    if isinstance(source, (bytes, bytearray, memoryview)):
        return container.BufferReader(source), None
    fh = open(source, "rb")
    if not mapped:
        return fh, fh
    try:
        if os.fstat(fh.fileno()).st_size == 0:
            return container.BufferReader(b""), fh
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return fh, fh
    fh.close()
    return container.BufferReader(mm), mm


class SlabDecoder:
    """A .cgen stream opened for decoding: the header, index and (version 2) calibration are
    read and checked on opening; ``blocks`` then decodes it a slab (a run of whole chunks) at
    a time, reading only that slab's chunks."""

    def __init__(self, f: BinaryIO, device: str = "cpu", calibration=None, slab_bytes: int | None = None) -> None:
        self.f = f
        self.device = resolve_device(device)
        # On the GPU a version-2 file's tables are read on the device (transform_resident): the
        # host only walks them (the full parse of 65,536 tables costs ~20 ms of host time).
        self.header, _, self.offsets, self.size = read_header_and_index(f, defer_tables=self.device == "cuda")
        h = self.header
        if h.num_chunks == 0 and getattr(h.params, "table_starts", None) is not None:
            # no chunks: decoded on the CPU (decode_v2), which reads the tables themselves
            f.seek(0)
            self.header, _, self.offsets, self.size = read_header_and_index(f)
            h = self.header
        self.dtype = DTYPE_BY_NAME[h.dtype]
        self.calibration = calibration
        self.saturate = saturates(h)
        self.v2 = None
        if h.version == container.FORMAT_VERSION_2:
            from ..methods import transform as transform_codec

            if self.device == "cpu":
                self.v2 = transform_codec.V2SlabDecoder(h, calibration)
                per = transform_codec.slab_chunks_count(h.num_layers, h.num_channels, h.chunk_tokens,
                                                        slab_bytes or transform_codec.V2_SLAB_BYTES)
                self.slabs = [Slab(k, min(per, h.num_chunks - k), k * h.chunk_tokens,
                                   min(h.num_tokens, (k + per) * h.chunk_tokens)) for k in range(0, h.num_chunks, per)]
            else:
                transform_codec.check_calibration(h, calibration)
                self.slabs = []
        else:
            self.slabs = list(iter_slabs(h, slab_bytes or (GPU_SLAB_BYTES if self.device == "cuda" else SLAB_BYTES)))

    def blocks(self, progress: ProgressFn | None = None, into: np.ndarray | None = None) -> Iterator[tuple[int, int, object]]:
        """Decode slab by slab: yields (t0, t1, block), block the tokens [t0, t1) as a tensor
        [L, 2, t1 - t0, C] of the source dtype (on the GPU when it decoded there), valid until
        the next block is asked for (the CPU reuses its memory).  ``into``:
        the words (uint16 / uint32) of a CPU output [L, 2, T, C]; a slab the CPU decodes
        straight into it yields block None."""
        h, f = self.header, self.f
        if h.version == container.FORMAT_VERSION_2 and self.v2 is None:  # the GPU: the whole file at once
            from . import transform_resident as device_pipeline

            if h.num_chunks:
                f.seek(0)
                blob = _resident_upload(f.read())
                hh, offsets, size = device_pipeline.read_header(blob)
                data = device_pipeline.decode(blob, hh, offsets, size, self.calibration)
            else:
                data = decode_v2(h, [], self.dtype, self.calibration).to(device_pipeline.device())
            if self.saturate:
                saturate_(data)
            if progress:
                progress(h.num_chunks, h.num_chunks)
            yield 0, h.num_tokens, data
            return
        batch = max((s.num_chunks for s in self.slabs), default=1)
        chunks = iter_chunks(f, h, self.offsets, self.size, min(CRC_BATCH, batch) if into is None else CRC_BATCH)
        if self.v2 is not None:
            for slab in self.slabs:
                part = [next(chunks) for _ in range(slab.num_chunks)]
                if into is not None:
                    self.v2.decode_into(part, into, slab.t0)
                    if self.saturate:
                        saturate_words_(into[:, :, slab.t0 : slab.t1], self.dtype)
                    block = None
                else:  # the block is valid until the next one
                    words = self.v2.empty(slab.t1 - slab.t0, reuse=True)
                    self.v2.decode_into(part, words, 0)
                    if self.saturate:
                        saturate_words_(words, self.dtype)
                    block = self.v2.as_tensor(words)
                del part
                if progress:
                    progress(slab.first_chunk + slab.num_chunks, h.num_chunks)
                yield slab.t0, slab.t1, block
        else:
            yield from self._v1_blocks(chunks, progress, into)
        for _ in chunks:  # drains the generator: runs its final consistency check
            pass

    def _v1_blocks(self, chunks: Iterator[Chunk], progress, into):
        h, f, device = self.header, self.f, self.device
        kernels = get_kernels(device)
        on_gpu = False
        if device == "cuda":
            from . import lmcache_device as gpu_codec

            on_gpu = gpu_codec.torch_cuda_ok()
        blob = blob_d = upload = None
        if on_gpu:
            # The device decodes straight from a copy of the whole file; the host only checks it.
            # The copy runs on a worker thread (torch releases the GIL) while the host checks
            # the chunks' sizes and CRCs.
            here = f.tell()
            f.seek(0)
            blob = f.read()
            f.seek(here)
            upload = _pool().submit(gpu_codec.upload_blob, blob)
        fused = device == "cpu" and kernels is cpu_kernels and self.dtype in (torch.bfloat16, torch.float32)
        to_bf16 = self.dtype == torch.bfloat16
        from ..storage.kvio import SlabBuffers

        buffers = SlabBuffers()
        for slab in self.slabs:
            batch = [next(chunks) for _ in range(slab.num_chunks)]
            if on_gpu:
                if blob_d is None:
                    blob_d = upload.result()
                x, blob_d = gpu_codec.decode_blob(h, blob, self.offsets, batch, slab.first_chunk, blob_d)
                x = (saturate_(x.to(self.dtype)) if _v1_scales_overflow(h, batch) else x.to(self.dtype))
            elif device == "cuda":
                x = torch.from_numpy(gpu_codec.decode_slab(h, batch))
                x = saturate_(x.to(self.dtype)) if _v1_scales_overflow(h, batch) else x.to(self.dtype)
            elif fused and into is not None:  # the fused CPU kernel writes straight into the output
                _decode_slab_cpu(h, batch, into, slab.t0, to_bf16)
                x = None
            elif fused:
                words = buffers.get("out", (h.num_layers, 2, slab.t1 - slab.t0, h.num_channels),
                                    np.uint16 if to_bf16 else np.float32)  # valid until the next block
                _decode_slab_cpu(h, batch, words, 0, to_bf16)
                x = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16) if to_bf16 else torch.from_numpy(words)
            else:  # float16 (or the reference kernels): float32, then converted
                x = torch.from_numpy(decode_slab(h, batch, kernels)).to(self.dtype)
                if _v1_scales_overflow(h, batch):
                    saturate_(x)
            del batch
            if progress:
                progress(slab.first_chunk + slab.num_chunks, h.num_chunks)
            yield slab.t0, slab.t1, x


def decode_from_stream(f: BinaryIO, progress: ProgressFn | None = None, device: str = "cpu",
                       calibration=None) -> tuple[FileHeader, torch.Tensor]:
    """Decode a whole .cgen stream; returns its header and the [L, 2, T, C] tensor in the source dtype.
    ``calibration``: the Calibration a rotated (version 2) file was encoded with."""
    dec = SlabDecoder(f, device, calibration)
    h = dec.header
    shape = (h.num_layers, 2, h.num_tokens, h.num_channels)
    data = None
    into = None
    if dec.device == "cpu":
        data = torch.empty(shape, dtype=dec.dtype)
        into = _cpu_output_words(data) if h.version == 1 else kvio_words(data)
    for t0, t1, block in dec.blocks(progress, into):
        if block is None:
            continue
        if data is None:
            if t0 == 0 and t1 == h.num_tokens:  # one block: the whole cache (v2 on a GPU)
                data = block
                continue
            data = torch.empty(shape, dtype=dec.dtype, device=block.device)
        data[:, :, t0:t1, :] = block
    if data is None:
        data = torch.empty(shape, dtype=dec.dtype, device="cuda" if dec.device == "cuda" else "cpu")
    return h, data


# The device-resident decoder reruns this reader on a file that failed a check there, to raise
# the CPU's exact error.
transform_resident.CPU_READER = decode_from_stream


def kvio_words(data: torch.Tensor) -> np.ndarray:
    """The words (uint16 / uint32) of a contiguous CPU tensor, writable, for V2SlabDecoder."""
    from ..storage.kvio import _words

    return _words(data)


def decode_to_file(dec: SlabDecoder, path, progress: ProgressFn | None = None) -> None:
    """Decode an opened stream into a safetensors file at ``path`` (a temporary path the caller
    renames), slab by slab: the process holds one slab, not the cache."""
    from ..storage.kvio import SafetensorsWriter

    h = dec.header
    with SafetensorsWriter(path, h.descriptor, h.dtype) as writer:
        for t0, _, block in dec.blocks(progress):
            if isinstance(block, torch.Tensor) and block.is_cuda:  # through page-locked memory
                words = staging.to_host(block).view(np.uint16 if block.element_size() == 2 else np.uint32)
                block = words.reshape(block.shape)
            writer.write(t0, block)
