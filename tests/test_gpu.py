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
    blob = cg.encode(kv.cuda(), device="cuda")
    assert blob == cg.encode(kv, device="cpu")
    out = cg.decode(blob, device="cuda")["kv"]
    assert out.is_cuda and out.dtype == kv.dtype and out.shape == kv.shape
    tensors = {k: v.cuda() for k, v in per_layer(kv[:4]).items()}
    assert cg.encode(tensors, device="cuda") == cg.encode(per_layer(kv[:4]), device="cpu")


@pytest.mark.parametrize("chunk_tokens", [1, 256, 300])
def test_encode_to_device_same_bytes(sample_stacked, chunk_tokens):
    kv = load_file(str(sample_stacked))["kv"]
    if chunk_tokens == 1:
        kv = kv[:, :, :20].contiguous()
    on_device = cg.encode_to_device(kv.cuda(), chunk_tokens=chunk_tokens)
    assert on_device.is_cuda and on_device.dtype == torch.uint8
    assert on_device.cpu().numpy().tobytes() == cg.encode(kv, device="cpu", chunk_tokens=chunk_tokens)
    assert torch.equal(cg.decode(on_device, device="cuda")["kv"].cpu(), cg.decode(on_device, device="cpu")["kv"])
