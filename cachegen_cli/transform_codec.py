"""Format version 2: the transform (method 2) and lossless (method 3) codecs.

Encoding, on the whole cache (statistics are taken over every token, so the
tables are shared by all chunks and cost almost nothing next to the payload):

  method 2: [rotate] -> per-coordinate mean and per-(layer, K/V) RMS -> step =
            relative step x RMS -> levels -> direct or token-delta symbols per
            channel -> counts -> 4-bit-coded tables -> range-coded streams
  method 3: split each word into its top byte (coded) and low byte(s) (raw)

Chunks keep version 1's stream layout (chunk x layer x K/V x channel group), so a
chunk still decodes on its own given the file's header; the first ``sink_tokens``
tokens (attention sinks, with values far larger than the rest) are stored
verbatim in the header and quantized as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import container
from .calibration import Calibration, CalibrationError
from .config import ALLOCATION_MAX_STEP, ALLOCATION_STRENGTH, MIN_STEP, TransformConfig
from .container import Chunk, FileHeader
from .errors import ConfigError
from .kernels import cpu as cpu_kernels
from .kernels import cpu_transform as k2
from .kernels.coding_params import max_stream_bytes
from .kernels.tables import SYMBOL_COST
from .kernels.transform import MODE_DELTA, MODE_DIRECT, TRANSFORM_QMAX
from .kvio import KVCache
from .params import ITEMSIZE, METHOD_LOSSLESS, METHOD_TRANSFORM, Params, bf16_values, pack_refinement, unpack_refinement

_WORDS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits (round to nearest even) of float64 values, as torch rounds."""
    t = torch.from_numpy(np.ascontiguousarray(values, np.float64)).to(torch.float32).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def _source_words(data: torch.Tensor) -> np.ndarray:
    """The cache's raw words [L, 2, T, C] (uint16 or uint32)."""
    w = data.contiguous().view(_WORDS[data.dtype]).numpy()
    return w.view(np.uint16 if w.dtype == np.int16 else np.uint32)


@dataclass
class EncodedV2:
    header: FileHeader
    chunks: list[Chunk]


def make_header_v2(cache: KVCache, cfg: TransformConfig, chunk_tokens: int, params: Params, sink: int) -> FileHeader:
    rotated = params.calibration != bytes(32)
    return FileHeader(
        num_tokens=cache.num_tokens, num_layers=cache.num_layers, num_channels=cache.num_channels,
        chunk_tokens=chunk_tokens, num_chunks=-(-cache.num_tokens // chunk_tokens),
        group=container.choose_group_v2(chunk_tokens, cache.num_channels), dtype=cache.dtype_name,
        layout=cache.layout, bins=np.zeros((cache.num_layers, 2), np.int32), descriptor=cache.descriptor(),
        method=params.method, cdf_coding=container.CDF_CODING_SHARED, version=container.FORMAT_VERSION_2,
        flags=(container.FLAG_ROTATED if rotated else 0) | (container.FLAG_REFINED if params.refine_tokens else 0),
        sink_tokens=sink, params=params)


def _choose_tables(q: np.ndarray, chunk_tokens: int, allow_delta: bool, method: int):
    """Per table: mode, lo and alphabet from the levels' direct and delta ranges."""
    L, _, T, C = q.shape
    stats = np.empty((L, 2, C, 6), np.int64)
    k2.level_stats(q, chunk_tokens, stats)
    return tables_from_stats(stats, allow_delta, T)


def tables_from_stats(stats: np.ndarray, allow_delta: bool, T: int):
    """(modes, lo, alphabet) [L, 2, C] from level_stats' output."""
    L, _, C, _ = stats.shape
    mn, mx, ab, dmn, dmx, dab = (stats[..., i] for i in range(6))
    modes = np.full((L, 2, C), MODE_DIRECT, np.uint8)
    lo = mn.copy()
    alphabet = mx - mn + 1
    if allow_delta:
        # Delta pays when it shrinks the symbols' total magnitude (a cheap, integer
        # proxy for their entropy) and its range fits the table's int8 lo.
        use = (dab < ab) & (dmn >= -TRANSFORM_QMAX) & (dmx <= TRANSFORM_QMAX)
        modes[use] = MODE_DELTA
        lo = np.where(use, dmn, mn)
        alphabet = np.where(use, dmx - dmn + 1, alphabet)
    if T == 0:
        lo[:] = 0
        alphabet[:] = 1
    return modes, lo.astype(np.int64), alphabet.astype(np.int64)


def _code(h: FileHeader, q: np.ndarray, modes, lo, alphabet):
    """Symbols, tables and range-coded streams of the levels q; returns (codes, lengths, payload, offsets)."""
    L, _, T, C = q.shape
    ct, G = h.chunk_tokens, h.group
    width = int(alphabet.max(initial=1))
    sym = np.empty(q.shape, np.uint8)
    counts = np.empty((L, 2, C, width), np.int64)
    k2.levels_to_symbols(q, modes, lo, ct, sym, counts)
    codes = np.empty((L, 2, C, width), np.uint8)
    cum = np.empty((L, 2, C, width + 1), np.int32)
    k2.build_tables(counts, alphabet, codes, cum)
    # Neighbouring channels often have near-identical statistics (after a rotation they are
    # ordered by variance): a channel that codes about as well with the previous table
    # sends a one-byte reference instead of its own table.
    shared = np.zeros((L, 2, C), np.bool_)
    k2.share_tables(counts, lo, alphabet, modes, cum, SYMBOL_COST, shared, np.empty((L, 2, C), np.int64))
    if shared.any():
        modes, lo, alphabet, codes, cum = expand_shared(shared, modes, lo, alphabet, codes, cum)
        k2.levels_to_symbols(q, modes, lo, ct, sym, np.empty((L, 2, C, width), np.int64))
    K = h.num_chunks
    tab = np.empty((L, 2, C, width), np.uint32)
    lut = np.empty((L, 2, C, cpu_kernels.LUT_SIZE), np.uint8)
    k2.coder_tables(cum, alphabet, tab, lut)
    lengths = np.empty((K, L, 2, h.groups), np.int32)
    plane_bytes = np.empty(K * L * 2, np.int64)
    # One row per plane, big enough for its worst case; only the bytes written are touched.
    planes = np.empty((K * L * 2, h.groups * max_stream_bytes(ct * G)), np.uint8)
    k2.encode_table_planes(sym, tab.reshape(L, 2, C * width), ct, G, lengths, plane_bytes, planes)
    plane_offsets = np.zeros(K * L * 2 + 1, np.int64)
    np.cumsum(plane_bytes, out=plane_offsets[1:])
    payload = np.empty(int(plane_offsets[-1]), np.uint8)
    cpu_kernels.pack_streams(planes, plane_bytes, plane_offsets, payload)
    lengths = lengths.reshape(-1)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return codes, lengths, payload, offsets, shared, modes, lo, alphabet


def expand_shared(shared, *arrays):
    """Copy, along the channel axis of [L, 2, C, ...] arrays, each shared channel's entries
    from the last channel before it in its (layer, K/V) that has its own table."""
    C = shared.shape[2]
    idx = np.where(shared, 0, np.arange(C)[None, None, :])
    np.maximum.accumulate(idx, axis=2, out=idx)
    out = []
    for a in arrays:
        take = idx.reshape(idx.shape + (1,) * (a.ndim - 3))
        out.append(np.ascontiguousarray(np.take_along_axis(a, np.broadcast_to(take, idx.shape + a.shape[3:]), axis=2)))
    return out


def _chunks(h: FileHeader, lengths, payload, offsets, raw: np.ndarray | None, ref: np.ndarray | None = None) -> list[Chunk]:
    """Chunks from the streams; ``raw``: the lossless low bytes [L, 2, T, C, nraw];
    ``ref``: the refinement indices [L, 2, R, C] of the last R tokens."""
    L, ct = h.num_layers, h.chunk_tokens
    per = h.streams_per_chunk
    lengths = lengths.reshape(h.num_chunks, L, 2, h.groups)
    out = []
    empty = np.empty(0, np.uint8)
    r0 = h.refine_start
    for k in range(h.num_chunks):
        t0, t1 = k * ct, min(h.num_tokens, (k + 1) * ct)
        body = empty if raw is None else np.ascontiguousarray(raw[:, :, t0:t1]).reshape(-1)
        if ref is not None and t1 > r0:
            part = ref[:, :, max(t0, r0) - r0 : t1 - r0]
            body = np.frombuffer(pack_refinement(part, h.params.refine_bits), np.uint8)
        out.append(Chunk(k, t0, t1 - t0, body, empty, lengths[k], payload[offsets[k * per] : offsets[(k + 1) * per]]))
    return out


def allocate(rel: np.ndarray, rms: np.ndarray, sensitivity: np.ndarray) -> np.ndarray:
    """Relative steps [L, 2] scaled by the planes' allocation factors.

    A plane's expected damage is about sensitivity x (step x rms)^2 and its size about
    -log2(step) bits per value, so the smallest file at a given total damage has
    step_i ~ (rms_i^2 s_i)^(-1/2); the codec goes ``ALLOCATION_STRENGTH`` of the way
    (the sensitivities come from other caches: an estimate).  The factors have a
    geometric mean of 1 over the planes with any spread, so the mean log step (about the
    size) stays that of ``rel``.  Steps stay within [MIN_STEP, max(ALLOCATION_MAX_STEP, rel)]."""
    live = rms > 1e-30
    factor = np.ones_like(rel)
    if live.any():
        w = np.where(live, rms * rms * sensitivity, 1.0)
        logw = np.log(w)
        logw -= logw[live].mean()
        factor = np.where(live, np.exp(-0.5 * ALLOCATION_STRENGTH * logw), 1.0)
    return np.clip(rel * factor, MIN_STEP, np.maximum(ALLOCATION_MAX_STEP, rel))


def step_params(sums: np.ndarray, sumsq: np.ndarray, n: int, rel: np.ndarray, sensitivity: np.ndarray | None = None):
    """(offset bits, offsets, step bits, steps) from transform_stats' sums over n tokens;
    ``sensitivity`` [L, 2] (a calibration's) scales the relative steps ``rel`` (:func:`allocate`)."""
    C = sums.shape[2]
    mean = sums / n if n > 0 else np.zeros_like(sums)
    offsets_bits = _bf16_bits(mean)
    m = bf16_values(offsets_bits)
    # Residual energy around the stored (rounded) means: sum (v - m)^2 = sumsq - 2 m sum + n m^2.
    resid = np.maximum(sumsq - 2.0 * m * sums + n * m * m, 0.0).sum(axis=2)
    rms = np.sqrt(resid / max(n * C, 1))
    if sensitivity is not None:
        rel = allocate(rel, rms, sensitivity)
    step = rel * rms
    # A plane with no spread (all values equal to their means) gets any positive step: 1.
    step = np.where(step > 1e-30, step, 1.0)
    steps_bits = _bf16_bits(np.minimum(step, 3.0e38))
    return offsets_bits, m, steps_bits, bf16_values(steps_bits)


def encode_v2(cache: KVCache, cfg: TransformConfig, chunk_tokens: int,
              calibration: Calibration | None = None, device: str = "cpu") -> EncodedV2:
    """Encode a whole cache with method 2 or 3; returns the header and the chunks."""
    if device == "cuda":
        from .gpu_transform import encode_v2_gpu

        return encode_v2_gpu(cache, cfg, chunk_tokens, calibration)
    L, T, C = cache.num_layers, cache.num_tokens, cache.num_channels
    if cfg.method == "lossless":
        words = _source_words(cache.data)
        nraw = ITEMSIZE[cache.dtype_name] - 1
        q = np.empty(words.shape, np.int16)
        raw = np.empty(words.shape + (nraw,), np.uint8)
        k2.split_words(words, nraw, q, raw)
        modes, lo, alphabet = _choose_tables(q, chunk_tokens, False, METHOD_LOSSLESS)
        params = Params(METHOD_LOSSLESS, modes, lo, alphabet, np.zeros((L, 2, C, 1), np.uint8))
        h = make_header_v2(cache, cfg, chunk_tokens, params, 0)
        codes, lengths, payload, offsets, shared, modes, lo, alphabet = _code(h, q, modes, lo, alphabet)
        params.codes, params.shared, params.modes, params.lo, params.alphabet = codes, shared, modes, lo, alphabet
        return EncodedV2(h, _chunks(h, lengths, payload, offsets, raw))

    x = cache.data.to(torch.float32).contiguous().numpy() if cache.data.dtype != torch.float32 else cache.data.contiguous().numpy()
    sink = min(cfg.sink_tokens, T)
    rot, digest = encoder_rotation(calibration, L, C)
    sums = np.empty((L, 2, C), np.float64)
    sumsq = np.empty((L, 2, C), np.float64)
    k2.transform_stats(x, rot, sink, sums, sumsq)
    offsets_bits, m, steps_bits, steps = step_params(sums, sumsq, T - sink, cfg.steps_table(L),
                                                     plane_sensitivity(cfg, calibration))
    q, ref, R, bits = quantize_levels(k2, np.empty, x, rot, sink, m.astype(np.float32), steps, cfg, (L, T, C))
    del x
    modes, lo, alphabet = _choose_tables(q, chunk_tokens, cfg.token_delta, METHOD_TRANSFORM)
    params = Params(METHOD_TRANSFORM, modes, lo, alphabet, np.zeros((L, 2, C, 1), np.uint8), digest,
                    steps_bits, offsets_bits, sink_words(cache, sink), refine_tokens=R, refine_bits=bits)
    h = make_header_v2(cache, cfg, chunk_tokens, params, sink)
    codes, lengths, payload, offsets, shared, modes, lo, alphabet = _code(h, q, modes, lo, alphabet)
    params.codes, params.shared, params.modes, params.lo, params.alphabet = codes, shared, modes, lo, alphabet
    return EncodedV2(h, _chunks(h, lengths, payload, offsets, None, ref))


def encoder_rotation(calibration: Calibration | None, L: int, C: int) -> tuple[np.ndarray, bytes]:
    """(rotation [L, 2, C, C] or [0, 0, 0, 0], the Params block's calibration hash) for encoding."""
    if calibration is None:
        return np.zeros((0, 0, 0, 0), np.float32), bytes(32)
    calibration.check_shape(L, C)
    return calibration.rotation, calibration.sha256


def quantize_levels(kernels, empty, x, rot, sink: int, offsets, steps, cfg: TransformConfig, shape):
    """Levels [L, 2, T, C] and, for the last R tokens, refinement indices [L, 2, R, C] (None
    when R = 0), with ``kernels`` (cpu_transform or cuda_transform) on arrays from ``empty``;
    returns (q, ref, R, bits)."""
    L, T, C = shape
    q = empty((L, 2, T, C), np.int16)
    R, bits = refine_plan(cfg, T, sink)
    kernels.transform_quantize(x, rot, sink, offsets, steps, TRANSFORM_QMAX, float(cfg.rounding), T - R, bits, q)
    ref = None
    if R:
        ref = empty((L, 2, R, C), np.uint8)
        kernels.transform_refine(x, rot, T - R, offsets, steps, q, bits, ref)
    return q, ref, R, bits


def refine_plan(cfg: TransformConfig, T: int, sink: int) -> tuple[int, int]:
    """(refined tokens, bits): the config's last ``recent_tokens`` tokens past the sink tokens."""
    R = min(cfg.recent_tokens, T - sink) if cfg.recent_bits else 0
    return (R, cfg.recent_bits) if R > 0 else (0, 0)


def gather_refinement(h: FileHeader, chunks: list[Chunk]) -> np.ndarray:
    """The refinement indices [L, 2, R, C] of a refined file's last R tokens, from the chunks' raw sections."""
    L, C = h.num_layers, h.num_channels
    p = h.params
    parts = []
    for c in chunks:
        n = h.refined_in(c.first_token, c.token_count)
        if n:
            parts.append(unpack_refinement(c.scales, L * 2 * n * C, p.refine_bits).reshape(L, 2, n, C))
    if not parts:
        return np.zeros((L, 2, 0, C), np.uint8)
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def plane_sensitivity(cfg: TransformConfig, calibration: Calibration | None) -> np.ndarray | None:
    """The sensitivities the steps follow: the calibration's, unless the config says "none"."""
    if calibration is None or cfg.allocation == "none":
        return None
    return calibration.sensitivity


def sink_words(cache: KVCache, sink: int) -> np.ndarray:
    """The first ``sink`` tokens' raw words as bytes [L, 2, S, C, itemsize] (the Params block's sink)."""
    L, C = cache.num_layers, cache.num_channels
    words = cache.data[:, :, :sink].contiguous().cpu().view(torch.uint8).numpy()
    return words.reshape(L, 2, sink, C, ITEMSIZE[cache.dtype_name]).copy()


def gather_streams(chunks: list[Chunk]):
    """Every stream's length, start and bytes, chunks back to back: (lengths, offsets, payload)."""
    lengths = (np.concatenate([c.lengths.reshape(-1) for c in chunks]).astype(np.int32)
               if chunks else np.empty(0, np.int32))
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.concatenate([c.payload for c in chunks]) if chunks else np.empty(0, np.uint8)
    return lengths, offsets, payload


def gather_raw(h: FileHeader, chunks: list[Chunk]) -> np.ndarray:
    """The lossless method's raw low bytes of every chunk: [L, 2, T, C, nraw]."""
    L, C, nraw = h.num_layers, h.num_channels, h.raw_bytes_per_value
    if not chunks:
        return np.empty((L, 2, 0, C, nraw), np.uint8)
    return np.concatenate([c.scales.reshape(L, 2, c.token_count, C, nraw) for c in chunks], axis=2)


def check_calibration(h: FileHeader, calibration: Calibration | None) -> np.ndarray:
    """The rotation a file needs ([0, 0, 0, 0] when none), checked against its SHA-256."""
    p = h.params
    L, C = h.num_layers, h.num_channels
    rot = np.zeros((0, 0, 0, 0), np.float32)
    if h.rotated:
        if calibration is None:
            raise CalibrationError(
                f"this file was encoded with calibration {p.calibration.hex()[:16]}…; pass that calibration file "
                "(--calibration)")
        calibration.check_shape(L, C)
        if calibration.sha256 != p.calibration:
            raise CalibrationError(
                f"the calibration file ({calibration.sha256.hex()[:16]}…) is not the one this file was encoded "
                f"with ({p.calibration.hex()[:16]}…)")
        rot = calibration.rotation
    return rot


def decode_v2(h: FileHeader, chunks: list[Chunk], dtype: torch.dtype,
              calibration: Calibration | None = None, device: str = "cpu") -> torch.Tensor:
    """Decode all chunks of a version-2 file into [L, 2, T, C] of ``dtype``."""
    if device == "cuda":
        from .gpu_transform import decode_v2_gpu

        return decode_v2_gpu(h, chunks, dtype, calibration)
    p = h.params
    L, T, C = h.num_layers, h.num_tokens, h.num_channels
    rot = check_calibration(h, calibration)
    width = p.width
    cum = np.empty((L, 2, C, width + 1), np.int32)
    k2.cum_from_table_codes(p.codes, p.alphabet, cum)
    tab = np.empty((L, 2, C, width), np.uint32)
    lut = np.empty((L, 2, C, cpu_kernels.LUT_SIZE), np.uint8)
    k2.coder_tables(cum, p.alphabet, tab, lut)
    lengths, offsets, payload = gather_streams(chunks)
    sym = np.empty((L, 2, T, C), np.uint8)
    k2.decode_table_planes(payload, offsets, lengths, cum.reshape(L, 2, -1), lut.reshape(L, 2, -1), h.chunk_tokens,
                           h.group, sym)
    q = np.empty((L, 2, T, C), np.int16)
    k2.symbols_to_levels(sym, p.modes, p.lo, h.chunk_tokens, q)
    del sym
    if h.method == METHOD_LOSSLESS:
        nraw = h.raw_bytes_per_value
        raw = gather_raw(h, chunks)
        words = np.empty((L, 2, T, C), np.uint16 if nraw == 1 else np.uint32)
        k2.join_words(q, raw, nraw, words)
        signed = words.view(np.int16 if nraw == 1 else np.int32)
        return torch.from_numpy(signed).view(dtype)
    out = np.zeros((L, 2, T, C), np.float32)
    ref = gather_refinement(h, chunks)
    k2.transform_dequantize(q, rot, h.sink_tokens, bf16_values(p.offsets).astype(np.float32),
                            bf16_values(p.steps), h.refine_start, p.refine_bits, ref, out)
    data = torch.from_numpy(out).to(dtype)
    S = h.sink_tokens
    if S:
        sink = torch.from_numpy(np.ascontiguousarray(p.sink).reshape(-1)).view(dtype).reshape(L, 2, S, C)
        data[:, :, :S] = sink
    return data
