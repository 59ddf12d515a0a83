"""CUDA kernels of the device-resident pipeline for the shared-table methods (format version
2: transform, with or without a rotation, and lossless): a cache tensor on the GPU -> the whole
.cgen file in a uint8 GPU tensor, and back, with the bytes and values of the CPU kernels.

The arithmetic that decides bytes is the shared ``register_jitable`` device functions
(transform.py: levels and refinement; tables.py: table choice and sharing costs; cdf.py:
codes and CDFs; range_coder.py: the coder), so every decision matches the CPU's; what
differs is who does what, so that every kernel has enough threads and adjacent threads
touch adjacent memory.

Who does what (host wrappers launch on ``stream`` without synchronising; V = channels per
thread, as many as one 8-byte word holds, see ``lanes``):
  nonfinite_layers   one thread per 8-byte word of the cache: flags the layers with NaN / Inf
  rotate_blocks      a block of threads per (128 tokens, layer, K/V, diagonal block, 128
                     outputs), 8 x 8 outputs per thread: the rotation (float64 rows out) and, on
                     decoding, its inverse (float32 out)
  fixed_rows,        one block per (token, layer, K/V), threads over the channels: the
  fixed_rows_out,    fixed-point rotation's integer rows (largest magnitude reduced in shared
  fixed_values       memory), their product scaled back to float32, the decoder's values x'
                     (float32 or bfloat16 words, saturating); the product between is cuBLAS's
  offset_sums        one thread per output channel: the offsets through the rotation, in order
  stats_partial      one thread per (layer, K/V, 256-token block, V channels): the block's sum
                     and sum of squares in token order (transform.STATS_BLOCK's tree)
  stats_reduce       one thread per (layer, K/V, channel): the block sums in block order
                     (reduce_stats; also the fixed-point product's partial sums)
  quantize_levels    one thread per (layer, K/V, chunk, V channels), walking the chunk's tokens:
                     levels (int8), refinement indices, and the chunk's level statistics
  split_levels       the same for the lossless method: top-byte symbols and statistics
  choose_tables      one thread per table: statistics over the chunks -> mode, lo, alphabet
  histogram          one block per (layer, K/V, 32 channels): 32 / V lanes x 8 V chunk slices,
                     counts in shared memory (rows padded to 257: no bank conflicts)
  build_tables       one thread per table: counts -> 4-bit codes -> CDF
  share_tables       one warp per (layer, K/V, 64 channels): channels in order, lanes over symbols
  coder_tables,
  symbol_bytes       one thread per table: packed coder rows, the lo / delta bytes
  encode_streams,
  decode_streams     one thread per stream, threads ordered (layer, K/V, group, chunk) so that
                     a warp's lanes read the same table rows; the encoder makes each symbol
                     from the levels as it codes (no symbol array)
  write_tables       one thread per table entry of the Params block
  write_streams      a warp per stream: its length and bytes
  write_raw          the raw sections: one thread per value (lossless) or per byte (refinement)
  layout_records     one thread: the records' places from the streams' sizes (a prefix sum)
  write_frame        one thread per chunk header (and its index entry), one for the index's
                     head, the trailer and the file header's params_size
  put_file_crcs      one thread per 2 KiB segment of the Params block and of the index, then
                     one for the header's and the index's CRC fields
  dequantize         one thread per (layer, K/V, chunk, V channels): symbols -> levels (token
                     delta) -> values (refinement bits read from the file), bfloat16 or
                     float32 out; the lossless join likewise
"""

from __future__ import annotations

import math

import numpy as np

from .launch import jit_kernel
from .cuda import BLOCK, CHUNK_CRC_SEGMENT, CHUNK_HEADER_BYTES, SIM, _bits_f32, _bits_f64, _block_max, _crc_span, _f32_bits, _fast_div, _fill_crc_slices, _grid, _placeholder, as_device, cuda, flat, item  # noqa: F401
from .cdf import codes_to_cum, counts_to_codes
from .coding_params import MASK32, PROB_BITS, PROB_TOTAL, RANGE_INIT, RANGE_TOP
from .crc import multmodp, x8nmodp
from .quantize import float_from_bits16
from . import rope as _rope
from . import fixed_rotation as _fx
from . import transform as _tr
from . import allocation as _allocation

import os as _os

#: Register caps per kernel: a lower cap lets more threads run per SM at the price of spills;
#: the bytes never change.  First chosen on the H200 on 2026-12-01 at 1f50d53 (docs/
#: benchmarks.md, history, night section); re-chosen for the 32-bit decoder and the word-writing
#: encoder on 2026-12-02 at 4dde434: `CACHEGEN_MAXREG=... python benchmarks/bench_device.py
#: --tokens 8192 --repeats 7 --methods high,balanced,lossless` with no change, decode=80,
#: decode=0, encode=64, encode=72 (docs/results/2026-12-02c_maxreg_4dde434.txt): encode=64 gave
#: 103-117 GB/s encode against 96-106 with no cap (82 registers), and the decoder without its
#: cap 108-115 decode against 101-106 with 64.
#: CACHEGEN_MAXREG="decode=64,encode=0,..." overrides them (0: no cap), for such measurements.
#: "quantize32": the levels kernel over 4-byte words (rotated rows, keys without their RoPE, a
#: float32 cache), whose stage took 1.45 ms at 64 against 1.71 at 96 for high+cal/head+rope on an
#: H100, where the bfloat16 words' kernel took 3.32 ms at 64 against 1.62 (2026-12-06, `bench_device.py
#: --maxreg`; docs/results/2026-12-06_maxreg_quantize32_a753f3e_h100.json, docs/benchmarks.md).
REG_CAPS = {"encode": 64, "dequantize": 64, "quantize": 96, "quantize32": 64}
REG_CAPS.update({k: int(v) for k, v in (item.split("=") for item in
                                        filter(None, _os.environ.get("CACHEGEN_MAXREG", "").split(",")))})


def _jit(role: str):
    """``jit_kernel`` (kernels/launch.py) with the register cap REG_CAPS gives ``role`` (none by default)."""
    cap = REG_CAPS.get(role)
    return jit_kernel(max_registers=cap) if cap and not SIM else jit_kernel

from .range_coder import _add_carry, flush_stream
from .tables import COST_ONE, SHARE_SPAN, STAT_EMPTY, choose_table, table_bytes
from .transform import (MODE_DELTA, STATS_BLOCK, TRANSFORM_QMAX, fast_level32, level_value,
                        refine_index, step_level, symbol_top_byte, token_level, token_value, top_byte_symbol)

#: Histogram blocks: 32 channels (lanes) x HIST_SLICES chunk slices (one under the simulator,
#: which runs every thread in Python).
HIST_SLICES = 1 if SIM else 8
HIST_ROW = 257  # 256 symbols + 1: rows start on different banks
#: CRC-32 segment of the header's Params block: one thread each.
PARAMS_CRC_SEGMENT = 2048
#: Threads that share one (table walk, stream copy): a warp, one thread under the simulator.
LANES = 1 if SIM else 32
#: Threads per coder block.
CODER_THREADS = 128
#: Shared memory a coder block may take for its tables (bytes): the default limit of a
#: launch without an opt-in attribute.
CODER_SHARED_BYTES = 48 * 1024
#: Entries of a packed table row in global memory: every symbol of an 8-bit alphabet + 1.
TAB_WIDTH = 257
#: Decoder lookup table per channel: one entry per 2**LUT_SHIFT of the probability scale.
LUT_SHIFT = 8
LUT_SIZE = PROB_TOTAL >> LUT_SHIFT


def _cfg(n: int, block: int = BLOCK):
    """(blocks, threads) for n threads of work; small launches get small blocks (the
    simulator starts every thread of a block)."""
    block = min(block, max(32, (n + 31) // 32 * 32))
    return _grid(n, block), block


#: Value words of the token-walking kernels: the cache's float32 / bfloat16 / float16 words,
#: or the float64 rows of a rotated cache (rotate_blocks).
FMT_FLOAT32, FMT_BFLOAT16, FMT_FLOAT16, FMT_FLOAT64 = 0, 1, 2, 3


@cuda.jit(device=True)
def _word_value(w, fmt):
    """float32 value of a value word: float32 bits (fmt 0), bfloat16 (1), float16 (2), float64
    bits (3, rounded to float32: what the statistics sum); the words are the tensor's raw
    int64 / int32 / int16 words."""
    w = np.int64(w)
    if fmt == 0:
        return _bits_f32(w)
    if fmt == 1:
        return _bits_f32((w & 0xFFFF) << 16)
    if fmt == 3:
        return np.float32(_bits_f64(w))
    return float_from_bits16(w, 2)


@cuda.jit(device=True)
def _word_value64(w, fmt):
    """float64 value of a value word (what the levels are computed from): as _word_value, but
    a float64 word keeps all its bits."""
    if fmt == 3:
        return _bits_f64(np.int64(w))
    return np.float64(_word_value(w, fmt))


# ---------------------------------------------------------------- channels per thread
#
# The token-walking kernels (statistics, levels, histogram, values) give each thread V
# adjacent channels, read and written as one word of V values (8 bytes of 16-bit words, or
# 4 bytes of levels): a warp's loads are 8x wider than one channel per thread, and each
# thread's index arithmetic is shared by V values.  V is a compile-time constant (a kernel
# per V, made on first use), so the per-channel state stays in registers.


#: Bytes of values per thread of the token-walking kernels (see ``lanes``): "levels"
#: (statistics, levels), "histogram" (levels in), "values" (values out).  Benchmarks may
#: change them (benchmarks/bench_device.py --widths); the bytes do not depend on them.
WIDTH = {"levels": 8, "histogram": 4, "values": 8}


def lanes(C: int, itemsize: int, limit: int = 8) -> int:
    """Channels per thread: the most (a power of two) whose values fit ``limit`` bytes and
    divide C."""
    v = max(1, limit // itemsize)
    while v > 1 and C % v:
        v //= 2
    return v


#: numpy dtype of a word of n bytes
WORD_DTYPE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

_MADE: dict = {}


def _made(make, *key):
    """The kernel make(*key), compiled once per key."""
    kern = _MADE.get((make, key))
    if kern is None:
        kern = _MADE[(make, key)] = make(*key)
    return kern


@cuda.jit(device=True)
def _signed_word(w, nbytes):
    """The low nbytes of w as a signed integer (what an int8/16/32/64 array holds)."""
    if nbytes >= 8:
        return w
    w &= (np.int64(1) << (8 * nbytes)) - 1
    if w >= np.int64(1) << (8 * nbytes - 1):
        w -= np.int64(1) << (8 * nbytes)
    return w


@cuda.jit(device=True)
def _word_thread_of(i, P, K, CW):
    """(layer, plane, block or chunk, word) of thread i of a launch over (layer, P planes of it,
    K blocks or chunks, CW words of channels), word fastest: adjacent threads read adjacent words."""
    cw = i % CW
    r = i // CW
    p = r // K
    return p // P, p % P, r % K, cw


@cuda.jit(device=True)
def _word_thread(i, K, CW):
    """_word_thread_of over both planes of each layer: (layer, K/V, block or chunk, word)."""
    return _word_thread_of(i, 2, K, CW)


# ---------------------------------------------------------------- finite values


def _make_nonfinite(nvals, bits):
    vmask = (1 << bits) - 1

    @jit_kernel
    def kernel(wf, per_layer, emask, flags):
        # thread i reads words i, i + n, i + 2n, ... (n threads): coalesced, several loads in
        # flight per thread
        n = cuda.gridsize(1)
        for i in range(cuda.grid(1), wf.shape[0], n):
            w = np.int64(wf[i])
            bad = False
            for j in range(nvals):
                if ((w >> (bits * j)) & vmask & emask) == emask:
                    bad = True
            if bad:
                flags[i // per_layer] = 1  # every writer writes 1: no race that matters

    return kernel


#: Words per thread of nonfinite_layers.
NONFINITE_WORDS = 4


def nonfinite_layers(words, per_layer, exponent_mask, itemsize, flags, stream=0):
    """flags[l] = 1 (uint8 [L], zeroed by the caller) when layer l holds a NaN or an Inf: a
    value whose exponent bits (exponent_mask) are all ones.  words: the cache's values as
    flat words of 8 // itemsize values (or 1 per word), per_layer words per layer."""
    n = words.shape[0]
    if n == 0:
        return
    nvals = words.dtype.itemsize // itemsize
    _made(_make_nonfinite, nvals, 8 * itemsize)[(*_cfg(-(-n // NONFINITE_WORDS)), stream)](
        as_device(words), np.int64(per_layer), np.int64(exponent_mask), as_device(flags))


# ---------------------------------------------------------------- rotation (method 2)
#
# A rotated (layer, K/V) plane is a product of matrices per diagonal block h: Y_h = X_h R_h
# (X_h: the tokens x D channels of the block), and decoding multiplies by R_h's transpose.
# The format fixes each output's sum (transform.rotate_row): over the block's inputs in
# order, in float64, every product exact.  A tiled matrix product keeps that order when
# each thread owns whole outputs and walks the inner dimension in order (no split of the
# sum across threads or tensor cores); a fused multiply-add of an exact product rounds as
# the add alone, so the CPU's sums come out bit for bit.

#: Rotation tiles: ROT_TM tokens x ROT_TN outputs per block, ROT_RM x ROT_RN outputs per
#: thread (strided by the thread grid, so a warp's loads and stores are adjacent), ROT_TK
#: inputs per shared-memory step.  (Small under the simulator, which runs every thread.)
#: (128 x 128 tiles of 8 x 8: 1.6x the multiply-adds per second of 64 x 64 / 4 x 4 on the H200,
#: benchmarks/profile_rotation.py; still only ~3 of its ~17 T float64 multiply-adds per second.)
ROT_TM, ROT_TN, ROT_TK, ROT_RM, ROT_RN = (8, 8, 4, 2, 2) if SIM else (128, 128, 16, 8, 8)
ROT_FLAT = True


def _make_rotate(TM, TN, TK, RM, RN, wide, flat=True):
    """The rotation kernel for one tiling, its source written out with the RM x RN
    accumulators and the operands of each inner step as scalars.  ``flat``: the shared tiles
    as flat arrays indexed by unsigned integers (a signed index costs a wraparound test per
    access, and the kernel is bound by its integer instructions: Nsight Compute)."""
    NX = TN // RN  # threads along the outputs
    NY = TM // RM  # threads along the tokens
    NT = NX * NY
    acc = [f"acc_{i}_{j}" for i in range(RM) for j in range(RN)]
    ind = " " * 12
    src = [
        "def kernel(x, rot, t_first, y):",
        "    # block (token tile, (layer, K/V, block h, output tile)); thread (ty, tx) owns the",
        "    # outputs (t0 + ty + NY i, d0 + tx + NX j)",
        "    T = x.shape[2]", "    H = rot.shape[2]", "    D = rot.shape[3]",
        "    ntn = (D + TN - 1) // TN", "    bj = cuda.blockIdx.y", "    ot = bj % ntn", "    h = (bj // ntn) % H",
        "    p = bj // (ntn * H)", "    l = p // 2", "    kv = p % 2", "    tid = cuda.threadIdx.x",
        "    tx = tid % NX", "    ty = tid // NX",
        (f"    a_s = cuda.shared.array({TK * (TM + 1)}, np.float64)  # rows of TM + 1: the stores hit different banks"
         if flat else f"    a_s = cuda.shared.array(({TK}, {TM + 1}), np.float64)"),
        (f"    b_s = cuda.shared.array({TK * TN}, np.float64)" if flat
         else f"    b_s = cuda.shared.array(({TK}, {TN}), np.float64)"),
        *[f"    {a} = 0.0" for a in acc],
        "    t0 = t_first + cuda.blockIdx.x * TM", "    d0 = ot * TN", "    base = h * D",
        "    for k0 in range(0, D, TK):",
        "        for e in range(tid, TM * TK, NT):  # inputs: adjacent threads, adjacent channels",
        "            m = e // TK", "            kk = e % TK",
        "            v = 0.0  # past the block or the tokens: a zero, which changes no sum",
        "            if t0 + m < T and k0 + kk < D:",
        "                v = np.float64(np.float32(x[l, kv, t0 + m, base + k0 + kk]))",
        f"            a_s[np.uint32(kk * {TM + 1} + m)] = v" if flat else "            a_s[kk, m] = v",
        "        for e in range(tid, TK * TN, NT):",
        "            kk = e // TN", "            n = e % TN", "            v = 0.0",
        "            if k0 + kk < D and d0 + n < D:",
        "                v = np.float64(rot[l, kv, h, k0 + kk, d0 + n])",
        f"            b_s[np.uint32(kk * {TN} + n)] = v" if flat else "            b_s[kk, n] = v",
        "        cuda.syncthreads()",
        "        for kk in range(TK):  # in order: every output's sum runs over c = 0 .. D - 1",
        *([f"{ind}ua = np.uint32(kk * {TM + 1} + ty)", f"{ind}ub = np.uint32(kk * {TN} + tx)"] if flat else []),
        *[(f"{ind}a_{i} = a_s[ua + np.uint32({NY * i})]" if flat else f"{ind}a_{i} = a_s[kk, ty + {NY * i}]")
          for i in range(RM)],
        *[(f"{ind}b_{j} = b_s[ub + np.uint32({NX * j})]" if flat else f"{ind}b_{j} = b_s[kk, tx + {NX * j}]")
          for j in range(RN)],
        *[f"{ind}acc_{i}_{j} += a_{i} * b_{j}" for i in range(RM) for j in range(RN)],
        "        cuda.syncthreads()",
    ]
    for i in range(RM):
        src += [f"    t = t0 + ty + {NY * i}", "    if t < T:"]
        for j in range(RN):
            value = f"acc_{i}_{j}" if wide else f"np.float32(acc_{i}_{j})"
            src += [f"        d = d0 + tx + {NX * j}", "        if d < D:", f"            y[l, kv, t, base + d] = {value}"]
    env = {"cuda": cuda, "np": np, "TM": TM, "TN": TN, "TK": TK, "NX": NX, "NY": NY, "NT": NT}
    exec(compile("\n".join(src), f"<rotate {TM}x{TN}x{TK}/{RM}x{RN}>", "exec"), env)
    return jit_kernel(env["kernel"]), NT


def rotate_blocks(x, rot, t_first, y, stream=0):
    """y[l, kv, t] = x[l, kv, t] R for the tokens t >= t_first (the others untouched), R the
    block-diagonal matrix of rot[l, kv] ([L, 2, H, D, D] float32 blocks): float64 y, the
    encoder's rotate_row (cpu_transform._fill_rows); float32 y, float32 of the sums (the
    decoder's inverse rotation, with rot its blocks transposed).  x: float32 [L, 2, T, C]."""
    L, _, T, C = x.shape
    H, D = rot.shape[2], rot.shape[3]
    n = T - t_first
    if n <= 0 or L == 0 or C == 0:
        return
    wide = y.dtype == np.float64
    kern, threads = _made(_make_rotate, ROT_TM, ROT_TN, ROT_TK, ROT_RM, ROT_RN, wide, ROT_FLAT)
    grid = (-(-n // ROT_TM), L * 2 * H * -(-D // ROT_TN))
    kern[grid, threads, stream](as_device(x), as_device(rot), np.int64(t_first), as_device(y))


# ---------------------------------------------------------------- fixed-point rotation (flags bit 3)
# The integer rows and their product (fixed_rotation.py: the same names and signatures on the
# CPU; the product itself is fixed_rotation.block_product, cuBLAS on integer-valued float64).

FIXED_ROW_THREADS = 32 if SIM else 128


@cuda.jit(device=True)
def _block_row():
    """(layer, K/V, row) of a row kernel's block: blockIdx (row, plane), plane = 2 layer + K/V."""
    p = cuda.blockIdx.y
    return p // 2, p % 2, cuda.blockIdx.x


def _make_fixed_rows(bf16):
    """The row kernel for float32 rows, or (``bf16``) for the cache's own bfloat16 words (int16):
    widened exactly in registers, so a bfloat16 cache needs no float32 copy."""

    @cuda.jit(device=True)
    def bits_of(w):
        if bf16:
            return (np.int64(w) & 0xFFFF) << 16
        return _f32_bits(w)

    @jit_kernel
    def kernel(x, t_first, X, e):
        # one block per row: blockIdx (token, plane); its threads stride over the channels, the
        # largest magnitude's bits reduced in shared memory (integers: any order), then each
        # thread writes the integers of its channels (adjacent threads, adjacent words)
        C = x.shape[3]
        l, kv, t = _block_row()
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        top_s = cuda.shared.array(FIXED_ROW_THREADS, np.uint32)
        top = np.int64(0)
        for c in range(tid, C, nt):
            a = bits_of(x[l, kv, t_first + t, c]) & 0x7FFFFFFF
            if a > top:
                top = a
        ex = _fx.row_exponent(_block_max(top_s, tid, top, FIXED_ROW_THREADS))
        scale = math.ldexp(1.0, int(_fx.X_BITS - ex))
        for c in range(tid, C, nt):
            v = np.float64(_bits_f32(bits_of(x[l, kv, t_first + t, c])))
            X[l, kv, t, c] = _fx.round_even(v * scale)
        if tid == 0:
            e[l, kv, t] = ex

    return kernel


def fixed_rows(x, t_first, X, e, stream=0):
    """fixed_rotation.fixed_rows: one block of FIXED_ROW_THREADS per row.  x: float32 rows, or
    a bfloat16 cache's int16 words."""
    L, _, T, C = x.shape
    n = T - t_first
    if n <= 0 or L == 0 or C == 0:
        return
    kern = _made(_make_fixed_rows, x.dtype == np.int16)
    kern[(n, L * 2), FIXED_ROW_THREADS, stream](as_device(x), np.int64(t_first), as_device(X), as_device(e))


@jit_kernel
def _fixed_rows_out_kernel(Y, e, t_first, y):
    # blockIdx (token, plane), threads over the channels: no index division
    C = Y.shape[3]
    l, kv, t = _block_row()
    scale = math.ldexp(1.0, int(e[l, kv, t] - _fx.X_BITS - _fx.R_BITS))  # exact: see fixed_rotation
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        y[l, kv, t_first + t, c] = np.float32(Y[l, kv, t, c] * scale)


def fixed_rows_out(Y, e, t_first, y, stream=0):
    """fixed_rotation.fixed_rows_out: one block per row."""
    L, _, n, C = Y.shape
    if n <= 0 or L == 0 or C == 0:
        return
    _fixed_rows_out_kernel[(n, L * 2), FIXED_ROW_THREADS, stream](as_device(Y), as_device(e), np.int64(t_first),
                                                                 as_device(y))


@jit_kernel
def _offset_sums_kernel(offsets, rint_t, b):
    # one thread per output (l, kv, h D + i), its sum over j in order; adjacent threads read
    # adjacent words of the transposed blocks
    L, _, H, D, _ = rint_t.shape
    k = cuda.grid(1)
    if k >= L * 2 * H * D:
        return
    i = k % D
    h = (k // D) % H
    p = k // (D * H)
    l = p // 2
    kv = p % 2
    unit = math.ldexp(1.0, -_fx.R_BITS)
    acc = 0.0
    for j in range(D):
        acc = acc + np.float64(offsets[l, kv, h * D + j]) * (rint_t[l, kv, h, j, i] * unit)
    b[l, kv, h * D + i] = acc


def offset_sums(offsets, rint_t, b, stream=0):
    """fixed_rotation.offset_sums: one thread per output channel."""
    L, _, H, D, _ = rint_t.shape
    total = L * 2 * H * D
    if total == 0:
        return
    blocks, threads = _cfg(total)
    _offset_sums_kernel[blocks, threads, stream](as_device(offsets), as_device(rint_t), as_device(b))


def _make_fixed_values(bf16):
    """The values kernel writing float32, or (``bf16``) bfloat16 words rounded to nearest even
    and saturating (docs/format.md's cast, as rope.store_values on the CPU): one pass, no float32
    copy to cast."""

    @jit_kernel
    def kernel(A, steps, b, t_first, out):
        # blockIdx (token, plane), threads over the channels
        C = A.shape[3]
        l, kv, t = _block_row()
        unit = math.ldexp(steps[l, kv], -_fx.R_BITS)
        for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
            v = _fx.fixed_value(A[l, kv, t, c], unit, b[l, kv, c])
            if bf16:
                w = _bf16_nearest(v)
                if (w & 0x7FFF) == 0x7F80:  # rounded up to an infinity: the largest finite value
                    w -= 1
                out[l, kv, t_first + t, c] = np.int16(w)
            else:
                out[l, kv, t_first + t, c] = v

    return kernel


def fixed_values(A, steps, b, t_first, out, stream=0):
    """fixed_rotation.fixed_values: one block per row.  out: float32, or int16 for bfloat16
    words (saturating)."""
    L, _, n, C = A.shape
    if n <= 0 or L == 0 or C == 0:
        return
    kern = _made(_make_fixed_values, out.dtype == np.int16)
    kern[(n, L * 2), FIXED_ROW_THREADS, stream](as_device(A), as_device(steps), as_device(b), np.int64(t_first),
                                               as_device(out))


# ---------------------------------------------------------------- statistics (method 2)


def _value_mask(B):
    """Mask of one B-bit value in an int64 word (all bits for a float64 word)."""
    return (1 << B) - 1 if B < 64 else -1


@cuda.jit(device=True)
def _stats_thread(i, L, CW, part1):
    """(live, layer, plane, block, word) of thread i of a statistics launch over part1 [L, P,
    blocks, C]: P planes a layer summed, both or (1) its keys alone."""
    P = part1.shape[1]
    NB = part1.shape[2]
    l, kv, b, cw = _word_thread_of(i, P, NB, CW)
    return i < L * P * NB * CW, l, kv, b, cw


def _make_stats_partial(V, B):
    vmask = _value_mask(B)

    @jit_kernel
    def kernel(wf, L, T, CW, fmt, sink, part1, part2, WP):
        live, l, kv, b, cw = _stats_thread(cuda.grid(1), L, CW, part1)
        if not live:
            return
        p = WP * l + kv  # (WP: the planes a layer of the words holds, 2 or the keys alone)
        s1 = cuda.local.array(V, np.float64)
        s2 = cuda.local.array(V, np.float64)
        for j in range(V):
            s1[j] = 0.0
            s2[j] = 0.0
        t1 = min(T, (b + 1) * STATS_BLOCK)
        tb0 = max(sink, b * STATS_BLOCK)
        at = (p * T + tb0) * CW + cw
        w = np.int64(0)
        if tb0 < t1:
            w = np.int64(wf[at])
        for t in range(tb0, t1):
            wn = np.int64(0)
            if t + 1 < t1:  # the next token's load in flight while this one is summed
                wn = np.int64(wf[at + CW])
            for j in range(V):  # each channel in token order: the CPU's sums
                v = np.float64(_word_value((w >> (B * j)) & vmask, fmt))
                s1[j] += v
                s2[j] += v * v
            w = wn
            at += CW
        for j in range(V):
            part1[l, kv, b, cw * V + j] = s1[j]
            part2[l, kv, b, cw * V + j] = s2[j]

    return kernel


@jit_kernel
def _stats_reduce_kernel(part1, part2, sums, sumsq):
    i = cuda.grid(1)
    L, P, NB, C = part1.shape
    if i >= L * P * C:
        return
    c = i % C
    p = i // C
    l = p // P
    kv = p % P
    s1 = 0.0
    s2 = 0.0
    for b in range(NB):
        s1 += part1[l, kv, b, c]
        s2 += part2[l, kv, b, c]
    sums[l, kv, c] = s1
    sumsq[l, kv, c] = s2


def transform_stats(words, itemsize, fmt, sink, part1, part2, sums, sumsq, stream=0):
    """sums / sumsq [L, 2, C]: cpu_transform.transform_stats of an unrotated cache given as its
    raw words [L, 2, T, C / V], V = words.itemsize // itemsize values each; part1 / part2:
    float64 scratch [L, P, ceil(T / STATS_BLOCK), C].  P = 1: the key planes alone (the values'
    sums are not written), of words [L, 2, ...] or of the keys alone, words [L, 1, ...]."""
    L, P, NB, C = part1.shape
    CW = words.shape[3]
    V = C // CW if CW else 1
    WP = words.shape[1]
    if P not in (1, 2) or WP not in (P, 2) or sums.shape[:2] != (L, 2):
        raise ValueError(f"transform_stats: words {words.shape}, scratch {part1.shape}, sums {sums.shape}")
    if L * P * NB * CW:
        T = words.shape[2]
        _made(_make_stats_partial, V, 8 * itemsize)[(*_cfg(L * P * NB * CW), stream)](
            as_device(flat(words)), np.int64(L), np.int64(T), np.int64(CW), np.int64(fmt), np.int64(sink),
            as_device(part1), as_device(part2), np.int64(WP))
    reduce_stats(part1, part2, sums, sumsq, stream)


def reduce_stats(part1, part2, sums, sumsq, stream=0):
    """sums / sumsq [L, 2, C] from the statistics blocks' partial sums part1 / part2 [L, P,
    NB, C] (transform_stats'), added in block order from 0 as the CPU's."""
    L, P, NB, C = part1.shape
    if part2.shape != part1.shape or sums.shape[:2] != (L, 2) or sums.shape[2] != C or sumsq.shape != sums.shape:
        raise ValueError(f"reduce_stats: partial sums {part1.shape}, sums {sums.shape}")
    _stats_reduce_kernel[(*_cfg(L * P * C), stream)](as_device(part1), as_device(part2), as_device(sums),
                                                      as_device(sumsq))


# ---------------------------------------------------------------- steps (method 2)
#
# The offsets and steps of methods/transform.step_params from the sums on the device, so the
# encoder need not wait for them on the host.  The same IEEE operations as the CPU's
# (cpu_transform.plane_offsets_rms): products that feed a sum are rounded on their own
# (mul_rn), never fused into a multiply-add as the compiler would otherwise do, and the sum
# over channels follows numpy's pairwise tree (transform.pairwise_sum, shared with the CPU).

if SIM:
    @cuda.jit(device=True)
    def _mul_rn(x, y):
        return x * y
else:
    from numba.cuda import libdevice as _libdevice

    @cuda.jit(device=True)
    def _mul_rn(x, y):
        return _libdevice.dmul_rn(x, y)


@cuda.jit(device=True)
def _pairwise(a, n):
    """sum(a[:n]) in numpy's pairwise order: transform.pairwise_sum, the CPU's function, over
    this thread's local scratch."""
    return _tr.pairwise_sum(a, 0, n, cuda.local.array(64, np.int64), cuda.local.array(64, np.int64),
                            cuda.local.array(64, np.int64), cuda.local.array(64, np.float64))


@jit_kernel
def _plane_offsets_kernel(sums, sumsq, n, bf16_max, obits, offs, resid, bad):
    """One thread per (plane, channel): the channel's offset (its mean's bfloat16) and its
    squared residuals around it."""
    i = cuda.grid(1)
    L, _, C = sums.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    l = p // 2
    kv = p % 2
    fn = np.float64(n)
    s1 = sums[l, kv, c]
    s2 = sumsq[l, kv, c]
    if not (abs(s1) <= 1.7976931348623157e308 and abs(s2) <= 1.7976931348623157e308):
        bad[0] = 1  # a NaN or an Inf among the values: the caller raises check_finite's error
        s1 = 0.0
        s2 = 0.0
    mean = s1 / fn if n > 0 else 0.0
    mean = min(max(mean, -bf16_max), bf16_max)
    b = _bf16_bits(np.float32(mean))
    obits[l, kv, c] = b
    mf = _bits_f32(b << 16)
    offs[l, kv, c] = mf
    m = np.float64(mf)
    r = (s2 - _mul_rn(2.0 * m, s1)) + _mul_rn(fn * m, m)
    resid[l, kv, c] = 0.0 if r < 0.0 else r


@jit_kernel
def _plane_rms_kernel(resid, n, rms, every):
    """One thread per plane: sqrt(sum of the residuals / (n C)), the sum in numpy's order; of
    every plane (``every`` 1) or of the key planes alone (2)."""
    p = cuda.grid(1)
    L, _, C = resid.shape
    if p >= L * 2 or p % every:
        return
    rms[p] = math.sqrt(_pairwise(resid[p // 2, p % 2], C) / np.float64(max(n * C, 1)))


@jit_kernel
def _input_means_kernel(sums, sumsq, n, means, bad):
    """One thread per (plane, channel): cpu_transform.input_means32, and bad[0] = 1 when a sum
    is not finite."""
    i = cuda.grid(1)
    L, _, C = sums.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    s1 = sums[p // 2, p % 2, c]
    if not (abs(s1) <= 1.7976931348623157e308 and abs(sumsq[p // 2, p % 2, c]) <= 1.7976931348623157e308):
        bad[0] = 1  # a NaN or an Inf among the values: the caller raises check_finite's error
        s1 = 0.0
    means[p // 2, p % 2, c] = np.float32(s1 / np.float64(n)) if n > 0 else np.float32(0.0)


@jit_kernel
def _rotated_offsets_kernel(mu, n, bf16_max, obits, offs, term):
    """One thread per (plane, channel): cpu_transform.rotated_offsets_rms' offset and its term
    n m^2 - 2 m (n mu) of the plane's residuals."""
    i = cuda.grid(1)
    L, _, C = mu.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    l = p // 2
    kv = p % 2
    fn = np.float64(n)
    mean = min(max(mu[l, kv, c], -bf16_max), bf16_max)
    b = _bf16_bits(np.float32(mean))
    obits[l, kv, c] = b
    mf = _bits_f32(b << 16)
    offs[l, kv, c] = mf
    m = np.float64(mf)
    s1 = _mul_rn(mu[l, kv, c], fn)
    term[l, kv, c] = _mul_rn(fn * m, m) - _mul_rn(2.0 * m, s1)


@jit_kernel
def _rotated_rms_kernel(term, sumsq, n, rms):
    """One thread per plane: cpu_transform.rotated_offsets_rms' RMS."""
    p = cuda.grid(1)
    L, _, C = term.shape
    if p >= L * 2:
        return
    r = _pairwise(sumsq[p // 2, p % 2], C) + _pairwise(term[p // 2, p % 2], C)
    rms[p] = math.sqrt((0.0 if r < 0.0 else r) / np.float64(max(n * C, 1)))


_log_rn, _exp_rn, _allocate_rn = _allocation.make(_mul_rn)


@jit_kernel
def _plane_steps_kernel(rel, sensitivity, allocated, strength, min_step, max_step, scratch, sbits, steps):
    """One thread for every plane: the relative steps (allocated by a calibration's
    sensitivities when ``allocated``: they need every plane's RMS), then the steps and their
    bfloat16 bits.  scratch [4, P]: the RMS, then the allocation's logs, live logs, steps."""
    if cuda.grid(1) != 0:
        return
    P = rel.shape[0]
    rms = scratch[0]
    relp = scratch[3]
    if allocated:
        _allocate_rn(rel, rms, sensitivity, strength, min_step, max_step, relp, scratch[1], scratch[2],
                     cuda.local.array(64, np.int64), cuda.local.array(64, np.int64), cuda.local.array(64, np.int64),
                     cuda.local.array(64, np.float64))
    for p in range(P):
        step = (relp[p] if allocated else rel[p]) * rms[p]
        if not step > 1e-30:
            step = 1.0
        step = min(step, 3.0e38)
        sb = _bf16_bits(np.float32(step))
        sbits[p] = sb
        steps[p] = np.float64(_bits_f32(sb << 16))


def plane_steps(sums, sumsq, n, bf16_max, rel, obits, offs, sbits, steps, resid, scratch, bad, allocation=None,
                rms_sums=None, rotated=None, stream=0):
    """methods/transform.step_params on the device: from sums / sumsq [L, 2, C] (transform_stats)
    over n tokens and the relative steps rel [L, 2], obits (int32 [L, 2, C]: the offsets'
    bfloat16 bits), offs (float32 [L, 2, C]: their values), sbits (int32 [L, 2]) and steps
    (float64 [L, 2]); with ``allocation`` = (sensitivity float64 [L, 2], strength, MIN_STEP,
    ALLOCATION_MAX_STEP) the relative steps are allocated first (methods/transform.allocate)
    with kernels/allocation.py's arithmetic, the CPU's.  resid: float64
    [L, 2, C] and scratch: float64 [4, 2 L] scratch; bad[0] (int32, zeroed by the caller) = 1
    when a sum is not finite.  Three launches: a thread per channel, per plane, then one.
    ``rms_sums`` = (sums, sumsq, obits, offs): the sums the RMS comes from when they are not the
    coded values' (step_params' rms_sums: keys coded without their RoPE), and scratch for their
    offsets (int32 / float32 [L, 2, C]); two more launches.  ``rotated`` = (rint float64 [L, 2,
    H, D, D], means float32 [L, 2, C], mu float64 [L, 2, C]): sums / sumsq are the unrotated
    inputs' and the offsets and RMS are methods/transform.rotated_step_params' (the encoder's
    fixed-point blocks rint; means and mu scratch); with rms_sums, the key planes' RMS from
    them."""
    L, _, C = sums.shape
    if L == 0:
        return
    if rotated is not None:
        # methods/transform.rotated_step_params: the inputs' means through the rotation
        rint, means, mu = rotated
        _input_means_kernel[(*_cfg(2 * L * C), stream)](as_device(sums), as_device(sumsq), np.int64(n),
                                                        as_device(means), as_device(bad))
        offset_sums(means, rint, mu, stream)
        _rotated_offsets_kernel[(*_cfg(2 * L * C), stream)](as_device(mu), np.int64(n), np.float64(bf16_max),
                                                            as_device(obits), as_device(offs), as_device(resid))
        _rotated_rms_kernel[(*_cfg(2 * L), stream)](as_device(resid), as_device(sumsq), np.int64(n),
                                                    as_device(item(scratch, 0)))
    if rms_sums is not None:
        r1, r2, robits, roffs = rms_sums
        _plane_offsets_kernel[(*_cfg(2 * L * C), stream)](as_device(r1), as_device(r2), np.int64(n),
                                                          np.float64(bf16_max), as_device(robits), as_device(roffs),
                                                          as_device(resid), as_device(bad))
        _plane_rms_kernel[(*_cfg(2 * L), stream)](as_device(resid), np.int64(n), as_device(item(scratch, 0)),
                                                  np.int64(2 if rotated is not None else 1))
    if rotated is None:
        _plane_offsets_kernel[(*_cfg(2 * L * C), stream)](as_device(sums), as_device(sumsq), np.int64(n),
                                                          np.float64(bf16_max), as_device(obits), as_device(offs),
                                                          as_device(resid), as_device(bad))
    if rms_sums is None and rotated is None:
        _plane_rms_kernel[(*_cfg(2 * L), stream)](as_device(resid), np.int64(n), as_device(item(scratch, 0)),
                                                  np.int64(1))
    allocated = allocation is not None
    sensitivity, strength, min_step, max_step = allocation if allocated else (rel, 0.0, 0.0, 0.0)
    _plane_steps_kernel[(1, 1, stream)](as_device(flat(rel)),
                                        as_device(flat(sensitivity)),
                                        np.int64(allocated), np.float64(strength), np.float64(min_step),
                                        np.float64(max_step), as_device(scratch), as_device(flat(sbits)),
                                        as_device(flat(steps)))


# ---------------------------------------------------------------- levels and their statistics


@cuda.jit(device=True)
def _put_stats(stats, l, kv, k, c, mn, mx, ab, dmn, dmx, dab):
    stats[l, kv, k, c, 0] = mn
    stats[l, kv, k, c, 1] = mx
    stats[l, kv, k, c, 2] = ab
    stats[l, kv, k, c, 3] = dmn
    stats[l, kv, k, c, 4] = dmx
    stats[l, kv, k, c, 5] = dab


#: How far from a rounding decision (an integer, or an integer + the threshold) a level
#: computed with the step's reciprocal must be to be trusted: it is within 3 units in the
#: last place of the correctly rounded quotient, < 2e-12 below FAST_LEVEL_LIMIT.
FAST_LEVEL_EPS = 1.0e-9
FAST_LEVEL_LIMIT = 4096.0


@cuda.jit(device=True)
def _fast_level(y, off, step, inv, threshold):
    """transform.step_level(y, off, step, TRANSFORM_QMAX, threshold), the same integer: a
    multiplication by 1 / step decides unless the quotient is near a decision point, where
    the correctly rounded division of step_level does (a float64 division costs tens of
    instructions per value)."""
    v = (y - np.float64(off)) * inv
    a = abs(v)
    if a < FAST_LEVEL_LIMIT:
        whole = np.float64(np.int64(a))
        fa = a - whole
        if fa > FAST_LEVEL_EPS and fa < 1.0 - FAST_LEVEL_EPS and abs(fa - threshold) > FAST_LEVEL_EPS:
            qa = np.int64(whole)
            if fa >= threshold:
                qa += 1
            qa = min(qa, TRANSFORM_QMAX)
            return qa if v > 0 else -qa
    return np.int64(step_level(y, off, step, TRANSFORM_QMAX, threshold))


#: fast_level32 serves planes whose step lies within 2^+-STEP32_RANGE (its reciprocal a normal
#: float32 with room for the products); other planes take the float64 path throughout.
STEP32_RANGE = 2.0 ** 60


@cuda.jit(device=True)
def _stats_reset(j, prev, mn, mx, ab, dmn, dmx, dab):
    """Lane j's chunk statistics before its first token (which they give way to)."""
    prev[j] = 0
    mn[j] = np.int32(1 << 30)
    mx[j] = np.int32(-(1 << 30))
    ab[j] = 0
    dmn[j] = np.int32(1 << 30)
    dmx[j] = np.int32(-(1 << 30))
    dab[j] = 0


@cuda.jit(device=True)
def _stats_add(j, v, prev, mn, mx, ab, dmn, dmx, dab):
    """Lane j's level v of the next token into its chunk statistics (cpu_transform.level_stats':
    the levels' and the token deltas' minimum, maximum and sum of magnitudes)."""
    d = np.int32(v - prev[j])
    prev[j] = v
    mn[j] = min(mn[j], v)
    mx[j] = max(mx[j], v)
    ab[j] = np.int32(ab[j] + abs(v))
    dmn[j] = min(dmn[j], d)
    dmx[j] = max(dmx[j], d)
    dab[j] = np.int32(dab[j] + abs(d))


def _make_quantize(V, B, lossless, fmt):
    """Levels of V channels per thread: method 2's (token_level, refine_index), or the lossless
    method's top-byte symbols (then shift = 8 x the raw bytes per value).  fmt (FMT_*) is a
    constant of the kernel: no per-value branch on it.  The levels come from fast_level32
    where float32 decides them (about all), else _fast_level's float64: the same integers as
    step_level either way; the per-channel state is int32 (levels within +-255, a chunk's sums
    of |levels| within 255 x MAX_CHUNK_TOKENS)."""
    if V > 4:
        raise ValueError("quantize: at most 4 values a thread (levels packed in 32 bits)")
    vmask = _value_mask(B)
    try32 = not lossless and fmt != FMT_FLOAT64  # a float64 row's value is not a float32

    @_jit("quantize32" if B == 32 else "quantize")
    def kernel(wf, L, T, CW, sink, offsets, steps, threshold, thr32, t_ref, bits, chunk_tokens, shift, qf, ref,
               stats, emask, bad, k_first):
        i = cuda.grid(1)
        K = stats.shape[2]
        if i >= L * 2 * K * CW:
            return
        l, kv, k, cw = _word_thread(i, K, CW)
        if k < k_first:  # chunks whose levels the fixed-point product made (fix_levels)
            return
        p = 2 * l + kv
        c0 = cw * V
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        step = 1.0
        if not lossless:
            step = steps[l, kv]
        inv = 1.0 / step
        use32 = try32 and step > 1.0 / STEP32_RANGE and step < STEP32_RANGE
        inv32 = np.float32(inv)
        off = cuda.local.array(V, np.float32)
        lv = cuda.local.array(V, np.int32)  # a token's levels
        prev = cuda.local.array(V, np.int32)
        mn = cuda.local.array(V, np.int32)
        mx = cuda.local.array(V, np.int32)
        ab = cuda.local.array(V, np.int32)
        dmn = cuda.local.array(V, np.int32)
        dmx = cuda.local.array(V, np.int32)
        dab = cuda.local.array(V, np.int32)
        for j in range(V):
            off[j] = np.float32(0.0)
            if not lossless:
                off[j] = offsets[l, kv, c0 + j]
            _stats_reset(j, prev, mn, mx, ab, dmn, dmx, dab)  # (a chunk has at least one token)
        at = (p * T + t0) * CW + cw
        w = np.int64(0)
        if t0 < t1:
            w = np.int64(wf[at])
        wa = np.int64(0)
        if t0 + 1 < t1:
            wa = np.int64(wf[at + CW])
        for t in range(t0, t1):
            wn = np.int64(0)
            if t + 2 < t1:  # the loads of the next two tokens in flight while this one is quantized
                wn = np.int64(wf[np.uint64(at + 2 * CW)])  # unsigned: no negative-index wrap code
            # which case a token is does not depend on the lane: a warp takes one branch
            if lossless:
                for j in range(V):
                    x = (w >> (B * j)) & vmask
                    lv[j] = np.int32(top_byte_symbol(x >> shift))
                    if emask != 0 and (x & emask) == emask:  # NaN or Inf: the caller raises
                        bad[l] = 1
            elif t < sink:
                for j in range(V):
                    lv[j] = 0
            elif bits > 0 and t >= t_ref:  # refined
                for j in range(V):
                    y = _word_value64((w >> (B * j)) & vmask, fmt)
                    v = np.int32(token_level(y, np.float64(off[j]), step, TRANSFORM_QMAX, threshold, True, bits))
                    ref[l, kv, t - t_ref, c0 + j] = refine_index(y, np.float64(off[j]), step, v, bits)
                    lv[j] = v
            else:
                for j in range(V):
                    x = (w >> (B * j)) & vmask
                    done = False
                    if use32:
                        v, done = fast_level32(_word_value(x, fmt), off[j], inv32, thr32)
                    if not done:
                        v = np.int32(_fast_level(_word_value64(x, fmt), np.float64(off[j]), step, inv, threshold))
                    lv[j] = v
            qw = np.int64(0)
            for j in range(V):
                v = lv[j]
                qw |= np.int64(v & 0xFF) << (8 * j)
                _stats_add(j, v, prev, mn, mx, ab, dmn, dmx, dab)
            qf[np.uint64(at)] = _signed_word(qw, V)
            w = wa
            wa = wn
            at += CW
        for j in range(V):
            if t0 >= t1:  # no token (none is ever launched so): the statistics of nothing
                mn[j] = mx[j] = dmn[j] = dmx[j] = 0
            if lossless:  # no deltas: their statistics are the levels' (split_words')
                _put_stats(stats, l, kv, k, c0 + j, mn[j], mx[j], ab[j], mn[j], mx[j], ab[j])
            else:
                _put_stats(stats, l, kv, k, c0 + j, mn[j], mx[j], ab[j], dmn[j], dmx[j], dab[j])

    return kernel


def quantize_levels(words, itemsize, fmt, sink, offsets, steps, threshold, t_ref, bits, chunk_tokens, q, ref, stats,
                    stream=0, k_first=0):
    """Levels q (int8 [L, 2, T, C], given as words [L, 2, T, C / V] of V levels) of
    cpu_transform.transform_quantize, the refinement indices ref [L, 2, T - t_ref, C] of
    cpu_transform.transform_refine (tokens t_ref.. when bits > 0), and stats [L, 2, K, C, 6]
    (int32): per chunk, cpu_transform.level_stats' quantities.  words: the cache's raw words
    [L, 2, T, C / V], V values of ``itemsize`` bytes each.  ``k_first``: the chunks from it only
    (the others' levels and statistics left as they are)."""
    _levels(False, words, itemsize, fmt, sink, offsets, steps, threshold, t_ref, bits, chunk_tokens, 0, q, ref,
            stats, stream, k_first=k_first)


#: fixed_rotation_matmul.LEVEL_UNDECIDED: the product's level for a value float32 did not decide
LEVEL_UNDECIDED = -128


def _make_fix_levels(V):
    """The levels the fixed-point product wrote (fixed_rotation_matmul.rotate_rows(levels=...)),
    V a thread: each LEVEL_UNDECIDED decided by _fast_level from its value in y (written back),
    then per chunk the statistics quantize_levels makes."""

    @_jit("fix_levels")
    def kernel(qf, yf, L, T, CW, sink, offsets, steps, threshold, chunk_tokens, k_last, stats):
        i = cuda.grid(1)
        K = stats.shape[2]
        if i >= L * 2 * K * CW:
            return
        l, kv, k, cw = _word_thread(i, K, CW)
        if k >= k_last:  # a chunk with refined tokens: quantize_levels' (from its values)
            return
        p = 2 * l + kv
        c0 = cw * V
        C = CW * V
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        step = steps[l, kv]
        inv = 1.0 / step
        lv = cuda.local.array(V, np.int32)
        prev = cuda.local.array(V, np.int32)
        mn = cuda.local.array(V, np.int32)
        mx = cuda.local.array(V, np.int32)
        ab = cuda.local.array(V, np.int32)
        dmn = cuda.local.array(V, np.int32)
        dmx = cuda.local.array(V, np.int32)
        dab = cuda.local.array(V, np.int32)
        for j in range(V):
            _stats_reset(j, prev, mn, mx, ab, dmn, dmx, dab)
        at = (p * T + t0) * CW + cw
        w = np.int64(0)
        if t0 < t1:
            w = np.int64(qf[at])
        wa = np.int64(0)
        if t0 + 1 < t1:
            wa = np.int64(qf[at + CW])
        for t in range(t0, t1):
            wn = np.int64(0)
            if t + 2 < t1:  # the loads of the next two tokens in flight while this one is summed
                wn = np.int64(qf[np.uint64(at + 2 * CW)])
            undecided = False
            for j in range(V):
                v = np.int32((w >> (8 * j)) & 0xFF)
                if v >= 128:
                    v = np.int32(v - 256)
                if t < sink:
                    v = 0
                elif v == LEVEL_UNDECIDED:  # rare: the float64 path, from the value in y
                    y = np.float64(yf[(p * T + t) * C + c0 + j])
                    v = np.int32(_fast_level(y, np.float64(offsets[l, kv, c0 + j]), step, inv, threshold))
                    undecided = True
                lv[j] = v
            qw = np.int64(0)
            for j in range(V):
                v = lv[j]
                qw |= np.int64(v & 0xFF) << (8 * j)
                _stats_add(j, v, prev, mn, mx, ab, dmn, dmx, dab)
            if undecided:
                qf[at] = _signed_word(qw, V)
            w = wa
            wa = wn
            at += CW
        for j in range(V):
            if t0 >= t1:  # no token (none is ever launched so): the statistics of nothing
                mn[j] = mx[j] = dmn[j] = dmx[j] = 0
            _put_stats(stats, l, kv, k, c0 + j, mn[j], mx[j], ab[j], dmn[j], dmx[j], dab[j])

    return kernel


def fix_levels(q, y, sink, offsets, steps, threshold, chunk_tokens, k_last, stats, stream=0):
    """The chunks k < k_last of the fixed-point product's levels q (int8 [L, 2, T, C], given as
    words [L, 2, T, C / V] of V levels; fixed_rotation_matmul.rotate_rows(levels=...)): each
    LEVEL_UNDECIDED replaced by the level of its value in y (float32 [L, 2, T, C]) as
    quantize_levels gives it (_fast_level, step_level's integer), the sink tokens' levels 0, and
    stats [L, 2, K, C, 6] of those chunks as quantize_levels makes them; offsets float32 [L, 2,
    C], steps float64 [L, 2].  Reads one byte a value (and the rare undecided values)."""
    L, _, K, C, _ = stats.shape
    CW = q.shape[3]
    n = L * 2 * K * CW
    if n == 0 or k_last <= 0:
        return
    V = C // CW
    T = q.shape[2]
    _made(_make_fix_levels, V)[(*_cfg(n), stream)](
        as_device(flat(q)), as_device(flat(y)), np.int64(L), np.int64(T), np.int64(CW), np.int64(sink),
        as_device(offsets), as_device(steps), np.float64(threshold), np.int64(chunk_tokens), np.int64(k_last),
        as_device(stats))


def split_levels(words, itemsize, shift, chunk_tokens, q, stats, exponent_mask=0, bad=None, stream=0):
    """Lossless: q (uint8 [L, 2, T, C], as words of V symbols) = the coded symbol of each
    word's top byte (cpu_transform.split_words), and per-chunk statistics as quantize_levels
    (no deltas); words as quantize_levels'.  With an ``exponent_mask``, bad[l] (int32 [L],
    zeroed by the caller) = 1 when layer l holds a value whose exponent bits are all ones
    (NaN or Inf): the check of kvio.check_finite, fused into this pass over the cache."""
    offsets = np.zeros((1, 1, 1), np.float32) if SIM else _placeholder((1, 1, 1), np.float32)
    steps = np.zeros((1, 1), np.float64) if SIM else _placeholder((1, 1), np.float64)
    ref = np.zeros((1, 1, 1, 1), np.uint8) if SIM else _placeholder((1, 1, 1, 1), np.uint8)
    _levels(True, words, itemsize, 0, 0, offsets, steps, 0.5, 0, 0, chunk_tokens, shift, q, ref, stats, stream,
            exponent_mask, bad)


def _levels(lossless, words, itemsize, fmt, sink, offsets, steps, threshold, t_ref, bits, chunk_tokens, shift, q, ref,
            stats, stream, exponent_mask=0, bad=None, k_first=0):
    L, _, K, C, _ = stats.shape
    CW = words.shape[3]
    n = L * 2 * K * CW
    if n == 0:
        return
    if bad is None:
        bad = np.zeros(1, np.int32) if SIM else _placeholder((1,), np.int32)
    V = C // CW
    T = words.shape[2]
    _made(_make_quantize, V, 8 * itemsize, lossless, int(fmt))[(*_cfg(n), stream)](
        as_device(flat(words)), np.int64(L), np.int64(T), np.int64(CW), np.int64(sink),
        as_device(offsets), as_device(steps), np.float64(threshold), np.float32(threshold), np.int64(t_ref),
        np.int64(bits), np.int64(chunk_tokens), np.int64(shift), as_device(flat(q)), as_device(ref),
        as_device(stats), np.int64(exponent_mask), as_device(bad), np.int64(k_first))


# ---------------------------------------------------------------- tables


@jit_kernel
def _choose_kernel(stats, allow_delta, num_tokens, modes, lo, alphabet):
    i = cuda.grid(1)
    L, _, K, C, _ = stats.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    l = p // 2
    kv = p % 2
    mn = np.int64(STAT_EMPTY)
    mx = np.int64(-STAT_EMPTY)
    dmn = np.int64(STAT_EMPTY)
    dmx = np.int64(-STAT_EMPTY)
    ab = np.int64(0)
    dab = np.int64(0)
    for k in range(K):
        mn = min(mn, np.int64(stats[l, kv, k, c, 0]))
        mx = max(mx, np.int64(stats[l, kv, k, c, 1]))
        ab += np.int64(stats[l, kv, k, c, 2])
        dmn = min(dmn, np.int64(stats[l, kv, k, c, 3]))
        dmx = max(dmx, np.int64(stats[l, kv, k, c, 4]))
        dab += np.int64(stats[l, kv, k, c, 5])
    mode, base, a = choose_table(mn, mx, ab, dmn, dmx, dab, allow_delta, num_tokens)
    modes[l, kv, c] = mode
    lo[l, kv, c] = base
    alphabet[l, kv, c] = a


def choose_tables(stats, allow_delta, num_tokens, modes, lo, alphabet, stream=0):
    """Per table [L, 2, C]: tables.choose_table of the chunks' statistics (uint8 modes, int32
    lo and alphabet)."""
    L, _, _, C, _ = stats.shape
    _choose_kernel[(*_cfg(L * 2 * C), stream)](as_device(stats), np.int64(bool(allow_delta)), np.int64(num_tokens),
                                               as_device(modes), as_device(lo), as_device(alphabet))


def _make_histogram(V):
    HL = 32 // V  # threads across a tile of 32 channels

    @jit_kernel
    def kernel(qf, L, T, CW, lob, dmb, chunk_tokens, counts):
        hist = cuda.shared.array((32, HIST_ROW), np.int32)
        K = (T + chunk_tokens - 1) // chunk_tokens
        C = CW * V
        tiles = (C + 31) // 32
        p = cuda.blockIdx.x // tiles
        tile = cuda.blockIdx.x % tiles
        l = p // 2
        kv = p % 2
        tid = cuda.threadIdx.x
        lane = tid % HL
        part = tid // HL
        slices = cuda.blockDim.x // HL
        for j in range(tid, 32 * HIST_ROW, cuda.blockDim.x):
            hist[j // HIST_ROW, j % HIST_ROW] = 0
        cuda.syncthreads()
        c0 = tile * 32 + lane * V
        if c0 < C:
            cw = c0 // V
            low = np.int64(0)  # the V channels' lo bytes and delta masks, one byte each
            dmw = np.int64(0)
            for j in range(V):
                low |= np.int64(lob[l, kv, c0 + j]) << (8 * j)
                dmw |= np.int64(dmb[l, kv, c0 + j]) << (8 * j)
            per = (K + slices - 1) // slices
            for k in range(part * per, min(K, (part + 1) * per)):
                t0 = k * chunk_tokens
                t1 = min(T, t0 + chunk_tokens)
                at = (p * T + t0) * CW + cw
                pm = np.int64(0)
                w = np.int64(qf[at])
                for t in range(t0, t1):
                    wn = np.int64(0)
                    if t + 1 < t1:
                        wn = np.int64(qf[at + CW])
                    for j in range(V):  # byte arithmetic mod 256: the symbol whatever the signs
                        s = (((w >> (8 * j)) & 0xFF) - ((pm >> (8 * j)) & 0xFF) - ((low >> (8 * j)) & 0xFF)) & 0xFF
                        cuda.atomic.add(hist, (lane * V + j, s), 1)
                    pm = w & dmw
                    w = wn
                    at += CW
        cuda.syncthreads()
        for j in range(tid, 32 * 256, cuda.blockDim.x):
            r = j // 256
            cc = tile * 32 + r
            if cc < C:
                counts[l, kv, cc, j % 256] = hist[r, j % 256]

    return kernel


def histogram(q, lob, dmb, chunk_tokens, counts, stream=0):
    """counts [L, 2, C, 256] (int32) = the symbols of each table under its own mode and lo,
    over every token (cpu_transform.levels_to_symbols' counts); q: the levels as words
    [L, 2, T, C / V] of V bytes (V <= 4); lob / dmb (uint8 [L, 2, C]): each channel's own
    lo (low byte) and 0xFF where its mode is the token delta (symbol_bytes)."""
    L, _, T, CW = q.shape
    C = counts.shape[2]
    if T == 0:
        return
    V = C // CW
    blocks = L * 2 * ((C + 31) // 32)
    threads = (32 // V) * (1 if SIM else 8 * V)
    _made(_make_histogram, V)[blocks, threads, stream](as_device(flat(q)), np.int64(L), np.int64(T),
                                                        np.int64(CW), as_device(lob), as_device(dmb),
                                                        np.int64(chunk_tokens), as_device(counts))


@jit_kernel
def _symbol_bytes_kernel(lo, modes, lob, dmb):
    i = cuda.grid(1)
    L, _, C = lo.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    lob[p // 2, p % 2, c] = np.int64(lo[p // 2, p % 2, c]) & 0xFF
    dmb[p // 2, p % 2, c] = 0xFF if modes[p // 2, p % 2, c] == MODE_DELTA else 0


def symbol_bytes(lo, modes, lob, dmb, stream=0):
    """lob / dmb (uint8 [L, 2, C]): the low byte of each channel's lo, and 0xFF where its mode
    is the token delta, else 0: a symbol is (level - (previous level & dmb) - lob) mod 256
    at every token but a chunk's first (where the previous level counts as 0)."""
    L, _, C = lo.shape
    if L * C:
        _symbol_bytes_kernel[(*_cfg(L * 2 * C), stream)](as_device(lo), as_device(modes), as_device(lob),
                                                          as_device(dmb))


@jit_kernel
def _build_kernel(counts, alphabet, codes, cum):
    i = cuda.grid(1)
    L, _, C, _ = counts.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    l = p // 2
    kv = p % 2
    a = np.int64(alphabet[l, kv, c])
    # only the alphabet's entries: nothing reads codes or cum past them
    counts_to_codes(counts[l, kv, c, :a], a, codes[l, kv, c, :a])
    codes_to_cum(codes[l, kv, c, :a], a, cum[l, kv, c, : a + 1])


def build_tables(counts, alphabet, codes, cum, stream=0):
    """codes [L, 2, C, 256] and cum [L, 2, C, 257] of every table (cpu_transform.build_tables)."""
    L, _, C, _ = counts.shape
    _build_kernel[(*_cfg(L * 2 * C), stream)](as_device(counts), as_device(alphabet), as_device(codes),
                                              as_device(cum))


if SIM:

    @cuda.jit(device=True)
    def _warp_sum(v, scratch, lane):
        """Sum of v over the threads of the block (a single warp; one thread under the simulator)."""
        scratch[lane] = v
        cuda.syncthreads()
        total = np.int64(0)
        for j in range(cuda.blockDim.x):
            total += scratch[j]
        cuda.syncthreads()
        return total

else:

    @cuda.jit(device=True)
    def _warp_sum(v, scratch, lane):
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off //= 2
        return v


@jit_kernel
def _share_kernel(counts, lo, alphabet, modes, cum, cost, shared, ref):
    scratch = cuda.shared.array(32, np.int64)
    L, _, C = alphabet.shape
    spans = (C + SHARE_SPAN - 1) // SHARE_SPAN
    p = cuda.blockIdx.x // spans
    c_first = (cuda.blockIdx.x % spans) * SHARE_SPAN
    lane = cuda.threadIdx.x
    l = p // 2
    kv = p % 2
    r = np.int64(-1)
    for c in range(c_first, min(C, c_first + SHARE_SPAN)):
        a = np.int64(alphabet[l, kv, c])
        use = False
        if r >= 0 and modes[l, kv, c] == modes[l, kv, r]:
            shift = np.int64(lo[l, kv, c]) - np.int64(lo[l, kv, r])
            if shift >= 0 and shift + a <= alphabet[l, kv, r]:
                own = np.int64(0)
                other = np.int64(0)
                for s in range(lane, a, cuda.blockDim.x):
                    n = np.int64(counts[l, kv, c, s])
                    if n > 0:
                        own += n * cost[cum[l, kv, c, s + 1] - cum[l, kv, c, s]]
                        other += n * cost[cum[l, kv, r, s + shift + 1] - cum[l, kv, r, s + shift]]
                own = _warp_sum(own, scratch, lane) + np.int64(8 * COST_ONE) * table_bytes(a)
                other = _warp_sum(other, scratch, lane) + np.int64(8 * COST_ONE)
                use = other < own
        if lane == 0:
            shared[l, kv, c] = use
            ref[l, kv, c] = r if use else c
        if not use:
            r = c


def share_tables(counts, lo, alphabet, modes, cum, cost, shared, ref, stream=0):
    """tables.share_plane of every (layer, K/V) plane, a warp per SHARE_SPAN channels: shared
    [L, 2, C] (uint8) and ref [L, 2, C] (int32: the channel whose table each channel codes
    with).  cost: tables.SYMBOL_COST."""
    L, _, C = alphabet.shape
    blocks = L * 2 * ((C + SHARE_SPAN - 1) // SHARE_SPAN)
    _share_kernel[blocks, LANES, stream](as_device(counts), as_device(lo), as_device(alphabet), as_device(modes),
                                         as_device(cum), as_device(cost), as_device(shared), as_device(ref))


@jit_kernel
def _coder_table_kernel(cum, ref, lo, alphabet, tab, lo_eff, alphabet_eff, lut):
    i = cuda.grid(1)
    L, _, C, W = tab.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    l = p // 2
    kv = p % 2
    src = ref[l, kv, c]
    a = np.int64(alphabet[l, kv, src])
    for s in range(a):  # entries past the alphabet are never read: the last one stops the scans
        base = np.int64(cum[l, kv, src, s])
        e = base | ((np.int64(cum[l, kv, src, s + 1]) - base) << 16)
        if e >= np.int64(1) << 31:  # a frequency of PROB_TOTAL: the int32's sign bit
            e -= np.int64(1) << 32
        tab[l, kv, c, s] = e
    tab[l, kv, c, a] = PROB_TOTAL
    lo_eff[l, kv, c] = lo[l, kv, src]
    alphabet_eff[l, kv, c] = a
    if lut.shape[3] == LUT_SIZE:  # the decoder's lookup table (cpu.build_lut's)
        start = 0
        for s in range(a):
            end = min((np.int64(cum[l, kv, src, s + 1]) + (1 << LUT_SHIFT) - 1) >> LUT_SHIFT, LUT_SIZE)
            for b in range(start, end):
                lut[l, kv, c, b] = s
            start = max(start, end)


def coder_tables(cum, ref, lo, alphabet, tab, lo_eff, alphabet_eff, lut, stream=0):
    """Each channel's coding table, its own or the one it shares (ref): tab [L, 2, C, 257] int32
    holding the 32 bits cum[s] | freq[s] << 16 for its A symbols, then PROB_TOTAL at A (where
    the decoder's scan stops; later entries are not written), the lo and alphabet it codes with (params.expand_shared's) and,
    when lut is [L, 2, C, LUT_SIZE] (uint8), the decoder's lookup table: for each b the symbol
    s with cum[s] <= b << LUT_SHIFT < cum[s + 1] (cpu.build_lut), its first guess."""
    L, _, C, W = tab.shape
    n = L * 2 * C
    if n == 0:
        return
    _coder_table_kernel[(*_cfg(n), stream)](as_device(cum), as_device(ref), as_device(lo), as_device(alphabet),
                                            as_device(tab), as_device(lo_eff), as_device(alphabet_eff),
                                            as_device(lut))


@_jit("read_tables")
def _read_tables_kernel(blob, params_at, starts, source, method2, tab, lut, modes, lo_eff, alphabet_eff, bad):
    i = cuda.grid(1)
    L, _, C, W = tab.shape
    if i >= L * 2 * C:
        return
    c = i % C
    p = i // C
    l = p // 2
    kv = p % 2
    o = params_at + starts[source[i]]  # the entry's codes; mode, lo and alphabet - 1 before them
    mode = np.int64(blob[o - 3])
    base = np.int64(blob[o - 2])
    a = np.int64(blob[o - 1]) + 1
    ok = True
    if method2:
        if base >= 128:
            base -= 256
        ok = (mode == 0 or mode == 1) and base >= -TRANSFORM_QMAX and base + a - 1 <= TRANSFORM_QMAX and a <= 255
    else:
        ok = mode == 0 and base + a <= 256
    if ok and (a & 1) == 1 and (np.int64(blob[o + a // 2]) >> 4) != 0:
        ok = False  # a padding nibble
    if not ok:
        bad[0] = 1  # the caller reruns the CPU reader for the exact error
        mode = 0
        base = 0
        a = 1
    codes = cuda.local.array(256, np.uint8)
    cum = cuda.local.array(257, np.int32)
    for s in range(a):
        codes[s] = (np.int64(blob[o + s // 2]) >> (4 * (s & 1))) & 15 if ok else 0
    codes_to_cum(codes[:a], a, cum[: a + 1])
    for s in range(a):
        e = np.int64(cum[s]) | ((np.int64(cum[s + 1]) - np.int64(cum[s])) << 16)
        if e >= np.int64(1) << 31:
            e -= np.int64(1) << 32
        tab[l, kv, c, s] = e
    tab[l, kv, c, a] = PROB_TOTAL
    start = 0
    for s in range(a):
        end = min((np.int64(cum[s + 1]) + (1 << LUT_SHIFT) - 1) >> LUT_SHIFT, LUT_SIZE)
        for b in range(start, end):
            lut[l, kv, c, b] = s
        start = max(start, end)
    modes[l, kv, c] = mode
    lo_eff[l, kv, c] = base
    alphabet_eff[l, kv, c] = a


def read_tables(blob, params_at, starts, source, method2, tab, lut, modes, lo_eff, alphabet_eff, bad, stream=0):
    """The decoder's tables straight from the file's bytes: entry i's table is the entry
    source[i] (itself, or the own entry it shares), whose codes start at blob[params_at +
    starts[source[i]]] (params.parse_params(defer_tables=True)).  Writes tab, lut, modes,
    lo_eff and alphabet_eff as coder_tables does, and bad[0] = 1 when an entry breaks the
    format's rules (a mode, a range, a padding nibble: params.parse_tables' checks)."""
    L, _, C, _ = tab.shape
    n = L * 2 * C
    if n == 0:
        return
    _read_tables_kernel[(*_cfg(n), stream)](as_device(blob), np.int64(params_at), as_device(starts),
                                            as_device(source), np.int64(bool(method2)), as_device(tab),
                                            as_device(lut), as_device(modes), as_device(lo_eff),
                                            as_device(alphabet_eff), as_device(bad))


#: Threads of a stream_starts block (one block a chunk).
STARTS_BLOCK = 64


@jit_kernel
def _stream_starts_kernel(blob, lengths_at, payload_at, per, lens, starts, lens_c):
    # Block k: chunk k.  Thread t sums the lengths of its run of the chunk's streams, thread 0
    # turns the runs' sums into their first offsets (exclusive prefix sums, in shared memory),
    # then each thread writes its run's starts.
    k = cuda.blockIdx.x
    t = cuda.threadIdx.x
    size = blob.shape[0]
    run = (per + STARTS_BLOCK - 1) // STARTS_BLOCK
    s0 = min(per, t * run)
    s1 = min(per, s0 + run)
    base = k * per
    part = cuda.shared.array(STARTS_BLOCK, np.int64)
    total = np.int64(0)
    for s in range(s0, s1):
        a = lengths_at[k] + 2 * s
        v = np.int64(0)
        if a >= 0 and a + 1 < size:  # a corrupt index is checked after; reads stay in the file
            v = np.int64(blob[a]) | (np.int64(blob[a + 1]) << 8)
        lens[base + s] = v
        total += v
    part[t] = total
    cuda.syncthreads()
    if t == 0:
        acc = np.int64(0)
        for i in range(STARTS_BLOCK):
            v = part[i]
            part[i] = acc
            acc += v
    cuda.syncthreads()
    o = payload_at[k] + part[t]
    for s in range(s0, s1):
        st = min(o, size)
        lens_c[base + s] = max(np.int64(0), min(lens[base + s], size - st))
        starts[base + s] = st
        o += lens[base + s]


def stream_starts(blob, lengths_at, payload_at, per, lens, starts, lens_c, stream=0):
    """Every stream's length and start from the chunks' lengths sections: lens[k * per + s] =
    the u16 LE at blob[lengths_at[k] + 2 s] (0 where that is past the file), starts = payload_at[k]
    + the lengths before it in its chunk, capped at the file's size, lens_c = lens cut at the
    file's end (what the range decoder may read)."""
    K = lengths_at.shape[0]
    if K == 0 or per == 0:
        return
    _stream_starts_kernel[(K, STARTS_BLOCK, stream)](as_device(blob), as_device(lengths_at), as_device(payload_at),
                                                     np.int64(per), as_device(lens), as_device(starts),
                                                     as_device(lens_c))


# ---------------------------------------------------------------- the range coder
#
# One thread per stream, threads numbered (layer, K/V, group, chunk), chunk fastest: the
# lanes of a warp code the same group of channels in different chunks, so at each step they
# read the same table row (one or two cache lines: the tables stay in L1) and each reads
# its own symbols, eight at a time when a group is a whole number of 8-byte words.  Stream
# numbers, which order the lengths and the payload, stay the format's (chunk, layer, K/V,
# group).


@cuda.jit(device=True)
def _coder_thread(i, L, T, C, chunk_tokens, group):
    """Stream of coder thread i: (stream number, plane = layer * 2 + K/V, t0, t1, c0, c1), its
    tokens [t0, t1) and channels [c0, c1); stream number -1 past the last stream."""
    K = (T + chunk_tokens - 1) // chunk_tokens
    groups = (C + group - 1) // group
    k = i % K
    pair = i // K
    g = pair % groups
    plane = pair // groups
    s = (k * L * 2 + plane) * groups + g
    if i >= K * L * 2 * groups:
        s = -1
    t0 = k * chunk_tokens
    c0 = g * group
    return s, plane, t0, min(T, t0 + chunk_tokens), c0, min(C, c0 + group)


@cuda.jit(device=True)
def _put(out32, n, acc, b):
    """Byte b at position n of a stream: into acc, the word being filled (byte n at bits
    8 (n % 4)), and acc to the stream's word n // 4 once full.  A warp's lanes write different
    streams: four bytes a store instead of one cut the coder's memory transactions fourfold."""
    acc |= np.int64(b) << (8 * (n & 3))
    n += 1
    if (n & 3) == 0:
        out32[(n >> 2) - 1] = acc
        acc = np.int64(0)
    return n, acc


@cuda.jit(device=True)
def _emit(out32, n, acc, p, f, b):
    """Emit byte b.  The coder holds back its last byte below 0xFF (p, -1 before the first)
    and the 0xFF bytes after it (f of them): range_coder._add_carry's walk back over 0xFF
    bytes then happens in registers, not in reads of the bytes just written (a carry comes
    every ~15 symbols, and a warp waits for any lane's)."""
    if b == 0xFF and p >= 0:
        return n, acc, p, f + 1
    if p >= 0:
        n, acc = _put(out32, n, acc, p)
        for _ in range(f):
            n, acc = _put(out32, n, acc, 0xFF)
    return n, acc, b, 0


@cuda.jit(device=True)
def _add_carry_words(out, n, acc):
    """range_coder._add_carry(out, n) when bytes n & ~3 .. n - 1 are still in acc (_put)."""
    i = n - 1
    while i >= (n & ~3):
        sh = 8 * (i & 3)
        if ((acc >> sh) & 0xFF) != 0xFF:
            return acc + (np.int64(1) << sh)
        acc &= ~(np.int64(0xFF) << sh)
        i -= 1
    _add_carry(out, n & ~3)  # every byte in acc was 0xFF: the carry goes on into the written words
    return acc


@cuda.jit(device=True)
def _carry(out, out32, n, acc, p, f):
    """Add one to the big-endian number out[:n], p, f x 0xFF (range_coder._add_carry)."""
    if p < 0:  # nothing emitted yet: nothing to add to (as _add_carry(out, 0))
        return n, acc, p, f
    p += 1
    if p == 256:  # only when the first byte was 0xFF: the written bytes take the carry
        p = 0
        acc = _add_carry_words(out, n, acc)
    if f == 0:
        return n, acc, p, 0
    n, acc = _put(out32, n, acc, p)  # the 0xFF bytes became zeros: the last one is the byte held back
    for _ in range(f - 1):
        n, acc = _put(out32, n, acc, 0)
    return n, acc, 0, 0


@cuda.jit(device=True)
def _code_symbol(low, rng, n, acc, p, f, out, out32, entry):
    """One symbol of range_coder.encode_stream (entry = cum | freq << 16), bytes held back
    as _emit says."""
    # 32 x 32 -> 64-bit products (the operands fit 32 bits): one wide multiply each
    r = np.int64(np.uint32(rng >> PROB_BITS))
    low += r * np.int64(np.uint32(entry & 0xFFFF))
    rng = r * np.int64(np.uint32((entry >> 16) & 0xFFFF))
    if low > MASK32:
        n, acc, p, f = _carry(out, out32, n, acc, p, f)
        low &= MASK32
    while rng < RANGE_TOP:
        n, acc, p, f = _emit(out32, n, acc, p, f, (low >> 24) & 0xFF)
        low = (low << 8) & MASK32
        rng <<= 8
    return low, rng, n, acc, p, f


@cuda.jit(device=True)
def _sub_bytes(x, y):
    """The four bytes of x - y, each mod 256 (x, y < 2^32): borrows stop at byte borders."""
    return (((x | 0x80808080) - (y & 0x7F7F7F7F)) ^ ((x ^ ~y) & 0x80808080)) & MASK32


@_jit("encode")
def _encode_kernel(qf, q64f, words8, lob, dmb, lob64, dmb64, tabf, W, L, T, C, chunk_tokens, group, slots, lengths):
    s, plane, t0, t1, c0, c1 = _coder_thread(cuda.grid(1), L, T, C, chunk_tokens, group)
    if s < 0:
        return
    trow0 = (plane * C + c0) * W  # channel c's table row: trow0 + (c - c0) * W
    out = slots[s]
    out32 = out.view(np.uint32)  # the same bytes as words (_put; a row is a whole number of words)
    low = np.int64(0)
    rng = np.int64(RANGE_INIT)
    n = 0
    acc = np.int64(0)
    p = np.int64(-1)  # the byte held back (_emit) and the 0xFF bytes after it
    f = 0
    if words8 and c1 - c0 == 8:
        # One word of 8 levels per token (the usual group): the table bytes and the previous
        # token's word stay in registers, and the next token's word is loaded while this one
        # is coded (otherwise each token would start with a wait for memory).
        bat = (plane * C + c0) // 8
        lw = np.int64(lob64[bat])
        dm = np.int64(dmb64[bat])
        stride = C // 8
        at = ((plane * T + t0) * C + c0) // 8
        prev = np.int64(0)  # a chunk's first token codes its levels themselves
        w_next = np.int64(0)
        if t0 < t1:
            w_next = np.int64(q64f[at])
        for t in range(t0, t1):
            w = w_next
            if t + 1 < t1:
                w_next = np.int64(q64f[np.uint64(at + stride)])
            at += stride
            pm = prev & dm
            tb = trow0  # channel c0 + 4 half + j's table row: one addition a symbol
            for half in range(2):
                sh = 32 * half
                sw = _sub_bytes(_sub_bytes((w >> sh) & MASK32, (pm >> sh) & MASK32), (lw >> sh) & MASK32)
                for j in range(4):
                    # unsigned: the index is never negative, and no wrap-around code is made for it
                    entry = np.int64(tabf[np.uint64(tb + ((sw >> (8 * j)) & 0xFF))])
                    tb += W
                    low, rng, n, acc, p, f = _code_symbol(low, rng, n, acc, p, f, out, out32, entry)
            prev = w
        t1 = t0  # done: the general loop below runs no token
    for t in range(t0, t1):
        # each symbol: (level - (previous level if token delta) - lo) mod 256 (symbol_bytes)
        if words8:
            at = ((plane * T + t) * C + c0) // 8
            bat = (plane * C + c0) // 8
            for wj in range((c1 - c0) // 8):
                w = np.int64(q64f[at + wj])
                pm = np.int64(0)
                if t > t0:
                    pm = np.int64(q64f[at + wj - C // 8]) & np.int64(dmb64[bat + wj])
                lw = np.int64(lob64[bat + wj])
                tb = trow0 + wj * 8 * W
                for half in range(2):  # 4 symbols at once per 32-bit half (bytewise mod 256)
                    sh = 32 * half
                    sw = _sub_bytes(_sub_bytes((w >> sh) & MASK32, (pm >> sh) & MASK32), (lw >> sh) & MASK32)
                    for j in range(4):
                        entry = np.int64(tabf[tb + (4 * half + j) * W + ((sw >> (8 * j)) & 0xFF)])
                        low, rng, n, acc, p, f = _code_symbol(low, rng, n, acc, p, f, out, out32, entry)
        else:
            at = (plane * T + t) * C
            for c in range(c0, c1):
                pm = np.int64(0)
                if t > t0:
                    pm = np.int64(qf[at + c - C]) & np.int64(dmb[plane * C + c])
                sym = (np.int64(qf[at + c]) - pm - np.int64(lob[plane * C + c])) & 0xFF
                entry = np.int64(tabf[trow0 + (c - c0) * W + sym])
                low, rng, n, acc, p, f = _code_symbol(low, rng, n, acc, p, f, out, out32, entry)
    if p >= 0:  # write what is held back (the 0 only pushes it out), then the CPU's flush
        n, acc, p, f = _emit(out32, n, acc, p, f, 0)
    for i in range(n & ~3, n):  # the last word's bytes so far, one by one
        out[i] = (acc >> (8 * (i & 3))) & 0xFF
    lengths[s] = flush_stream(low, rng, n, out)


def encode_streams(q, q64, lob, dmb, lob64, dmb64, tab, chunk_tokens, group, slots, lengths, stream=0):
    """Range-code every stream of the levels q [L, 2, T, C] (int8 levels or uint8 lossless
    symbols) with tab (coder_tables) and the symbol bytes lob / dmb of the tables the channels
    code with (symbol_bytes of lo_eff): slots[s] gets stream s (the format's order: chunk,
    layer, K/V, group), lengths[s] its length: the bytes of cpu_transform.encode_table_planes;
    slots' rows must be a whole number of 4-byte words (the coder writes words).
    q64, lob64, dmb64: the same as int64 words, used when group and C are multiples of 8
    (else any placeholders)."""
    L, _, T, C = q.shape
    n = lengths.shape[0]
    if n == 0:
        return
    if slots.shape[1] % 4:
        raise ValueError("encode_streams: slot rows must be whole 4-byte words")
    words8 = group % 8 == 0 and C % 8 == 0
    W = tab.shape[3]
    _encode_kernel[(*_cfg(n), stream)](
        as_device(flat(q)), as_device(flat(q64)), np.int64(words8), as_device(flat(lob)),
        as_device(flat(dmb)), as_device(flat(lob64)), as_device(flat(dmb64)),
        as_device(flat(tab)), np.int64(W), np.int64(L), np.int64(T), np.int64(C), np.int64(chunk_tokens),
        np.int64(group), as_device(slots), as_device(lengths))


@cuda.jit(device=True)
def _file_word(blob, blob64, n64, wi):
    """Bytes 8 wi .. 8 wi + 7 of the file as a little-endian int64: one aligned load within
    blob64 (the file's first n64 words), byte by byte past it (zeros past the file's end)."""
    if wi < n64:
        return np.int64(blob64[wi])
    w = np.int64(0)
    for b in range(8):
        if wi * 8 + b < blob.shape[0]:
            w |= np.int64(blob[wi * 8 + b]) << (8 * b)
    return w


@cuda.jit(device=True)
def _stream_byte(blob, blob64, n64, a, end, cur, left, wi, nxt):
    """(byte a of the file as a uint32, 0 at or past end; a + 1 and the word cache): cur holds
    the rest of word wi (its next byte lowest; ``left`` bytes), nxt word wi + 1, loaded one word
    ahead so that a stream's next word is in flight while the current one is decoded."""
    x = np.uint32(cur & 0xFF)
    if a >= end:
        x = np.uint32(0)
    cur >>= 8
    left -= 1
    if left == 0:
        wi += 1
        cur = nxt
        left = 8
        nxt = _file_word(blob, blob64, n64, wi + 1)
    return x, a + 1, cur, left, wi, nxt


@cuda.jit(device=True)
def _decode_symbol(code, rng, tabf, trow, lutf, lrow):
    """One symbol of range_coder.decode_stream, before the renormalisation: (symbol, code,
    rng), all three uint32.  The channel's lookup table (at lutf[lrow:]) gives the first
    candidate; the scan over its table row (tabf[trow:]) stops at the row's PROB_TOTAL entry
    at the latest.  32-bit arithmetic throughout: a valid stream keeps code < rng <= 2^32 - 1,
    and r * freq, r * cum < 2^32 (r < 2^17, freq, cum <= 2^15); a corrupt one wraps, decodes to
    some symbols of the table, and fails its chunk CRC."""
    r = np.uint32(rng >> PROB_BITS)
    # floor(code / r): a float32 quotient (code rounded to 24 bits, an approximate division)
    # is within 2 of it; the remainder of that guess fits an int32, and integer steps fix it
    qq = np.int32(_fast_div(code, r))
    rem = np.int32(code - np.uint32(qq) * r)
    while rem < 0:
        qq = np.int32(qq - 1)
        rem = np.int32(rem + r)
    while rem >= r:
        qq = np.int32(qq + 1)
        rem = np.int32(rem - r)
    if qq >= PROB_TOTAL:
        qq = np.int32(PROB_TOTAL - 1)
    s = np.int32(lutf[lrow + (qq >> LUT_SHIFT)])
    # the candidate's entry and the next one's cum, loaded together; a step reuses the next
    e0 = np.uint32(tabf[trow + s])
    e1 = np.uint32(tabf[trow + s + 1])
    while np.int32(e1 & 0xFFFF) <= qq:
        s = np.int32(s + 1)
        e0 = e1
        e1 = np.uint32(tabf[trow + s + 1])
    code = np.uint32(code - r * (e0 & 0xFFFF))
    rng = np.uint32(r * (e0 >> 16))
    return s, code, rng


@cuda.jit(device=True)
def _renormalize(code, rng, blob, blob64, n64, a, end, cur, left, wi, nxt):
    """range_coder.decode_stream's renormalisation: bytes shifted into code while rng < RANGE_TOP
    (_stream_byte's word cache); returns (code, rng, a, cur, left, wi, nxt)."""
    while rng < RANGE_TOP:
        y, a, cur, left, wi, nxt = _stream_byte(blob, blob64, n64, a, end, cur, left, wi, nxt)
        code = np.uint32((code << 8) | y)
        rng = np.uint32(rng << 8)
    return code, rng, a, cur, left, wi, nxt


@_jit("decode")
def _decode_kernel(blob, blob64, n64, starts, lens, tabf, W, lutf, L, T, C, chunk_tokens, group, symf, sym64f, words8):
    s, plane, t0, t1, c0, c1 = _coder_thread(cuda.grid(1), L, T, C, chunk_tokens, group)
    if s < 0:
        return
    trow0 = (plane * C + c0) * W
    lrow0 = (plane * C + c0) * LUT_SIZE
    a = np.int64(starts[s])
    end = a + np.int64(lens[s])
    wi = a >> 3
    cur = _file_word(blob, blob64, n64, wi) >> (8 * (a & 7))  # arithmetic shift: bytes are masked
    left = 8 - (a & 7)
    nxt = _file_word(blob, blob64, n64, wi + 1)
    code = np.uint32(0)
    for _ in range(4):
        x, a, cur, left, wi, nxt = _stream_byte(blob, blob64, n64, a, end, cur, left, wi, nxt)
        code = np.uint32((code << 8) | x)
    rng = np.uint32(RANGE_INIT)
    for t in range(t0, t1):
        if words8:
            at = ((plane * T + t) * C + c0) // 8
            for wj in range((c1 - c0) // 8):
                w = np.int64(0)
                tb = trow0 + wj * 8 * W
                lb = lrow0 + wj * 8 * LUT_SIZE
                for j in range(8):
                    x, code, rng = _decode_symbol(code, rng, tabf, tb + j * W, lutf, lb + j * LUT_SIZE)
                    code, rng, a, cur, left, wi, nxt = _renormalize(code, rng, blob, blob64, n64, a, end, cur, left,
                                                                    wi, nxt)
                    w |= np.int64(x) << (8 * j)
                sym64f[at + wj] = w
        else:
            at = (plane * T + t) * C
            for c in range(c0, c1):
                x, code, rng = _decode_symbol(code, rng, tabf, trow0 + (c - c0) * W, lutf,
                                              lrow0 + (c - c0) * LUT_SIZE)
                code, rng, a, cur, left, wi, nxt = _renormalize(code, rng, blob, blob64, n64, a, end, cur, left, wi,
                                                                nxt)
                symf[at + c] = x


def decode_streams(blob, blob64, starts, lens, tab, lut, chunk_tokens, group, sym, sym64, stream=0):
    """Decode every stream s = blob[starts[s]:starts[s] + lens[s]] (the format's order) into
    sym [L, 2, T, C] (uint8) with the coding tables tab and lookup tables lut (coder_tables);
    blob64: blob's first len // 8 bytes as int64 words (blob 8-byte aligned), else None;
    sym64: sym viewed as int64 words (group and C multiples of 8), else a placeholder.  The
    symbols of cpu_transform.decode_table_planes; a corrupt stream decodes to some symbols of
    the table (the chunk CRC is what reports it)."""
    L, _, T, C = sym.shape
    n = lens.shape[0]
    if n == 0:
        return
    n64 = 0 if blob64 is None else blob64.shape[0]
    if blob64 is None:
        blob64 = np.zeros(1, np.int64) if SIM else _placeholder((1,), np.int64)
    words8 = group % 8 == 0 and C % 8 == 0
    _decode_kernel[(*_cfg(n), stream)](as_device(blob), as_device(blob64), np.int64(n64), as_device(starts),
                                       as_device(lens), as_device(flat(tab)), np.int64(tab.shape[3]),
                                       as_device(flat(lut)), np.int64(L), np.int64(T), np.int64(C),
                                       np.int64(chunk_tokens), np.int64(group), as_device(flat(sym)),
                                       as_device(flat(sym64)), np.int64(words8))


# ---------------------------------------------------------------- the file's sections


@jit_kernel
def _tables_kernel(out, at, excl, shared, modes, lo, alphabet, codes):
    e = cuda.grid(1)
    L, _, C = alphabet.shape
    if e >= L * 2 * C:
        return
    c = e % C
    p = e // C
    l = p // 2
    kv = p % 2
    o = at + excl[e]
    if shared[l, kv, c]:
        out[o] = 2  # transform.MODE_SAME
        return
    a = np.int64(alphabet[l, kv, c])
    out[o] = modes[l, kv, c]
    out[o + 1] = np.int64(lo[l, kv, c]) & 0xFF
    out[o + 2] = a - 1
    for j in range((a + 1) // 2):
        hi = np.int64(0)
        if 2 * j + 1 < a:
            hi = np.int64(codes[l, kv, c, 2 * j + 1])
        out[o + 3 + j] = np.int64(codes[l, kv, c, 2 * j]) | (hi << 4)


def write_tables(out, at, excl, shared, modes, lo, alphabet, codes, stream=0):
    """The tables of the Params block (params.pack_tables) at out[at:]: entry e at at + excl[e]
    (excl: exclusive prefix sums of the entries' sizes, tables.table_bytes or 1 when shared)."""
    L, _, C = alphabet.shape
    n = L * 2 * C
    if n == 0:
        return
    _tables_kernel[(*_cfg(n), stream)](as_device(out), np.int64(at), as_device(excl), as_device(shared),
                                       as_device(modes), as_device(lo), as_device(alphabet), as_device(codes))


@jit_kernel
def _lengths_payload_kernel(out, out32, payload_at, lengths_at, lengths, excl, per, slots, slots32):
    # A warp per stream: lane 0 writes the u16 length; the lanes copy the stream's bytes, the
    # whole 4-byte words of the file inside them as words (each made of two slot words
    # shifted: a stream starts at any byte), the at most 3 + 3 bytes at its ends one by one
    # (the words there are shared with the streams beside it).  The encoder's "layout (device)"
    # stage, whose largest kernel this is, went from 0.66 to 0.59-0.60 ms for a high encode on an
    # H100 (bench_device.py's encode_stages_ms, docs/benchmarks.md, 2026-12-06 evening).
    s = cuda.grid(1) // LANES
    lane = cuda.threadIdx.x % LANES
    if s >= lengths.shape[0]:
        return
    k = s // per
    n = np.int64(lengths[s])
    if lane == 0:
        a = lengths_at[k] + 2 * (s - k * per)
        out[a] = n & 0xFF
        out[a + 1] = (n >> 8) & 0xFF
    o = payload_at[k] + excl[s] - excl[k * per]
    e = o + n
    src = slots[s]
    src32 = slots32[s]
    a0 = min((o + 3) & ~3, e)  # the first whole word of the file inside the stream
    a1 = max(e & ~3, a0)  # the end of the whole words
    for t in range(o + lane, a0, LANES):
        out[t] = src[t - o]
    for t in range(a1 + lane, e, LANES):
        out[t] = src[t - o]
    sh = 8 * ((a0 - o) & 3)  # every whole word's first byte sits at this bit offset of a slot word
    for w in range(a0 + 4 * lane, a1, 4 * LANES):
        j = (w - o) >> 2
        v = np.int64(src32[j]) & MASK32
        if sh:  # the next slot word holds the rest (inside the slot's row: w + 3 < e)
            v = (v >> sh) | ((np.int64(src32[j + 1]) & MASK32) << (32 - sh))
        v &= MASK32
        out32[w >> 2] = np.int32(v - ((v >> 31) << 32))  # the word's bits as an int32


def write_streams(out, out32, payload_at, lengths_at, lengths, excl, per, slots, slots32, stream=0):
    """Each chunk's stream lengths (u16 LE at lengths_at[k]) and streams (back to back from
    payload_at[k]; excl: exclusive prefix sums of all lengths; per: streams per chunk).
    out32: out's first len(out) // 4 bytes as int32 words; slots32: slots' rows as
    4-byte words (rows of whole words)."""
    n = lengths.shape[0]
    if n == 0:
        return
    if slots32.shape != (slots.shape[0], slots.shape[1] // 4) or out32.shape[0] != out.shape[0] // 4:
        raise ValueError(f"write_streams: word views {out32.shape}, {slots32.shape} of {out.shape}, {slots.shape}")
    if SIM:  # host arrays are copied in and back by the simulator, each view on its own, and the
        # later copy would undo the other's writes: one buffer, seen through both views in place
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        out, out32 = (FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in (out, out32))
    _lengths_payload_kernel[(*_cfg(LANES * n, 256), stream)](as_device(out), as_device(out32), as_device(payload_at),
                                                             as_device(lengths_at), as_device(lengths),
                                                             as_device(excl), np.int64(per), as_device(slots),
                                                             as_device(slots32))


@cuda.jit(device=True)
def _chunk_of(i, first):
    """The k with first[k] <= i < first[k + 1] (first: K + 1 non-decreasing offsets)."""
    lo_k = 0
    hi_k = first.shape[0] - 1
    while hi_k - lo_k > 1:
        mid = (lo_k + hi_k) >> 1
        if first[mid] <= i:
            lo_k = mid
        else:
            hi_k = mid
    return lo_k


@jit_kernel
def _raw_kernel(out, raw_at, raw_first, chunk_tokens, refine_start, bits, ref, L, T, C):
    i = cuda.grid(1)
    K = raw_first.shape[0] - 1
    if i >= raw_first[K]:
        return
    k = _chunk_of(i, raw_first)
    j = i - raw_first[k]
    t0 = k * chunk_tokens
    t1 = min(T, t0 + chunk_tokens)
    # refinement indices of the chunk's refined tokens, [L][2][n][C], bits each, LSB first
    r0 = max(t0, refine_start)
    nk = t1 - r0
    count = L * 2 * nk * C
    byte = np.int64(0)
    for bit in range(8):
        pos = 8 * j + bit
        idx = pos // bits
        if idx < count:
            c = idx % C
            r = (idx // C) % nk
            p = idx // (C * nk)
            v = np.int64(ref[p // 2, p % 2, r0 - refine_start + r, c])
            byte |= ((v >> (pos % bits)) & 1) << bit
    out[raw_at[k] + j] = byte


def _make_low_bytes(V, B):
    vmask = (1 << B) - 1

    @jit_kernel
    def kernel(out, raw_at, wf, T, CW, chunk_tokens, nraw):
        # a block per (layer, K/V, token) row: its index arithmetic once, V values per thread
        row = cuda.blockIdx.x
        p = row // T
        t = row - p * T
        k = t // chunk_tokens
        t0 = k * chunk_tokens
        tk = min(chunk_tokens, T - t0)
        base = raw_at[k] + (p * tk + (t - t0)) * (CW * V) * nraw
        for cw in range(cuda.threadIdx.x, CW, cuda.blockDim.x):
            w = np.int64(wf[row * CW + cw])
            o = base + cw * V * nraw
            for j in range(V):
                x = (w >> (B * j)) & vmask
                for b in range(nraw):
                    out[o + j * nraw + b] = (x >> (8 * b)) & 0xFF

    return kernel


@jit_kernel
def _scatter_kernel(out, src, src_first, dst_at):
    i = cuda.grid(1)
    if i >= src_first[src_first.shape[0] - 1]:
        return
    s = _chunk_of(i, src_first)
    out[dst_at[s] + i - src_first[s]] = src[i]


def scatter_bytes(out, src, src_first, dst_at, total, stream=0):
    """out[dst_at[s] + j] = src[src_first[s] + j] for every byte j of segment s of src
    (src_first: S + 1 non-decreasing offsets, total = src_first[S]): the bytes a file's host
    side made (header, index and trailer, chunk headers) put in place in one launch, a
    thread a byte."""
    if total == 0:
        return
    _scatter_kernel[(*_cfg(total), stream)](as_device(out), as_device(src), as_device(src_first),
                                            as_device(dst_at))


def write_raw(out, raw_at, raw_first, chunk_tokens, refine_start, bits, ref, words, itemsize, nraw, total, stream=0):
    """The chunks' raw sections: lossless low bytes (nraw > 0, from the cache's words) or the
    refinement indices (params.pack_refinement of ref [L, 2, R, C], tokens refine_start..);
    chunk k's at out[raw_at[k]:], raw_first its prefix sums (K + 1), total = raw_first[K].
    words: the cache's raw words [L, 2, T, C / V], V values of ``itemsize`` bytes each."""
    if total == 0:
        return
    L, _, T, CW = words.shape
    V = words.dtype.itemsize // itemsize
    if nraw > 0:
        _made(_make_low_bytes, V, 8 * itemsize)[L * 2 * T, min(BLOCK, max(32, -(-CW // 32) * 32)), stream](
            as_device(out), as_device(raw_at), as_device(flat(words)), np.int64(T), np.int64(CW),
            np.int64(chunk_tokens), np.int64(nraw))
        return
    _raw_kernel[(*_cfg(total), stream)](as_device(out), as_device(raw_at), as_device(raw_first),
                                        np.int64(chunk_tokens), np.int64(refine_start), np.int64(max(bits, 1)),
                                        as_device(ref), np.int64(L), np.int64(T), np.int64(CW * V))


# ---------------------------------------------------------------- encoding: the layout on the device
#
# The records' places depend on the streams' sizes, which only the device knows once it has
# coded them.  Placing them on the host costs a synchronisation in mid-call and then the host's
# arithmetic and launches while the device waits (~1.4 ms an 8192-token encode on the H200,
# benchmarks/host_stages.py); here the device places them, so every launch of an encode is
# queued before its one wait for the size.  ``lay`` (int64) holds, for K chunks:
#   [0K, 1K) rec_at   [1K, 2K) rec_sizes   [2K, 3K) raw_at   [3K, 4K) lengths_at
#   [4K, 5K) payload_at   [5K, 6K) payload   [6K, 7K] seg_first (crc32_chunks' segments)
#   7K + 1 + LAY_PARAMS_SIZE, LAY_INDEX_AT, LAY_TOTAL, LAY_PAYLOAD: the file's scalars

LAY_PARAMS_SIZE, LAY_INDEX_AT, LAY_TOTAL, LAY_PAYLOAD = 0, 1, 2, 3
LAY_SCALARS = 4


def layout_size(K: int) -> int:
    """Entries of a ``lay`` array for K chunks."""
    return 7 * K + 1 + LAY_SCALARS


@jit_kernel
def _layout_kernel(incl, tincl, raw, per, hb, fixed_size, params_at, tail_bytes, lay):
    # One thread: the chunks in order (a prefix sum over K records, K ~ tokens / 256).
    if cuda.grid(1) != 0:
        return
    K = raw.shape[0]
    E = tincl.shape[0]
    tables = tincl[E - 1] if E > 0 else np.int64(0)
    params_size = fixed_size + tables
    at = params_at + params_size
    prev = np.int64(0)
    seg = np.int64(0)
    for k in range(K):
        end = incl[(k + 1) * per - 1]
        payload = end - prev
        prev = end
        size = hb + raw[k] + 2 * per + payload
        lay[k] = at
        lay[K + k] = size
        lay[2 * K + k] = at + hb
        lay[3 * K + k] = at + hb + raw[k]
        lay[4 * K + k] = at + hb + raw[k] + 2 * per
        lay[5 * K + k] = payload
        # kernels/cuda.chunk_crc_segments: the header segment, then the body cut at multiples
        b0 = at + CHUNK_HEADER_BYTES
        cut = (b0 // CHUNK_CRC_SEGMENT + 1) * CHUNK_CRC_SEGMENT
        d = at + size - cut
        lay[6 * K + k] = seg
        seg += 2
        if d > 0:
            seg += (d + CHUNK_CRC_SEGMENT - 1) // CHUNK_CRC_SEGMENT
        at += size
    lay[7 * K] = seg
    s = 7 * K + 1
    lay[s + LAY_PARAMS_SIZE] = params_size
    lay[s + LAY_INDEX_AT] = at
    lay[s + LAY_TOTAL] = at + tail_bytes
    lay[s + LAY_PAYLOAD] = prev


def layout_records(incl, tincl, raw, per, hb, fixed_size, params_at, tail_bytes, lay, stream=0):
    """Fill ``lay`` (int64 [layout_size(K)]) from the streams' inclusive length sums ``incl``
    (K x per streams, chunk-major), the table entries' inclusive size sums ``tincl`` and the
    chunks' raw section sizes ``raw`` (K): the records from params_at + fixed_size + tables on,
    each hb + raw + 2 per + payload bytes; tail_bytes (index + trailer) after them."""
    _layout_kernel[1, 1, stream](as_device(incl), as_device(tincl), as_device(raw), np.int64(per), np.int64(hb),
                                 np.int64(fixed_size), np.int64(params_at), np.int64(tail_bytes), as_device(lay))


@cuda.jit(device=True)
def _put_le(out, at, value, nbytes):
    for b in range(nbytes):
        out[at + b] = (value >> (8 * b)) & 0xFF


@jit_kernel
def _frame_kernel(out, lay, raw, per, chunk_tokens, T, chunk_magic, index_magic, trailer_magic,
                  params_size_at):
    # Thread k < K: chunk k's 40-byte header (its CRC field zero: put_crcs) and its index entry;
    # thread K: the index's magic and count, the trailer, the file header's params_size.
    i = cuda.grid(1)
    K = raw.shape[0]
    if i > K:
        return
    s = 7 * K + 1
    index_at = lay[s + LAY_INDEX_AT]
    if i < K:
        a = lay[i]
        t0 = np.int64(i) * chunk_tokens
        _put_le(out, a, chunk_magic, 4)
        _put_le(out, a + 4, np.int64(i), 4)
        _put_le(out, a + 8, t0, 4)
        _put_le(out, a + 12, min(chunk_tokens, T - t0), 4)
        _put_le(out, a + 16, raw[i], 4)
        _put_le(out, a + 20, np.int64(0), 4)  # cdf_size: the tables are in the Params block
        _put_le(out, a + 24, 2 * per, 4)
        _put_le(out, a + 28, lay[5 * K + i], 4)
        _put_le(out, a + 32, np.int64(0), 8)  # reserved, then the CRC
        _put_le(out, index_at + 8 + 8 * i, a, 8)
        return
    _put_le(out, index_at, index_magic, 4)
    _put_le(out, index_at + 4, np.int64(K), 4)
    t = index_at + 12 + 8 * K
    _put_le(out, t, index_at, 8)
    _put_le(out, t + 8, trailer_magic, 8)
    _put_le(out, params_size_at, lay[s + LAY_PARAMS_SIZE], 4)


def _le(magic: bytes) -> np.int64:
    return np.int64(int.from_bytes(magic, "little", signed=True))


def write_frame(out, lay, raw, per, chunk_tokens, T, chunk_magic, index_magic, trailer_magic, params_size_at,
                stream=0):
    """The bytes placed by ``lay`` (layout_records): each chunk's header but its CRC, the chunk
    index but its CRC, the trailer, and the file header's params_size field (u32 at
    params_size_at): a thread per chunk and one more."""
    K = raw.shape[0]
    _frame_kernel[(*_cfg(K + 1), stream)](as_device(out), as_device(lay), as_device(raw), np.int64(per),
                                          np.int64(chunk_tokens), np.int64(T), _le(chunk_magic), _le(index_magic),
                                          _le(trailer_magic), np.int64(params_size_at))


@jit_kernel
def _file_spans_crc_kernel(data, words, aligned, lay, K, desc_len, nseg0, acc):
    # Segments [0, nseg0): the descriptor and Params block (from byte 64, desc_len +
    # params_size bytes; nseg0 covers the largest Params block); the rest: the index's body.
    slices = cuda.shared.array((8, 256), np.uint32)
    _fill_crc_slices(slices)
    j = cuda.grid(1)
    s = 7 * K + 1
    if j < nseg0:
        span = 0
        start = np.int64(64)
        size = desc_len + lay[s + LAY_PARAMS_SIZE]
    else:
        span = 1
        j -= nseg0
        start = lay[s + LAY_INDEX_AT]
        size = 8 + 8 * K
    a = j * PARAMS_CRC_SEGMENT
    if a >= size:
        return
    n = min(np.int64(PARAMS_CRC_SEGMENT), size - a)
    c = _crc_span(data, words, aligned, start + a, n, slices)
    after = size - (a + n)
    if after > 0:  # crc(A + B) = crc(A) x^(8|B|) xor crc(B): every segment shifted to its place
        c = multmodp(x8nmodp(after), c)
    cuda.atomic.xor(acc, span, c)


@jit_kernel
def _file_crcs_kernel(out, lay, K, desc_len, acc):
    # One block: the header's CRC (its first 60 bytes, a byte at a time, then the span summed
    # in acc[0]) and the index's (acc[1]), written in place.  (No int64 view of ``out`` here:
    # the simulator copies each array argument back after the launch, and an aliasing view's
    # copy would undo the writes.)
    slices = cuda.shared.array((8, 256), np.uint32)
    _fill_crc_slices(slices)
    if cuda.threadIdx.x != 0:
        return
    s = 7 * K + 1
    head = _crc_span(out, out, 0, np.int64(0), np.int64(60), slices)
    size = desc_len + lay[s + LAY_PARAMS_SIZE]
    _put_le(out, np.int64(60), acc[0] ^ multmodp(x8nmodp(size), head), 4)
    _put_le(out, lay[s + LAY_INDEX_AT] + 8 + 8 * K, acc[1], 4)


def put_file_crcs(out, words, lay, K, desc_len, params_max, acc, stream=0):
    """The file header's CRC-32 (bytes 0..59, the descriptor of desc_len bytes and the Params
    block of lay's params_size, <= params_max) at byte 60 and the chunk index's at its end, both
    summed on the device from lay's places.  words: out as int64 words when 8-byte aligned,
    else None; acc: int64 [2] scratch, zeroed by the caller.  Run after every byte they cover
    is written (the frame included)."""
    aligned = words is not None
    if not aligned:
        words = np.zeros(1, np.int64) if SIM else _placeholder((1,), np.int64)
    nseg0 = -(-(desc_len + params_max) // PARAMS_CRC_SEGMENT)
    nseg1 = -(-(8 + 8 * K) // PARAMS_CRC_SEGMENT)
    _file_spans_crc_kernel[(*_cfg(nseg0 + nseg1), stream)](as_device(out), as_device(words), np.int64(aligned),
                                                           as_device(lay), np.int64(K), np.int64(desc_len),
                                                           np.int64(nseg0), as_device(acc))
    _file_crcs_kernel[1, 256 if not SIM else 32, stream](as_device(out), as_device(lay), np.int64(K),
                                                         np.int64(desc_len), as_device(acc))


@jit_kernel
def _span_crc_kernel(data, words, aligned, start, size, segment, acc):
    slices = cuda.shared.array((8, 256), np.uint32)
    _fill_crc_slices(slices)
    j = cuda.grid(1)
    a = j * segment
    if a >= size:
        return
    n = min(segment, size - a)
    c = _crc_span(data, words, aligned, start + a, n, slices)
    after = size - (a + n)
    if after > 0:  # crc(A + B) = crc(A) x^(8|B|) xor crc(B): every segment shifted to its place
        c = multmodp(x8nmodp(after), c)
    cuda.atomic.xor(acc, 0, c)


@jit_kernel
def _span_crc_value_kernel(acc, crc_head, size, value):
    if cuda.grid(1) != 0:
        return
    value[0] = acc[0] ^ multmodp(x8nmodp(size), np.int64(crc_head))


def span_crc(data, words, start, size, crc_head, acc, value, stream=0):
    """value[0] (int64 [1]) = the CRC-32 that continues crc_head over data[start:start + size]
    (for a reader: the file header's CRC checked on the device); acc: int64 [1] scratch, zeroed
    by the caller."""
    aligned = words is not None
    if not aligned:
        words = np.zeros(1, np.int64) if SIM else _placeholder((1,), np.int64)
    nseg = (size + PARAMS_CRC_SEGMENT - 1) // PARAMS_CRC_SEGMENT
    if nseg:
        _span_crc_kernel[(*_cfg(nseg), stream)](as_device(data), as_device(words), np.int64(aligned), np.int64(start),
                                                np.int64(size), np.int64(PARAMS_CRC_SEGMENT), as_device(acc))
    _span_crc_value_kernel[1, 1, stream](as_device(acc), np.int64(crc_head), np.int64(size), as_device(value))


# ---------------------------------------------------------------- decoding: symbols -> values


@cuda.jit(device=True)
def _bf16_bits(v):
    """bfloat16 bits (0 .. 65535) of a float32 value, rounded to nearest even (as torch casts;
    no NaN here)."""
    u = np.uint32(_f32_bits(v))
    # every sum truncated to 32 bits (a NaN's carry out is dropped): the compiler keeps them 32-bit
    b = np.uint32(np.uint32(u + np.uint32(0x7FFF)) + np.uint32((u >> np.uint32(16)) & np.uint32(1)))
    return np.int64(b >> np.uint32(16))


@cuda.jit(device=True)
def _bf16_nearest(v):
    """_bf16_bits as a signed 16-bit number (what an int16 array holds)."""
    b = _bf16_bits(v)
    if b >= 32768:
        b -= 65536
    return b


@cuda.jit(device=True)
def _raw_bits(blob, at, pos, bits):
    """``bits`` bits (<= 8) of the bit string at blob[at:], from bit pos, least significant first."""
    o = at + (pos >> 3)
    sh = pos & 7
    v = np.int64(blob[o]) >> sh
    if sh + bits > 8:
        v |= np.int64(blob[o + 1]) << (8 - sh)
    return v & ((np.int64(1) << bits) - 1)


#: The dequantize kernel's float32 products serve steps below this (q x step stays finite).
STEP32_PRODUCT_LIMIT = 2.0 ** 120


def _make_dequantize(V, OB, method2, levels=False):
    """Values of V channels per thread, OB output bytes each (2: bfloat16 or 16-bit lossless
    words; 4: float32 bits or 32-bit lossless words); with ``levels`` (method 2, OB 2), the
    levels q' themselves as int16 words 256 q' - 1 (the fixed-point rotation's input).

    level_value's float32 value float32(q x step + offset), summed in float64, is computed
    in float32 where that is the same number: a level (|q| <= 255) times a bfloat16 step has at
    most 16 significant bits, so the float32 product is exact, and the float32 sum of it and
    the (float32) offset is the correctly rounded exact sum, as is float32 of the float64 sum
    (that sum is exact, or one term is below 2^-29 of the other, and both roundings give the
    larger term).  A step that is not a bfloat16 value, or so large that the product
    could overflow, takes the float64 path for its whole plane.  Levels and their token deltas
    are int32 (within +-2^31 for any valid or corrupt symbol stream: 255 x MAX_CHUNK_TOKENS)."""
    omask = (1 << (8 * OB)) - 1
    lo_level, hi_level = (-TRANSFORM_QMAX, TRANSFORM_QMAX) if method2 else (0, 255)

    @_jit("dequantize")
    def kernel(symf, L, T, CW, modes, lo_eff, chunk_tokens, sink, offsets, steps, refine_start, bits, blob, raw_at,
               nraw, outf, bad):
        i = cuda.grid(1)
        K = (T + chunk_tokens - 1) // chunk_tokens
        if i >= L * 2 * K * CW:
            return
        l, kv, k, cw = _word_thread(i, K, CW)
        p = 2 * l + kv
        C = CW * V
        c0 = cw * V
        t0 = k * chunk_tokens
        t1 = min(T, t0 + chunk_tokens)
        base = cuda.local.array(V, np.int32)
        delta = cuda.local.array(V, np.int32)  # all ones (token delta) or zero: a mask of prev
        off = cuda.local.array(V, np.float32)
        prev = cuda.local.array(V, np.int32)
        lv = cuda.local.array(V, np.int32)  # a token's levels
        for j in range(V):
            base[j] = lo_eff[l, kv, c0 + j]
            delta[j] = -1 if modes[l, kv, c0 + j] == MODE_DELTA else 0
            off[j] = 0.0
            if method2:
                off[j] = offsets[l, kv, c0 + j]
            prev[j] = 0
        step = 0.0
        if method2:
            step = steps[l, kv]
        step32 = np.float32(step)
        use32 = (np.float64(step32) == step and (_f32_bits(step32) & 0xFFFF) == 0
                 and abs(step) < STEP32_PRODUCT_LIMIT)
        r0 = max(t0, refine_start)
        nk = t1 - r0
        raw = raw_at[k]
        shift = 8 * nraw
        at = (p * T + t0) * CW + cw
        w = np.int64(0)
        if t0 < t1:
            w = np.int64(symf[at])
        for t in range(t0, t1):
            wn = np.int64(0)
            if t + 1 < t1:
                wn = np.int64(symf[np.uint64(at + CW)])  # unsigned: no negative-index wrap code
            first = t == t0
            for j in range(V):
                v = np.int32(np.int32((w >> (8 * j)) & 0xFF) + base[j])
                if not first:
                    v = np.int32(v + (prev[j] & delta[j]))
                prev[j] = v
                if v < lo_level or v > hi_level:  # docs/format.md: levels stay in range
                    bad[0] = 1
                lv[j] = v
            ow = np.int64(0)
            # which case a token is does not depend on the lane: a warp takes one branch
            if not method2:
                for j in range(V):
                    val = np.int64(symbol_top_byte(lv[j])) << shift
                    o = raw + ((((l * 2 + kv) * (t1 - t0)) + (t - t0)) * C + c0 + j) * nraw
                    for b in range(nraw):
                        val |= np.int64(blob[o + b]) << (8 * b)
                    ow |= (val & omask) << (8 * OB * j)
            elif t < sink:  # tokens below sink: the sink words, written afterwards
                ow = np.int64(0)
            elif bits > 0 and t >= refine_start:  # refined
                for j in range(V):
                    jj = _raw_bits(blob, raw, (((l * 2 + kv) * nk + (t - r0)) * C + c0 + j) * bits, bits)
                    val = np.int64(0)
                    if levels:
                        # 256 q' - 1, q' = v + (j - 2^(b-1) + 1) / 2^b (refined_value's, step 1
                        # and offset 0): an integer, as the product takes it
                        val = 256 * np.int64(lv[j]) - 1 + ((jj - (np.int64(1) << (bits - 1)) + 1) << (8 - bits))
                    else:
                        z = token_value(lv[j], jj, True, bits, off[j], step)
                        val = _bf16_bits(z) if OB == 2 else _f32_bits(z) & MASK32
                    ow |= (val & omask) << (8 * OB * j)
            elif levels:
                for j in range(V):
                    ow |= ((256 * np.int64(lv[j]) - 1) & omask) << (8 * OB * j)
            elif use32:  # a plane's choice, one branch (a choice per value had both paths computed)
                for j in range(V):
                    z = np.float32(lv[j]) * step32 + off[j]  # an exact product, one rounding
                    val = _bf16_bits(z) if OB == 2 else _f32_bits(z) & MASK32
                    ow |= val << (8 * OB * j)
            else:
                for j in range(V):
                    z = level_value(lv[j], off[j], step)
                    val = _bf16_bits(z) if OB == 2 else _f32_bits(z) & MASK32
                    ow |= val << (8 * OB * j)
            outf[np.uint64(at)] = _signed_word(ow, V * OB)
            w = wn
            at += CW

    return kernel


def dequantize(sym, modes, lo_eff, chunk_tokens, method2, sink, offsets, steps, refine_start, bits, blob, raw_at,
               nraw, out_bytes, out, bad, levels=False, stream=0):
    """Decoded symbols -> the cache: levels (symbols + lo, token deltas summed within each
    chunk: cpu_transform.symbols_to_levels), then method 2's values (token_value, refinement
    indices read from the chunks' raw sections at raw_at[k]) as bfloat16 bits (out_bytes 2)
    or float32 bits (out_bytes 4), tokens below sink left for the caller; or the lossless words
    (the top byte joined with the nraw raw low bytes).  sym: words [L, 2, T, C / V] of V
    symbols; out: words [L, 2, T, C / V] of V values of out_bytes each (``levels``: method 2's
    levels q' as int16 words 256 q' - 1, out_bytes 2; offsets and steps unused); bad[0] (int64) = 1
    when a level leaves the format's range (a token delta summed past it).  Same values as
    methods/transform.decode_v2 on the CPU."""
    L, _, T, CW = sym.shape
    K = (T + chunk_tokens - 1) // chunk_tokens
    n = L * 2 * K * CW
    if n == 0:
        return
    V = out.dtype.itemsize // out_bytes
    if levels and not (method2 and out_bytes == 2 and bits <= 8):
        raise ValueError("dequantize: levels words are method 2's, 2 bytes each, at most 8 refinement bits")
    _made(_make_dequantize, V, out_bytes, bool(method2), bool(levels))[(*_cfg(n), stream)](
        as_device(flat(sym)), np.int64(L), np.int64(T), np.int64(CW), as_device(modes), as_device(lo_eff),
        np.int64(chunk_tokens), np.int64(sink), as_device(offsets), as_device(steps), np.int64(refine_start),
        np.int64(bits), as_device(blob), as_device(raw_at), np.int64(nraw), as_device(flat(out)),
        as_device(bad))


# ---------------------------------------------------------------- keys without RoPE (flags bit 2)
#
# kernels/rope.py's arithmetic over dmul_rn (no product fused into a sum, as on the CPU).

_sincos_rn = _rope.make_sincos(_mul_rn)
_unturn_rn, _turn_rn = _rope.make_pair_ops(_mul_rn)


@jit_kernel
def _turn_keys_kernel(x, L, T, C, inv_freq, rows, F, style, rotary_dim, head_dim, pos0, t_first, sink, forward):
    """One thread per (layer, token, pair): the pair's angle once, then the pair in every head."""
    i = cuda.grid(1)
    if i >= L * T * F:
        return
    j = i % F
    t = (i // F) % T
    l = i // (F * T)
    if t_first + t < sink:
        return
    f = inv_freq[(l if rows > 1 else 0) * F + j]
    s, c = _sincos_rn(_mul_rn(float(pos0 + t_first + t), f))
    a, b = _rope.pair_channels(j, style, rotary_dim)
    base = (l * 2 * T + t) * C  # the key plane's row of token t
    for h in range(C // head_dim):
        ca = base + h * head_dim + a
        cb = base + h * head_dim + b
        if forward:
            x[ca], x[cb] = _turn_rn(float(x[ca]), float(x[cb]), s, c)
        else:
            x[ca], x[cb] = _unturn_rn(float(x[ca]), float(x[cb]), s, c)


@jit_kernel
def _rope_angles_kernel(inv_freq, rows, F, pos0, t_first, n, sin_out, cos_out):
    """One thread per (frequency row, token, pair): the angle's sine and cosine (kernels/rope.
    sincos over dmul_rn, as _turn_keys_kernel)."""
    i = cuda.grid(1)
    if i >= rows * n * F:
        return
    j = i % F
    t = (i // F) % n
    f = i // (F * n)
    s, c = _sincos_rn(_mul_rn(float(pos0 + t_first + t), inv_freq[f * F + j]))
    sin_out[i] = s
    cos_out[i] = c


def rope_angles(freq, rope, t_first, n, sin_out, cos_out, stream=0):
    """sin_out / cos_out (float64 [F, n, rotary_dim / 2]) = the sines and cosines of the angles
    (rope.position_start + t) x f of tokens t = t_first .. t_first + n - 1 and each row of
    ``freq`` (rope's frequencies [F, rotary_dim / 2], float64, on the device): what
    fixed_rotation_matmul's kernels turn the keys by."""
    F = rope.rotary_dim // 2
    rows = rope.inv_freq.shape[0]
    if rows * n * F == 0:
        return
    _rope_angles_kernel[(*_cfg(rows * n * F), stream)](
        as_device(flat(freq)), np.int64(rows), np.int64(F), np.int64(rope.position_start), np.int64(t_first),
        np.int64(n), as_device(flat(sin_out)), as_device(flat(cos_out)))


def turn_keys(x, freq, rope, t_first, sink, forward, stream=0):
    """In place on float32 x [L, 2, T, C] (tokens t_first ..): the keys' RoPE removed
    (forward False) or restored (True), as rope.turn_keys (the same signature), for the tokens at or
    past ``sink``.  ``rope``: format.params.Rope; ``freq``: its frequencies, float64, on the device."""
    L, _, T, C = x.shape
    F = rope.rotary_dim // 2
    n = L * T * F
    if n == 0:
        return
    _turn_keys_kernel[_grid(n), BLOCK, stream](
        as_device(flat(x)), np.int64(L), np.int64(T), np.int64(C), as_device(flat(freq)),
        np.int64(rope.inv_freq.shape[0]), np.int64(F), np.int64(rope.style), np.int64(rope.rotary_dim),
        np.int64(rope.head_dim), np.int64(rope.position_start), np.int64(t_first), np.int64(sink), bool(forward))
