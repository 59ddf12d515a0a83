"""CPU model of the size of LMCache's CacheGen serializer output.

LMCache (https://github.com/LMCache/LMCache) ships a CacheGen serde
(``remote_serde: cachegen``) that runs on CUDA. This module rebuilds its
output on the CPU so that ``.cgen`` files can be compared with it byte for
byte. Sources read (LMCache 0.5.6 sdist and the GitHub tree):

* ``lmcache/storage_backend/serde/cachegen_encoder.py``:
  ``torch_quant_vectorized``, ``encode_function``, ``collect_bytes``;
* ``lmcache/storage_backend/serde/cachegen_basics.py``:
  ``CacheGenGPUBytestream``, ``CacheGenGPUEncoderOutput`` (pickled by
  ``to_bytes``), ``CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK = 256``;
* ``lmcache/v1/storage_backend/naive_serde/cachegen_{basics,encoder,decoder}.py``:
  the v1 serializer, the default bins table, and dequantization;
* ``csrc/cuda/cal_cdf.cu`` (``calculate_cdf``) and ``csrc/cuda/ac_enc.cu``
  (``encode_fast_new``, ``encode_with_accessor_kernel``).

What is reproduced, per LMCache chunk (``chunk_tokens`` tokens, 256 by
default; LMCache serializes each chunk as its own object):

1. Quantization. K and V each become ``[L, n, C]`` with ``C = heads * head_dim``.
   For each (layer, token) row, ``max1 = amax(|x|)`` over the C channels, kept in
   the KV dtype. The code is ``round(x * (MAX / max1) + MAX)`` in float32, with
   ``MAX = bins // 2 - 1`` and ``bins`` a float32 per-layer tensor. Symbols
   fall in ``[0, 2*MAX]`` and are stored as int8.
2. CDF. One int16 CDF per (K/V layer, channel) over the chunk's tokens, with
   ``Lp = max(bins) + 1`` entries (33 by default). Entry ``i`` is
   ``floor((65535 - max_bins) * count(sym < i) / n) + i``. The ``+ i`` gives
   every symbol at least 1/65536, including unused ones. The top symbol
   ``Lp - 2`` ends at 65536.
3. Arithmetic coding. There is one stream per (K/V layer, channel) per block of
   at most 256 tokens. Each stream uses a 32-bit low/high range coder with
   16-bit CDF precision and E3 "pending" bits. It is terminated by one bit
   plus ``pending + 1`` bits and padded to whole bytes. A stream's length is
   ``ceil((renormalisation_shifts + 2) / 8)`` bytes. Stream lengths are
   stored as an int32 ``bytestream_lengths[2L, C]`` tensor per block.
4. Output object. ``pickle.dump(CacheGenGPUEncoderOutput(...))`` (protocol 4) of:
   ``data_chunks`` (a list of ``CacheGenGPUBytestream(bytestream uint8[total],
   bytestream_lengths int32[2L, C], ntokens)``), ``cdf`` int16 ``[2L, C, Lp]``,
   ``max_tensors_key`` and ``max_tensors_value`` (KV dtype, ``[L, n, 1]``),
   and ``num_heads`` and ``head_size``. The tensors are CUDA tensors. Each
   storage is pickled through a legacy ``torch.save``, which costs about
   400 bytes per tensor.

Exactness: the bytestream byte count is EXACT, not an estimate. The coder
below repeats the CUDA kernel's integer arithmetic, and the byte count depends
only on the number of renormalisation shifts. The quantization repeats the
same float32 torch operations, so the symbols are bit-identical. The CDF
bytes, max-tensor bytes, stream-index bytes and pickle overhead are exact
sizes of an object with the same fields, dtypes and shapes. One part is
patched: the pickle is made with CPU tensors, and ``len("cuda:0") -
len("cpu")`` bytes are added per tensor storage for the device tag. A few
more bytes can differ because legacy ``torch.save`` writes each storage's
address as a decimal key. ``bytestream_ideal`` (the sum of -log2 p under
LMCache's own quantized CDF) is also returned, for information only. It is
a lower bound of the payload.

Validation (docs/lmcache_reference.md has the numbers): LMCache 0.5.6's
own Python (``encode_function``, ``to_bytes``, ``do_dequantize``) was run
with its ``csrc/cuda`` kernels built for an H200, on synthetic caches and the
SmolLM2 samples. The symbols, the CDFs and every stream length matched
exactly. The pickled length matched to the byte, or within 8 bytes when the
storage address keys differ in length. The reconstruction error matched to
1e-16. The pickle bytes also depend on the torch version, by about 50 bytes
per chunk (torch 2.13 here, 2.11 on the GPU machine).

Not counted: the transport header that LMCache's remote connectors put in
front of each serialized chunk (``RemoteMetadata`` in
``lmcache/v1/protocol.py``, about 28 bytes). Leaving it out makes LMCache
look slightly smaller, so comparisons against this model are conservative.

LMCache's default ``save_unfull_chunk=False`` means LMCache does NOT store a
trailing partial chunk (fewer than ``chunk_tokens`` tokens). This model
encodes that chunk (the ``save_unfull_chunk=True`` behaviour), so that both
sides cover the same tokens. It also reports ``full_chunks`` (full chunks
only) and ``partial_chunk`` separately.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import pickle
import sys
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

try:  # numba is in the project venv; fall back to pure Python if missing
    from numba import njit, prange

    _HAVE_NUMBA = True
except Exception:  # pragma: no cover
    _HAVE_NUMBA = False

    def njit(*args, **kwargs):  # type: ignore
        def deco(f):
            return f

        if args and callable(args[0]):
            return args[0]
        return deco

    prange = range  # type: ignore


# Constants taken from LMCache (see module docstring for the file paths).
CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK = 256  # cachegen_basics.py
AC_PRECISION = 16  # ac_enc.cu: `precision`
MAX_LP = 48  # ac_enc.cu: CDF length limit of the encoder kernel
MAX_BINS_SUPPORTED = 64  # cal_cdf.cu
OUTPUT_BUFFER_LENGTH_PER_THREAD = 256  # ac_enc.cu: per-stream shared buffer
PICKLE_PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL on the Pythons LMCache supports
_LMCACHE_BASICS_MODULE = "lmcache.storage_backend.serde.cachegen_basics"

BinsArg = Union[None, int, Sequence[int], torch.Tensor, np.ndarray]


# --------------------------------------------------------------------------
# Bins
# --------------------------------------------------------------------------
def default_bins(num_layers: int) -> Tuple[List[int], List[int]]:
    """LMCache's default per-layer bins.

    K uses 32 bins in layers [0, 10) and 16 after. V uses 32 bins in layers
    [0, 2) and 16 after. A model with fewer than 10 layers uses 32 bins
    everywhere. This is the ``CacheGenConfig.from_model_name`` rule, the same
    for the Mistral-7B / Llama-3.1-8B / GLM-4-9B entries and for the
    AutoConfig fallback.
    """
    if num_layers < 10:
        return [32] * num_layers, [32] * num_layers
    k = [32 if i < 10 else 16 for i in range(num_layers)]
    v = [32 if i < 2 else 16 for i in range(num_layers)]
    return k, v


def _as_bins(bins: BinsArg, num_layers: int, default: List[int]) -> List[int]:
    if bins is None:
        out = list(default)
    elif isinstance(bins, (int, np.integer)):
        out = [int(bins)] * num_layers
    else:
        out = [int(b) for b in (bins.tolist() if hasattr(bins, "tolist") else bins)]
    if len(out) != num_layers:
        raise ValueError(f"need {num_layers} per-layer bins, got {len(out)}")
    for b in out:
        if b < 4 or b + 1 > MAX_LP or b >= MAX_BINS_SUPPORTED:
            raise ValueError(f"bins={b} outside what LMCache's kernels accept")
    return out


# --------------------------------------------------------------------------
# Quantization (torch_quant_vectorized) and dequantization (do_dequantize)
# --------------------------------------------------------------------------
def quantize_like_lmcache(
    x: torch.Tensor, bins_f32: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [L, n, C] (KV dtype) the way LMCache does.

    Returns the symbols (uint8, in [0, 2*MAX]) and ``max1`` [L, n, 1] in
    x's dtype. The arithmetic is LMCache's: float32 ``MAX / max1``, then
    ``x * factor + MAX`` in float32, ``round`` (half to even), and int8.
    The GPU does the same IEEE float32 operations, in two separate kernels
    with no FMA.
    """
    MAX = (bins_f32 // 2 - 1)[:, None, None]  # float32 [L,1,1]
    max1 = torch.amax(torch.abs(x), dim=-1, keepdim=True)  # KV dtype
    factor = MAX / max1  # float32 (type promotion)
    xq = torch.round(x * factor + MAX)
    # A row of all zeros gives 0 * inf = NaN. CUDA's float->int8 turns NaN
    # into 0; set that explicitly so the result does not depend on the host.
    xq = torch.nan_to_num(xq, nan=0.0)
    return xq.to(torch.int8).to(torch.uint8), max1


def dequantize_like_lmcache(
    sym: torch.Tensor, bins_f32: torch.Tensor, max1: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """LMCache's ``do_dequantize`` then ``.to(kv_dtype)`` (the v1 deserializer)."""
    C = (bins_f32 // 2 - 1)[:, None, None]
    t = sym.float()
    t = (t - C) / C
    t = t * max1
    return t.to(dtype)


# --------------------------------------------------------------------------
# CDF (cal_cdf.cu: calculate_cdf)
# --------------------------------------------------------------------------
def histogram(sym: np.ndarray, max_bins: int) -> np.ndarray:
    """Per-(layer, channel) symbol counts: sym [L, n, C] -> int64 [L, C, max_bins]."""
    L, n, C = sym.shape
    idx = (np.arange(L)[:, None, None] * C + np.arange(C)[None, None, :]) * max_bins
    idx = (idx + sym.astype(np.int64)).ravel()
    return np.bincount(idx, minlength=L * C * max_bins).reshape(L, C, max_bins)


def cdf_like_lmcache(counts: np.ndarray, max_bins: int) -> np.ndarray:
    """Integer CDF as ``calculate_cdf`` computes it, as uint16 [L, C, max_bins+1].

    ``cdf[k] = floor((0xFFFF - max_bins) * count(sym < k) / n) + k``. LMCache
    stores the same bit pattern as int16.
    """
    L, C, _ = counts.shape
    cum = np.zeros((L, C, max_bins + 1), dtype=np.int64)
    cum[:, :, 1:] = np.cumsum(counts, axis=2)
    total = cum[:, :, -1:]
    norm = ((0xFFFF - max_bins) * cum) // np.maximum(total, 1)
    cdf = norm + np.arange(max_bins + 1, dtype=np.int64)
    cdf = np.where(total > 0, cdf, np.arange(max_bins + 1, dtype=np.int64))
    return (cdf & 0xFFFF).astype(np.uint16)


def symbol_freqs(cdf: np.ndarray) -> np.ndarray:
    """Per-symbol frequency (out of 2^16) that the encoder uses, [L, C, Lp-1]."""
    c = cdf.astype(np.int64)
    hi = np.concatenate([c[:, :, 1:-1], np.full(c.shape[:2] + (1,), 1 << 16)], axis=2)
    return hi - c[:, :, :-1]


# --------------------------------------------------------------------------
# Arithmetic coder (ac_enc.cu: encode_with_accessor_kernel), length only
# --------------------------------------------------------------------------
@njit(cache=False, parallel=True)
def _ac_stream_lengths(cdf, sym, out_len):  # pragma: no cover - numba
    """Bytes that LMCache's range coder emits for each (layer, channel) stream.

    cdf: int64 [S, C, Lp] (uint16 values); sym: uint8 [S, n, C];
    out_len: int64 [S, C] (written). This follows the kernel's 32-bit integer
    arithmetic. Output bits = renormalisation shifts (each E1/E2 shift
    emits a bit, each E3 shift a pending bit that is emitted later) + 2
    termination bits, padded up to a whole byte.
    """
    S, n, C = sym.shape
    lp = cdf.shape[2]
    max_symbol = lp - 2
    M32 = 0xFFFFFFFF
    for job in prange(S * C):
        l = job // C
        c = job % C
        low = 0
        high = M32
        shifts = 0
        for i in range(n):
            s = sym[l, i, c]
            c_low = cdf[l, c, s]
            if s == max_symbol:
                c_high = 0x10000
            else:
                c_high = cdf[l, c, s + 1]
            span = high - low + 1
            high = (low - 1 + ((span * c_high) >> 16)) & M32
            low = (low + ((span * c_low) >> 16)) & M32
            while True:
                if high < 0x80000000:
                    low = (low << 1) & M32
                    high = ((high << 1) | 1) & M32
                    shifts += 1
                elif low >= 0x80000000:
                    low = (low << 1) & M32
                    high = ((high << 1) | 1) & M32
                    shifts += 1
                elif low >= 0x40000000 and high < 0xC0000000:
                    low = (low << 1) & 0x7FFFFFFF
                    high = ((high << 1) | 0x80000001) & M32
                    shifts += 1
                else:
                    break
        out_len[l, c] = (shifts + 2 + 7) // 8


def ac_stream_lengths(cdf_u16: np.ndarray, sym_u8: np.ndarray) -> np.ndarray:
    """Exact LMCache stream lengths in bytes, int64 [S, C]."""
    cdf = np.ascontiguousarray(cdf_u16.astype(np.int64))
    sym = np.ascontiguousarray(sym_u8.astype(np.uint8))
    out = np.zeros((sym.shape[0], sym.shape[2]), dtype=np.int64)
    _ac_stream_lengths(cdf, sym, out)
    return out


# --------------------------------------------------------------------------
# Pickle overhead of CacheGenGPUEncoderOutput
# --------------------------------------------------------------------------
@dataclasses.dataclass
class CacheGenGPUBytestream:  # same fields and order as LMCache's
    bytestream: torch.Tensor
    bytestream_lengths: torch.Tensor
    ntokens: int


@dataclasses.dataclass
class CacheGenGPUEncoderOutput:  # same fields and order as LMCache's
    data_chunks: List[CacheGenGPUBytestream]
    cdf: torch.Tensor
    max_tensors_key: torch.Tensor
    max_tensors_value: torch.Tensor
    num_heads: int
    head_size: int


@contextlib.contextmanager
def _lmcache_class_names():
    """Pickle our replica classes under LMCache's module and class names.

    Pickle writes the module path and class name, so they must match
    LMCache's for the sizes to match. Stub modules are registered only for
    the duration of the pickling, and only if no real ``lmcache`` is loaded.
    """
    if "lmcache" in sys.modules:  # real LMCache present: use its classes
        mod = sys.modules.get(_LMCACHE_BASICS_MODULE)
        if mod is None:
            import importlib

            mod = importlib.import_module(_LMCACHE_BASICS_MODULE)
        yield mod.CacheGenGPUBytestream, mod.CacheGenGPUEncoderOutput
        return
    names = ["lmcache", "lmcache.storage_backend", "lmcache.storage_backend.serde",
             _LMCACHE_BASICS_MODULE]
    saved = {}
    for k in (CacheGenGPUBytestream, CacheGenGPUEncoderOutput):
        saved[k] = (k.__module__, k.__qualname__)
    mods = {name: types.ModuleType(name) for name in names}
    for parent, child in zip(names, names[1:]):
        setattr(mods[parent], child.rsplit(".", 1)[1], mods[child])
    try:
        for k in (CacheGenGPUBytestream, CacheGenGPUEncoderOutput):
            k.__module__ = _LMCACHE_BASICS_MODULE
            setattr(mods[_LMCACHE_BASICS_MODULE], k.__name__, k)
        sys.modules.update(mods)
        yield CacheGenGPUBytestream, CacheGenGPUEncoderOutput
    finally:
        for name in names:
            if sys.modules.get(name) is mods[name]:
                del sys.modules[name]
        for k, (m, q) in saved.items():
            k.__module__, k.__qualname__ = m, q


def pickled_output_size(
    bytestream_sizes: Sequence[int],
    block_ntokens: Sequence[int],
    num_layers: int,
    nchannels: int,
    lp: int,
    ntokens: int,
    num_heads: int,
    head_size: int,
    max_dtype: torch.dtype,
    device_tag: str = "cuda:0",
) -> Tuple[int, int]:
    """Pickle a stand-in CacheGenGPUEncoderOutput and return (len, raw tensor bytes).

    The stand-in has the same fields, dtypes and shapes as LMCache's; the
    tensor contents do not change the size. CPU tensors are pickled, and
    ``len(device_tag) - len("cpu")`` bytes are added per storage for the CUDA
    location tag that legacy ``torch.save`` writes.
    """
    with _lmcache_class_names() as (BS, EO):
        chunks = [
            BS(
                bytestream=torch.zeros(int(nb), dtype=torch.uint8),
                bytestream_lengths=torch.zeros((2 * num_layers, nchannels), dtype=torch.int32),
                ntokens=int(nt),
            )
            for nb, nt in zip(bytestream_sizes, block_ntokens)
        ]
        out = EO(
            chunks,
            torch.zeros((2 * num_layers, nchannels, lp), dtype=torch.int16),
            max_tensors_key=torch.zeros((num_layers, ntokens, 1), dtype=max_dtype),
            max_tensors_value=torch.zeros((num_layers, ntokens, 1), dtype=max_dtype),
            num_heads=int(num_heads),
            head_size=int(head_size),
        )
        with io.BytesIO() as f:
            pickle.dump(out, f, protocol=PICKLE_PROTOCOL)
            n = len(f.getvalue())
    n_storages = 3 + 2 * len(chunks)
    n += (len(device_tag) - len("cpu")) * n_storages
    itemsize = torch.empty((), dtype=max_dtype).element_size()
    raw = (
        sum(int(b) for b in bytestream_sizes)
        + len(chunks) * 2 * num_layers * nchannels * 4
        + 2 * num_layers * nchannels * lp * 2
        + 2 * num_layers * ntokens * itemsize
    )
    return n, raw


# --------------------------------------------------------------------------
# Main entry point
# --------------------------------------------------------------------------
_KEYS = ("bytestream", "cdf", "max_tensors", "stream_index", "pickle_overhead", "total")


def _encode_chunk(
    k: torch.Tensor,
    v: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    num_heads: int,
    head_size: int,
    device_tag: str,
) -> Dict[str, Any]:
    """Model LMCache's ``encode_function`` + ``to_bytes`` for one chunk.

    k, v: [L, n, C] in the KV dtype.
    """
    L, n, C = k.shape
    sym_k, max_k = quantize_like_lmcache(k, kb)
    sym_v, max_v = quantize_like_lmcache(v, vb)
    mb_k, mb_v = int(kb.max()), int(vb.max())
    sk, sv = sym_k.numpy(), sym_v.numpy()
    cnt_k, cnt_v = histogram(sk, mb_k), histogram(sv, mb_v)
    cdf_k, cdf_v = cdf_like_lmcache(cnt_k, mb_k), cdf_like_lmcache(cnt_v, mb_v)
    if cdf_k.shape[-1] != cdf_v.shape[-1]:
        # LMCache would fail at torch.cat([cdf_key, cdf_value]); model both anyway.
        lp = max(cdf_k.shape[-1], cdf_v.shape[-1])
    else:
        lp = cdf_k.shape[-1]

    # Encoded per block of <= 256 tokens, with the same per-chunk CDF.
    lens_blocks, block_nt = [], []
    for s in range(0, n, CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK):
        e = min(s + CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK, n)
        lk = ac_stream_lengths(cdf_k, sk[:, s:e, :])
        lv = ac_stream_lengths(cdf_v, sv[:, s:e, :])
        lens_blocks.append(np.concatenate([lk, lv], axis=0))
        block_nt.append(e - s)
    bs_sizes = [int(x.sum()) for x in lens_blocks]
    max_stream = max(int(x.max()) for x in lens_blocks)
    overflow = sum(int((x > OUTPUT_BUFFER_LENGTH_PER_THREAD).sum()) for x in lens_blocks)

    ideal_bits = 0.0
    for cnt, cdf in ((cnt_k, cdf_k), (cnt_v, cdf_v)):
        f = symbol_freqs(cdf)[:, :, : cnt.shape[2]]
        with np.errstate(divide="ignore"):
            ideal_bits += float((cnt * (AC_PRECISION - np.log2(f))).sum())

    itemsize = max_k.element_size()
    pick, raw = pickled_output_size(
        bs_sizes, block_nt, L, C, lp, n, num_heads, head_size, max_k.dtype, device_tag
    )
    sizes = {
        "bytestream": sum(bs_sizes),
        "cdf": 2 * L * C * lp * 2,
        "max_tensors": 2 * L * n * itemsize,
        "stream_index": len(bs_sizes) * 2 * L * C * 4,
    }
    sizes["pickle_overhead"] = pick - raw
    sizes["total"] = pick
    assert raw == sum(sizes[x] for x in ("bytestream", "cdf", "max_tensors", "stream_index"))

    # Reconstruction as LMCache's v1 deserializer produces it.
    err = {}
    for name, x, sym, b, mx in (("k", k, sym_k, kb, max_k), ("v", v, sym_v, vb, max_v)):
        xh = dequantize_like_lmcache(sym, b, mx, x.dtype).double()
        xd = x.double()
        err[name] = (float(((xd - xh) ** 2).sum()), float((xd ** 2).sum()))
    return {
        "ntokens": n,
        "sizes": sizes,
        "bytestream_ideal": ideal_bits / 8.0,
        "max_stream_bytes": max_stream,
        "overflow_streams": overflow,
        "streams": len(bs_sizes) * 2 * L * C,
        "err": err,
    }


def _summarize(parts: List[Dict[str, Any]], L: int, H: int, D: int, dtype) -> Dict[str, Any]:
    tokens = sum(p["ntokens"] for p in parts)
    out: Dict[str, Any] = {k: sum(p["sizes"][k] for p in parts) for k in _KEYS}
    values = L * 2 * tokens * H * D
    out["bytestream_ideal"] = sum(p["bytestream_ideal"] for p in parts)
    out["num_tokens"] = tokens
    out["num_chunks"] = len(parts)
    out["num_values"] = values
    out["bits_per_value"] = 8.0 * out["total"] / values if values else float("nan")
    out["payload_bits_per_value"] = 8.0 * out["bytestream"] / values if values else float("nan")
    out["ratio_vs_bf16"] = (2.0 * values) / out["total"] if out["total"] else float("nan")
    se_k = sum(p["err"]["k"][0] for p in parts)
    ss_k = sum(p["err"]["k"][1] for p in parts)
    se_v = sum(p["err"]["v"][0] for p in parts)
    ss_v = sum(p["err"]["v"][1] for p in parts)
    out["rel_mse_k"] = se_k / ss_k if ss_k else float("nan")
    out["rel_mse_v"] = se_v / ss_v if ss_v else float("nan")
    out["rel_mse"] = (se_k + se_v) / (ss_k + ss_v) if (ss_k + ss_v) else float("nan")
    return out


def lmcache_cachegen_size(
    kv: torch.Tensor,
    chunk_tokens: int = 256,
    key_bins: BinsArg = None,
    value_bins: BinsArg = None,
    device_tag: str = "cuda:0",
) -> Dict[str, Any]:
    """Size of LMCache CacheGen's serialized output for ``kv``, byte by byte.

    Args:
        kv: [num_layers, 2, num_tokens, num_kv_heads, head_dim], any float
            dtype. LMCache keeps the max tensors in this dtype; bf16 and fp16
            models give 2 bytes per (layer, token).
        chunk_tokens: LMCache ``chunk_size`` (default 256). Each chunk is
            serialized on its own. A trailing partial chunk is included
            (``save_unfull_chunk=True``) and also reported on its own.
        key_bins, value_bins: per-layer bins (int for all layers, or a
            sequence). The default is LMCache's rule (see ``default_bins``).
        device_tag: storage location written by legacy ``torch.save`` for
            LMCache's CUDA tensors (affects a few bytes per tensor).

    Returns a dict. Byte counts: ``bytestream`` (arithmetic-coded payload,
    exact), ``cdf``, ``max_tensors``, ``stream_index`` (the int32
    ``bytestream_lengths``), ``pickle_overhead``, and ``total`` (the length of
    the pickled objects, summed over chunks). Other entries:
    ``bits_per_value`` and ``ratio_vs_bf16`` (over total);
    ``bytestream_ideal`` (sum of -log2 p under LMCache's quantized CDFs, a
    lower bound, for information); ``rel_mse_k``, ``rel_mse_v`` and
    ``rel_mse`` (||x - x_hat||^2 / ||x||^2 of LMCache's reconstruction);
    ``full_chunks`` and ``partial_chunk`` (the same summary restricted to
    those chunks); ``chunks`` (a per-chunk breakdown); and the diagnostics
    ``max_stream_bytes`` and ``overflow_streams`` (streams over the kernel's
    256-byte per-thread buffer, where LMCache would corrupt data; expected
    0).
    """
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    if not kv.is_floating_point():
        raise ValueError("kv must be a floating point tensor")
    kv = kv.detach().cpu()
    L, _, T, H, D = kv.shape
    C = H * D
    dk, dv = default_bins(L)
    kb_list = _as_bins(key_bins, L, dk)
    vb_list = _as_bins(value_bins, L, dv)
    # LMCache builds these as float32 tensors (torch.zeros(nlayers) filled in).
    kb = torch.tensor(kb_list, dtype=torch.float32)
    vb = torch.tensor(vb_list, dtype=torch.float32)

    parts = []
    for s in range(0, T, chunk_tokens):
        e = min(s + chunk_tokens, T)
        chunk = kv[:, :, s:e].reshape(L, 2, e - s, C)
        k = chunk[:, 0].contiguous()
        v = chunk[:, 1].contiguous()
        parts.append(_encode_chunk(k, v, kb, vb, H, D, device_tag))

    out = _summarize(parts, L, H, D, kv.dtype)
    full = [p for p in parts if p["ntokens"] == chunk_tokens]
    partial = [p for p in parts if p["ntokens"] != chunk_tokens]
    out["full_chunks"] = _summarize(full, L, H, D, kv.dtype) if full else None
    out["partial_chunk"] = _summarize(partial, L, H, D, kv.dtype) if partial else None
    out["chunk_tokens"] = chunk_tokens
    out["key_bins"] = kb_list
    out["value_bins"] = vb_list
    out["shape"] = list(kv.shape)
    out["dtype"] = str(kv.dtype).replace("torch.", "")
    out["max_stream_bytes"] = max(p["max_stream_bytes"] for p in parts) if parts else 0
    out["overflow_streams"] = sum(p["overflow_streams"] for p in parts)
    out["chunks"] = [
        dict(p["sizes"], ntokens=p["ntokens"], bytestream_ideal=p["bytestream_ideal"])
        for p in parts
    ]
    out["bytestream_exact"] = True
    return out


# --------------------------------------------------------------------------
# Loading and CLI
# --------------------------------------------------------------------------
def load_kv_safetensors(path: str) -> torch.Tensor:
    """Load a KV cache as [L, 2, T, H, D].

    Two layouts are accepted: (a) a single tensor [L, 2, T, H, D], or (b)
    ``layers.{i}.key`` / ``layers.{i}.value`` tensors, each [H, T, D] or
    [1, H, T, D].
    """
    from safetensors.torch import load_file

    tensors = load_file(path)
    layer_keys = [k for k in tensors if k.startswith("layers.") and k.endswith(".key")]
    if layer_keys:
        idx = sorted(int(k.split(".")[1]) for k in layer_keys)
        if idx != list(range(len(idx))):
            raise ValueError(f"layer indices are not 0..N-1: {idx[:10]}...")
        layers = []
        for i in idx:
            pair = []
            for name in ("key", "value"):
                t = tensors[f"layers.{i}.{name}"]
                if t.dim() == 4:
                    if t.shape[0] != 1:
                        raise ValueError(f"layers.{i}.{name}: batch size must be 1")
                    t = t[0]
                if t.dim() != 3:
                    raise ValueError(f"layers.{i}.{name} must be [H,T,D] or [1,H,T,D]")
                pair.append(t.permute(1, 0, 2))  # -> [T, H, D]
            layers.append(torch.stack(pair))
        return torch.stack(layers).contiguous()
    five = [t for t in tensors.values() if t.dim() == 5 and t.shape[1] == 2]
    if len(five) != 1:
        raise ValueError(
            "expected one [L,2,T,H,D] tensor or layers.{i}.key/value tensors; "
            f"found {[(k, tuple(t.shape)) for k, t in tensors.items()][:8]}"
        )
    return five[0].contiguous()


def format_report(r: Dict[str, Any]) -> str:
    lines = [
        f"LMCache CacheGen model: shape={r['shape']} dtype={r['dtype']} "
        f"chunk_tokens={r['chunk_tokens']} chunks={r['num_chunks']}",
        f"  key_bins={_runs(r['key_bins'])} value_bins={_runs(r['value_bins'])}",
    ]
    raw = 2 * r["num_values"]

    def block(title, s):
        lines.append(f"  {title}: {s['num_tokens']} tokens")
        for k in _KEYS:
            lines.append(f"    {k:<16}{s[k]:>12,d} B  {100.0 * s[k] / s['total']:6.2f}%")
        lines.append(
            f"    bits/value {s['bits_per_value']:.4f} (payload only "
            f"{s['payload_bits_per_value']:.4f}), ratio vs bf16 {s['ratio_vs_bf16']:.3f}x"
        )
        lines.append(
            f"    ideal payload (lower bound) {s['bytestream_ideal']:,.0f} B; "
            f"rel MSE K {s['rel_mse_k']:.4e} V {s['rel_mse_v']:.4e} all {s['rel_mse']:.4e}"
        )

    block("all chunks", r)
    if r["partial_chunk"] is not None and r["full_chunks"] is not None:
        block("full chunks only (LMCache default save_unfull_chunk=False)", r["full_chunks"])
        block("trailing partial chunk", r["partial_chunk"])
    lines.append(
        f"  bf16 raw size {raw:,d} B; bytestream exact; max stream {r['max_stream_bytes']} B, "
        f"overflowing streams {r['overflow_streams']}"
    )
    return "\n".join(lines)


def _runs(b: List[int]) -> str:
    out, i = [], 0
    while i < len(b):
        j = i
        while j + 1 < len(b) and b[j + 1] == b[i]:
            j += 1
        out.append(f"[{i},{j + 1}):{b[i]}")
        i = j + 1
    return " ".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="KV cache .safetensors")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--key-bins", type=int, default=None, help="same bins for all K layers")
    ap.add_argument("--value-bins", type=int, default=None, help="same bins for all V layers")
    ap.add_argument("--json", action="store_true", help="print JSON")
    a = ap.parse_args(argv)
    kv = load_kv_safetensors(a.file)
    r = lmcache_cachegen_size(kv, a.chunk_tokens, a.key_bins, a.value_bins)
    try:
        print(json.dumps(r, indent=1) if a.json else format_report(r))
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
