"""The pieces that keep the GPU-resident pipelines' host side short, each against a plain
reference: the stream-starts and byte-scatter kernels (under numba's simulator here, on the
GPU in the device run), the header reader's prefetch sized by the last header, the uploads
of several arrays in one copy, and the cached reshapes of kernel arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen_cli.kernels import cuda as cuda_kernels
from cachegen_cli.kernels import cuda_pipeline as k
from cachegen_cli.pipeline import staging
from cachegen_cli.pipeline.lmcache_device import _DeviceReader


def _starts_reference(blob: np.ndarray, lengths_at, payload_at, per):
    size = blob.size
    lens, starts, lens_c = [], [], []
    for la, pa in zip(lengths_at, payload_at):
        o = pa
        for s in range(per):
            a = la + 2 * s
            v = int(blob[a]) | int(blob[a + 1]) << 8 if 0 <= a and a + 1 < size else 0
            st = min(o, size)
            lens.append(v)
            starts.append(st)
            lens_c.append(max(0, min(v, size - st)))
            o += v
    return [np.asarray(x, np.int64) for x in (lens, starts, lens_c)]


@pytest.mark.parametrize("per, seed", [(1, 0), (5, 1), (70, 2), (130, 3)])
def test_stream_starts_match_the_sums_and_stay_inside_the_file(per, seed):
    rng = np.random.default_rng(seed)
    K = 3
    size = 2 * per * K + 400
    blob = rng.integers(0, 256, size, dtype=np.uint8)
    blob[1::2] = rng.integers(0, 2, blob[1::2].size)  # lengths up to ~511: some starts run past the end
    lengths_at = np.array([0, 2 * per, size - per], np.int64)  # the last chunk's lengths cut by the file's end
    payload_at = np.array([2 * per * K, 2 * per * K + 50, size - 10], np.int64)
    lens = np.full(K * per, -1, np.int64)
    starts = np.full(K * per, -1, np.int64)
    lens_c = np.full(K * per, -1, np.int64)
    k.stream_starts(blob, lengths_at, payload_at, per, lens, starts, lens_c)
    want = _starts_reference(blob, lengths_at, payload_at, per)
    for got, ref in zip((lens, starts, lens_c), want):
        np.testing.assert_array_equal(got, ref)
    assert (starts <= size).all() and (starts + lens_c <= size).all()


def test_scatter_bytes_puts_every_segment_in_place():
    rng = np.random.default_rng(7)
    sizes = [5, 0, 3, 9, 1]
    src = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    src_first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    dst_at = np.array([40, 2, 10, 20, 0], np.int64)
    out = np.zeros(64, np.uint8)
    k.scatter_bytes(out, src, src_first, dst_at, int(src_first[-1]))
    want = np.zeros(64, np.uint8)
    for s, n in enumerate(sizes):
        want[dst_at[s] : dst_at[s] + n] = src[src_first[s] : src_first[s] + n]
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("hint", [0, 100, 5000, 1 << 30])
def test_device_reader_gives_the_same_bytes_whatever_the_prefetch(hint, monkeypatch):
    data = np.random.default_rng(3).integers(0, 256, 3 * _DeviceReader.PREFETCH + 12345, dtype=np.uint8)
    monkeypatch.setattr(_DeviceReader, "header_hint", hint)
    r = _DeviceReader(torch.from_numpy(data))
    raw = data.tobytes()
    for at, n in [(0, 64), (60, 200_000), (len(raw) - 30, 30), (70_000, 1), (len(raw) - 100, 500)]:
        r.seek(at)
        assert r.read(n) == raw[at : at + n]
    _DeviceReader.note_header_end(hint)
    assert _DeviceReader.header_hint == min(hint, _DeviceReader.HEADER_HINT_CAP)


def test_upload_arrays_keeps_shapes_dtypes_and_values():
    parts = [np.arange(7, dtype=np.int64), np.zeros(0, np.float64), np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
             np.array([1, 2, 255], np.uint8), np.array([[1 << 40]], np.int64)]
    out = staging.upload_arrays(parts, torch.device("cpu"))
    for a, t in zip(parts, out):
        assert tuple(t.shape) == a.shape and t.numpy().dtype == a.dtype
        np.testing.assert_array_equal(t.numpy(), a)


def test_flat_and_item_are_the_reshape_and_the_row():
    a = np.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(cuda_kernels.flat(a), a.reshape(-1))
    np.testing.assert_array_equal(cuda_kernels.item(a, 1), a[1])

    class Holder:  # an object that takes attributes, as numba's device arrays do
        def __init__(self, x):
            self.x = x
            self.calls = 0

        def reshape(self, *shape):
            self.calls += 1
            return self.x.reshape(*shape)

    h = Holder(a)
    first = cuda_kernels.flat(h)
    assert cuda_kernels.flat(h) is first and h.calls == 1


@pytest.mark.parametrize("K, per, seed", [(1, 2, 0), (3, 4, 1), (7, 6, 2)])
def test_layout_on_the_device_is_the_host_layout(K, per, seed):
    """layout_records + write_frame + put_file_crcs (the encoder's layout on the device) give the
    places, chunk headers, index, trailer and CRC-32s that the host's packing gives, for records
    whose bodies straddle CRC segments (sizes up to a few segments)."""
    import struct
    import zlib

    from cachegen_cli.format import container

    rng = np.random.default_rng(seed)
    hb = container.CHUNK_HEADER.size
    lengths = rng.integers(0, 1500, K * per).astype(np.int64)
    entry = rng.integers(1, 131, 5).astype(np.int64)
    raw = rng.integers(0, 3000, K).astype(np.int64)
    desc_len, fixed_size = 37, 100
    params_at = 64 + desc_len
    tail = 12 + 8 * K + container.TRAILER.size
    lay = np.full(k.layout_size(K), -1, np.int64)
    k.layout_records(np.cumsum(lengths), np.cumsum(entry), raw, per, hb, fixed_size, params_at, tail, lay)
    payload = lengths.reshape(K, per).sum(1)
    sizes = hb + raw + 2 * per + payload
    params_size = fixed_size + int(entry.sum())
    rec_at = params_at + params_size + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    index_at = params_at + params_size + int(sizes.sum())
    want = np.concatenate([rec_at, sizes, rec_at + hb, rec_at + hb + raw, rec_at + hb + raw + 2 * per, payload,
                           cuda_kernels.chunk_crc_segments(rec_at, sizes),
                           [params_size, index_at, index_at + tail, int(lengths.sum())]])
    np.testing.assert_array_equal(lay, want)
    # the encoder launches crc32_chunks over a bound of the segments, made before the sizes are known
    from cachegen_cli.pipeline.transform_resident import _segments_max

    assert lay[7 * K] <= _segments_max(K, hb + 2 * per + raw, int(lengths.sum()))

    total = index_at + tail
    out = rng.integers(0, 256, total + 64, dtype=np.uint8)  # past the file: bytes no kernel may read
    out[60:64] = 0
    ct, T = 16, 16 * K - 3
    k.write_frame(out, lay, raw, per, ct, T, container.CHUNK_MAGIC, container.INDEX_MAGIC, container.TRAILER_MAGIC, 48)
    for i in range(K):
        got = container.CHUNK_HEADER.unpack_from(out, int(rec_at[i]))
        assert got == (container.CHUNK_MAGIC, i, i * ct, min(ct, T - i * ct), int(raw[i]), 0, 2 * per,
                       int(payload[i]), 0, 0)
    assert struct.unpack_from("<I", out, 48)[0] == params_size
    acc = np.zeros(2, np.int64)
    words = out[: out.size // 8 * 8].view(np.int64)
    k.put_file_crcs(out, words, lay, K, desc_len, params_size + 999, acc)
    blob = out[:total].tobytes()
    assert blob[index_at:] == container.pack_index(rec_at.tolist()) + container.pack_trailer(index_at)
    crc = zlib.crc32(blob[:60] + blob[64 : params_at + params_size])
    assert struct.unpack_from("<I", blob, 60)[0] == crc


@pytest.mark.parametrize("seed", range(4))
def test_rotated_range_check_on_the_device_is_the_hosts(seed):
    """transform_resident._rotated_range_exceeded (torch, on the encoder's device) refuses exactly
    the steps and offsets that format.params.check_rotated_range refuses: steps near the top of
    float32 / 128, offsets of every size, Inf and NaN bit patterns."""
    from cachegen_cli.errors import SizeError
    from cachegen_cli.format.params import check_rotated_range
    from cachegen_cli.pipeline.transform_resident import _rotated_range_exceeded

    rng = np.random.default_rng(seed)
    L, C = 3, 5
    outcomes = set()
    for _ in range(40):
        # biased bfloat16 exponents: any, near 2^121 (128 x step near float32's top), Inf / NaN
        u = rng.random(2 * L * (C + 1))
        exps = np.where(u < 0.02, 255, np.where(u < 0.5, rng.integers(244, 255, u.size), rng.integers(0, 255, u.size)))
        bits = (rng.integers(0, 2, exps.size) << 15 | exps << 7 | rng.integers(0, 128, exps.size)).astype(np.int64)
        try:
            with np.errstate(invalid="ignore"):
                check_rotated_range(bits[: 2 * L].astype(np.uint16).reshape(L, 2),
                                    bits[2 * L :].astype(np.uint16).reshape(L, 2, C))
            refused = False
        except SizeError:
            refused = True
        outcomes.add(refused)
        got = _rotated_range_exceeded(torch.from_numpy(bits.astype(np.int32)), L, C)
        assert bool(got.item()) == refused
    assert outcomes == {True, False}


class _CountingBuffers(staging.HostBuffers):
    """HostBuffers with pageable tensors in place of page-locked ones (no CUDA here), counting
    the allocations."""

    def __init__(self, limit):
        super().__init__(limit)
        self.allocated = []

    @staticmethod
    def available() -> bool:
        return True

    def allocate(self, nbytes):
        self.allocated.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)


def test_host_buffers_grow_are_reused_per_role_and_thread_and_are_released():
    import threading

    bufs = _CountingBuffers(limit=8 << 20)
    a = bufs.get("input", 3 << 20)
    assert a.numel() == 3 << 20 and bufs.allocated == [3 << 20]
    a[:4] = 7
    b = bufs.get("input", 1 << 20)  # smaller: the same memory
    assert bufs.allocated == [3 << 20] and b.data_ptr() == a.data_ptr() and int(b[0]) == 7
    bufs.get("output", 10)  # another role: its own buffer, at least 1 MiB
    assert bufs.allocated == [3 << 20, 1 << 20]
    bufs.get("input", 5 << 20)  # larger: a new one
    assert bufs.allocated[-1] == 5 << 20
    assert bufs.get("input", 9 << 20) is None  # past the limit: the caller uses pageable memory
    other = []
    worker = threading.Thread(target=lambda: other.append(bufs.get("input", 1 << 20)))
    worker.start()
    worker.join()
    assert other[0].data_ptr() != bufs.get("input", 1 << 20).data_ptr()  # each thread its own
    n = len(bufs.allocated)
    bufs.release()
    bufs.get("input", 1 << 20)
    assert len(bufs.allocated) == n + 1


def test_pinned_slab_buffers_and_to_host_without_cuda():
    """Without CUDA (this machine), the file paths' buffers are plain arrays: reads fill them,
    and to_host of a CPU tensor gives its bytes."""
    arr = staging.PinnedSlabBuffers("input").get("read", (2, 3), np.uint16)
    assert arr.shape == (2, 3) and arr.dtype == np.uint16
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert staging.to_host(t).tobytes() == t.numpy().tobytes()
