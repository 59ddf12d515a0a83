"""The cachegen serde inside the real LMCache (the optional extra ``cachegen[lmcache]``).

Real chunks of the SmolLM2 sample cache, in LMCache's chunk layout [2, layers, tokens,
hidden], go through LMCache's own serde machinery: the registry by name
(``create_serde_processor``), its AsyncSerdeProcessor (submit, event fd, query), its memory
objects (``AdHocMemoryAllocator``'s TensorMemoryObj) and its narrowing of the stored bytes
(``set_used_size``); the bytes are then loaded back into a buffer of the estimated size, as
LMCache's serde wrapper does after an L2 load, and deserialized."""

from __future__ import annotations

import select

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("lmcache", reason="the lmcache package is not installed (pip install 'cachegen[lmcache]')")

from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, TensorMemoryAllocator  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.errors import CacheGenError, ConfigError, DTypeError, FormatError, ShapeError, SizeError  # noqa: E402
from cachegen_cli.integrations import lmcache_serde  # noqa: E402  (registers "cachegen")
from cachegen_cli.methods import calibration as calibration_io  # noqa: E402
from cachegen_cli.format import parts as fmt  # noqa: E402
from cachegen_cli.pipeline import codec  # noqa: E402
from cachegen_cli.storage import kvio  # noqa: E402

from conftest import SAMPLE_PER_LAYER, SAMPLE_STACKED  # noqa: E402

QUALITIES = ["lossless", "high", "balanced", "small"]


@pytest.fixture(scope="module")
def chunks() -> list[torch.Tensor]:
    """The sample [30, 2, 520, 3, 64] as LMCache chunks [2, 30, T, 192]: two full 256-token
    chunks and the 8-token rest."""
    kv = load_file(str(SAMPLE_STACKED))["kv"]
    L, _, T, H, D = kv.shape
    lm = kv.permute(1, 0, 2, 3, 4).reshape(2, L, T, H * D)
    return [lm[:, :, a:b].contiguous() for a, b in ((0, 256), (256, 512), (512, 520))]


class _Pool:
    """LMCache's L1 allocator (TensorMemoryAllocator over a host buffer); the objects a test
    allocates are released (ref_count_down) when it ends."""

    def __init__(self) -> None:
        self.allocator = TensorMemoryAllocator(torch.empty(192 << 20, dtype=torch.uint8))
        self.live: list = []

    def allocate(self, shapes, dtypes, fmt):
        obj = self.allocator.allocate(shapes, dtypes, fmt=fmt)
        assert obj is not None, "the test pool is full"
        self.live.append(obj)
        return obj

    def release(self) -> None:
        while self.live:
            self.live.pop().ref_count_down()


ALLOC = _Pool()


@pytest.fixture(autouse=True)
def _release_memory_objects():
    yield
    ALLOC.release()


def _kv_object(shape, dtype=torch.bfloat16, data: torch.Tensor | None = None):
    obj = ALLOC.allocate([torch.Size(shape)], [dtype], fmt=MemoryFormat.KV_2LTD)
    if data is not None:
        obj.tensor.copy_(data)
    return obj


def _byte_object(n: int):
    return ALLOC.allocate([torch.Size([n])], [torch.uint8], fmt=MemoryFormat.BINARY_BUFFER)


def _wait(fd: int, query, task: int) -> bool:
    for _ in range(600):  # LMCache's poll loop: wait on the event fd, drain it, then query
        if select.select([fd], [], [], 1.0)[0]:
            consume_fd(fd)
        done = query(task)
        if done is not None:
            return done
    raise AssertionError("the serde task did not finish")


def _store(proc, chunk: torch.Tensor) -> tuple[bytes, int]:
    """Serialize through the processor; returns the bytes LMCache would store, and the estimate."""
    src = _kv_object(chunk.shape, chunk.dtype, chunk)
    estimate = proc.estimate_serialized_size(MemoryLayoutDesc([chunk.shape], [chunk.dtype]))
    dst = _byte_object(estimate)
    assert _wait(proc.get_serialize_event_fd(), proc.query_serialize_result, proc.submit_serialize([src], [dst]))
    # AsyncSerdeProcessor narrowed the buffer to the bytes written: what an L2 adapter stores
    assert dst.get_size() <= estimate
    return bytes(dst.byte_array), estimate


def _load(proc, stored: bytes, estimate: int, shape, dtype=torch.bfloat16) -> tuple[bool, torch.Tensor]:
    """Deserialize from a buffer of the estimated size (LMCache's load temp), past the stored
    bytes filled with noise; returns (success, the destination chunk)."""
    buf = _byte_object(estimate)
    noise = torch.randint(0, 256, (estimate,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    buf.tensor.copy_(noise)
    buf.tensor[: len(stored)].copy_(torch.frombuffer(bytearray(stored), dtype=torch.uint8))
    dst = _kv_object(shape, dtype)
    dst.tensor.zero_()
    ok = _wait(proc.get_deserialize_event_fd(), proc.query_deserialize_result, proc.submit_deserialize([buf], [dst]))
    return ok, dst.tensor.clone()


def _cgen_blob(stored: bytes) -> bytes:
    """The one .cgen file of a one-group envelope."""
    magic, version, groups = lmcache_serde.ENVELOPE.unpack_from(stored)
    assert (magic, version, groups) == (b"CGLM", 1, 1)
    (n,) = lmcache_serde.GROUP_LENGTH.unpack_from(stored, lmcache_serde.ENVELOPE.size)
    blob = stored[lmcache_serde.envelope_size(1):]
    assert len(blob) == n
    return blob


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _stacked(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.permute(1, 0, 2, 3).unsqueeze(3)


def test_the_serde_is_registered_by_name():
    assert "cachegen" in get_registered_serde_types()
    assert {"fp8", "turboquant"} <= set(get_registered_serde_types())  # next to LMCache's own
    lmcache_serde.register()  # a second registration is harmless
    proc = create_serde_processor(SerdeConfig("cachegen", {"quality": "small", "max_workers": 2}))
    try:
        assert isinstance(proc._serializer, lmcache_serde.CacheGenSerializer)
    finally:
        proc.close()


def test_lossless_chunks_round_trip_bit_exact(chunks):
    proc = create_serde_processor(SerdeConfig("cachegen", {"quality": "lossless"}))
    try:
        for chunk in chunks:
            stored, estimate = _store(proc, chunk)
            assert len(stored) <= estimate
            if chunk.shape[2] == 256:
                assert len(stored) < chunk.numel() * 2  # lossless, and smaller than the bf16 chunk
            ok, out = _load(proc, stored, estimate, chunk.shape)
            assert ok and torch.equal(_words(out), _words(chunk))
    finally:
        proc.close()


def _method(blob: bytes) -> int:
    return codec.read_header_and_index(codec.open_input(blob)[0])[0].method


def _allowed_error(chunk: torch.Tensor, blob: bytes) -> torch.Tensor:
    """Per-value error bound [2, L, T, C] of a lossy .cgen file: half a quantization step
    (method 2: the plane's step from the file; method 1: the token's scale / maxq), plus the
    rounding of the decoded value to bfloat16; the transform's sink token is exact."""
    h, _, _, _ = codec.read_header_and_index(codec.open_input(blob)[0])
    x = chunk.double()
    if h.version == 2 and h.method == 3:  # lossless
        return torch.zeros_like(x)
    if h.version == 2:
        steps = torch.from_numpy((np.asarray(h.params.steps, np.uint32) << 16).view(np.float32).astype(np.float64))
        half = (steps.T / 2)[:, :, None, None].expand_as(x).clone()  # [L, 2] -> [2, L, T, C]
        half[:, :, : h.sink_tokens] = 0
    else:
        scale = x.abs().amax(dim=3, keepdim=True) * (1 + 2**-7)  # the abs-max, rounded up to a bfloat16
        maxq = torch.from_numpy(h.maxq.astype(np.float64)).T[:, :, None, None]
        half = (scale / maxq / 2).expand_as(x)
    return half + (x.abs() + half) * 2**-8 + 1e-12


@pytest.mark.parametrize("settings", [{"quality": "high"}, {"quality": "balanced"}, {"quality": "small"},
                                      {"preset": "lmcache"}])
def test_lossy_chunks_round_trip_within_the_preset_error(chunks, settings):
    proc = create_serde_processor(SerdeConfig("cachegen", dict(settings)))
    try:
        for chunk in chunks:
            stored, estimate = _store(proc, chunk)
            blob = _cgen_blob(stored)
            # the serde stores exactly the library's .cgen file of the chunk
            assert blob == cg.encode(_stacked(chunk), device="cpu", **settings)
            assert len(stored) <= estimate
            if chunk.shape[2] == 256:  # a full chunk; the 8-token rest is mostly the file's tables (docs/lmcache.md)
                assert len(stored) < chunk.numel() * 2 / 3
            ok, out = _load(proc, stored, estimate, chunk.shape)
            assert ok
            err = (out.double() - chunk.double()).abs()
            assert (err <= _allowed_error(chunk, blob)).all(), settings
            if _method(blob) == 3:  # the small-cache rule (docs/config.md): the 8-token rest at `high` grew
                assert chunk.shape[2] == 8 and torch.equal(_words(out), _words(chunk))
            else:
                assert err.max() > 0  # lossy indeed
    finally:
        proc.close()


def test_qualities_order_bytes_and_error(chunks):
    chunk = chunks[0]
    sizes, errors = [], []
    for quality in QUALITIES:
        proc = create_serde_processor(SerdeConfig("cachegen", {"quality": quality}))
        try:
            stored, estimate = _store(proc, chunk)
            ok, out = _load(proc, stored, estimate, chunk.shape)
        finally:
            proc.close()
        assert ok
        sizes.append(len(stored))
        errors.append(float((out.double() - chunk.double()).pow(2).sum() / chunk.double().pow(2).sum()))
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors) and errors[0] == 0


def test_calibration_file_option(chunks, tmp_path):
    other = kvio.read_safetensors(SAMPLE_PER_LAYER)  # fitted on another text's cache
    path = tmp_path / "smollm2.calibration.safetensors"
    calibration_io.save(calibration_io.fit([other.data]), path)
    chunk = chunks[1]
    proc = create_serde_processor(SerdeConfig("cachegen", {"quality": "balanced", "calibration": str(path)}))
    plain = create_serde_processor(SerdeConfig("cachegen", {"quality": "balanced"}))
    try:
        stored, estimate = _store(proc, chunk)
        blob = _cgen_blob(stored)
        h, _, _, _ = codec.read_header_and_index(codec.open_input(blob)[0])
        assert h.rotated
        ok, out = _load(proc, stored, estimate, chunk.shape)
        assert ok
        rel = float((out.double() - chunk.double()).pow(2).sum() / chunk.double().pow(2).sum())
        assert rel < 0.05
        # a rotated chunk cannot be loaded without its calibration: the task fails
        ok, _ = _load(plain, stored, estimate, chunk.shape)
        assert not ok
        with pytest.raises(CacheGenError, match="calibration"):
            lmcache_serde.CacheGenDeserializer(lmcache_serde.CacheGenSerdeConfig.from_kwargs({})).deserialize(
                _filled(stored, estimate), _kv_object(chunk.shape))
    finally:
        proc.close()
        plain.close()


def _filled(stored: bytes, size: int):
    buf = _byte_object(size)
    buf.tensor.zero_()
    buf.tensor[: len(stored)].copy_(torch.frombuffer(bytearray(stored), dtype=torch.uint8))
    return buf


def test_float16_and_float32_chunks_and_a_two_group_object():
    g = torch.Generator().manual_seed(3)
    cfg = lmcache_serde.CacheGenSerdeConfig.from_kwargs({"quality": "lossless"})
    ser, de = lmcache_serde.CacheGenSerializer(cfg), lmcache_serde.CacheGenDeserializer(cfg)
    for dtype in (torch.float16, torch.float32):
        chunk = torch.randn(2, 4, 40, 16, generator=g).to(dtype)
        src = _kv_object(chunk.shape, dtype, chunk)
        estimate = ser.estimate_serialized_size(MemoryLayoutDesc([chunk.shape], [dtype]))
        dst = _byte_object(estimate)
        n = ser.serialize(src, dst)
        assert 0 < n <= estimate
        out = _kv_object(chunk.shape, dtype)
        de.deserialize(_filled(bytes(dst.tensor[:n].numpy()), estimate), out)
        assert torch.equal(out.tensor, chunk)
    # a hybrid model's object: two kernel groups of different shapes, each its own .cgen file
    shapes = [torch.Size([2, 3, 32, 8]), torch.Size([2, 2, 32, 24])]
    parts = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    src = ALLOC.allocate(shapes, [torch.bfloat16] * 2, fmt=MemoryFormat.KV_2LTD)
    for i, p in enumerate(parts):
        src.get_tensor(i).copy_(p)
    estimate = ser.estimate_serialized_size(MemoryLayoutDesc(shapes, [torch.bfloat16] * 2))
    dst = _byte_object(estimate)
    n = ser.serialize(src, dst)
    assert n <= estimate and lmcache_serde.ENVELOPE.unpack_from(bytes(dst.tensor[:8].numpy()))[2] == 2
    out = ALLOC.allocate(shapes, [torch.bfloat16] * 2, fmt=MemoryFormat.KV_2LTD)
    de.deserialize(_filled(bytes(dst.tensor[:n].numpy()), estimate), out)
    assert all(torch.equal(_words(out.get_tensor(i)), _words(p)) for i, p in enumerate(parts))


def test_wrong_shapes_and_dtypes_are_clear_errors():
    cfg = lmcache_serde.CacheGenSerdeConfig.from_kwargs({})
    ser, de = lmcache_serde.CacheGenSerializer(cfg), lmcache_serde.CacheGenDeserializer(cfg)
    with pytest.raises(ShapeError, match=r"3-D MLA chunk \[num_layers, num_tokens, hidden\]"):
        ser.estimate_serialized_size(MemoryLayoutDesc([torch.Size([30, 256, 576])], [torch.bfloat16]))
    with pytest.raises(ShapeError, match=r"shape \[3, 30, 256, 192\]; LMCache's chunks are \[2, num_layers"):
        ser.estimate_serialized_size(MemoryLayoutDesc([torch.Size([3, 30, 256, 192])], [torch.bfloat16]))
    with pytest.raises(DTypeError, match="float8_e4m3fn; the cachegen serde codes float16, bfloat16 and float32"):
        ser.estimate_serialized_size(MemoryLayoutDesc([torch.Size([2, 30, 256, 192])], [torch.float8_e4m3fn]))
    src = _kv_object((30, 256, 576))
    with pytest.raises(ShapeError, match="MLA"):
        ser.serialize(src, _byte_object(10))
    chunk = torch.randn(2, 2, 16, 8).to(torch.bfloat16)
    src = _kv_object(chunk.shape, data=chunk)
    with pytest.raises(SizeError, match="the destination buffer holds 100 bytes; the chunk needs"):
        ser.serialize(src, _byte_object(100))
    with pytest.raises(DTypeError, match="byte buffer is bfloat16, not uint8"):
        ser.serialize(src, _kv_object((2, 2, 16, 8)))
    estimate = ser.estimate_serialized_size(MemoryLayoutDesc([chunk.shape], [chunk.dtype]))
    dst = _byte_object(estimate)
    n = ser.serialize(src, dst)
    stored = bytes(dst.tensor[:n].numpy())
    # loading into a chunk of another shape or dtype: refused before anything is written
    with pytest.raises(SizeError, match="decodes to 1,024 bytes, more than the limit of 512"):
        de.deserialize(_filled(stored, estimate), _kv_object((2, 2, 8, 8)))
    with pytest.raises(ShapeError, match=r"decodes to \[2, 2, 16, 1, 8\] bfloat16, the destination needs"):
        de.deserialize(_filled(stored, estimate), _kv_object((2, 2, 8, 16)))
    with pytest.raises(ShapeError, match="float32"):
        de.deserialize(_filled(stored, estimate), _kv_object((2, 2, 16, 8), torch.float32))
    # bytes that are not the serde's, a truncated buffer, a corrupted .cgen file
    with pytest.raises(FormatError, match="envelope"):
        de.deserialize(_filled(b"\x89CGEN\r\n\x1a" + bytes(40), estimate), _kv_object(chunk.shape))
    with pytest.raises(SizeError, match="announces"):
        de.deserialize(_filled(stored[:-10], n - 10), _kv_object(chunk.shape))
    bad = bytearray(stored)
    bad[-40] ^= 0xFF
    with pytest.raises(FormatError):
        de.deserialize(_filled(bytes(bad), estimate), _kv_object(chunk.shape))


def test_bad_options_are_refused_when_lmcache_builds_the_serde(tmp_path):
    cases = [({"quality": "tiny"}, "unknown quality 'tiny'"),
             ({"quality": "small", "preset": "lmcache"}, "only one of"),
             ({"qualty": "small"}, "unknown option\\(s\\) qualty"),
             ({"chunk_tokens": 0}, "chunk_tokens must be between 1"),
             ({"device": "tpu"}, "device must be one of auto, cpu, cuda"),
             ({"max_workers": 0}, "max_workers must be a whole number >= 1"),
             ({"calibration": str(tmp_path / "missing.safetensors")}, "no such calibration file"),
             ({"preset": "lmcache", "calibration": str(SAMPLE_STACKED)}, "calibration")]
    for kwargs, message in cases:
        with pytest.raises(CacheGenError, match=message):
            create_serde_processor(SerdeConfig("cachegen", kwargs))
    with pytest.raises(ConfigError, match="lossless"):
        other = kvio.read_safetensors(SAMPLE_PER_LAYER)
        path = tmp_path / "c.safetensors"
        calibration_io.save(calibration_io.fit([other.data]), path)
        create_serde_processor(SerdeConfig("cachegen", {"quality": "lossless", "calibration": str(path)}))


def test_a_failed_serialize_is_reported_to_lmcache_as_a_failure():
    proc = create_serde_processor(SerdeConfig("cachegen", {}))
    try:
        src = _kv_object((30, 64, 576))  # a 3-D chunk: refused; the processor reports False, it does not hang
        dst = _byte_object(1000)
        assert _wait(proc.get_serialize_event_fd(), proc.query_serialize_result,
                     proc.submit_serialize([src], [dst])) is False
    finally:
        proc.close()


def _mla_object(shape, dtype=torch.bfloat16, data: torch.Tensor | None = None):
    obj = ALLOC.allocate([torch.Size(shape)], [dtype], fmt=MemoryFormat.KV_MLA_FMT)
    if data is not None:
        obj.tensor.copy_(data)
    return obj


def _mla_chunk(layers=3, tokens=40, hidden=72, dtype=torch.bfloat16, seed=4) -> torch.Tensor:
    """An MLA chunk as LMCache 0.5 lays it out, [1, layers, tokens, hidden] (kv_size 1):
    correlated channels, as a latent's are, and a rope part of a different scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, layers, tokens, hidden, generator=g) @ torch.randn(hidden, hidden, generator=g) / 8
    x[..., -8:] *= 4
    return x.to(dtype)


@pytest.mark.parametrize("settings", [{"quality": "lossless"}, {"quality": "balanced"}, {"preset": "lmcache"}])
def test_mla_chunks_round_trip_through_lmcaches_processor(settings):
    chunk = _mla_chunk()
    proc = create_serde_processor(SerdeConfig("cachegen", settings))
    try:
        src = _mla_object(chunk.shape, chunk.dtype, chunk)
        estimate = proc.estimate_serialized_size(MemoryLayoutDesc([chunk.shape], [chunk.dtype]))
        dst = _byte_object(estimate)
        assert _wait(proc.get_serialize_event_fd(), proc.query_serialize_result, proc.submit_serialize([src], [dst]))
        stored = bytes(dst.byte_array)
        assert len(stored) <= estimate
        blob = _cgen_blob(stored)
        assert blob[8] == 3  # a multi-part file of latents
        assert [e["name"] for e in fmt.PartsFile(blob).manifest["tensors"]] == [f"layers.{l}.latent" for l in range(3)]
        buf = _filled(stored, estimate)
        out = _mla_object(chunk.shape, chunk.dtype)
        out.tensor.zero_()
        assert _wait(proc.get_deserialize_event_fd(), proc.query_deserialize_result,
                     proc.submit_deserialize([buf], [out]))
        got = out.tensor.clone()
    finally:
        proc.close()
    if settings.get("quality") == "lossless":
        assert torch.equal(_words(got), _words(chunk))
    else:
        err = float((got.float() - chunk.float()).pow(2).mean() / chunk.float().pow(2).mean())
        assert 0 < err < 0.05
        if settings.get("quality") == "balanced":  # at least 2x smaller than bf16 on these correlated values
            assert len(stored) < chunk.numel() * 2 / 2


def test_mla_chunk_estimate_bounds_every_chunk_and_shapes_are_checked():
    cfg = lmcache_serde.CacheGenSerdeConfig.from_kwargs({"quality": "small"})
    ser, de = lmcache_serde.CacheGenSerializer(cfg), lmcache_serde.CacheGenDeserializer(cfg)
    # incompressible values (noise, odd channel count, a partial chunk): still within the estimate
    for shape in ((1, 2, 37, 77), (1, 1, 1, 576), (1, 4, 256, 64)):
        g = torch.Generator().manual_seed(sum(shape))
        chunk = (torch.rand(shape, generator=g) * 2e4 - 1e4).to(torch.bfloat16)
        estimate = ser.estimate_serialized_size(MemoryLayoutDesc([torch.Size(shape)], [torch.bfloat16]))
        dst = _byte_object(estimate)
        n = ser.serialize(_mla_object(shape, data=chunk), dst)
        assert 0 < n <= estimate
    stored = bytes(dst.tensor[:n].numpy())
    with pytest.raises(CacheGenError, match="more than the limit"):  # the size first, from the header
        de.deserialize(_filled(stored, estimate), _mla_object((1, 4, 128, 64)))
    with pytest.raises(ShapeError, match=r"the destination needs 4 latents layers.\{l\}.latent \[128, 128\]"):
        de.deserialize(_filled(stored, estimate), _mla_object((1, 4, 128, 128)))
    with pytest.raises(ShapeError, match="the destination needs 4 latents .* float16"):
        de.deserialize(_filled(stored, estimate), _mla_object((1, 4, 256, 64), torch.float16))


def test_an_object_of_a_kv_group_and_an_mla_index_group(tmp_path):
    """LMCache's hybrid objects: a K+V main cache group next to a key-only MLA group (kv_size 1)."""
    g = torch.Generator().manual_seed(8)
    shapes = [torch.Size([2, 2, 32, 16]), torch.Size([1, 2, 32, 24])]
    parts = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    cfg = lmcache_serde.CacheGenSerdeConfig.from_kwargs({"quality": "lossless"})
    ser, de = lmcache_serde.CacheGenSerializer(cfg), lmcache_serde.CacheGenDeserializer(cfg)
    src = ALLOC.allocate(shapes, [torch.bfloat16] * 2, fmt=MemoryFormat.KV_2LTD)
    for i, p in enumerate(parts):
        src.get_tensor(i).copy_(p)
    estimate = ser.estimate_serialized_size(MemoryLayoutDesc(shapes, [torch.bfloat16] * 2))
    dst = _byte_object(estimate)
    n = ser.serialize(src, dst)
    assert n <= estimate
    out = ALLOC.allocate(shapes, [torch.bfloat16] * 2, fmt=MemoryFormat.KV_2LTD)
    de.deserialize(_filled(bytes(dst.tensor[:n].numpy()), estimate), out)
    assert all(torch.equal(_words(out.get_tensor(i)), _words(p)) for i, p in enumerate(parts))


def test_mla_chunks_with_a_version_3_calibration(tmp_path):
    from cachegen_cli.methods import parts_calibration
    from cachegen_cli.storage import kvparts

    sample = _mla_chunk(tokens=120, seed=11)
    latents = {f"layers.{l}.latent": sample[0, l] for l in range(sample.shape[1])}
    path = tmp_path / "mla.cal.safetensors"
    parts_calibration.save(parts_calibration.fit_parts([kvparts.analyse(latents)]), path)
    cfg = lmcache_serde.CacheGenSerdeConfig.from_kwargs({"quality": "balanced", "calibration": str(path)})
    ser, de = lmcache_serde.CacheGenSerializer(cfg), lmcache_serde.CacheGenDeserializer(cfg)
    chunk = _mla_chunk(seed=12)
    estimate = ser.estimate_serialized_size(MemoryLayoutDesc([chunk.shape], [chunk.dtype]))
    dst = _byte_object(estimate)
    n = ser.serialize(_mla_object(chunk.shape, data=chunk), dst)
    stored = bytes(dst.tensor[:n].numpy())
    out = _mla_object(chunk.shape)
    de.deserialize(_filled(stored, estimate), out)
    err = float((out.tensor.float() - chunk.float()).pow(2).mean() / chunk.float().pow(2).mean())
    assert err < 0.05
    # the chunk's groups are rotated: without the calibration the bytes do not decode
    plain = lmcache_serde.CacheGenDeserializer(lmcache_serde.CacheGenSerdeConfig.from_kwargs({"quality": "balanced"}))
    with pytest.raises(CacheGenError, match="calibration"):
        plain.deserialize(_filled(stored, estimate), _mla_object(chunk.shape))
