"""Real-GPU checks (marked gpu; skipped without a CUDA device).  Run on a GPU machine with

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -q -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import cachegen_cli as cg

from conftest import per_layer, realistic_kv

pytestmark = pytest.mark.gpu


def _both(kv, **kw):
    kw.setdefault("preset", None if "bins" in kw else "lmcache")  # format version 1: the GPU's
    cpu = cg.encode(kv, device="cpu", **kw)
    gpu = cg.encode(kv, device="cuda", **kw)
    assert cpu == gpu
    return cpu


def test_sample_files_identical_bytes(sample_stacked, sample_per_layer):
    kv = load_file(str(sample_stacked))["kv"]
    blob = _both(kv)
    assert torch.equal(cg.decode(blob, device="cuda")["kv"].cpu(), cg.decode(blob, device="cpu")["kv"])
    tensors = load_file(str(sample_per_layer))
    blob = _both(tensors)
    a, b = cg.decode(blob, device="cuda"), cg.decode(blob, device="cpu")
    assert all(torch.equal(a[k].cpu(), b[k]) for k in b)


@pytest.mark.parametrize("chunk_tokens", [1, 255, 256, 257, 4096])
def test_chunk_boundaries_and_long_chunks(sample_stacked, chunk_tokens):
    kv = load_file(str(sample_stacked))["kv"]
    kv = torch.cat([kv, kv.flip(2)], dim=2)[:, :, :1030].contiguous()  # 1030 tokens
    if chunk_tokens == 1:
        kv = kv[:, :, :40].contiguous()
    _both(kv, chunk_tokens=chunk_tokens)


def test_zero_channels_and_tokens_and_bins():
    kv = realistic_kv(layers=4, tokens=600, heads=4, head_dim=32, dtype=torch.float32)
    kv[:, :, :, 1, 5] = 0
    kv[:, :, 17] = 0
    kv[2, 1] = 0
    for bins in ("3", "255", "k:0-2=64,2-=5;v:-=9"):
        _both(kv, bins=bins, chunk_tokens=256)


def test_cuda_tensors_in_and_out(sample_stacked):
    kv = load_file(str(sample_stacked))["kv"]
    blob = cg.encode(kv.cuda(), device="cuda", preset="lmcache")
    assert blob == cg.encode(kv, device="cpu", preset="lmcache")
    out = cg.decode(blob, device="cuda")["kv"]
    assert out.is_cuda and out.dtype == kv.dtype and out.shape == kv.shape
    tensors = {k: v.cuda() for k, v in per_layer(kv[:4]).items()}
    assert cg.encode(tensors, device="cuda", preset="lmcache") == cg.encode(per_layer(kv[:4]), device="cpu", preset="lmcache")


@pytest.mark.parametrize("chunk_tokens", [1, 256, 300])
def test_encode_to_device_same_bytes(sample_stacked, chunk_tokens):
    kv = load_file(str(sample_stacked))["kv"]
    if chunk_tokens == 1:
        kv = kv[:, :, :20].contiguous()
    on_device = cg.encode_to_device(kv.cuda(), chunk_tokens=chunk_tokens, preset="lmcache")
    assert on_device.is_cuda and on_device.dtype == torch.uint8
    assert on_device.cpu().numpy().tobytes() == cg.encode(kv, device="cpu", chunk_tokens=chunk_tokens, preset="lmcache")
    assert torch.equal(cg.decode(on_device, device="cuda")["kv"].cpu(), cg.decode(on_device, device="cpu")["kv"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_device_bytes_decode_like_the_cpu(sample_per_layer, dtype):
    """decode(GPU bytes) checks and decodes on the GPU: the CPU's tensors, per-layer layout too."""
    tensors = {k: v.to(dtype) for k, v in load_file(str(sample_per_layer)).items()}
    on_device = cg.encode_to_device({k: v.cuda() for k, v in tensors.items()}, chunk_tokens=64, preset="lmcache")
    blob = cg.encode(tensors, device="cpu", chunk_tokens=64, preset="lmcache")
    assert on_device.cpu().numpy().tobytes() == blob
    a, b = cg.decode(on_device, device="cuda"), cg.decode(blob, device="cpu")
    assert all(a[k].is_cuda and a[k].dtype == dtype and torch.equal(a[k].cpu(), b[k]) for k in b)


def test_device_bytes_corruption_is_caught(sample_stacked):
    kv = load_file(str(sample_stacked))["kv"][:, :, :300].contiguous()
    on_device = cg.encode_to_device(kv.cuda(), preset="lmcache")
    for pos in (70, on_device.numel() // 2, on_device.numel() - 20):
        bad = on_device.clone()
        bad[pos] ^= 1
        with pytest.raises(Exception) as cpu_error:
            cg.decode(bad.cpu().numpy().tobytes(), device="cpu")
        with pytest.raises(type(cpu_error.value)):
            cg.decode(bad, device="cuda")


# ---------------------------------------------------------------- format version 2 (--quality)


@pytest.mark.parametrize("quality", ["lossless", "high", "balanced", "small"])
@pytest.mark.parametrize("chunk_tokens", [1, 256, 4096])
def test_v2_sample_identical_bytes_and_values(sample_stacked, sample_per_layer, quality, chunk_tokens):
    for tensors in (load_file(str(sample_stacked)), load_file(str(sample_per_layer))):
        cpu = cg.encode(tensors, quality=quality, chunk_tokens=chunk_tokens, device="cpu")
        gpu = cg.encode({k: v.cuda() for k, v in tensors.items()}, quality=quality, chunk_tokens=chunk_tokens,
                        device="cuda")
        assert cpu == gpu
        a, b = cg.decode(cpu, device="cuda"), cg.decode(cpu, device="cpu")
        assert all(torch.equal(a[k].cpu().view(torch.int16), b[k].view(torch.int16)) for k in b)


def test_v2_rotated_identical_bytes_and_values(sample_stacked):
    from cachegen_cli.methods import calibration as calib

    kv = load_file(str(sample_stacked))["kv"]
    cal = calib.fit([kv.reshape(30, 2, 520, 192)[:, :, 260:]])
    x = kv[:, :, :260].contiguous()
    cpu = cg.encode(x, calibration=cal, device="cpu")
    assert cpu == cg.encode(x.cuda(), calibration=cal, device="cuda")
    a = cg.decode(cpu, device="cuda", calibration=cal)["kv"].cpu()
    b = cg.decode(cpu, device="cpu", calibration=cal)["kv"]
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_v2_zero_planes_float_dtypes():
    for dtype in (torch.float16, torch.float32):
        kv = realistic_kv(layers=3, tokens=300, heads=2, head_dim=64, dtype=dtype, seed=5)
        kv[1, 1] = 0
        kv[:, :, :, 1, 3] = 0
        for quality in ("balanced", "lossless"):
            cpu = cg.encode(kv, quality=quality, device="cpu")
            assert cpu == cg.encode(kv.cuda(), quality=quality, device="cuda")


def test_upload_ring_wraps_without_overwriting_queued_copies():
    """pipeline/staging's ring, made tiny so that it wraps many times while copies are queued
    behind a long kernel: every device tensor holds its own host array."""
    import numpy as np

    from cachegen_cli.pipeline.staging import UploadRing

    ring = UploadRing(min_bytes=4096)
    dev = torch.device("cuda")
    rng = np.random.default_rng(5)
    slow = torch.randn(4096, 4096, device=dev)
    for _ in range(4):
        slow = slow @ slow  # keeps the stream busy while the uploads are queued behind it
    outs = []
    for i in range(300):
        dtype = [np.int64, np.float32, np.uint8, np.float64][i % 4]
        a = (rng.standard_normal(int(rng.integers(0, 700))) * 100).astype(dtype)
        outs.append(ring.upload(a, dev))
        a[...] = 0  # the caller's array may change as soon as upload returns
    torch.cuda.synchronize()
    rng = np.random.default_rng(5)  # the sources were zeroed: made again from the seed
    for i, o in enumerate(outs):
        dtype = [np.int64, np.float32, np.uint8, np.float64][i % 4]
        a = (rng.standard_normal(int(rng.integers(0, 700))) * 100).astype(dtype)
        assert o.dtype == torch.from_numpy(a).dtype
        assert np.array_equal(o.cpu().numpy(), a)
