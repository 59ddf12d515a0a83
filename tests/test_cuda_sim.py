"""CUDA kernels against the CPU kernels, byte for byte.

Without a GPU these run under numba's CUDA simulator (conftest sets
NUMBA_ENABLE_CUDASIM=1), which interprets every thread in Python: inputs stay tiny.
On a GPU machine run them for real with NUMBA_ENABLE_CUDASIM=0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen_cli.pipeline import codec
from cachegen_cli.pipeline import lmcache_device
from cachegen_cli.methods.config import QuantizationConfig, QuantizationSpec
from cachegen_cli.storage.kvio import from_tensors

from conftest import realistic_kv


def _header(kv, chunk_tokens, key_bins=16, value_bins=8):
    quant = QuantizationConfig((QuantizationSpec(0, None, key_bins),), (QuantizationSpec(0, None, value_bins),))
    cache = from_tensors(kv)
    return cache, codec.make_header(cache, quant, chunk_tokens)


def _same_chunks(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.index, x.first_token, x.token_count) == (y.index, y.first_token, y.token_count)
        np.testing.assert_array_equal(x.scales, y.scales)
        np.testing.assert_array_equal(x.codes, y.codes)
        np.testing.assert_array_equal(x.lengths, y.lengths)
        np.testing.assert_array_equal(x.payload, y.payload)


@pytest.mark.parametrize("chunk_tokens, tokens", [(3, 7), (1, 2), (8, 8)])
def test_gpu_encode_slab_matches_cpu(chunk_tokens, tokens):
    kv = realistic_kv(layers=1, tokens=tokens, heads=1, head_dim=5, dtype=torch.bfloat16, seed=tokens)
    kv[0, 1, 1] = 0  # an all-zero token
    cache, h = _header(kv, chunk_tokens)
    x = cache.data.to(torch.float32).numpy()
    cpu_chunks = codec.encode_slab(h, np.ascontiguousarray(x), 0)
    gpu_chunks = lmcache_device.encode_slab(h, cache.data, 0)
    _same_chunks(cpu_chunks, gpu_chunks)
    decoded = lmcache_device.decode_slab(h, gpu_chunks)
    decoded = decoded.cpu().numpy() if isinstance(decoded, torch.Tensor) else decoded
    np.testing.assert_array_equal(decoded, codec.decode_slab(h, cpu_chunks))


def test_api_bytes_identical_on_both_devices():
    import cachegen_cli as cg

    kv = realistic_kv(layers=1, tokens=5, heads=1, head_dim=3, dtype=torch.float16, seed=3)
    cpu_blob = cg.encode(kv, chunk_tokens=2, device="cpu", preset="lmcache")
    gpu_blob = cg.encode(kv, chunk_tokens=2, device="cuda", preset="lmcache")
    assert cpu_blob == gpu_blob
    a = cg.decode(cpu_blob, device="cuda")["kv"]
    b = cg.decode(cpu_blob, device="cpu")["kv"]
    assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, 1), (torch.float16, 2)])
def test_word_kernels_match_the_float_path(dtype, fmt):
    """quantize_bits reads 16-bit words directly; dequantize_bf16 fuses the bf16 cast."""
    from cachegen_cli.kernels import cpu
    from cachegen_cli.kernels import cuda as gpu

    kv = realistic_kv(layers=1, tokens=3, heads=1, head_dim=5, dtype=dtype, seed=11).reshape(1, 2, 3, 5)
    kv[0, 0, 1, 2] = -kv[0, 0, 1, 2]
    maxq = np.array([[7, 3]], np.int32)
    scales, symbols = np.empty((1, 2, 3), np.uint16), np.empty((1, 2, 3, 5), np.uint8)
    cpu.quantize(np.ascontiguousarray(kv.float().numpy()), maxq, scales, symbols)
    scales2, symbols2 = np.empty_like(scales), np.empty_like(symbols)
    gpu.quantize_bits(kv.view(torch.int16).numpy(), fmt, maxq, scales2, symbols2)
    np.testing.assert_array_equal(scales, scales2)
    np.testing.assert_array_equal(symbols, symbols2)
    ref = np.empty((1, 2, 3, 5), np.float32)
    cpu.dequantize(symbols, scales, maxq, ref)
    bits = np.empty((1, 2, 3, 5), np.int16)
    gpu.dequantize_bf16(symbols, scales, maxq, bits)
    np.testing.assert_array_equal(bits, torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16).numpy())


def test_record_crcs_match_zlib():
    import zlib

    from cachegen_cli.kernels import cuda as gpu

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 3000).astype(np.uint8)
    # two records: [0, 36) + [40, 1000) and [1000, 1036) + [1040, 3000), cut into segments
    records = [[(0, 36), (40, 500), (540, 460)], [(1000, 36), (1040, 1), (1041, 1959)]]
    starts = np.array([s for r in records for s, _ in r], np.int64)
    lens = np.array([n for r in records for _, n in r], np.int64)
    first = np.array([0, 3], np.int64)
    count = np.array([3, 3], np.int64)
    seg_crc = np.empty(6, np.int64)
    out = np.empty(2, np.int64)
    gpu.crc32_records(data, starts, lens, first, count, seg_crc, out)
    want = [zlib.crc32(data[0:36].tobytes() + data[40:1000].tobytes()), zlib.crc32(data[1000:1036].tobytes() + data[1040:3000].tobytes())]
    assert out.tolist() == want


def test_chunk_crcs_and_span_crc_match_zlib():
    """crc32_chunks (slicing-by-8 over the aligned words, bytes at the edges) and span_crc give
    zlib's CRC-32 for records at odd offsets, shorter and longer than a segment, with the data
    read as words and as bytes."""
    import zlib

    from cachegen_cli.kernels import cuda as gpu
    from cachegen_cli.kernels import cuda_pipeline

    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, 3 * gpu.CHUNK_CRC_SEGMENT + 777).astype(np.uint8)
    rec_at = np.array([3, 47, 47 + 2 * gpu.CHUNK_CRC_SEGMENT + 5], np.int64)
    rec_len = np.array([44, 2 * gpu.CHUNK_CRC_SEGMENT + 5, data.size - rec_at[2]], np.int64)
    want = [zlib.crc32(data[a : a + 36].tobytes() + data[a + 40 : a + n].tobytes()) for a, n in zip(rec_at, rec_len)]
    seg_first = gpu.chunk_crc_segments(rec_at, rec_len)
    for words in (data[: data.size // 8 * 8].view(np.int64), None):
        out = np.zeros(3, np.int64)
        gpu.crc32_chunks(data, words, rec_at, rec_len, seg_first, out, int(seg_first[-1]))
        assert out.tolist() == want
        for start, size in ((5, 3000), (8, 2 * cuda_pipeline.PARAMS_CRC_SEGMENT + 9), (0, 0)):
            acc = np.zeros(1, np.int64)
            value = np.zeros(1, np.int64)
            cuda_pipeline.span_crc(data, words, start, size, 0, acc, value)
            assert int(value[0]) == zlib.crc32(data[start : start + size].tobytes())


def test_chunk_crcs_over_several_blocks_match_zlib():
    """crc32_chunks with more segments than a block has threads: warps whose segments end at
    different rounds (records of a few bytes to several segments, odd places), and threads past
    the last segment (the pipeline launches for an upper bound of the segments)."""
    import zlib

    from cachegen_cli.kernels import cuda as gpu

    rng = np.random.default_rng(29)
    lens = np.concatenate([[40, 41, 47], rng.integers(40, 3 * gpu.CHUNK_CRC_SEGMENT, 90)]).astype(np.int64)
    rec_at = 5 + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    data = rng.integers(0, 256, int(rec_at[-1] + lens[-1]) + 16).astype(np.uint8)
    want = [zlib.crc32(data[a : a + 36].tobytes() + data[a + 40 : a + n].tobytes()) for a, n in zip(rec_at, lens)]
    seg_first = gpu.chunk_crc_segments(rec_at, lens)
    assert seg_first[-1] > 2 * gpu.BLOCK
    out = np.zeros(lens.size, np.int64)
    gpu.crc32_chunks(data, data[: data.size // 8 * 8].view(np.int64), rec_at, lens, seg_first, out,
                     int(seg_first[-1]) + 37)
    assert out.tolist() == want


def test_tiny_rows_quantize_alike():
    """A row whose abs-max is below ~1e-37 (maxq / scale overflows float32) gives the same
    symbols on both devices: the inverse step is capped at the largest float32."""
    from cachegen_cli.kernels import cpu
    from cachegen_cli.kernels import cuda as gpu

    x = np.zeros((1, 2, 2, 4), np.float32)
    x[0, 0, 0] = [1e-40, -2e-39, 0.0, 5e-39]
    x[0, 1, 1] = [0.0, -0.0, 1e-45, -1e-45]
    maxq = np.array([[7, 15]], np.int32)
    a = (np.empty((1, 2, 2), np.uint16), np.empty((1, 2, 2, 4), np.uint8))
    b = (np.empty_like(a[0]), np.empty_like(a[1]))
    cpu.quantize(x, maxq, *a)
    gpu.quantize(x, maxq, *b)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[1][0, 0, 0, 2] == 7  # an exact zero stays at the middle level


# ---------------------------------------------------------------- the whole file on the device


def _device_case(kv, chunk_tokens, key_bins=16, value_bins=8):
    import cachegen_cli as cg

    quant = QuantizationConfig((QuantizationSpec(0, None, key_bins),), (QuantizationSpec(0, None, value_bins),))
    cache, h = _header(kv, chunk_tokens, key_bins, value_bins)
    cpu_blob = cg.encode(kv, quantization=quant, chunk_tokens=chunk_tokens, device="cpu")
    return cache, h, cpu_blob


_DEV = "cuda" if lmcache_device.torch_cuda_ok() else "cpu"  # where decode_device's input lives


def _as_tensor(blob: bytes) -> torch.Tensor:
    if not blob:
        return torch.zeros(0, dtype=torch.uint8, device=_DEV)
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return t.clone() if _DEV == "cpu" else t.to(_DEV)  # a fresh allocation: 8-byte aligned


@pytest.mark.parametrize(
    "dtype, tokens, head_dim, chunk_tokens, bins",
    [
        (torch.bfloat16, 7, 6, 3, (16, 8)),  # C = 6: the paired-word quantizer; a short last chunk
        (torch.bfloat16, 5, 8, 2, (32, 16)),  # C = 8: the four-word quantizer; 8 channels a stream, one word a token
        (torch.bfloat16, 5, 8, 256, (16, 8)),  # 4 channels a stream: decoding reads 8-byte words, stores one per token
        (torch.bfloat16, 6, 4, 512, (32, 16)),  # 2 channels a stream
        (torch.float16, 5, 3, 2, (16, 8)),  # odd C: the one-word quantizer
        (torch.float32, 4, 4, 4, (255, 3)),  # CDF rows too wide for shared memory: global rows
        (torch.float16, 3, 4, 1, (16, 8)),  # one-token chunks: a stream holds every channel; float16 words
    ],
)
def test_device_file_matches_cpu(dtype, tokens, head_dim, chunk_tokens, bins):
    """encode_file_device writes the CPU's bytes; decode_device reads them back to the CPU's values."""
    import cachegen_cli as cg

    kv = realistic_kv(layers=1, tokens=tokens, heads=1, head_dim=head_dim, dtype=dtype, seed=tokens)
    kv[0, 1, 1] = 0  # an all-zero token
    cache, h, cpu_blob = _device_case(kv, chunk_tokens, *bins)
    got = lmcache_device.encode_file_device(h, cache.data)
    assert got.cpu().numpy().tobytes() == cpu_blob
    h2, out = lmcache_device.decode_device(_as_tensor(cpu_blob))
    assert out.dtype == dtype
    assert torch.equal(out.reshape(kv.shape).cpu(), cg.decode(cpu_blob, device="cpu")["kv"])


def test_device_decode_checks_like_the_cpu():
    """Corrupted bytes give decode_device the CPU reader's error, checks made on the device included."""
    import struct
    import zlib

    import cachegen_cli as cg
    from cachegen_cli.format import container

    kv = realistic_kv(layers=1, tokens=5, heads=1, head_dim=4, dtype=torch.bfloat16, seed=1)
    blob = cg.encode(kv, chunk_tokens=2, device="cpu", preset="lmcache")
    h, end = container.read_file_header(container.BufferReader(blob), len(blob))
    offsets = container.read_index(container.BufferReader(blob), h, end, len(blob))
    index_at = len(blob) - 16 - (12 + 8 * h.num_chunks)
    o = offsets[1]
    head = container.CHUNK_HEADER.unpack(blob[o : o + 40])

    def edit(pos, xor=0, value=None, fix_crc=False):
        b = bytearray(blob)
        b[pos] = value if value is not None else b[pos] ^ xor
        if fix_crc:  # a consistent CRC, so that the section checks are what fails
            b[o + 36 : o + 40] = struct.pack("<I", zlib.crc32(bytes(b[o : o + 36]) + bytes(b[o + 40 : o + 40 + sum(head[4:8])])))
        return bytes(b)

    cases = [b"", blob[:-5], edit(index_at - 2, 1), edit(end + 5, 1), edit(10, 1),
             edit(o + 40 + head[4] + head[5], 1, fix_crc=True),  # a stream length
             edit(o + 41, 0x80, fix_crc=True),  # a negative scale
             edit(o + 32, value=1, fix_crc=True)]  # the reserved field
    for case in cases:
        with pytest.raises(Exception) as cpu_error:
            cg.decode(case, device="cpu")
        with pytest.raises(type(cpu_error.value), match="^" + str(cpu_error.value).replace("(", r"\(").replace(")", r"\)") + "$"):
            lmcache_device.decode_device(_as_tensor(case))


@pytest.mark.parametrize("sink", [3, 70])
def test_device_stats_of_the_keys_alone_match_the_cpu(sink):
    """cuda_pipeline.transform_stats over the keys alone (words [L, 1, T, C], P = 1: the turned
    keys the fixed-point encoder sums) gives the key planes' sums of both planes' words and
    cpu_transform.transform_stats' bits; the value entries are left as they were."""
    from cachegen_cli.kernels import cpu_transform as ct
    from cachegen_cli.kernels import cuda_pipeline as cp
    from cachegen_cli.kernels.transform import STATS_BLOCK

    rng = np.random.default_rng(5 + sink)
    L, T, C = 2, STATS_BLOCK + 77, 4
    x = (rng.standard_normal((L, 2, T, C)) * np.exp(rng.standard_normal((L, 2, T, 1)))).astype(np.float32)
    nb = -(-T // STATS_BLOCK)
    want = [np.zeros((L, 2, C)) for _ in range(2)]
    ct.transform_stats(x, np.zeros((0, 0, 0, 0, 0), np.float32), sink, *want)
    both = np.zeros((2, L, 2, C))
    cp.transform_stats(x.view(np.int32), 4, 0, sink, np.zeros((L, 2, nb, C)), np.zeros((L, 2, nb, C)), both[0], both[1])
    keys = np.full((2, L, 2, C), 7.0)
    cp.transform_stats(np.ascontiguousarray(x[:, :1]).view(np.int32), 4, 0, sink, np.zeros((L, 1, nb, C)),
                       np.zeros((L, 1, nb, C)), keys[0], keys[1])
    for i in range(2):
        assert np.array_equal(both[i], want[i])
        assert np.array_equal(keys[i][:, 0], want[i][:, 0]) and (keys[i][:, 1] == 7.0).all()
