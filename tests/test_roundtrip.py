"""Seeded round trips through the public API: bins x chunk sizes x dtypes x layouts."""

from __future__ import annotations

import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.methods.config import QuantizationConfig, QuantizationSpec

from conftest import per_layer, realistic_kv

TOKENS = 40


def _table(bins: int) -> QuantizationConfig:
    spec = (QuantizationSpec(0, None, bins),)
    return QuantizationConfig(spec, spec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bins", [3, 16, 32, 255])
@pytest.mark.parametrize("chunk_tokens", [1, 13, TOKENS - 1, TOKENS, TOKENS + 1, 256])
def test_stacked_roundtrip(dtype, bins, chunk_tokens):
    kv = realistic_kv(layers=2, tokens=TOKENS, heads=2, head_dim=8, dtype=dtype, seed=bins + chunk_tokens)
    blob = cg.encode(kv, quantization=_table(bins), chunk_tokens=chunk_tokens)
    out = cg.decode(blob)
    assert list(out) == ["kv"]
    y = out["kv"]
    assert y.shape == kv.shape and y.dtype == kv.dtype
    # per-token rows are [heads, head_dim] in the stacked layout: bound per (layer, kv, token)
    x = kv.float()
    absmax = x.abs().amax(dim=(-2, -1), keepdim=True)
    step = absmax * (1 + 2.0**-7) / ((bins - 1) // 2)
    bound = 0.5 * step + (x.abs() + step) * 2.0**-7 + 1e-30
    assert ((y.float() - x).abs() <= bound).all()
    assert cg.encode(kv, quantization=_table(bins), chunk_tokens=chunk_tokens) == blob  # deterministic


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 16, 17, 256])
def test_per_layer_roundtrip(dtype, batch, chunk_tokens):
    kv = realistic_kv(layers=3, tokens=17, heads=3, head_dim=4, dtype=dtype, seed=chunk_tokens)
    tensors = per_layer(kv, batch)
    blob = cg.encode(tensors, chunk_tokens=chunk_tokens, metadata={"model": "test", "n": "17"})
    out = cg.decode(blob)
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].shape == t.shape and out[name].dtype == t.dtype
    # the same cache in the stacked layout decodes to the same values
    stacked = cg.decode(cg.encode(kv, chunk_tokens=chunk_tokens))["kv"]
    again = torch.stack([torch.stack([out[f"layers.{i}.key"].reshape(3, 17, 4), out[f"layers.{i}.value"].reshape(3, 17, 4)]) for i in range(3)])
    assert torch.equal(again.permute(0, 1, 3, 2, 4), stacked)


def test_zero_tokens_channels_and_empty_cache():
    kv = realistic_kv(layers=2, tokens=20, heads=2, head_dim=4, dtype=torch.float32)
    kv[:, :, 5] = 0  # a token that is all zeros
    kv[:, :, :, 1, 2] = 0  # a channel that is all zeros
    kv[1, 1] = 0  # a whole plane of zeros
    y = cg.decode(cg.encode(kv, preset="lmcache", chunk_tokens=8))["kv"]  # format v1: per-token scales
    assert torch.isfinite(y).all()
    assert (y[:, :, 5] == 0).all() and (y[:, :, :, 1, 2] == 0).all() and (y[1, 1] == 0).all()
    empty = torch.zeros(2, 2, 0, 2, 4, dtype=torch.bfloat16)
    y = cg.decode(cg.encode(empty, preset="lmcache"))["kv"]
    assert y.shape == empty.shape and y.dtype == empty.dtype


def test_quality_improves_with_bins():
    kv = realistic_kv(layers=2, tokens=64, heads=2, head_dim=16, dtype=torch.float32)
    errors, sizes = [], []
    for bins in (4, 16, 64, 255):
        blob = cg.encode(kv, quantization=_table(bins))
        y = cg.decode(blob)["kv"]
        errors.append(float(((y - kv) ** 2).sum() / (kv**2).sum()))
        sizes.append(len(blob))
    assert errors == sorted(errors, reverse=True) and sizes == sorted(sizes)
    assert errors[-1] < 1e-4


def test_layer_table_is_applied():
    kv = realistic_kv(layers=12, tokens=30, heads=1, head_dim=8, dtype=torch.float32)
    blob = cg.encode(kv, preset="lmcache")
    from cachegen_cli.format import container
    import io

    h, _ = container.read_file_header(io.BytesIO(blob))
    assert h.bins[:, 0].tolist() == [32] * 10 + [16] * 2
    assert h.bins[:, 1].tolist() == [32] * 2 + [16] * 10
    blob = cg.encode(kv, bins="k:0-3=64,3-=8;v:-=20")
    h, _ = container.read_file_header(io.BytesIO(blob))
    assert h.bins[:, 0].tolist() == [64] * 3 + [8] * 9 and h.bins[:, 1].tolist() == [20] * 12


def test_decode_accepts_a_uint8_tensor():
    kv = realistic_kv(layers=2, tokens=9)
    blob = cg.encode(kv, chunk_tokens=4)
    as_tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    assert torch.equal(cg.decode(as_tensor)["kv"], cg.decode(blob)["kv"])
    from cachegen_cli.errors import FormatError

    with pytest.raises(FormatError):
        cg.decode(torch.zeros(3, 3, dtype=torch.uint8))
