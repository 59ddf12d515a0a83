"""Format version 2 on a CUDA GPU: methods/transform.py's encode and decode through
``kernels/cuda_transform.py``, with the same bytes as the CPU.

The bulk work (rotation, quantization, level statistics, symbols, tables, range
coding, decoding, dequantization) runs on the device; the few per-table decisions
(which mode and range each table gets, which channels share a table) are made on
the host from small arrays copied back, by the same code the CPU path uses, so
both devices decide alike.  Under numba's CUDA simulator the same code runs on
numpy arrays (that is how ``make test`` checks CPU and GPU give the same bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from ..methods.calibration import Calibration
from ..methods.config import TransformConfig
from ..format.container import Chunk, FileHeader
from ..kernels import cpu_transform as k2
from ..kernels.coding_params import max_stream_bytes
from ..kernels.tables import SYMBOL_COST
from ..storage.kvio import KVCache
from ..format.params import ITEMSIZE, METHOD_LOSSLESS, METHOD_TRANSFORM, Params, bf16_values
from ..format.params import check_level_range


def _k():
    from ..kernels import cuda_transform

    return cuda_transform


def _real_gpu() -> bool:
    from .lmcache_device import torch_cuda_ok

    return torch_cuda_ok()


class _Dev:
    """Device arrays: numba device arrays on a real GPU, numpy arrays under the simulator
    (whose kernels take host arrays)."""

    def __init__(self) -> None:
        from numba import cuda

        self.cuda = cuda
        self.real = _real_gpu()

    def put(self, a: np.ndarray):
        return self.cuda.to_device(np.ascontiguousarray(a)) if self.real else np.ascontiguousarray(a)

    def empty(self, shape, dtype):
        return self.cuda.device_array(shape, dtype) if self.real else np.empty(shape, dtype)

    def get(self, a) -> np.ndarray:
        return a.copy_to_host() if self.real else a

    def tensor_in(self, t: torch.Tensor):
        """A device view of a tensor (copied to the GPU first if it lives on the host)."""
        if self.real:
            t = t.contiguous().cuda()
            return self.cuda.as_cuda_array(t), t
        return t.contiguous().cpu().numpy(), t


def _tables(dev: _Dev, q, h: FileHeader, modes, lo, alphabet):
    """Symbols and tables on the device, sharing decided on the host; returns
    (sym, cum, codes, shared, modes, lo, alphabet) with the host arrays expanded."""
    k = _k()
    from ..format.params import expand_shared

    L, C, ct = h.num_layers, h.num_channels, h.chunk_tokens
    width = int(alphabet.max(initial=1))
    sym = dev.empty(q.shape, np.uint8)
    counts = dev.empty((L, 2, C, width), np.int64)
    k.levels_to_symbols(q, dev.put(modes), dev.put(lo), ct, sym, counts)
    codes = dev.empty((L, 2, C, width), np.uint8)
    cum = dev.empty((L, 2, C, width + 1), np.int32)
    k.build_tables(counts, dev.put(alphabet), codes, cum)
    counts_h, codes_h, cum_h = dev.get(counts), dev.get(codes), dev.get(cum)
    shared = np.zeros((L, 2, C), np.bool_)
    k2.share_tables(counts_h, lo, alphabet, modes, cum_h, SYMBOL_COST, shared, np.empty((L, 2, C), np.int64))
    if shared.any():
        modes, lo, alphabet, codes_h, cum_h = expand_shared(shared, modes, lo, alphabet, codes_h, cum_h)
        k.levels_to_symbols(q, dev.put(modes), dev.put(lo), ct, sym, counts)
        cum = dev.put(cum_h)
    return sym, cum, codes_h, shared, modes, lo, alphabet


def _code(dev: _Dev, h: FileHeader, sym, cum):
    """Range-code every stream on the device; returns (lengths, payload, offsets) on the host."""
    from ..kernels import cuda as cuda_kernels

    k = _k()
    n = h.num_chunks * h.streams_per_chunk
    lengths = dev.empty(n, np.int32)
    slots = dev.empty((n, max_stream_bytes(h.chunk_tokens * h.group)), np.uint8)
    k.encode_table_streams(sym, cum, h.chunk_tokens, h.group, slots, lengths)
    lengths_h = dev.get(lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths_h, out=offsets[1:])
    payload = dev.empty(max(int(offsets[-1]), 1), np.uint8)
    cuda_kernels.pack_streams(slots, lengths, dev.put(offsets), payload)
    return lengths_h, dev.get(payload)[: int(offsets[-1])], offsets


def encode_v2_gpu(cache: KVCache, cfg: TransformConfig, chunk_tokens: int,
                  calibration: Calibration | None = None) -> "EncodedV2":
    from ..methods.transform import (EncodedV2, _chunks, encoder_rotation, make_header_v2, plane_sensitivity,
                                  quantize_levels, sink_words, step_params, tables_from_stats)

    k = _k()
    dev = _Dev()
    L, T, C = cache.num_layers, cache.num_tokens, cache.num_channels
    if cfg.method == "lossless":
        words_t = cache.data.contiguous().view(torch.int16 if cache.data.element_size() == 2 else torch.int32)
        words, _keep = dev.tensor_in(words_t)
        nraw = ITEMSIZE[cache.dtype_name] - 1
        q = dev.empty((L, 2, T, C), np.int16)
        raw = dev.empty((L, 2, T, C, nraw), np.uint8)
        k.split_words(words, nraw, q, raw)
        stats = dev.empty((L, 2, C, 6), np.int64)
        k.level_stats(q, chunk_tokens, stats)
        modes, lo, alphabet = tables_from_stats(dev.get(stats), False, T)
        params = Params(METHOD_LOSSLESS, modes, lo, alphabet, np.zeros((L, 2, C, 1), np.uint8))
        h = make_header_v2(cache, cfg, chunk_tokens, params, 0)
        sym, cum, codes, shared, modes, lo, alphabet = _tables(dev, q, h, modes, lo, alphabet)
        lengths, payload, offsets = _code(dev, h, sym, cum)
        params.codes, params.shared, params.modes, params.lo, params.alphabet = codes, shared, modes, lo, alphabet
        return EncodedV2(h, _chunks(h, lengths, payload, offsets, dev.get(raw)))

    x, _keep = dev.tensor_in(cache.data.float())
    sink = min(cfg.sink_tokens, T)
    rot_h, digest = encoder_rotation(calibration, L, C)
    rot = dev.put(rot_h) if rot_h.size else rot_h
    sums = dev.empty((L, 2, C), np.float64)
    sumsq = dev.empty((L, 2, C), np.float64)
    k.transform_stats(x, rot, sink, sums, sumsq)
    offsets_bits, m, steps_bits, steps = step_params(dev.get(sums), dev.get(sumsq), T - sink, cfg.steps_table(L),
                                                     plane_sensitivity(cfg, calibration))
    q, ref_d, R, bits = quantize_levels(k, dev.empty, x, rot, sink, dev.put(m.astype(np.float32)), dev.put(steps),
                                        cfg, (L, T, C))
    ref = dev.get(ref_d) if ref_d is not None else None
    stats = dev.empty((L, 2, C, 6), np.int64)
    k.level_stats(q, chunk_tokens, stats)
    modes, lo, alphabet = tables_from_stats(dev.get(stats), cfg.token_delta, T)
    params = Params(METHOD_TRANSFORM, modes, lo, alphabet, np.zeros((L, 2, C, 1), np.uint8), digest,
                    steps_bits, offsets_bits, sink_words(cache, sink), refine_tokens=R, refine_bits=bits)
    h = make_header_v2(cache, cfg, chunk_tokens, params, sink)
    sym, cum, codes, shared, modes, lo, alphabet = _tables(dev, q, h, modes, lo, alphabet)
    lengths, payload, offsets = _code(dev, h, sym, cum)
    params.codes, params.shared, params.modes, params.lo, params.alphabet = codes, shared, modes, lo, alphabet
    return EncodedV2(h, _chunks(h, lengths, payload, offsets, None, ref))


def decode_v2_gpu(h: FileHeader, chunks: list[Chunk], dtype: torch.dtype,
                  calibration: Calibration | None = None) -> torch.Tensor:
    """Decode on the device; returns a CUDA tensor on a real GPU (a CPU one under the simulator)."""
    from ..methods.transform import check_calibration, gather_raw, gather_refinement, gather_streams

    k = _k()
    dev = _Dev()
    p = h.params
    L, T, C = h.num_layers, h.num_tokens, h.num_channels
    rot_h = check_calibration(h, calibration)
    width = p.width
    cum = dev.empty((L, 2, C, width + 1), np.int32)
    k.cum_from_table_codes(dev.put(p.codes), dev.put(p.alphabet), cum)
    lengths, offsets, payload = gather_streams(chunks)
    sym = dev.empty((L, 2, T, C), np.uint8)
    k.decode_table_streams(dev.put(payload if payload.size else np.zeros(1, np.uint8)), dev.put(offsets),
                           dev.put(lengths), cum, width, h.chunk_tokens, h.group, sym)
    q = dev.empty((L, 2, T, C), np.int16)
    k.symbols_to_levels(sym, dev.put(p.modes), dev.put(p.lo), h.chunk_tokens, q)
    if q.size:  # a host-side check of two numbers; every stored level is exact (deltas are int8)
        qt = torch.as_tensor(q)
        check_level_range(int(qt.min()), int(qt.max()), h.method)
    device = "cuda" if dev.real else "cpu"
    if h.method == METHOD_LOSSLESS:
        nraw = h.raw_bytes_per_value
        raw = gather_raw(h, chunks)
        words = dev.empty((L, 2, T, C), np.int16 if nraw == 1 else np.int32)
        k.join_words(q, dev.put(raw), nraw, words)
        return torch.as_tensor(words, device=device).view(dtype)
    out = dev.empty((L, 2, T, C), np.float32)
    rot = dev.put(rot_h) if rot_h.size else rot_h
    ref = gather_refinement(h, chunks)
    k.transform_dequantize(q, rot, h.sink_tokens, dev.put(bf16_values(p.offsets).astype(np.float32)),
                           dev.put(bf16_values(p.steps)), h.refine_start, p.refine_bits,
                           dev.put(ref if ref.size else np.zeros((1, 1, 1, 1), np.uint8)), out)
    data = torch.as_tensor(out, device=device).to(dtype)
    S = h.sink_tokens
    if S:
        sink = torch.from_numpy(np.ascontiguousarray(p.sink).reshape(-1)).view(dtype).reshape(L, 2, S, C)
        data[:, :, :S] = sink.to(device)
    return data
