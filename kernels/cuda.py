"""CUDA kernels (numba-cuda): the same names, arguments and bytes as ``cpu.py``.

Each public function is a host wrapper: it takes device arrays (numba device
arrays, or anything with ``__cuda_array_interface__`` such as torch CUDA
tensors, wrapped without a host sync), picks the launch configuration and
launches on ``stream`` without synchronising, so a caller can queue a whole
slab of work and wait once.  The arithmetic is the shared ``register_jitable``
device functions of quantize.py, cdf.py and range_coder.py, compiled for the
GPU, which is why the bytes match the CPU's.

Who does what:
  quantize          one block of 128 threads per (layer, K/V, token) row: a shared-
                    memory abs-max reduction, then each thread quantizes every 128th channel
  dequantize        one thread per value
  histogram         one thread per (chunk, layer, K/V, channel); a warp reads 32
                    neighbouring channels of a token: coalesced
  build_cdf,
  cum_from_codes    one thread per (chunk, layer, K/V, channel)
  histogram_cdf     both at once, counts in shared memory (GPU fast path)
  encode_streams,
  decode_streams    one thread per stream (chunk, layer, K/V, channel group); neighbouring
                    threads own neighbouring channel groups, so symbol reads coalesce; each
                    thread copies its CDF rows to shared memory first
  pack_streams      one thread per stream, copying its bytes
"""

from __future__ import annotations

import numpy as np

# numba-cuda 0.30.4 still calls np.row_stack, which numpy 2.5 removed; it is an
# alias of np.vstack, so restoring it changes nothing else.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402

from .cdf import codes_to_cum, counts_to_codes  # noqa: E402
from .quantize import (  # noqa: E402
    bf16_bits_nearest,
    bf16_bits_round_up,
    float_from_bits16,
    dequant_step,
    dequantize_value,
    quant_inverse_step,
    quantize_value,
)
from .range_coder import decode_stream, encode_stream  # noqa: E402

ROW_THREADS = 128  # threads per quantization row: a power of two for the tree reduction
BLOCK = 128


def is_available() -> bool:
    try:
        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - no driver, no toolkit: simply not available
        return False


def as_device(array):
    """A numba device-array view of a device buffer, without a host sync."""
    if hasattr(array, "__cuda_array_interface__") and not hasattr(array, "copy_to_host"):
        return cuda.as_cuda_array(array, sync=False)
    return array


def _grid(n: int, block: int = BLOCK) -> int:
    return max(1, (n + block - 1) // block)


# ---------------------------------------------------------------- quantization


@cuda.jit(device=True)
def _row_coords(row, T):
    """(layer, K/V, token) of quantization row ``row`` of an [L, 2, T, C] array."""
    return row // (2 * T), (row // T) % 2, row % T


@cuda.jit(device=True)
def _channel_coords(i, L, C):
    """(chunk, layer, K/V, channel) of the i-th CDF row of a [K, L, 2, C, ...] array."""
    return i // (2 * C * L), (i // (2 * C)) % L, (i // C) % 2, i % C


@cuda.jit(device=True)
def _row_scale_bits(top, bits_shared, tid, local):
    """Block-wide maximum of the threads' ``local`` abs-max values (a tree reduction in
    shared memory), as the bfloat16 scale bits every thread of the row gets back."""
    top[tid] = local
    cuda.syncthreads()
    width = ROW_THREADS // 2
    while width > 0:
        if tid < width and top[tid + width] > top[tid]:
            top[tid] = top[tid + width]
        cuda.syncthreads()
        width //= 2
    if tid == 0:
        bits_shared[0] = bf16_bits_round_up(top[0])
    cuda.syncthreads()
    return bits_shared[0]


@cuda.jit(device=True)
def _load(x, l, kv, t, c, fmt):
    """One cache value as float32: x is float32 (fmt 0) or bfloat16 / float16 words (fmt 1 / 2)."""
    if fmt == 0:
        return np.float32(x[l, kv, t, c])
    return float_from_bits16(x[l, kv, t, c], fmt)


@cuda.jit
def _quantize_kernel(x, fmt, maxq, scales, symbols):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    L, _, T, C = x.shape
    l, kv, t = _row_coords(row, T)
    top = cuda.shared.array(ROW_THREADS, np.float32)
    bits_shared = cuda.shared.array(1, np.int64)
    local = np.float32(0.0)
    for c in range(tid, C, ROW_THREADS):
        a = abs(_load(x, l, kv, t, c, fmt))
        if a > local:
            local = a
    bits = _row_scale_bits(top, bits_shared, tid, local)
    if tid == 0:
        scales[l, kv, t] = bits
    m = np.int64(maxq[l, kv])
    inv = quant_inverse_step(bits, m)
    for c in range(tid, C, ROW_THREADS):
        symbols[l, kv, t, c] = quantize_value(_load(x, l, kv, t, c, fmt), inv, m)


def quantize(x, maxq, scales, symbols, stream=0):
    L, _, T, C = x.shape
    if L * 2 * T == 0:
        return
    _quantize_kernel[L * 2 * T, ROW_THREADS, stream](
        as_device(x), np.int64(0), as_device(maxq), as_device(scales), as_device(symbols)
    )


@cuda.jit
def _dequantize_kernel(symbols, scales, maxq, out):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    L, _, T, C = symbols.shape
    l, kv, t = _row_coords(row, T)
    m = np.int64(maxq[l, kv])
    step = dequant_step(scales[l, kv, t], m)  # every thread derives it: cheaper than a barrier
    for c in range(tid, C, ROW_THREADS):
        out[l, kv, t, c] = dequantize_value(symbols[l, kv, t, c], step, m)


def dequantize(symbols, scales, maxq, out, stream=0):
    L, _, T, C = symbols.shape
    if L * 2 * T * C == 0:
        return
    _dequantize_kernel[L * 2 * T, ROW_THREADS, stream](as_device(symbols), as_device(scales), as_device(maxq), as_device(out))


def quantize_bits(xbits, fmt, maxq, scales, symbols, stream=0):
    """quantize() for 16-bit caches given as their raw words (int16 / uint16 views):
    fmt 1 = bfloat16, 2 = float16.  Same symbols and scales as quantize() on the float32 copy."""
    L, _, T, C = xbits.shape
    if L * 2 * T == 0:
        return
    _quantize_kernel[L * 2 * T, ROW_THREADS, stream](
        as_device(xbits), np.int64(fmt), as_device(maxq), as_device(scales), as_device(symbols)
    )


@cuda.jit
def _dequantize_bf16_kernel(symbols, scales, maxq, out_bits):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    L, _, T, C = symbols.shape
    l, kv, t = _row_coords(row, T)
    m = np.int64(maxq[l, kv])
    step = dequant_step(scales[l, kv, t], m)
    for c in range(tid, C, ROW_THREADS):
        b = bf16_bits_nearest(dequantize_value(symbols[l, kv, t, c], step, m))
        if b >= 32768:
            b -= 65536
        out_bits[l, kv, t, c] = b


def dequantize_bf16(symbols, scales, maxq, out_bits, stream=0):
    """dequantize() then the float32 -> bfloat16 cast (round to nearest even), fused:
    writes bfloat16 bits into an int16 array."""
    L, _, T, C = symbols.shape
    if L * 2 * T * C == 0:
        return
    _dequantize_bf16_kernel[L * 2 * T, ROW_THREADS, stream](
        as_device(symbols), as_device(scales), as_device(maxq), as_device(out_bits)
    )


# ---------------------------------------------------------------- statistics


@cuda.jit
def _histogram_kernel(symbols, chunk_tokens, counts):
    i = cuda.grid(1)
    K, L, _, C, S = counts.shape
    if i >= K * L * 2 * C:
        return
    k, l, kv, c = _channel_coords(i, L, C)
    for s in range(S):
        counts[k, l, kv, c, s] = 0
    T = symbols.shape[2]
    t0 = k * chunk_tokens
    t1 = min(T, t0 + chunk_tokens)
    for t in range(t0, t1):
        counts[k, l, kv, c, symbols[l, kv, t, c]] += 1


def histogram(symbols, chunk_tokens, counts, stream=0):
    K, L, _, C, _ = counts.shape
    n = K * L * 2 * C
    if n == 0:
        return
    _histogram_kernel[_grid(n), BLOCK, stream](as_device(symbols), np.int64(chunk_tokens), as_device(counts))


@cuda.jit
def _build_cdf_kernel(counts, maxq, codes, cum):
    i = cuda.grid(1)
    K, L, _, C, S = counts.shape
    if i >= K * L * 2 * C:
        return
    k, l, kv, c = _channel_coords(i, L, C)
    alphabet = 2 * np.int64(maxq[l, kv]) + 1
    counts_to_codes(counts[k, l, kv, c], alphabet, codes[k, l, kv, c])
    codes_to_cum(codes[k, l, kv, c], alphabet, cum[k, l, kv, c])


def build_cdf(counts, maxq, codes, cum, stream=0):
    K, L, _, C, _ = counts.shape
    n = K * L * 2 * C
    if n == 0:
        return
    _build_cdf_kernel[_grid(n), BLOCK, stream](as_device(counts), as_device(maxq), as_device(codes), as_device(cum))


@cuda.jit
def _cum_from_codes_kernel(codes, maxq, cum):
    i = cuda.grid(1)
    K, L, _, C, S = codes.shape
    if i >= K * L * 2 * C:
        return
    k, l, kv, c = _channel_coords(i, L, C)
    alphabet = 2 * np.int64(maxq[l, kv]) + 1
    codes_to_cum(codes[k, l, kv, c], alphabet, cum[k, l, kv, c])


def cum_from_codes(codes, maxq, cum, stream=0):
    K, L, _, C, _ = codes.shape
    n = K * L * 2 * C
    if n == 0:
        return
    _cum_from_codes_kernel[_grid(n), BLOCK, stream](as_device(codes), as_device(maxq), as_device(cum))


STATS_THREADS = 128
_STATS_KERNELS: dict = {}


def _stats_kernel(width: int):
    """Histogram + codes + CDF in one pass, counts kept in shared memory (one row per thread)."""
    kernel = _STATS_KERNELS.get(width)
    if kernel is None:

        @cuda.jit
        def kernel(symbols, chunk_tokens, maxq, codes, cum):
            hist = cuda.shared.array((STATS_THREADS, width), np.int32)
            tid = cuda.threadIdx.x
            i = cuda.blockIdx.x * STATS_THREADS + tid
            K, L, _, C, S = codes.shape
            if i >= K * L * 2 * C:
                return
            k, l, kv, c = _channel_coords(i, L, C)
            row = hist[tid]
            for s in range(S):
                row[s] = 0
            T = symbols.shape[2]
            t0 = k * chunk_tokens
            t1 = min(T, t0 + chunk_tokens)
            for t in range(t0, t1):
                row[symbols[l, kv, t, c]] += 1
            alphabet = 2 * np.int64(maxq[l, kv]) + 1
            counts_to_codes(row, alphabet, codes[k, l, kv, c])
            codes_to_cum(codes[k, l, kv, c], alphabet, cum[k, l, kv, c])

        _STATS_KERNELS[width] = kernel
    return kernel


def histogram_cdf(symbols, chunk_tokens, maxq, codes, cum, stream=0):
    """histogram + build_cdf without the counts array (the counts live in shared memory)."""
    K, L, _, C, S = codes.shape
    n = K * L * 2 * C
    if n == 0:
        return
    width = S | 1  # an odd row stride spreads the threads' rows over the shared-memory banks
    if STATS_THREADS * width * 4 > 40 * 1024:
        counts = cuda.device_array((K, L, 2, C, S), np.int32, stream=stream)
        histogram(symbols, chunk_tokens, counts, stream)
        build_cdf(counts, maxq, codes, cum, stream)
        return
    _stats_kernel(width)[_grid(n, STATS_THREADS), STATS_THREADS, stream](
        as_device(symbols), np.int64(chunk_tokens), as_device(maxq), as_device(codes), as_device(cum)
    )


# ---------------------------------------------------------------- range coding


#: Shared memory a coder block may use for its streams' CDF rows (uint16 copies).
CODER_SHARED_BYTES = 40 * 1024
_CODER_KERNELS: dict = {}


def _coder_threads(group: int, width: int) -> int:
    """Threads per block whose CDF rows fit in shared memory; 0 means read them from global memory."""
    threads = min(BLOCK, CODER_SHARED_BYTES // (group * (width | 1) * 2) // 32 * 32)
    return threads if threads >= 32 else 0


def _stream_coords(s, groups, L, group, chunk_tokens, T, C):
    """(k, l, kv, t0, t1, c0, c1) of stream s: used by both coder kernels."""
    g = s % groups
    kv = (s // groups) % 2
    l = (s // (2 * groups)) % L
    k = s // (L * 2 * groups)
    t0 = k * chunk_tokens
    t1 = min(T, t0 + chunk_tokens)
    c0 = g * group
    c1 = min(C, c0 + group)
    return k, l, kv, t0, t1, c0, c1


_stream_coords_dev = cuda.jit(device=True)(_stream_coords)


def _coder_kernels(threads: int, group: int, width: int):
    """Encode and decode kernels, one thread per stream.  With threads > 0 each thread first
    copies its group's CDF rows to shared memory, interleaved with the other threads' rows
    (row j of thread t at j * threads + t, rows of odd length) to avoid bank conflicts:
    the coder reads them for every symbol."""
    key = (threads, group, width)
    kernels = _CODER_KERNELS.get(key)
    if kernels is not None:
        return kernels
    rows = max(threads * group, 1)
    shared = threads > 0
    step = max(threads, 1)
    cols = width | 1

    @cuda.jit
    def encode_kernel(symbols, cum, chunk_tokens, slots, lengths):
        tables = cuda.shared.array((rows, cols), np.uint16)
        s = cuda.grid(1)
        K, L, _, C, _S1 = cum.shape
        groups = (C + group - 1) // group
        if s >= K * L * 2 * groups:
            return
        k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, symbols.shape[2], C)
        if shared:
            tid = cuda.threadIdx.x
            for j in range(c1 - c0):
                for i in range(width):
                    tables[j * step + tid, i] = cum[k, l, kv, c0 + j, i]
            lengths[s] = encode_stream(symbols[l, kv], t0, t1, c0, c1, tables, tid, step, slots[s])
        else:
            lengths[s] = encode_stream(symbols[l, kv], t0, t1, c0, c1, cum[k, l, kv], c0, 1, slots[s])

    @cuda.jit
    def decode_kernel(payload, offsets, lengths, cum, maxq, chunk_tokens, symbols):
        tables = cuda.shared.array((rows, cols), np.uint16)
        s = cuda.grid(1)
        K, L, _, C, _S1 = cum.shape
        groups = (C + group - 1) // group
        if s >= K * L * 2 * groups:
            return
        k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, symbols.shape[2], C)
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        if shared:
            tid = cuda.threadIdx.x
            for j in range(c1 - c0):
                for i in range(width):
                    tables[j * step + tid, i] = cum[k, l, kv, c0 + j, i]
            decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, tables, tid, step, alphabet, symbols[l, kv])
        else:
            decode_stream(payload, offsets[s], lengths[s], t0, t1, c0, c1, cum[k, l, kv], c0, 1, alphabet, symbols[l, kv])

    kernels = (encode_kernel, decode_kernel)
    _CODER_KERNELS[key] = kernels
    return kernels


def encode_streams(symbols, cum, chunk_tokens, group, slots, lengths, stream=0):
    n = lengths.shape[0]
    if n == 0:
        return
    width = cum.shape[4]
    threads = _coder_threads(group, width)
    kernel = _coder_kernels(threads, group, width)[0]
    block = threads or BLOCK
    kernel[_grid(n, block), block, stream](
        as_device(symbols), as_device(cum), np.int64(chunk_tokens), as_device(slots), as_device(lengths)
    )


@cuda.jit
def _pack_streams_kernel(slots, lengths, offsets, payload):
    s = cuda.grid(1)
    if s >= lengths.shape[0]:
        return
    o = offsets[s]
    for i in range(lengths[s]):
        payload[o + i] = slots[s, i]


def pack_streams(slots, lengths, offsets, payload, stream=0):
    n = lengths.shape[0]
    if n == 0:
        return
    _pack_streams_kernel[_grid(n), BLOCK, stream](as_device(slots), as_device(lengths), as_device(offsets), as_device(payload))


def decode_streams(payload, offsets, lengths, cum, maxq, chunk_tokens, group, symbols, stream=0):
    n = lengths.shape[0]
    if n == 0:
        return
    width = cum.shape[4]
    threads = _coder_threads(group, width)
    kernel = _coder_kernels(threads, group, width)[1]
    block = threads or BLOCK
    kernel[_grid(n, block), block, stream](
        as_device(payload), as_device(offsets), as_device(lengths), as_device(cum), as_device(maxq),
        np.int64(chunk_tokens), as_device(symbols),
    )


# ---------------------------------------------------------------- CRC-32 of records

from .crc import CRC_TABLE, crc32_combine, crc32_range  # noqa: E402

#: Bytes per CRC segment: one thread each; a record's segments are joined by one thread.
CRC_SEGMENT_BYTES = 16384


@cuda.jit
def _crc_segments_kernel(data, seg_start, seg_len, out):
    table = cuda.shared.array(256, np.int64)
    for i in range(cuda.threadIdx.x, 256, cuda.blockDim.x):
        table[i] = CRC_TABLE[i]
    cuda.syncthreads()
    i = cuda.grid(1)
    if i < seg_start.shape[0]:
        out[i] = crc32_range(data, seg_start[i], seg_len[i], table)


@cuda.jit
def _crc_combine_kernel(seg_crc, seg_len, rec_first, rec_count, out):
    k = cuda.grid(1)
    if k >= rec_first.shape[0]:
        return
    a = rec_first[k]
    crc = seg_crc[a]
    for j in range(a + 1, a + rec_count[k]):
        crc = crc32_combine(crc, seg_crc[j], seg_len[j])
    out[k] = crc


def crc32_records(data, seg_start, seg_len, rec_first, rec_count, seg_crc, out, stream=0):
    """out[k] = zlib.crc32 of the concatenation of segments rec_first[k] .. + rec_count[k]
    (each data[seg_start[j]:seg_start[j] + seg_len[j]]); seg_crc is int64 scratch, one per segment."""
    n = seg_start.shape[0]
    if n == 0:
        return
    _crc_segments_kernel[_grid(n), BLOCK, stream](as_device(data), as_device(seg_start), as_device(seg_len), as_device(seg_crc))
    _crc_combine_kernel[_grid(rec_first.shape[0], 32), 32, stream](
        as_device(seg_crc), as_device(seg_len), as_device(rec_first), as_device(rec_count), as_device(out)
    )
