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

from ..format import container
from ..format.container import Chunk, FileHeader
from ..kernels.coding_params import max_stream_bytes
from . import staging


def _kernels():
    from ..kernels import cuda as cuda_kernels

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
#
# encode_file_device: a cache tensor -> the whole .cgen file in a uint8 device tensor;
# decode_device: such a tensor -> the [L, 2, T, C] cache.  Both run a fixed number of
# launches whatever the chunk count (no per-chunk Python loop), and cross to the host
# only small things: encoding, the chunks' payload sizes (one synchronisation: they
# place the records); decoding, the header, index and chunk headers it checks (a few
# hundred bytes each), then one [5, K] table of per-chunk results of the checks done on
# the device (CRC-32s, stream-length sums and maxima, padding nibbles, scales).
#
# Under numba's CUDA simulator (tests) the same code runs on CPU tensors: the kernels
# get numpy views of them.


def device_bytes(data) -> torch.Tensor:
    """.cgen bytes (bytes-like or a uint8 tensor) as a contiguous uint8 CUDA tensor."""
    if isinstance(data, torch.Tensor):
        return data.to("cuda").contiguous()
    if not len(data):
        return torch.zeros(0, dtype=torch.uint8, device="cuda")
    return upload_blob(data)


def to_host_bytes(blob: torch.Tensor) -> bytes:
    """A uint8 device tensor as ``bytes``, through the reused page-locked buffer (a
    pageable copy runs at a fraction of the link's speed)."""
    n = int(blob.numel())
    staging = _STAGING.get(n)
    staging.copy_(blob)  # synchronous: waits for the kernels that wrote blob
    return staging.numpy().tobytes()


#: Set by benchmarks/bench.py to a callable taking a stage name: called after each stage's
#: launches of encode_file_device / decode_device, so CUDA events can time the stages.
STAGE_HOOK = None


def _mark(name: str) -> None:
    if STAGE_HOOK is not None:
        STAGE_HOOK(name)


def _device() -> torch.device:
    return torch.device("cuda") if torch_cuda_ok() else torch.device("cpu")


def _nb(t: torch.Tensor):
    """The array a kernel takes for a tensor: a numba view of a CUDA tensor (no sync), or
    a numpy view of a CPU tensor (simulator)."""
    if t.is_cuda:
        return _kernels().as_device(t)
    return t.numpy()


_WS: dict = {}
#: encode_file_device / decode_device reuse _WS's buffers: one call at a time.
_LOCK = __import__("threading").RLock()


def _ws(name: str, shape, dtype, dev: torch.device, view=None):
    """A device buffer kept between calls, and its numba view (``view``: a dtype to view it
    as).  Making the view of a fresh torch tensor costs tens of microseconds of Python per
    array per launch, and while the GPU waits for the host that time is the GPU's too."""
    key = (tuple(shape), dtype, str(dev))
    e = _WS.get(name)
    if e is None or e["key"] != key:
        e = _WS[name] = {"key": key, "t": torch.empty(shape, dtype=dtype, device=dev), "nb": {}}
    nb = e["nb"].get(view)
    if nb is None:
        nb = e["nb"][view] = _nb(e["t"] if view is None else e["t"].view(view))
    return e["t"], nb


_CONSTS: dict = {}


def _consts(h: FileHeader, dev: torch.device) -> dict:
    """Per-shape device constants: maxq, each (layer, K/V) plane's offset inside a chunk's
    CDF-codes section, and where the padding nibbles of that section are."""
    key = (np.ascontiguousarray(h.bins, np.int32).tobytes(), h.num_channels, str(dev))
    c = _CONSTS.get(key)
    if c is None:
        nb = ((h.alphabets + 1) // 2).astype(np.int64).reshape(-1)
        plane_off = np.zeros(nb.size, np.int64)
        np.cumsum(nb[:-1] * h.num_channels, out=plane_off[1:])
        _, _, padded = container.nibble_maps(h, int(h.alphabets.max()))
        c = {
            "maxq": torch.as_tensor(np.ascontiguousarray(h.maxq, np.int32), device=dev),
            "plane_off": torch.as_tensor(plane_off.reshape(h.num_layers, 2), device=dev),
            "padded": torch.as_tensor(np.asarray(padded, np.int64), device=dev),
        }
        c["maxq_nb"], c["plane_off_nb"] = _nb(c["maxq"]), _nb(c["plane_off"])
        _CONSTS.clear()
        _CONSTS[key] = c
    return c


_CHUNK_HEADER_DTYPE = np.dtype([("magic", "S4"), ("index", "<u4"), ("first_token", "<u4"), ("token_count", "<u4"),
                                ("scales_size", "<u4"), ("cdf_size", "<u4"), ("lengths_size", "<u4"),
                                ("payload_size", "<u4"), ("reserved", "<u4"), ("crc", "<u4")])
assert _CHUNK_HEADER_DTYPE.itemsize == container.CHUNK_HEADER.size


def _upload(parts: list[np.ndarray], dev: torch.device, heads_row: int = 0) -> list[torch.Tensor]:
    """Several small host int64 arrays to the device in one copy; returns device views.
    With heads_row, the last part is returned as uint8 rows of that many bytes."""
    out = staging.upload_int64(parts, dev)
    if heads_row:
        out[-1] = out[-1].view(torch.uint8).view(-1, heads_row)
    return out


#: Integer dtypes of 2, 4 and 8 bytes: viewing [..., C] bytes as [..., C / G] words of G bytes.
_WORD_VIEWS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int64_words(blob: torch.Tensor):
    """The first len // 8 bytes of a uint8 tensor viewed as int64, for the kernels' 8-byte
    reads, or None when it does not start 8-byte aligned."""
    n = int(blob.numel()) // 8 * 8
    if n == 0 or blob.data_ptr() % 8:
        return None
    return _nb(blob[:n].view(torch.int64))


def _quantize_device(h: FileHeader, x: torch.Tensor, maxq, scales, symbols_name: str, symbols_shape) -> None:
    """Quantize x into _WS[symbols_name] (uint8 of symbols_shape) and scales (numba views)."""
    k = _kernels()
    C = x.shape[3]
    dev = x.device
    if x.dtype in _WORD_FORMATS and C % 4 == 0:
        words = x.contiguous().view(torch.int16).view(torch.int64)
        out = _ws(symbols_name, symbols_shape, torch.uint8, dev, torch.int32)[1]
        k.quantize_quads(_nb(words), _WORD_FORMATS[x.dtype], maxq, scales, out)
    elif x.dtype in _WORD_FORMATS and C % 2 == 0:
        words = x.contiguous().view(torch.int16).view(torch.int32)
        out = _ws(symbols_name, symbols_shape, torch.uint8, dev, torch.int16)[1]
        k.quantize_pairs(_nb(words), _WORD_FORMATS[x.dtype], maxq, scales, out)
    elif x.dtype in _WORD_FORMATS:
        out = _ws(symbols_name, symbols_shape, torch.uint8, dev)[1]
        k.quantize_bits(_nb(x.contiguous().view(torch.int16)), _WORD_FORMATS[x.dtype], maxq, scales, out)
    else:
        out = _ws(symbols_name, symbols_shape, torch.uint8, dev)[1]
        k.quantize(_nb(x.to(torch.float32).contiguous()), maxq, scales, out)


def _encode_records(h: FileHeader, x: torch.Tensor, first_chunk: int, alloc) -> np.ndarray:
    """The chunk records of x [L, 2, T_slab, C] (whole chunks from ``first_chunk`` on),
    written to the buffer that ``alloc(total_bytes)`` returns as (tensor, offset).
    Returns the records' sizes."""
    k = _kernels()
    dev = x.device
    L, _, T, C = x.shape
    ct, G = h.chunk_tokens, h.group
    K = -(-T // ct)
    per = h.streams_per_chunk
    n = K * per
    width = int(h.alphabets.max()) + 1  # CDF row length
    consts = _consts(h, dev)
    maxq, plane_off = consts["maxq_nb"], consts["plane_off_nb"]
    scales_t, scales = _ws("enc.scales", (L, 2, T), torch.int16, dev)  # bf16 scale bits are < 0x8000
    _mark("start")
    _quantize_device(h, x, maxq, scales, "enc.symbols", (L, 2, T, C))
    symbols_t, symbols = _ws("enc.symbols", (L, 2, T, C), torch.uint8, dev)
    _mark("quantize")
    cdf_size = h.section_sizes(ct)[1]
    codes_at_t, codes_at = _ws("enc.codes_at", (K,), torch.int64, dev)
    codes_at_t.copy_(torch.arange(K, dtype=torch.int64, device=dev) * cdf_size)
    packed_t, packed = _ws("enc.packed", (K * cdf_size,), torch.uint8, dev)
    k.stats_packed(symbols, ct, maxq, plane_off, codes_at, packed, width - 1)
    _mark("histogram + codes")
    slots_t, slots = _ws("enc.slots", (n, max_stream_bytes(ct * G)), torch.uint8, dev)
    lengths_t, lengths = _ws("enc.lengths", (n,), torch.int32, dev)
    words = None
    if G in _WORD_VIEWS and C % G == 0:  # one load per token for the coder
        words = _ws("enc.symbols", (L, 2, T, C), torch.uint8, dev, _WORD_VIEWS[G])[1]
    k.encode_streams_packed(symbols, packed, codes_at, plane_off, maxq, ct, G, width, slots, lengths,
                            symbol_words=words)
    _mark("range coding")
    incl_t, incl = _ws("enc.incl", (n,), torch.int64, dev)
    torch.cumsum(lengths_t, 0, dtype=torch.int64, out=incl_t)
    ends = incl_t[per - 1 :: per].cpu().numpy()  # the one synchronisation: payload sizes place the records
    _mark("payload sizes to the host (sync)")
    payload = np.diff(ends, prepend=0)
    tks = np.minimum(ct, T - np.arange(K, dtype=np.int64) * ct)
    ssz = 4 * L * tks
    lsz = 2 * per
    sizes = container.CHUNK_HEADER.size + ssz + cdf_size + lsz + payload
    buf, base = alloc(int(sizes.sum()))
    rec_at = base + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    heads = np.zeros(K, _CHUNK_HEADER_DTYPE)
    heads["magic"] = container.CHUNK_MAGIC
    heads["index"] = first_chunk + np.arange(K)
    heads["first_token"] = (first_chunk + np.arange(K)) * ct
    heads["token_count"] = tks
    heads["scales_size"] = ssz
    heads["cdf_size"] = cdf_size
    heads["lengths_size"] = lsz
    heads["payload_size"] = payload
    # delta[k]: where chunk k's payload starts in buf, less the payload bytes of the chunks before it
    delta = rec_at + container.CHUNK_HEADER.size + ssz + cdf_size + lsz - (ends - payload)
    seg_first = k.chunk_crc_segments(rec_at, sizes)
    rec_at_d, delta_d, sizes_d, seg_first_d, heads_d = (_nb(t) for t in _upload(
        [rec_at, delta, sizes, seg_first, heads.view(np.int64)], dev, heads_row=container.CHUNK_HEADER.size))
    buf_nb = _nb(buf)
    _mark("record layout on the host + upload")
    k.assemble_records(buf_nb, rec_at_d, heads_d, scales, packed, cdf_size, lengths, per, ct, slots, incl, delta_d)
    _mark("assemble the records")
    crc_t, crc = _ws("enc.crc", (K,), torch.int64, dev)
    crc_t.zero_()
    k.crc32_chunks(buf_nb, _int64_words(buf), rec_at_d, sizes_d, seg_first_d, crc, int(seg_first[-1]))
    k.put_crcs(buf_nb, rec_at_d, crc)
    _mark("chunk CRC-32s")
    return sizes


def encode_file_device(h: FileHeader, data: torch.Tensor) -> torch.Tensor:
    """The whole .cgen file of ``data`` [L, 2, T, C] (the header's cache) as a uint8 tensor
    on the GPU (CPU under the simulator), byte for byte what the CPU writes."""
    with _LOCK:
        return _encode_file_device(h, data)


def _encode_file_device(h: FileHeader, data: torch.Tensor) -> torch.Tensor:
    from .slabs import GPU_SLAB_BYTES, iter_slabs

    dev = _device()
    data = data.to(dev)
    head = container.pack_file_header(h)
    tail_len = 12 + 8 * h.num_chunks + container.TRAILER.size
    slabs = list(iter_slabs(h, GPU_SLAB_BYTES))
    single = len(slabs) == 1
    out = None
    parts: list[torch.Tensor] = []
    offsets: list[int] = []
    pos = len(head)

    def alloc(nbytes: int):
        nonlocal out
        if single:  # write the records straight into the file
            out = torch.empty(len(head) + nbytes + tail_len, dtype=torch.uint8, device=dev)
            return out, len(head)
        parts.append(torch.empty(nbytes, dtype=torch.uint8, device=dev))
        return parts[-1], 0

    for slab in slabs:
        sizes = _encode_records(h, data[:, :, slab.t0 : slab.t1, :], slab.first_chunk, alloc)
        at = pos + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        offsets.extend(int(v) for v in at)
        pos += int(sizes.sum())
    tail = container.pack_index(offsets) + container.pack_trailer(pos)
    ends = torch.frombuffer(bytearray(head + tail), dtype=torch.uint8).to(dev)
    if out is None:
        return torch.cat([ends[: len(head)], *parts, ends[len(head) :]])
    out[: len(head)] = ends[: len(head)]
    out[len(out) - len(tail) :] = ends[len(head) :]
    return out


_HEADER_STAGING = _Pinned()
_HEADER_LOCK = __import__("threading").Lock()


def _host_bytes(parts: list[torch.Tensor]) -> bytes:
    """The bytes of uint8 tensors back to back: for device tensors, copied into one
    page-locked buffer and waited for once (a pageable copy of a ~1 MB header costs more,
    and the stream's work before it is waited for either way)."""
    if not parts[0].is_cuda:
        return b"".join(t.numpy().tobytes() for t in parts)
    total = sum(int(t.numel()) for t in parts)
    with _HEADER_LOCK:
        buf = _HEADER_STAGING.get(total)
        o = 0
        for t in parts:
            m = int(t.numel())
            buf[o : o + m].copy_(t, non_blocking=True)
            o += m
        torch.cuda.current_stream(parts[0].device).synchronize()
        return buf.numpy().tobytes()


class _DeviceReader:
    """read / seek / tell over a uint8 device tensor, for the container's header and index
    parsers: each read copies only the bytes asked for."""

    #: Bytes copied at once from each end of the file: the header, bins and descriptor, and
    #: the index and trailer, usually fit, so parsing them costs one synchronisation.
    PREFETCH = 1 << 16
    #: The longest header (file start to first chunk) of the files read lately, up to
    #: HEADER_HINT_CAP: the next reader copies that much from the front at once.  A version-2
    #: Params block holds a table a channel (~0.9 MB for a Llama-8B-shaped cache), past
    #: PREFETCH, and a decoder is mostly called on files of one shape; a wrong guess costs one
    #: more copy, never a wrong byte.
    header_hint = 0
    HEADER_HINT_CAP = 4 << 20

    def __init__(self, blob: torch.Tensor) -> None:
        self.blob = blob
        self.size = n = int(blob.numel())
        self.pos = 0
        p = self.PREFETCH
        front = max(p, min(_DeviceReader.header_hint, self.HEADER_HINT_CAP))
        if n <= front + p:
            self.pieces = [(0, memoryview(_host_bytes([blob])))]
        else:
            # views of the one copy, not two more copies of its ~1 MB (a Llama-8B Params block)
            both = memoryview(_host_bytes([blob[:front], blob[n - p :]]))
            self.pieces = [(0, both[:front]), (n - p, both[front:])]

    @classmethod
    def note_header_end(cls, end: int) -> None:
        """Remember where a file's header ended (its first chunk), for the next readers."""
        cls.header_hint = min(int(end), cls.HEADER_HINT_CAP)

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        start, self.pos = self.pos, end
        if end <= start:
            return b""
        for at, piece in self.pieces:
            if at <= start and end <= at + len(piece):
                return piece[start - at : end - at].tobytes()
        return self.blob[start:end].cpu().numpy().tobytes()

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos


def _check_chunk_headers(h: FileHeader, reader: _DeviceReader, offsets: np.ndarray, raw: np.ndarray,
                         index_offset: int) -> np.ndarray:
    """Check every chunk header (a structured array) as container.read_chunk_record and the
    reader's placement checks do; on the first bad one, re-read it through the container to
    raise its exact error.  Returns the records' sizes."""
    K = len(offsets)
    i = np.arange(K, dtype=np.int64)
    tks = np.minimum(h.chunk_tokens, h.num_tokens - i * h.chunk_tokens)
    _, cdf_size, lengths_size = h.section_sizes(1)
    want_scales = 4 * h.num_layers * tks
    payload = raw["payload_size"].astype(np.int64)
    sizes = (container.CHUNK_HEADER.size + raw["scales_size"].astype(np.int64) + raw["cdf_size"] + raw["lengths_size"]
             + payload)
    bound = h.streams_per_chunk * (2 * tks * h.group + 8)
    ends = offsets + sizes
    ok = ((raw["magic"] == container.CHUNK_MAGIC) & (raw["index"] == i) & (raw["first_token"] == i * h.chunk_tokens)
          & (raw["token_count"] == tks) & (raw["scales_size"] == want_scales) & (raw["cdf_size"] == cdf_size)
          & (raw["lengths_size"] == lengths_size) & (payload <= bound) & (ends <= index_offset))
    placed = np.append(offsets[1:], index_offset) == ends
    bad = np.flatnonzero(~(ok & placed))
    if bad.size:
        j = int(bad[0])
        if ok[j]:  # the record itself is fine but the next one is not where it ends
            if j + 1 < K:
                raise container.SizeError(f"chunk {j + 1} is at byte {int(ends[j])}, the index says {int(offsets[j + 1])}")
            raise container.SizeError("bytes between the last chunk and the index")
        reader.seek(int(offsets[j]))
        container.read_chunk_record(reader, h, j, index_offset - int(offsets[j]))
        raise container.SizeError(f"chunk {j} has an invalid header")
    return sizes


def decode_device(blob: torch.Tensor) -> tuple[FileHeader, torch.Tensor]:
    """Decode a whole .cgen file held in a uint8 device tensor (a CPU tensor under the
    simulator) into its [L, 2, T, C] cache on the same device, in the file's dtype.

    Every check of docs/format.md's reader rules is made: the header, index and chunk
    headers on the host (only their bytes are copied), the CRC-32s, stream lengths,
    padding nibbles and scales on the device; errors are raised before returning."""
    with _LOCK:
        return _decode_device(blob)


def _decode_device(blob: torch.Tensor) -> tuple[FileHeader, torch.Tensor]:
    from ..errors import ChecksumError, UnsupportedVersionError
    from ..storage.kvio import DTYPE_BY_NAME

    k = _kernels()
    dev = blob.device
    _mark("start")
    reader = _DeviceReader(blob)
    h, header_end, offsets_l, size = container.read_header_and_index(reader)
    L, C, T, K = h.num_layers, h.num_channels, h.num_tokens, h.num_chunks
    dtype = DTYPE_BY_NAME[h.dtype]
    if K == 0:
        if size - container.TRAILER.size - 12 != header_end:
            raise container.SizeError("bytes between the last chunk and the index")
        return h, torch.empty((L, 2, 0, C), dtype=dtype, device=dev)
    offsets = np.asarray(offsets_l, np.int64)
    index_offset = size - container.TRAILER.size - (12 + 8 * K)
    hb = container.CHUNK_HEADER.size
    at = torch.from_numpy((offsets[:, None] + np.arange(hb, dtype=np.int64)[None, :]).reshape(-1)).to(dev)
    raw = np.frombuffer(blob[at].cpu().numpy().tobytes(), _CHUNK_HEADER_DTYPE)
    sizes = _check_chunk_headers(h, reader, offsets, raw, index_offset)
    scales_at = offsets + hb
    codes_at = scales_at + raw["scales_size"]
    lengths_at = codes_at + raw["cdf_size"]
    payload_at = lengths_at + raw["lengths_size"]
    seg_first = k.chunk_crc_segments(offsets, sizes)
    per = h.streams_per_chunk
    n = K * per
    G = h.group
    offs_t, sizes_t, seg_first_t, scales_at_t, codes_at_t, lengths_at_t, payload_at_t = _upload(
        [offsets, sizes, seg_first, scales_at, codes_at, lengths_at, payload_at], dev)
    consts = _consts(h, dev)
    maxq, plane_off = consts["maxq_nb"], consts["plane_off_nb"]
    blob_nb, blob_words = _nb(blob), _int64_words(blob)
    _mark("header, index, chunk headers (host)")
    # The decode first, so that the launches of the checks below queue while it runs.
    lens_t, lens = _ws("dec.lens", (n,), torch.int32, dev)
    steps_t, steps = _ws("dec.steps", (L, 2, T), torch.float32, dev)
    scales_bad_t, scales_bad = _ws("dec.scales_bad", (K,), torch.int32, dev)
    scales_bad_t.zero_()
    k.prepare_decode(blob_nb, _nb(lengths_at_t), per, lens, _nb(scales_at_t), h.chunk_tokens, maxq, steps, scales_bad)
    incl_t, incl = _ws("dec.incl", (n,), torch.int64, dev)
    torch.cumsum(lens_t, 0, dtype=torch.int64, out=incl_t)
    _mark("stream lengths + scales")
    width = int(h.alphabets.max()) + 1
    if dtype == torch.bfloat16:
        out = torch.empty((L, 2, T, C), dtype=torch.bfloat16, device=dev)
        bits, fmt = out.view(torch.int16), 1
    else:
        out = torch.empty((L, 2, T, C), dtype=torch.float32, device=dev)
        bits, fmt = out.view(torch.int32), 0
    out_words = None
    if fmt == 1 and blob_words is not None and G in (1, 2, 4) and C % G == 0:
        out_words = _nb(bits.view({1: torch.int16, 2: torch.int32, 4: torch.int64}[G]))
    k.decode_values(blob_nb, lens, incl, _nb(payload_at_t), _nb(codes_at_t), plane_off, maxq, steps, h.chunk_tokens,
                    G, width, None if out_words is not None else _nb(bits), fmt, blob_words=blob_words,
                    out_words=out_words)
    _mark("range decoding + dequantize")
    crc_t, crc = _ws("dec.crc", (K,), torch.int64, dev)
    crc_t.zero_()
    k.crc32_chunks(blob_nb, blob_words, _nb(offs_t), _nb(sizes_t), _nb(seg_first_t), crc, int(seg_first[-1]))
    # The per-chunk results of the checks, in one copy (the one synchronisation).
    by_chunk = lens_t.view(K, per)
    stream_sum = incl_t[per - 1 :: per] - torch.cat([incl_t.new_zeros(1), incl_t[per - 1 : -1 : per]])
    padded = consts["padded"]
    if padded.numel():
        pad_bad = (blob[codes_at_t[:, None] + padded[None, :]] >> 4).amax(dim=1).to(torch.int64)
    else:
        pad_bad = torch.zeros(K, dtype=torch.int64, device=dev)
    checks = torch.stack([crc_t, pad_bad, stream_sum, by_chunk.amax(dim=1).to(torch.int64),
                          scales_bad_t.to(torch.int64)]).cpu().numpy()
    _mark("chunk CRC-32s, checks to the host (sync)")
    bound = 2 * raw["token_count"].astype(np.int64) * h.group + max_stream_bytes(0)
    failures = np.stack([checks[0] != raw["crc"], raw["reserved"] != 0, checks[1] != 0, checks[2] != raw["payload_size"],
                         checks[3] > bound, checks[4] != 0])
    bad = np.flatnonzero(failures.any(axis=0))
    if bad.size:  # the first bad chunk, its first failed check in the CPU reader's order
        i = int(bad[0])
        what = int(np.flatnonzero(failures[:, i])[0])
        if what == 0:
            raise ChecksumError(f"chunk {i} CRC mismatch: the file is corrupted")
        if what == 1:
            raise UnsupportedVersionError(f"chunk {i} has reserved bits set")
        raise container.SizeError([
            f"chunk {i}: a padding nibble of the CDF codes is not zero",
            f"chunk {i} stream lengths add up to {int(checks[2, i])}, not {int(raw['payload_size'][i])}",
            f"chunk {i} has a stream longer than its bound",
            f"chunk {i} has a negative or non-finite scale",
        ][what - 2])
    if dtype not in (torch.bfloat16, torch.float32):
        out = out.to(dtype)
    return h, out
