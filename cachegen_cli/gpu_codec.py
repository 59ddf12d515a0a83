"""The codec's slab steps on a CUDA GPU: the same chunks as ``codec.encode_slab`` /
``codec.decode_slab``, computed by ``kernels/cuda.py``.

Encoding: a slab (many chunks) is one batch of launches on one CUDA stream with
a single host synchronisation, when the stream lengths come back to place the
streams; the CDF codes are packed to nibbles on the device and everything comes
back through one reused page-locked buffer.

Decoding (``decode_blob``): the whole .cgen file is copied to the device once;
the kernels read the CDF codes, scales and streams straight out of it at the
offsets the host computed while checking the file, so nothing is gathered or
concatenated on the host.

Inputs may be torch CUDA tensors (no host copy), CPU tensors (copied once), or,
under numba's CUDA simulator, numpy arrays (then the simpler host-side paths run).
"""

from __future__ import annotations

import numpy as np
import torch

from . import container
from .container import Chunk, FileHeader
from .kernels.coding_params import max_stream_bytes


def _kernels():
    from .kernels import cuda as cuda_kernels

    return cuda_kernels


def torch_cuda_ok() -> bool:
    """True when torch and numba can share real device memory (not under the simulator)."""
    from numba import config

    return bool(torch.cuda.is_available()) and not config.ENABLE_CUDASIM


class _Pinned:
    """A growing page-locked host buffer, reused between calls (cudaHostAlloc is slow)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return self.buf[:nbytes]


_STAGING = _Pinned()


def to_device_f32(x: torch.Tensor):
    """float32 [L, 2, T, C] on the device; returns (numba array, keep-alive object)."""
    from numba import cuda

    k = _kernels()
    if torch_cuda_ok():
        t = x.to(device="cuda", non_blocking=True).to(torch.float32).contiguous()
        return k.as_device(t), t
    arr = np.ascontiguousarray(x.to(torch.float32).cpu().numpy())
    return cuda.to_device(arr), arr


_DEVICE_MAPS: dict = {}


def _device_nibble_maps(h: FileHeader, width: int):
    key = (np.ascontiguousarray(h.alphabets, np.int32).tobytes(), h.num_layers, h.num_channels, width)
    maps = _DEVICE_MAPS.get(key)
    if maps is None:
        low, high, _ = container.nibble_maps(h, width)
        maps = (torch.as_tensor(low, device="cuda"), torch.as_tensor(high, device="cuda"))
        _DEVICE_MAPS.clear()
        _DEVICE_MAPS[key] = maps
    return maps


def _empty(shape, np_dtype):
    """A device buffer: from torch's caching allocator when torch has the GPU (cudaMalloc and
    cudaFree of gigabytes per call would dominate), else a numba array (simulator)."""
    from numba import cuda

    if torch_cuda_ok():
        torch_dtype = {np.uint8: torch.uint8, np.int32: torch.int32, np.int64: torch.int64,
                       np.float32: torch.float32, np.int16: torch.int16}[np_dtype]
        return _kernels().as_device(torch.empty(shape, dtype=torch_dtype, device="cuda"))
    return cuda.device_array(shape, np_dtype)


_WORD_FORMATS = {torch.bfloat16: 1, torch.float16: 2}


def encode_slab(h: FileHeader, x: torch.Tensor, first_chunk: int) -> list[Chunk]:
    """Encode x [L, 2, T_slab, C] (any float dtype, CPU or CUDA) on the GPU.

    The chunks' arrays may view a reused staging buffer: write them out before
    the next call."""
    from numba import cuda

    k = _kernels()
    stream = cuda.default_stream()
    L, _, T, C = x.shape
    ct = h.chunk_tokens
    K = -(-T // ct)
    S = int(h.alphabets.max())
    maxq = cuda.to_device(h.maxq, stream=stream)
    scales = cuda.device_array((L, 2, T), np.uint16, stream=stream)
    symbols = _empty((L, 2, T, C), np.uint8)
    if torch_cuda_ok() and x.dtype in _WORD_FORMATS:
        # 16-bit caches are read as raw words: no float32 copy of the cache.
        keep = x.to(device="cuda", non_blocking=True).contiguous().view(torch.int16)
        k.quantize_bits(k.as_device(keep), _WORD_FORMATS[x.dtype], maxq, scales, symbols, stream)
    else:
        xd, keep = to_device_f32(x)
        k.quantize(xd, maxq, scales, symbols, stream)
    codes = _empty((K, L, 2, C, S), np.uint8)
    cum = _empty((K, L, 2, C, S + 1), np.int32)
    k.histogram_cdf(symbols, ct, maxq, codes, cum, stream)
    per_chunk = h.streams_per_chunk
    n = K * per_chunk
    slots = _empty((n, max_stream_bytes(ct * h.group)), np.uint8)
    lengths_d = _empty((n,), np.int32)
    k.encode_streams(symbols, cum, ct, h.group, slots, lengths_d, stream)
    lengths = lengths_d.copy_to_host(stream=stream)
    stream.synchronize()  # the one sync: stream lengths place the streams
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    payload_d = _empty((max(total, 1),), np.uint8)
    k.pack_streams(slots, lengths_d, cuda.to_device(offsets, stream=stream), payload_d, stream)
    if torch_cuda_ok():
        codes_t = torch.as_tensor(codes, device="cuda").reshape(K, -1)
        low, high = _device_nibble_maps(h, S)
        flat = torch.cat([codes_t, torch.zeros((K, 1), dtype=torch.uint8, device="cuda")], dim=1)
        packed_t = flat[:, low] | (flat[:, high] << 4)
        cdf_size = packed_t.shape[1]
        staging = _STAGING.get(total + K * cdf_size).numpy()
        payload = staging[:total]
        if total:
            payload_d[:total].copy_to_host(payload, stream=stream)
        packed = staging[total:].reshape(K, cdf_size)
        torch.from_numpy(packed).copy_(packed_t)  # device -> page-locked host, same (legacy default) stream
    else:
        payload = payload_d.copy_to_host(stream=stream)[:total]
        packed = container.pack_codes(codes.copy_to_host(stream=stream), h)
    scales_h = scales.copy_to_host(stream=stream)
    stream.synchronize()
    del keep
    return container.slab_chunks(h, first_chunk, scales_h, packed, lengths, payload, offsets[::per_chunk])


def decode_slab(h: FileHeader, chunks: list[Chunk]):
    """Decode consecutive chunks (host arrays) on the GPU into float32 [L, 2, T_slab, C].

    Returns a torch CUDA tensor when torch can use the GPU, else a numpy array
    (numba's simulator)."""
    from numba import cuda

    k = _kernels()
    stream = cuda.default_stream()
    L, C = h.num_layers, h.num_channels
    K = len(chunks)
    T = sum(c.token_count for c in chunks)
    S = int(h.alphabets.max())
    maxq = cuda.to_device(h.maxq, stream=stream)
    codes = cuda.to_device(container.unpack_codes(np.stack([c.codes for c in chunks]), h, S), stream=stream)
    cum = cuda.device_array((K, L, 2, C, S + 1), np.int32, stream=stream)
    k.cum_from_codes(codes, maxq, cum, stream)
    lengths = np.concatenate([c.lengths.reshape(-1) for c in chunks]).astype(np.int32)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.concatenate([c.payload for c in chunks])
    payload_d = cuda.to_device(payload if payload.size else np.zeros(1, np.uint8), stream=stream)
    symbols = cuda.device_array((L, 2, T, C), np.uint8, stream=stream)
    k.decode_streams(payload_d, cuda.to_device(offsets, stream=stream), cuda.to_device(lengths, stream=stream),
                     cum, maxq, h.chunk_tokens, h.group, symbols, stream)
    scales = cuda.to_device(np.ascontiguousarray(np.concatenate([c.scales for c in chunks], axis=2)), stream=stream)
    if torch_cuda_ok():
        out_t = torch.empty((L, 2, T, C), dtype=torch.float32, device="cuda")
        k.dequantize(symbols, scales, maxq, k.as_device(out_t), stream)
        stream.synchronize()
        return out_t
    out = cuda.device_array((L, 2, T, C), np.float32, stream=stream)
    k.dequantize(symbols, scales, maxq, out, stream)
    return out.copy_to_host(stream=stream)


def upload_blob(blob) -> torch.Tensor:
    """The whole file as a uint8 CUDA tensor."""
    if not len(blob):
        return torch.zeros(1, dtype=torch.uint8, device="cuda")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: torch only reads it
        return torch.frombuffer(blob, dtype=torch.uint8).to("cuda")


def decode_blob(h: FileHeader, blob: memoryview, chunk_offsets: list[int], chunks: list[Chunk],
                first_chunk: int, blob_d: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``chunks`` (already checked by the host) reading their sections from the
    whole file on the device.  Returns ([L, 2, T_slab, C] CUDA tensor: bfloat16 for
    bfloat16 files, else float32; blob_d) so the caller can reuse the device copy of the
    file for the next slab."""
    k = _kernels()
    L, C = h.num_layers, h.num_channels
    K = len(chunks)
    S = int(h.alphabets.max())
    if blob_d is None:
        blob_d = upload_blob(blob)
    T = sum(c.token_count for c in chunks)
    # Host-side arithmetic on small arrays: where every section starts in the file.
    starts = np.array([chunk_offsets[first_chunk + i] for i in range(K)], np.int64)
    sizes = np.array([h.section_sizes(c.token_count) for c in chunks], np.int64).reshape(K, 3)
    scales_at = starts + container.CHUNK_HEADER.size
    codes_at = scales_at + sizes[:, 0]
    payload_at = codes_at + sizes[:, 1] + sizes[:, 2]
    lengths = np.concatenate([c.lengths.reshape(-1) for c in chunks]).astype(np.int32)
    per_chunk = h.streams_per_chunk
    within = np.zeros(lengths.size, np.int64)
    if lengths.size:
        local = lengths.reshape(K, per_chunk).astype(np.int64)
        within = (np.cumsum(local, axis=1) - local + payload_at[:, None]).reshape(-1)
    dev = torch.device("cuda")
    # CDF codes: gather each chunk's packed section, unpack nibbles on the device.
    cdf_size = int(sizes[0, 1]) if K else 0
    idx = torch.as_tensor(codes_at, device=dev)[:, None] + torch.arange(cdf_size, device=dev)[None, :]
    packed = blob_d[idx]
    low, high = _device_nibble_maps(h, S)
    flat = torch.zeros((K, L * 2 * C * S + 1), dtype=torch.uint8, device=dev)
    flat[:, low] = packed & 0x0F
    flat[:, high] = packed >> 4
    codes = flat[:, :-1].contiguous().reshape(K, L, 2, C, S)
    # Scales: u16 little-endian, [L, 2, tk] per chunk, laid end to end along the tokens.
    tks = np.array([c.token_count for c in chunks], np.int64)
    t_chunk = np.repeat(np.arange(K), tks)
    t_local = np.arange(T) - np.repeat(np.cumsum(tks) - tks, tks)
    lk = np.arange(L * 2, dtype=np.int64)[:, None]
    byte_at = scales_at[t_chunk][None, :] + 2 * (lk * tks[t_chunk][None, :] + t_local[None, :])
    byte_at = torch.as_tensor(byte_at, device=dev)
    scales = (blob_d[byte_at].to(torch.int32) | (blob_d[byte_at + 1].to(torch.int32) << 8)).reshape(L, 2, T)
    maxq = torch.as_tensor(h.maxq, device=dev)
    cum = torch.empty((K, L, 2, C, S + 1), dtype=torch.int32, device=dev)
    a = k.as_device
    k.cum_from_codes(a(codes), a(maxq), a(cum))
    symbols = torch.empty((L, 2, T, C), dtype=torch.uint8, device=dev)
    k.decode_streams(a(blob_d), a(torch.as_tensor(within, device=dev)), a(torch.as_tensor(lengths, device=dev)),
                     a(cum), a(maxq), h.chunk_tokens, h.group, a(symbols))
    if h.dtype == "bfloat16":  # dequantize and round to bfloat16 in one pass
        bits = torch.empty((L, 2, T, C), dtype=torch.int16, device=dev)
        k.dequantize_bf16(a(symbols), a(scales), a(maxq), a(bits))
        return bits.view(torch.bfloat16), blob_d
    out = torch.empty((L, 2, T, C), dtype=torch.float32, device=dev)
    k.dequantize(a(symbols), a(scales), a(maxq), a(out))
    return out, blob_d


# ---------------------------------------------------------------- .cgen bytes that stay on the GPU


def encode_records(h: FileHeader, x: torch.Tensor, first_chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Encode x [L, 2, T_slab, C] into the chunk records of the .cgen format, assembled on
    the GPU with their CRC-32s: returns (uint8 CUDA tensor of the records back to back,
    record sizes).  One host synchronisation, for the payload sizes; the only bytes
    that cross to the host are those sizes."""
    k = _kernels()
    a = k.as_device
    dev = torch.device("cuda")
    L, _, T, C = x.shape
    ct, G = h.chunk_tokens, h.group
    K = -(-T // ct)
    S = int(h.alphabets.max())
    per = h.streams_per_chunk
    n = K * per
    maxq = torch.as_tensor(h.maxq, device=dev)
    scales = torch.empty((L, 2, T), dtype=torch.int16, device=dev)  # bf16 scale bits are < 0x8000
    symbols = torch.empty((L, 2, T, C), dtype=torch.uint8, device=dev)
    if x.dtype in _WORD_FORMATS:
        words = x.to(device=dev).contiguous().view(torch.int16)
        k.quantize_bits(a(words), _WORD_FORMATS[x.dtype], a(maxq), a(scales), a(symbols))
    else:
        k.quantize(a(x.to(device=dev, dtype=torch.float32).contiguous()), a(maxq), a(scales), a(symbols))
    codes = torch.empty((K, L, 2, C, S), dtype=torch.uint8, device=dev)
    cum = torch.empty((K, L, 2, C, S + 1), dtype=torch.int32, device=dev)
    k.histogram_cdf(a(symbols), ct, a(maxq), a(codes), a(cum))
    slots = torch.empty((n, max_stream_bytes(ct * G)), dtype=torch.uint8, device=dev)
    lengths = torch.empty(n, dtype=torch.int32, device=dev)
    k.encode_streams(a(symbols), a(cum), ct, G, a(slots), a(lengths))
    low, high = _device_nibble_maps(h, S)
    flat = torch.cat([codes.reshape(K, -1), torch.zeros((K, 1), dtype=torch.uint8, device=dev)], dim=1)
    packed = flat[:, low] | (flat[:, high] << 4)
    payload_sizes = lengths.view(K, per).sum(dim=1, dtype=torch.int64).cpu().numpy()  # the sync
    tks = [min(ct, T - i * ct) for i in range(K)]
    sections = np.array([h.section_sizes(tk) for tk in tks], np.int64).reshape(K, 3)
    sizes = container.CHUNK_HEADER.size + sections.sum(axis=1) + payload_sizes
    rec_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rec = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev)
    heads = b"".join(
        container.CHUNK_HEADER.pack(container.CHUNK_MAGIC, first_chunk + i, (first_chunk + i) * ct, tks[i],
                                    *(int(v) for v in sections[i]), int(payload_sizes[i]), 0, 0)
        for i in range(K)
    )
    head_at = (rec_off[:, None] + np.arange(container.CHUNK_HEADER.size)[None, :]).reshape(-1)
    rec[torch.as_tensor(head_at, device=dev)] = torch.frombuffer(bytearray(heads), dtype=torch.uint8).to(dev)
    length_bytes = lengths.view(torch.uint8).view(n, 4)[:, :2].reshape(K, per * 2)  # u16 little-endian
    payload_at = np.empty(K, np.int64)
    for i in range(K):
        o = int(rec_off[i]) + container.CHUNK_HEADER.size
        t0 = i * ct
        part = scales[:, :, t0 : t0 + tks[i]].contiguous().view(torch.uint8).reshape(-1)
        rec[o : o + part.numel()] = part
        o += part.numel()
        rec[o : o + packed.shape[1]] = packed[i]
        o += packed.shape[1]
        rec[o : o + per * 2] = length_bytes[i]
        payload_at[i] = o + per * 2
    exclusive = (torch.cumsum(lengths.to(torch.int64), 0) - lengths).view(K, per)
    where = (exclusive - exclusive[:, :1] + torch.as_tensor(payload_at, device=dev)[:, None]).reshape(-1)
    k.pack_streams(a(slots), a(lengths), a(where), a(rec))
    # CRC-32 of each record: bytes 0..35 of its header, then everything after the CRC field.
    seg = k.CRC_SEGMENT_BYTES
    starts, lens, first, count = [], [], [], []
    for i in range(K):
        first.append(len(starts))
        starts.append(rec_off[i])
        lens.append(container.CHUNK_HEADER.size - 4)
        body0 = rec_off[i] + container.CHUNK_HEADER.size
        body_len = int(sizes[i]) - container.CHUNK_HEADER.size
        cuts = np.arange(0, body_len, seg, dtype=np.int64)
        starts.extend((body0 + cuts).tolist())
        lens.extend(np.minimum(seg, body_len - cuts).tolist())
        count.append(len(starts) - first[-1])
    as_dev = lambda v: torch.as_tensor(np.asarray(v, np.int64), device=dev)
    crc = torch.empty(K, dtype=torch.int64, device=dev)
    k.crc32_records(a(rec), a(as_dev(starts)), a(as_dev(lens)), a(as_dev(first)), a(as_dev(count)),
                    a(torch.empty(len(starts), dtype=torch.int64, device=dev)), a(crc))
    crc_bytes = ((crc[:, None] >> torch.tensor([0, 8, 16, 24], device=dev)[None, :]) & 0xFF).to(torch.uint8)
    crc_at = (rec_off[:, None] + 36 + np.arange(4)[None, :]).reshape(-1)
    rec[torch.as_tensor(crc_at, device=dev)] = crc_bytes.reshape(-1)
    return rec, [int(v) for v in sizes]
