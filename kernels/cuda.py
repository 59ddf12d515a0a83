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
  crc32_chunks      one thread per 2 KiB segment of a chunk record; a warp loads its 32
                    segments' words together (256 contiguous bytes a load) into shared memory,
                    then each lane walks its own by slicing-by-8
"""

from __future__ import annotations

import numpy as np

# numba-cuda 0.30.4 still calls np.row_stack, which numpy 2.5 removed; it is an
# alias of np.vstack, so restoring it changes nothing else.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402

from .launch import jit_kernel  # noqa: E402  (cuda.jit for kernels, with the lean launcher)

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
from .range_coder import _add_carry, decode_stream, encode_stream, flush_stream, stream_coords  # noqa: E402

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


def flat(array):
    """array.reshape(-1), kept on the array for the next call: a numba device array's reshape
    (or item) is a new array object, typed and packed again by every launch that takes it
    (tens of microseconds each, ~15 a call; the pipelines' own views are cached objects:
    pipeline/transform_resident._nb).  Host and simulator arrays are reshaped as they are."""
    f = getattr(array, "_cg_flat", None)
    if f is None:
        f = array.reshape(-1)
        try:
            array._cg_flat = f
        except AttributeError:  # a numpy array (simulator): a reshape is cheap there
            pass
    return f


def item(array, i: int):
    """array[i] for a leading index, kept on the array as flat keeps its reshape."""
    items = getattr(array, "_cg_items", None)
    if items is None:
        items = {}
        try:
            array._cg_items = items
        except AttributeError:
            return array[i]
    f = items.get(i)
    if f is None:
        f = items[i] = array[i]
    return f


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
def _block_max(top, tid, local, threads):
    """Block-wide maximum of the threads' ``local`` values, a tree reduction in the shared
    array ``top`` (one slot per thread; ``threads``, the block's size, a power of two); every
    thread gets it back (the loop's last barrier orders the reads of top[0])."""
    top[tid] = local
    cuda.syncthreads()
    width = threads // 2
    while width > 0:
        if tid < width and top[tid + width] > top[tid]:
            top[tid] = top[tid + width]
        cuda.syncthreads()
        width //= 2
    return top[0]


@cuda.jit(device=True)
def _row_scale_bits(top, bits_shared, tid, local):
    """Block-wide maximum of the threads' ``local`` abs-max values (_block_max), as the
    bfloat16 scale bits every thread of the row gets back."""
    m = _block_max(top, tid, local, ROW_THREADS)
    if tid == 0:
        bits_shared[0] = bf16_bits_round_up(m)
    cuda.syncthreads()
    return bits_shared[0]


@cuda.jit(device=True)
def _load(x, l, kv, t, c, fmt):
    """One cache value as float32: x is float32 (fmt 0) or bfloat16 / float16 words (fmt 1 / 2)."""
    if fmt == 0:
        return np.float32(x[l, kv, t, c])
    return float_from_bits16(x[l, kv, t, c], fmt)


@jit_kernel
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


@jit_kernel
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


@jit_kernel
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


@jit_kernel
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


@jit_kernel
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


@jit_kernel
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

        @jit_kernel
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


#: One function for the stream layout on every device (range_coder.stream_coords).
_stream_coords_dev = stream_coords


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

    @jit_kernel
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

    @jit_kernel
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


@jit_kernel
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

from .crc import CRC_SLICES, CRC_TABLE, crc32_combine, crc32_range  # noqa: E402

#: Bytes per CRC segment: one thread each; a record's segments are joined by one thread.
CRC_SEGMENT_BYTES = 16384


@jit_kernel
def _crc_segments_kernel(data, seg_start, seg_len, out):
    table = cuda.shared.array(256, np.int64)
    for i in range(cuda.threadIdx.x, 256, cuda.blockDim.x):
        table[i] = CRC_TABLE[i]
    cuda.syncthreads()
    i = cuda.grid(1)
    if i < seg_start.shape[0]:
        out[i] = crc32_range(data, seg_start[i], seg_len[i], table)


@jit_kernel
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


# ================================================================ end-to-end device path
#
# The kernels below serve gpu_codec.encode_file_device / decode_device: a bf16 CUDA
# tensor <-> .cgen bytes in a uint8 CUDA tensor.  They differ from the stage kernels
# above in what they read and write, never in the arithmetic that decides the bytes:
#   - quantize_pairs reads two 16-bit words per 32-bit load and bit-casts instead of
#     float_from_bits16's float64 arithmetic (same float32 values), one warp per row;
#   - stats_packed writes the CDF-codes section in its file format (nibbles), and the
#     coders build their CDF rows from those nibbles in shared memory (codes_to_cum,
#     as cum_from_codes does), so no [K, L, 2, C, S + 1] int32 table exists;
#   - decode_values dequantizes as it decodes, writing bfloat16 (or float32) bits:
#     no symbols array and no separate dequantize pass;
#   - the container's records are assembled by three kernels (sections, streams,
#     CRC-32s) instead of per-chunk copies.

from numba import config as _numba_config  # noqa: E402

from .cdf import codes_to_cum as _codes_to_cum  # noqa: E402
from .coding_params import MASK32, PROB_BITS, PROB_TOTAL, RANGE_INIT, RANGE_TOP  # noqa: E402
from .crc import multmodp, x8nmodp  # noqa: E402

SIM = bool(_numba_config.ENABLE_CUDASIM)

if SIM:  # numba's simulator has neither libdevice bit casts nor warp shuffles

    @cuda.jit(device=True)
    def _f32_bits(v):
        """The bits of a float32 as a signed 32-bit integer (in an int64)."""
        return np.int64(np.array(v, np.float32).view(np.int32))

    @cuda.jit(device=True)
    def _bits_f32(b):
        """The float32 whose bits are the low 32 bits of b."""
        return np.array(np.int64(b) & MASK32, np.uint32).view(np.float32)[()]

    @cuda.jit(device=True)
    def _bits_f64(b):
        """The float64 whose bits are b (an int64)."""
        return np.array(np.int64(b), np.int64).view(np.float64)[()]

    @cuda.jit(device=True)
    def _fast_div(x, y):
        """x / y in float32 (the device's approximate division: see below)."""
        return np.float32(x) / np.float32(y)

    @cuda.jit(device=True)
    def _warp_max(v, scratch, warp, lane):
        """Maximum of v over the 32 threads of a warp (every thread of the block calls it)."""
        scratch[warp, lane] = v
        cuda.syncthreads()
        m = scratch[warp, 0]
        for i in range(1, 32):
            if scratch[warp, i] > m:
                m = scratch[warp, i]
        cuda.syncthreads()
        return m

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _f32_bits(v):
        return np.int64(libdevice.float_as_int(np.float32(v)))

    @cuda.jit(device=True)
    def _bits_f64(b):
        return libdevice.longlong_as_double(np.int64(b))

    @cuda.jit(device=True)
    def _bits_f32(b):
        b = np.int64(b) & MASK32
        if b >= 0x80000000:
            b -= np.int64(1) << 32
        return libdevice.int_as_float(np.int32(b))

    @cuda.jit(device=True)
    def _fast_div(x, y):
        # a reciprocal and a multiply (within 2 ulp): for callers that correct the quotient
        return libdevice.fast_fdividef(np.float32(x), np.float32(y))

    @cuda.jit(device=True)
    def _warp_max(v, scratch, warp, lane):
        off = 16
        while off > 0:
            o = cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            if o > v:
                v = o
            off //= 2
        return v


_PLACEHOLDERS: dict = {}


def _placeholder(shape, dtype):
    """A small device array for a kernel argument the chosen variant never touches, made
    once: a cudaMalloc / cudaFree per call would cost more than some of the kernels."""
    key = (shape, np.dtype(dtype).str)
    arr = _PLACEHOLDERS.get(key)
    if arr is None:
        arr = _PLACEHOLDERS[key] = cuda.device_array(shape, dtype)
    return arr


@cuda.jit(device=True)
def _pair_value(w, half, fmt):
    """float32 value of the 16-bit word number ``half`` (0 = the lowest bits = the lowest
    channel) of the 32- or 64-bit word w: bfloat16 (fmt 1) by a bit cast, float16 (fmt 2)
    by exact arithmetic."""
    bits = (np.int64(w) >> (16 * half)) & 0xFFFF
    if fmt == 1:
        return _bits_f32(bits << 16)
    return float_from_bits16(bits, fmt)


QUANT_ROWS = 8  # rows (warps) per block of quantize_pairs


@jit_kernel
def _quantize_pairs_kernel(words, fmt, maxq, scales, pairs):
    L, _, T, C2 = words.shape
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    scratch = cuda.shared.array((QUANT_ROWS, 32), np.float32)
    n = L * 2 * T
    row = cuda.blockIdx.x * QUANT_ROWS + warp
    l, kv, t = _row_coords(min(row, n - 1), T)
    local = np.float32(0.0)
    if row < n:
        for i in range(lane, C2, 32):
            w = words[l, kv, t, i]
            a = abs(_pair_value(w, 0, fmt))
            b = abs(_pair_value(w, 1, fmt))
            if a > local:
                local = a
            if b > local:
                local = b
    top = _warp_max(local, scratch, warp, lane)  # every thread of the block takes part
    if row >= n:
        return
    bits = bf16_bits_round_up(top)
    if lane == 0:
        scales[l, kv, t] = bits
    m = np.int64(maxq[l, kv])
    inv = quant_inverse_step(bits, m)
    for i in range(lane, C2, 32):
        w = words[l, kv, t, i]
        p = quantize_value(_pair_value(w, 0, fmt), inv, m) | (quantize_value(_pair_value(w, 1, fmt), inv, m) << 8)
        if p >= 32768:
            p -= 65536
        pairs[l, kv, t, i] = p


@jit_kernel
def _quantize_quads_kernel(words, fmt, maxq, scales, quads):
    L, _, T, C4 = words.shape
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    scratch = cuda.shared.array((QUANT_ROWS, 32), np.float32)
    n = L * 2 * T
    row = cuda.blockIdx.x * QUANT_ROWS + warp
    plane = min(row, n - 1) // T  # one division: (layer, K/V) and token from it
    t = min(row, n - 1) - plane * T
    l = plane >> 1
    kv = plane & 1
    local = np.float32(0.0)
    if row < n:
        # Two independent 8-byte loads per iteration: more reads in flight per thread.
        for i in range(lane, C4, 64):
            w0 = words[l, kv, t, i]
            w1 = np.int64(0)
            if i + 32 < C4:
                w1 = words[l, kv, t, i + 32]
            for q in range(4):
                a = abs(_pair_value(w0, q, fmt))
                b = abs(_pair_value(w1, q, fmt))
                if a > local:
                    local = a
                if b > local:
                    local = b
    top = _warp_max(local, scratch, warp, lane)  # every thread of the block takes part
    if row >= n:
        return
    bits = bf16_bits_round_up(top)
    if lane == 0:
        scales[l, kv, t] = bits
    m = np.int64(maxq[l, kv])
    inv = quant_inverse_step(bits, m)
    for i in range(lane, C4, 32):
        w = words[l, kv, t, i]
        p = np.int64(0)
        for q in range(4):
            p |= quantize_value(_pair_value(w, q, fmt), inv, m) << (8 * q)
        if p >= 0x80000000:
            p -= np.int64(1) << 32
        quads[l, kv, t, i] = p


def quantize_quads(words, fmt, maxq, scales, quads, stream=0):
    """quantize_pairs() for a channel count that is a multiple of 4: the cache as int64
    words [L, 2, T, C / 4] (four 16-bit values, the lowest channel in the low bits), the
    symbols as int32 [L, 2, T, C / 4].  Half the load instructions of quantize_pairs."""
    L, _, T, C4 = words.shape
    n = L * 2 * T
    if n == 0 or C4 == 0:
        return
    _quantize_quads_kernel[_grid(n, QUANT_ROWS), 32 * QUANT_ROWS, stream](
        as_device(words), np.int64(fmt), as_device(maxq), as_device(scales), as_device(quads)
    )


def quantize_pairs(words, fmt, maxq, scales, pairs, stream=0):
    """quantize_bits() for an even channel count, reading the cache as int32 words
    [L, 2, T, C / 2] (two bfloat16 / float16 values each, the lower channel in the low
    half) and writing the symbols as int16 pairs [L, 2, T, C / 2] (lower channel in the low
    byte).  Same scales and symbols as quantize()."""
    L, _, T, C2 = words.shape
    n = L * 2 * T
    if n == 0 or C2 == 0:
        return
    _quantize_pairs_kernel[_grid(n, QUANT_ROWS), 32 * QUANT_ROWS, stream](
        as_device(words), np.int64(fmt), as_device(maxq), as_device(scales), as_device(pairs)
    )


# ---------------------------------------------------------------- CDF codes in the file's nibble format


@cuda.jit(device=True)
def _cum_row_from_packed(packed, at, alphabet, table, r):
    """table[r] = the integer CDF of the channel whose ceil(A/2) code bytes start at
    packed[at].  The codes are unpacked into table[r, 1:] and codes_to_cum turns them into
    the CDF in place (it reads code s before it writes entry s + 1)."""
    for j in range((alphabet + 1) // 2):
        b = np.int64(packed[at + j])
        table[r, 1 + 2 * j] = b & 15
        if 2 * j + 1 < alphabet:
            table[r, 2 + 2 * j] = b >> 4
    _codes_to_cum(table[r, 1:], alphabet, table[r])


_STATS_PACKED: dict = {}


def _stats_packed_kernel(width: int, shared: bool):
    key = (width, shared)
    kernel = _STATS_PACKED.get(key)
    if kernel is not None:
        return kernel
    rows = STATS_THREADS if shared else 1

    @jit_kernel
    def kernel(symbols, chunk_tokens, maxq, plane_off, codes_at, packed, counts):
        hist = cuda.shared.array((rows, width), np.int32)
        tid = cuda.threadIdx.x
        i = cuda.blockIdx.x * cuda.blockDim.x + tid
        L, _, T, C = symbols.shape
        K = codes_at.shape[0]
        if i >= K * L * 2 * C:
            return
        k, l, kv, c = _channel_coords(i, L, C)
        if shared:
            row = hist[tid]
        else:
            row = counts[i]
        for s in range(width):
            row[s] = 0
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        for t in range(t0, t1):
            row[symbols[l, kv, t, c]] += 1
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        counts_to_codes(row, alphabet, row)  # in place: reads count s before writing code s
        nb = (alphabet + 1) // 2
        at = codes_at[k] + plane_off[l, kv] + c * nb
        for j in range(nb):
            hi = np.int64(0)
            if 2 * j + 1 < alphabet:
                hi = np.int64(row[2 * j + 1])
            packed[at + j] = np.int64(row[2 * j]) | (hi << 4)

    _STATS_PACKED[key] = kernel
    return kernel


def stats_packed(symbols, chunk_tokens, maxq, plane_off, codes_at, packed, width, stream=0):
    """Histogram -> 4-bit codes of every (chunk, layer, K/V, channel), written as the
    CDF-codes sections: chunk k's at packed[codes_at[k]:], plane (l, kv) at plane_off[l, kv]
    within it (docs/format.md).  width >= the largest alphabet."""
    L, _, T, C = symbols.shape
    K = codes_at.shape[0]
    n = K * L * 2 * C
    if n == 0:
        return
    width = width | 1  # odd row stride: the threads' rows spread over the shared-memory banks
    shared = STATS_THREADS * width * 4 <= 40 * 1024
    counts = _placeholder((1, 1), np.int32) if shared else cuda.device_array((n, width), np.int32, stream=stream)
    _stats_packed_kernel(width, shared)[_grid(n, STATS_THREADS), STATS_THREADS, stream](
        as_device(symbols), np.int64(chunk_tokens), as_device(maxq), as_device(plane_off), as_device(codes_at),
        as_device(packed), counts,
    )


# ---------------------------------------------------------------- coders that read the nibble codes


@cuda.jit(device=True)
def _decode_values(data, start, length, t0, t1, c0, c1, cum, row0, row_step, alphabet, m, steps, out, fmt):
    """decode_stream (range_coder.py), the same arithmetic, but each symbol is dequantized
    at once: out[t, c] = the bits of float32(float32(symbol - m) * steps[t]), as bfloat16
    rounded to nearest even (fmt 1, int16 out) or as float32 (fmt 0, int32 out)."""
    pos = 0
    code = np.int64(0)
    for _ in range(4):
        b = np.int64(0)
        if pos < length:
            b = np.int64(data[start + pos])
        pos += 1
        code = (code << 8) | b
    rng = np.int64(RANGE_INIT)
    for t in range(t0, t1):
        step = steps[t]
        for c in range(c0, c1):
            r = rng >> PROB_BITS
            q = np.int64(np.float64(code) / np.float64(r))
            if q >= PROB_TOTAL:
                q = PROB_TOTAL - 1
            j = row0 + (c - c0) * row_step
            lo = 0
            hi = alphabet
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if cum[j, mid] <= q:
                    lo = mid
                else:
                    hi = mid
            base = np.int64(cum[j, lo])
            code -= r * base
            rng = r * (np.int64(cum[j, lo + 1]) - base)
            while rng < RANGE_TOP:
                b = np.int64(0)
                if pos < length:
                    b = np.int64(data[start + pos])
                pos += 1
                code = ((code << 8) | b) & MASK32
                rng <<= 8
            bits = _f32_bits(dequantize_value(lo, step, m))
            if fmt == 1:  # float32 -> bfloat16, round to nearest even (finite values)
                u = bits & MASK32
                bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
                if bits >= 32768:
                    bits -= 65536
            out[t, c] = bits


@cuda.jit(device=True)
def _encode_stream_words(words, t0, t1, g, group, cum, row0, row_step, out):
    """encode_stream (range_coder.py), the same arithmetic and bytes, for a stream whose
    ``group`` channels are one word per token: words = the plane's symbols viewed with
    ``group`` bytes per item, column g.  One load per token instead of one per symbol, and
    the next token's word is loaded before the current one is coded, so its latency
    overlaps the coding (the coder's stores stop the compiler from moving loads itself)."""
    low = np.int64(0)
    rng = np.int64(RANGE_INIT)
    n = 0
    nxt = np.int64(0)
    if t0 < t1:
        nxt = np.int64(words[t0, g])
    for t in range(t0, t1):
        w = nxt
        if t + 1 < t1:
            nxt = np.int64(words[t + 1, g])
        for q in range(group):
            s = (w >> (8 * q)) & 0xFF
            j = row0 + q * row_step
            base = np.int64(cum[j, s])
            r = rng >> PROB_BITS
            low += r * base
            rng = r * (np.int64(cum[j, s + 1]) - base)
            if low > MASK32:
                _add_carry(out, n)
                low &= MASK32
            while rng < RANGE_TOP:
                out[n] = (low >> 24) & 0xFF
                n += 1
                low = (low << 8) & MASK32
                rng <<= 8
    return flush_stream(low, rng, n, out)


@cuda.jit(device=True)
def _decode_words(data, words, nwords, start, length, t0, t1, g, group, cum, row0, row_step, alphabet, m, steps,
                  out):
    """_decode_values for bfloat16 output and a stream whose ``group`` channels (group <= 4)
    are one output word per token (out = the plane's bfloat16 bits viewed with 2 x group bytes
    per item, column g): one store per token; and the stream's bytes are read 8 at a time
    (words = the file as int64, nwords of them; the next word is loaded ahead), instead of a
    dependent one-byte load for every byte.  Same symbols and values as _decode_values."""
    end = start + length
    widx = np.int64(-2)
    cur = np.int64(0)
    nxt = np.int64(0)
    a = start
    code = np.int64(0)
    for _ in range(4):
        b = np.int64(0)
        if a < end:
            wi = a >> 3
            if wi < nwords:
                if wi != widx:
                    if wi == widx + 1:
                        cur = nxt
                    else:
                        cur = np.int64(words[wi])
                    widx = wi
                    if wi + 1 < nwords:
                        nxt = np.int64(words[wi + 1])
                b = (cur >> (8 * (a & 7))) & 0xFF
            else:
                b = np.int64(data[a])
        a += 1
        code = (code << 8) | b
    rng = np.int64(RANGE_INIT)
    for t in range(t0, t1):
        step = steps[t]
        packed = np.int64(0)
        for q in range(group):
            r = rng >> PROB_BITS
            qq = np.int64(np.float64(code) / np.float64(r))
            if qq >= PROB_TOTAL:
                qq = PROB_TOTAL - 1
            j = row0 + q * row_step
            lo = 0
            hi = alphabet
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if cum[j, mid] <= qq:
                    lo = mid
                else:
                    hi = mid
            base = np.int64(cum[j, lo])
            code -= r * base
            rng = r * (np.int64(cum[j, lo + 1]) - base)
            while rng < RANGE_TOP:
                b = np.int64(0)
                if a < end:
                    wi = a >> 3
                    if wi < nwords:
                        if wi != widx:
                            if wi == widx + 1:
                                cur = nxt
                            else:
                                cur = np.int64(words[wi])
                            widx = wi
                            if wi + 1 < nwords:
                                nxt = np.int64(words[wi + 1])
                        b = (cur >> (8 * (a & 7))) & 0xFF
                    else:
                        b = np.int64(data[a])
                a += 1
                code = ((code << 8) | b) & MASK32
                rng <<= 8
            u = _f32_bits(dequantize_value(lo, step, m)) & MASK32  # to bfloat16, nearest even
            packed |= (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF) << (16 * q)
        out[t, g] = _signed(packed, group)


@cuda.jit(device=True)
def _signed(v, group):
    """v (2 x group bytes) as the signed integer of that width, for the int16 / int32 stores."""
    if group == 1 and v >= 32768:
        return v - 65536
    if group == 2 and v >= 0x80000000:
        return v - (np.int64(1) << 32)
    return v


_PACKED_CODERS: dict = {}

#: A register cap for the range-coder kernels (CACHEGEN_CUDA_CODER_REGISTERS, for tuning
#: runs; unset = the compiler's choice).  At ~120 registers a thread they run 512 threads an
#: SM; a cap trades spills for more warps to hide the coder's dependent latencies.
import os as _os  # noqa: E402

CODER_REGISTERS = int(_os.environ.get("CACHEGEN_CUDA_CODER_REGISTERS", "0") or 0)


def _coder_jit(fn):
    return jit_kernel(max_registers=CODER_REGISTERS)(fn) if CODER_REGISTERS else jit_kernel(fn)


def _packed_coders(threads: int, group: int, width: int):
    """Encode / fused-decode kernels, one thread per stream, whose CDF rows come from the
    nibble codes: in shared memory as in _coder_kernels (threads > 0), else in global scratch
    rows of their own (gcum, group rows per stream)."""
    key = (threads, group, width)
    kernels = _PACKED_CODERS.get(key)
    if kernels is not None:
        return kernels
    rows = max(threads * group, 1)
    shared = threads > 0
    step = max(threads, 1)
    cols = width | 1

    @_coder_jit
    def encode_kernel(symbols, packed, codes_at, plane_off, maxq, chunk_tokens, slots, lengths, gcum):
        tables = cuda.shared.array((rows, cols), np.uint16)
        s = cuda.grid(1)
        L, _, T, C = symbols.shape
        K = codes_at.shape[0]
        groups = (C + group - 1) // group
        if s >= K * L * 2 * groups:
            return
        k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, T, C)
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        nb = (alphabet + 1) // 2
        at = codes_at[k] + plane_off[l, kv] + c0 * nb
        if shared:
            tid = cuda.threadIdx.x
            for j in range(c1 - c0):
                _cum_row_from_packed(packed, at + j * nb, alphabet, tables, j * step + tid)
            lengths[s] = encode_stream(symbols[l, kv], t0, t1, c0, c1, tables, tid, step, slots[s])
        else:
            r0 = s * group
            for j in range(c1 - c0):
                _cum_row_from_packed(packed, at + j * nb, alphabet, gcum, r0 + j)
            lengths[s] = encode_stream(symbols[l, kv], t0, t1, c0, c1, gcum, r0, 1, slots[s])

    @_coder_jit
    def decode_kernel(blob, lens, incl, payload_at, codes_at, plane_off, maxq, steps, chunk_tokens, out, fmt, gcum):
        tables = cuda.shared.array((rows, cols), np.uint16)
        s = cuda.grid(1)
        L, _, T, C = out.shape
        K = codes_at.shape[0]
        groups = (C + group - 1) // group
        if s >= K * L * 2 * groups:
            return
        k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, T, C)
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        nb = (alphabet + 1) // 2
        at = codes_at[k] + plane_off[l, kv] + c0 * nb
        # Where the stream starts: its chunk's payload plus the lengths before it in the
        # chunk (incl: inclusive prefix sums over all streams).  Clamped to the file, so a
        # corrupted length table (reported after the CRC check) never reads past it.
        first = k * (L * 2 * groups)
        start = payload_at[k] + (incl[s] - lens[s]) - (incl[first] - lens[first])
        size = np.int64(blob.shape[0])
        length = np.int64(lens[s])
        if start > size:
            start = size
        if length > size - start:
            length = size - start
        m = np.int64(maxq[l, kv])
        if shared:
            tid = cuda.threadIdx.x
            for j in range(c1 - c0):
                _cum_row_from_packed(blob, at + j * nb, alphabet, tables, j * step + tid)
            _decode_values(blob, start, length, t0, t1, c0, c1, tables, tid, step, alphabet, m, steps[l, kv],
                           out[l, kv], fmt)
        else:
            r0 = s * group
            for j in range(c1 - c0):
                _cum_row_from_packed(blob, at + j * nb, alphabet, gcum, r0 + j)
            _decode_values(blob, start, length, t0, t1, c0, c1, gcum, r0, 1, alphabet, m, steps[l, kv],
                           out[l, kv], fmt)

    @_coder_jit
    def encode_words_kernel(symwords, packed, codes_at, plane_off, maxq, chunk_tokens, slots, lengths, gcum):
        # encode_kernel for C % group == 0: symwords = the symbols with group bytes per item
        tables = cuda.shared.array((rows, cols), np.uint16)
        s = cuda.grid(1)
        L, _, T, groups = symwords.shape
        C = groups * group
        K = codes_at.shape[0]
        if s >= K * L * 2 * groups:
            return
        k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, T, C)
        g = c0 // group
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        nb = (alphabet + 1) // 2
        at = codes_at[k] + plane_off[l, kv] + c0 * nb
        if shared:
            tid = cuda.threadIdx.x
            for j in range(group):
                _cum_row_from_packed(packed, at + j * nb, alphabet, tables, j * step + tid)
            lengths[s] = _encode_stream_words(symwords[l, kv], t0, t1, g, group, tables, tid, step, slots[s])
        else:
            r0 = s * group
            for j in range(group):
                _cum_row_from_packed(packed, at + j * nb, alphabet, gcum, r0 + j)
            lengths[s] = _encode_stream_words(symwords[l, kv], t0, t1, g, group, gcum, r0, 1, slots[s])

    @_coder_jit
    def decode_words_kernel(blob, words, lens, incl, payload_at, codes_at, plane_off, maxq, steps, chunk_tokens, out,
                            gcum):
        # decode_kernel for bfloat16 output, C % group == 0, group <= 4 and the file 8-byte
        # aligned: out = the output bits with 2 x group bytes per item, words = blob as int64
        tables = cuda.shared.array((rows, cols), np.uint16)
        s = cuda.grid(1)
        L, _, T, groups = out.shape
        C = groups * group
        K = codes_at.shape[0]
        if s >= K * L * 2 * groups:
            return
        k, l, kv, t0, t1, c0, c1 = _stream_coords_dev(s, groups, L, group, chunk_tokens, T, C)
        g = c0 // group
        alphabet = 2 * np.int64(maxq[l, kv]) + 1
        nb = (alphabet + 1) // 2
        at = codes_at[k] + plane_off[l, kv] + c0 * nb
        first = k * (L * 2 * groups)
        start = payload_at[k] + (incl[s] - lens[s]) - (incl[first] - lens[first])
        size = np.int64(blob.shape[0])
        length = np.int64(lens[s])
        if start > size:
            start = size
        if length > size - start:
            length = size - start
        m = np.int64(maxq[l, kv])
        nwords = np.int64(words.shape[0])
        if shared:
            tid = cuda.threadIdx.x
            for j in range(group):
                _cum_row_from_packed(blob, at + j * nb, alphabet, tables, j * step + tid)
            _decode_words(blob, words, nwords, start, length, t0, t1, g, group, tables, tid, step, alphabet, m,
                          steps[l, kv], out[l, kv])
        else:
            r0 = s * group
            for j in range(group):
                _cum_row_from_packed(blob, at + j * nb, alphabet, gcum, r0 + j)
            _decode_words(blob, words, nwords, start, length, t0, t1, g, group, gcum, r0, 1, alphabet, m,
                          steps[l, kv], out[l, kv])

    kernels = (encode_kernel, decode_kernel, encode_words_kernel, decode_words_kernel)
    _PACKED_CODERS[key] = kernels
    return kernels


def _packed_launch(n, group, width, stream):
    threads = _coder_threads(group, width)
    if threads:
        gcum = _placeholder((1, width | 1), np.int32)
    else:
        gcum = cuda.device_array((n * group, width | 1), np.int32, stream=stream)
    return threads, threads or BLOCK, gcum


def encode_streams_packed(symbols, packed, codes_at, plane_off, maxq, chunk_tokens, group, width, slots, lengths,
                          stream=0, symbol_words=None):
    """encode_streams() with the CDF rows built from the CDF-codes sections (stats_packed's
    output) instead of a cum table.  width: the CDF row length, largest alphabet + 1.
    symbol_words: the symbols viewed with ``group`` bytes per item ([L, 2, T, C / group];
    group 2, 4 or 8 and C % group == 0), for one load per token; None for the general kernel."""
    n = lengths.shape[0]
    if n == 0:
        return
    threads, block, gcum = _packed_launch(n, group, width, stream)
    kernels = _packed_coders(threads, group, width)
    if symbol_words is not None:
        kernel, src = kernels[2], symbol_words
    else:
        kernel, src = kernels[0], symbols
    kernel[_grid(n, block), block, stream](
        as_device(src), as_device(packed), as_device(codes_at), as_device(plane_off), as_device(maxq),
        np.int64(chunk_tokens), as_device(slots), as_device(lengths), gcum,
    )


def decode_values(blob, lens, incl, payload_at, codes_at, plane_off, maxq, steps, chunk_tokens, group, width, out,
                  fmt, stream=0, blob_words=None, out_words=None):
    """Decode every stream of a .cgen file held in ``blob`` (uint8, the whole file) and
    dequantize into out [L, 2, T, C]: bfloat16 bits (fmt 1, int16) or float32 bits (fmt 0,
    int32).  lens: the streams' lengths, incl their inclusive prefix sums; payload_at /
    codes_at: where each chunk's payload / CDF codes start in blob; steps: float32 [L, 2, T]
    from prepare_decode.  With blob_words (blob as int64, blob 8-byte aligned) and out_words
    (bfloat16 output viewed with 2 x group bytes per item, group 1, 2 or 4, C % group == 0),
    the kernel that reads 8 stream bytes per load and stores one word per token."""
    n = lens.shape[0]
    if n == 0:
        return
    threads, block, gcum = _packed_launch(n, group, width, stream)
    kernels = _packed_coders(threads, group, width)
    if out_words is not None:
        kernels[3][_grid(n, block), block, stream](
            as_device(blob), as_device(blob_words), as_device(lens), as_device(incl), as_device(payload_at),
            as_device(codes_at), as_device(plane_off), as_device(maxq), as_device(steps), np.int64(chunk_tokens),
            as_device(out_words), gcum,
        )
        return
    kernels[1][_grid(n, block), block, stream](
        as_device(blob), as_device(lens), as_device(incl), as_device(payload_at), as_device(codes_at),
        as_device(plane_off), as_device(maxq), as_device(steps), np.int64(chunk_tokens), as_device(out),
        np.int64(fmt), gcum,
    )


# ---------------------------------------------------------------- record fields read from / written to the bytes


@jit_kernel
def _prepare_kernel(blob, lengths_at, per, lens, scales_at, chunk_tokens, maxq, steps, chunk_bad):
    # Threads [0, n) read the streams' lengths, the others the tokens' scales: one launch.
    i = cuda.grid(1)
    n = lens.shape[0]
    if i < n:
        k = i // per
        at = lengths_at[k] + 2 * (i - k * per)
        lens[i] = np.int64(blob[at]) | (np.int64(blob[at + 1]) << 8)
        return
    i -= n
    L, _, T = steps.shape
    if i >= L * 2 * T:
        return
    l, kv, t = _row_coords(i, T)
    k = t // chunk_tokens
    tl = t - k * chunk_tokens
    tk = min(chunk_tokens, T - k * chunk_tokens)
    at = scales_at[k] + 2 * ((l * 2 + kv) * tk + tl)
    bits = np.int64(blob[at]) | (np.int64(blob[at + 1]) << 8)
    if (bits & 0x8000) != 0 or (bits & 0x7F80) == 0x7F80:
        chunk_bad[k] = 1  # a negative or non-finite scale: the caller reports the chunk
        bits = np.int64(0)
    steps[l, kv, t] = dequant_step(bits, np.int64(maxq[l, kv]))


def prepare_decode(blob, lengths_at, per, lens, scales_at, chunk_tokens, maxq, steps, chunk_bad, stream=0):
    """From the .cgen bytes in blob: lens[s] = the u16 length of stream s (chunk k = s // per's
    table at blob[lengths_at[k]:]); steps[l, kv, t] = dequant_step of token t's scale (its
    chunk's scales section at blob[scales_at[k]:]); chunk_bad[k] = 1 where a scale is negative
    or not finite (chunk_bad zeroed by the caller)."""
    L, _, T = steps.shape
    n = lens.shape[0] + L * 2 * T
    if n == 0:
        return
    _prepare_kernel[_grid(n), BLOCK, stream](
        as_device(blob), as_device(lengths_at), np.int64(per), as_device(lens), as_device(scales_at),
        np.int64(chunk_tokens), as_device(maxq), as_device(steps), as_device(chunk_bad),
    )


CHUNK_HEADER_BYTES = 40


@jit_kernel
def _assemble_kernel(out, rec_at, heads, scales, packed, cdf_size, lengths, per, chunk_tokens, slots, incl, delta,
                     rest_blocks):
    # Chunk k = blockIdx.y.  Block columns x < 2L copy plane x's scales (whole 16-bit words);
    # the next rest_blocks stride over the header, the CDF codes and the stream lengths; the
    # others copy the chunk's streams, a warp each, so that reads and writes are contiguous.
    # No divisions: a 64-bit one costs tens of instructions and this kernel is all copying.
    k = cuda.blockIdx.y
    x = cuda.blockIdx.x
    L, _, T = scales.shape
    planes = 2 * L
    if x >= planes + rest_blocks:
        s = (x - planes - rest_blocks) * (cuda.blockDim.x // 32) + cuda.threadIdx.x // 32
        if s >= per:
            return
        s += k * per
        lane = cuda.threadIdx.x % 32
        n = np.int64(lengths[s])
        at = incl[s] - n + delta[k]
        for i in range(lane, n, 32):
            out[at + i] = slots[s, i]
        return
    t0 = k * chunk_tokens
    tk = min(chunk_tokens, T - t0)
    base = rec_at[k]
    scales_at = base + CHUNK_HEADER_BYTES
    if x < planes:
        l = x >> 1
        kv = x & 1
        at = scales_at + 2 * x * tk
        for t in range(cuda.threadIdx.x, tk, cuda.blockDim.x):
            w = np.int64(scales[l, kv, t0 + t])
            out[at + 2 * t] = w & 0xFF
            out[at + 2 * t + 1] = (w >> 8) & 0xFF
        return
    codes_at = scales_at + 2 * planes * tk
    rest = cdf_size + 2 * per
    j = (x - planes) * cuda.blockDim.x + cuda.threadIdx.x
    stride = rest_blocks * cuda.blockDim.x
    while j < rest + CHUNK_HEADER_BYTES:
        if j < cdf_size:
            out[codes_at + j] = packed[k * cdf_size + j]
        elif j < rest:
            o = j - cdf_size
            out[codes_at + j] = (np.int64(lengths[k * per + (o >> 1)]) >> (8 * (o & 1))) & 0xFF
        else:
            out[base + j - rest] = heads[k, j - rest]
        j += stride


def assemble_records(out, rec_at, heads, scales, packed, cdf_size, lengths, per, chunk_tokens, slots, incl, delta,
                     stream=0):
    """Write each chunk record but its CRC field at out[rec_at[k]:]: the header (heads
    [K, 40]), the scales (int16 [L, 2, T_slab]), the CDF codes (packed, cdf_size bytes per
    chunk), the stream lengths (u16 little-endian from int32 lengths, per streams per chunk)
    and the streams (stream s = slots[s, :lengths[s]], written at incl[s] - lengths[s] +
    delta[s // per]; incl: inclusive prefix sums of lengths).  One launch for all of it."""
    K = rec_at.shape[0]
    if K == 0:
        return
    L = scales.shape[0]
    block = 256
    rest_blocks = min(_grid(cdf_size + 2 * per + CHUNK_HEADER_BYTES, block), 1024)
    stream_blocks = _grid(32 * per, block)
    _assemble_kernel[(2 * L + rest_blocks + stream_blocks, K), block, stream](
        as_device(out), as_device(rec_at), as_device(heads), as_device(scales), as_device(packed), np.int64(cdf_size),
        as_device(lengths), np.int64(per), np.int64(chunk_tokens), as_device(slots), as_device(incl),
        as_device(delta), np.int64(rest_blocks),
    )


#: Bytes per CRC segment in crc32_chunks: one thread each.  Small segments give enough
#: threads to cover the device; every segment's CRC is shifted to its place independently.
#: Body segments are cut at multiples of this in the buffer, so they start 8-byte aligned.
CHUNK_CRC_SEGMENT = 2048


@cuda.jit(device=True)
def _fill_crc_slices(slices):
    """Copy crc.CRC_SLICES into a block's shared [8, 256] uint32 array (then a barrier)."""
    for i in range(cuda.threadIdx.x, 8 * 256, cuda.blockDim.x):
        slices[i >> 8, i & 255] = CRC_SLICES[i >> 8, i & 255]
    cuda.syncthreads()


@cuda.jit(device=True)
def _crc_word(c, w, slices):
    """The CRC register c after the 8 bytes of int64 word w (little-endian): slicing-by-8's
    eight independent lookups."""
    lo = (c ^ w) & 0xFFFFFFFF
    hi = (w >> 32) & 0xFFFFFFFF
    return (np.int64(slices[7, lo & 0xFF]) ^ np.int64(slices[6, (lo >> 8) & 0xFF])
            ^ np.int64(slices[5, (lo >> 16) & 0xFF]) ^ np.int64(slices[4, lo >> 24])
            ^ np.int64(slices[3, hi & 0xFF]) ^ np.int64(slices[2, (hi >> 8) & 0xFF])
            ^ np.int64(slices[1, (hi >> 16) & 0xFF]) ^ np.int64(slices[0, hi >> 24]))


@cuda.jit(device=True)
def _crc_span(data, words, aligned, start, n, slices):
    """zlib.crc32(data[start:start + n]); where ``aligned``, the 8-byte-aligned middle is read
    as int64 words (words = data viewed as int64) and each word takes the 8 independent lookups
    of slicing-by-8 (slices: crc.CRC_SLICES in shared memory): a byte-at-a-time table walk is a
    chain of dependent shared-memory loads, which is what bounded this kernel."""
    c = np.int64(0xFFFFFFFF)
    p = start
    end = start + n
    if aligned:
        while p < end and (p & 7) != 0:
            c = np.int64(slices[0, (c ^ np.int64(data[p])) & 0xFF]) ^ (c >> 8)
            p += 1
        while p + 8 <= end:
            c = _crc_word(c, words[p >> 3], slices)
            p += 8
    while p < end:
        c = np.int64(slices[0, (c ^ np.int64(data[p])) & 0xFF]) ^ (c >> 8)
        p += 1
    return c ^ 0xFFFFFFFF


@cuda.jit(device=True)
def _chunk_segment(i, rec_at, rec_len, seg_first):
    """Segment i of crc32_chunks: (its record, first byte, bytes, bytes of the record after it)."""
    R = rec_at.shape[0]
    lo = 0
    hi = R
    while hi - lo > 1:  # the record whose segments hold i
        mid = (lo + hi) >> 1
        if seg_first[mid] <= i:
            lo = mid
        else:
            hi = mid
    j = i - seg_first[lo]
    b0 = rec_at[lo] + CHUNK_HEADER_BYTES
    b1 = rec_at[lo] + rec_len[lo]
    if j == 0:  # bytes 0..35 of the header: everything before the CRC field
        start = rec_at[lo]
        n = np.int64(CHUNK_HEADER_BYTES - 4)
    else:
        cut = (b0 // CHUNK_CRC_SEGMENT + 1) * CHUNK_CRC_SEGMENT  # the first cut inside the body
        if j == 1:
            start = b0
            n = min(cut, b1) - b0
        else:
            start = cut + (j - 2) * CHUNK_CRC_SEGMENT
            n = min(np.int64(CHUNK_CRC_SEGMENT), b1 - start)
    after = b1 - (start + n)
    if j == 0:
        after = b1 - b0
    return lo, start, n, after


#: crc32_chunks' staging: each warp's 32 segments, STAGE_WORDS 8-byte words of each a round (a
#: row padded by one word, so that the lanes reading their own rows hit different banks).
STAGE_WORDS = 32
_STAGE_WARPS = BLOCK // 32  # (numba takes a shared array's shape from global constants, not expressions)
_STAGE_ROW = STAGE_WORDS + 1


@jit_kernel
def _crc_chunks_kernel(data, words, aligned, rec_at, rec_len, seg_first, out):
    """One thread per segment (BLOCK threads a block).  Where the data is 8-byte aligned, a warp
    loads its 32 segments' words together, 32 words of each segment a round, lane u taking word
    u of each (256 contiguous bytes a load, where one thread walking its own segment would
    touch a new line of memory at every step), into shared memory; then each lane takes its
    own segment's words from there.  Every thread runs every round (barriers); a segment holds
    at most CHUNK_CRC_SEGMENT // 8 words.  Its unaligned first and last bytes, one at a time."""
    slices = cuda.shared.array((8, 256), np.uint32)
    stage = cuda.shared.array((_STAGE_WARPS, 32, _STAGE_ROW), np.int64)
    wfirst = cuda.shared.array((_STAGE_WARPS, 32), np.int64)
    wcount = cuda.shared.array((_STAGE_WARPS, 32), np.int64)
    _fill_crc_slices(slices)
    i = cuda.grid(1)
    wp = cuda.threadIdx.x >> 5
    lane = cuda.threadIdx.x & 31
    live = i < seg_first[rec_at.shape[0]]
    rec = 0
    start = np.int64(0)
    n = np.int64(0)
    after = np.int64(0)
    if live:
        rec, start, n, after = _chunk_segment(i, rec_at, rec_len, seg_first)
    c = np.int64(0xFFFFFFFF)
    p = start
    end = start + n
    nw = np.int64(0)
    if aligned:
        while p < end and (p & 7) != 0:
            c = np.int64(slices[0, (c ^ np.int64(data[p])) & 0xFF]) ^ (c >> 8)
            p += 1
        nw = (end - p) >> 3
    wfirst[wp, lane] = p >> 3
    wcount[wp, lane] = nw
    cuda.syncthreads()
    if aligned:
        for r in range(0, CHUNK_CRC_SEGMENT // 8, STAGE_WORDS):
            u = r + lane
            for s in range(0, 32, 4):  # four loads in flight
                v0 = words[wfirst[wp, s] + u] if u < wcount[wp, s] else np.int64(0)
                v1 = words[wfirst[wp, s + 1] + u] if u < wcount[wp, s + 1] else np.int64(0)
                v2 = words[wfirst[wp, s + 2] + u] if u < wcount[wp, s + 2] else np.int64(0)
                v3 = words[wfirst[wp, s + 3] + u] if u < wcount[wp, s + 3] else np.int64(0)
                stage[wp, s, lane] = v0
                stage[wp, s + 1, lane] = v1
                stage[wp, s + 2, lane] = v2
                stage[wp, s + 3, lane] = v3
            cuda.syncthreads()
            for v in range(min(np.int64(STAGE_WORDS), nw - r)):
                c = _crc_word(c, stage[wp, lane, v], slices)
            cuda.syncthreads()
        p += 8 * nw
    while p < end:
        c = np.int64(slices[0, (c ^ np.int64(data[p])) & 0xFF]) ^ (c >> 8)
        p += 1
    c ^= 0xFFFFFFFF
    if live:
        if after > 0:  # crc(A + B) = crc(A) x^(8|B|) xor crc(B), for every later segment B at once
            c = multmodp(x8nmodp(after), c)
        cuda.atomic.xor(out, rec, c)


def chunk_crc_segments(rec_at: np.ndarray, rec_len: np.ndarray) -> np.ndarray:
    """seg_first for crc32_chunks (host side): each record's first segment, then the total.
    A record has its header segment and its body cut at multiples of CHUNK_CRC_SEGMENT."""
    b0 = np.asarray(rec_at, np.int64) + CHUNK_HEADER_BYTES
    b1 = np.asarray(rec_at, np.int64) + np.asarray(rec_len, np.int64)
    cut = (b0 // CHUNK_CRC_SEGMENT + 1) * CHUNK_CRC_SEGMENT
    counts = 2 + np.maximum(0, -(-(b1 - cut) // CHUNK_CRC_SEGMENT))
    first = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    return first


def crc32_chunks(data, words, rec_at, rec_len, seg_first, out, total_segments, stream=0):
    """out[k] (int64, zeroed by the caller) = the chunk_crc32 of the record at
    data[rec_at[k]:rec_at[k] + rec_len[k]]: zlib.crc32 of header bytes 0..35 and the body.
    words: data viewed as int64 (its first len // 8 words) when data starts 8-byte aligned,
    else None."""
    if total_segments == 0:
        return
    aligned = words is not None
    if not aligned:
        words = _placeholder((1,), np.int64)
    _crc_chunks_kernel[_grid(total_segments), BLOCK, stream](
        as_device(data), as_device(words), np.int64(aligned), as_device(rec_at), as_device(rec_len),
        as_device(seg_first), as_device(out)
    )


@jit_kernel
def _put_crc_kernel(out, rec_at, crc):
    i = cuda.grid(1)
    if i >= 4 * rec_at.shape[0]:
        return
    k = i // 4
    out[rec_at[k] + 36 + i % 4] = (crc[k] >> (8 * (i % 4))) & 0xFF


def put_crcs(out, rec_at, crc, stream=0):
    """Write crc[k] little-endian into the CRC field (bytes 36..39) of record k."""
    K = rec_at.shape[0]
    if K == 0:
        return
    _put_crc_kernel[_grid(4 * K), BLOCK, stream](as_device(out), as_device(rec_at), as_device(crc))
