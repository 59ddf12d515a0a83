"""The codec's slab steps on a CUDA GPU: the same chunks as ``codec.encode_slab`` /
``codec.decode_slab``, computed by ``kernels/cuda.py``.

A slab (many chunks) is one batch of launches on one CUDA stream with a single
host synchronisation, when the stream lengths come back to place the streams.
Inputs may be torch CUDA tensors (no host copy), CPU tensors (copied once), or,
under numba's CUDA simulator, numpy arrays.
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


def to_device_f32(x: torch.Tensor):
    """float32 [L, 2, T, C] on the device; returns (numba array, keep-alive object)."""
    from numba import cuda

    k = _kernels()
    if torch_cuda_ok():
        t = x.to(device="cuda", non_blocking=True).to(torch.float32).contiguous()
        return k.as_device(t), t
    arr = np.ascontiguousarray(x.to(torch.float32).cpu().numpy())
    return cuda.to_device(arr), arr


def encode_slab(h: FileHeader, x: torch.Tensor, first_chunk: int) -> list[Chunk]:
    """Encode x [L, 2, T_slab, C] (any float dtype, CPU or CUDA) on the GPU."""
    from numba import cuda

    k = _kernels()
    stream = cuda.default_stream()
    L, _, T, C = x.shape
    ct = h.chunk_tokens
    K = -(-T // ct)
    S = int(h.alphabets.max())
    xd, keep = to_device_f32(x)
    maxq = cuda.to_device(h.maxq, stream=stream)
    scales = cuda.device_array((L, 2, T), np.uint16, stream=stream)
    symbols = cuda.device_array((L, 2, T, C), np.uint8, stream=stream)
    k.quantize(xd, maxq, scales, symbols, stream)
    codes = cuda.device_array((K, L, 2, C, S), np.uint8, stream=stream)
    cum = cuda.device_array((K, L, 2, C, S + 1), np.int32, stream=stream)
    k.histogram_cdf(symbols, ct, maxq, codes, cum, stream)
    per_chunk = h.streams_per_chunk
    n = K * per_chunk
    slots = cuda.device_array((n, max_stream_bytes(ct * h.group)), np.uint8, stream=stream)
    lengths_d = cuda.device_array(n, np.int32, stream=stream)
    k.encode_streams(symbols, cum, ct, h.group, slots, lengths_d, stream)
    lengths = lengths_d.copy_to_host(stream=stream)
    stream.synchronize()  # the one sync: stream lengths place the streams
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload_d = cuda.device_array(max(int(offsets[-1]), 1), np.uint8, stream=stream)
    k.pack_streams(slots, lengths_d, cuda.to_device(offsets, stream=stream), payload_d, stream)
    payload = payload_d.copy_to_host(stream=stream)[: int(offsets[-1])]
    scales_h = scales.copy_to_host(stream=stream)
    codes_h = codes.copy_to_host(stream=stream)
    stream.synchronize()
    del keep
    packed = container.pack_codes(codes_h, h)
    chunks = []
    for i in range(K):
        a, b = i * per_chunk, (i + 1) * per_chunk
        t0, t1 = i * ct, min(T, (i + 1) * ct)
        chunks.append(
            Chunk(
                index=first_chunk + i,
                first_token=(first_chunk + i) * ct,
                token_count=t1 - t0,
                scales=scales_h[:, :, t0:t1],
                codes=packed[i],
                lengths=lengths[a:b].reshape(L, 2, h.groups),
                payload=payload[offsets[a] : offsets[b]],
            )
        )
    return chunks


def decode_slab(h: FileHeader, chunks: list[Chunk]):
    """Decode consecutive chunks on the GPU into float32 [L, 2, T_slab, C].

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
