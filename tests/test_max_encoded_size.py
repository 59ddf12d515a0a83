"""max_encoded_size: no cache, random or real, encodes to more bytes than the bound for its
shape, dtype and settings (LMCache's serde reserves exactly that many bytes before encoding)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import cachegen_cli.api as api
from cachegen_cli.errors import ConfigError

from conftest import SAMPLE_STACKED, per_layer, realistic_kv

SETTINGS = [{"quality": "lossless"}, {"quality": "high"}, {"quality": "balanced"}, {"quality": "small"},
            {"preset": "lmcache"}, {"bins": "3"}, {"bins": "255"}]


def _random_finite(shape, dtype, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "bits":  # every finite bit pattern equally likely: the top bytes are as random as they come
        info = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                torch.float16: (torch.int16, 0x7C00)}[dtype]
        words = torch.randint(-(1 << 31) if info[0] == torch.int32 else -(1 << 15),
                              (1 << 31) - 1 if info[0] == torch.int32 else (1 << 15) - 1, shape, generator=g,
                              dtype=torch.int64).to(info[0])
        finite = (words & info[1]) != info[1]
        words = torch.where(finite, words, words & ~info[1])  # exponent all ones -> zero: finite
        return words.view(dtype)
    if kind == "heavy":  # Cauchy-like: a few huge values per token, the rest tiny
        x = torch.randn(shape, generator=g) / torch.randn(shape, generator=g).abs().clamp_min(1e-3)
        return x.clamp(-6e4, 6e4).to(dtype)
    return torch.rand(shape, generator=g).mul(2).sub(1).to(dtype)  # uniform in [-1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["bits", "heavy", "uniform"])
def test_random_caches_stay_within_the_bound(dtype, kind):
    # 37 tokens in chunks of 16 (a short last chunk), 3 x 5 channels (not a multiple of a group)
    shape = (2, 2, 37, 3, 5)
    seed = [torch.bfloat16, torch.float16, torch.float32].index(dtype) * 3 + ["bits", "heavy", "uniform"].index(kind)
    kv = _random_finite(shape, dtype, seed=seed, kind=kind)
    for settings in SETTINGS:
        for chunk_tokens in (1, 16, 256):
            blob = api.encode(kv, chunk_tokens=chunk_tokens, device="cpu", **settings)
            bound = api.max_encoded_size(kv, chunk_tokens=chunk_tokens, **settings)
            assert len(blob) <= bound, (settings, chunk_tokens)
            # the shape-only form gives the same bound as the tensor itself
            assert api.max_encoded_size(shape, dtype, chunk_tokens=chunk_tokens, **settings) == bound


def test_edge_shapes_stay_within_the_bound():
    for tokens in (0, 1, 2, 255, 257):
        kv = realistic_kv(layers=2, tokens=tokens, heads=1, head_dim=4) if tokens else torch.zeros(2, 2, 0, 1, 4,
                                                                                                  dtype=torch.bfloat16)
        for settings in SETTINGS:
            blob = api.encode(kv, device="cpu", **settings)
            assert len(blob) <= api.max_encoded_size(kv, **settings), (tokens, settings)


def test_per_layer_names_count_in_the_bound():
    kv = realistic_kv(layers=3, tokens=20)
    tensors = per_layer(kv)
    meta = {"model": "a rather long model name " * 8}
    for settings in SETTINGS:
        blob = api.encode(tensors, metadata=meta, device="cpu", **settings)
        bound = api.max_encoded_size(tensors, metadata=meta, **settings)
        assert len(blob) <= bound
        # the descriptor (names, metadata) is part of the file: the bound grows with it
        assert bound > api.max_encoded_size(kv, **settings)


def test_real_cache_and_its_lmcache_chunks_stay_within_the_bound():
    kv = load_file(str(SAMPLE_STACKED))["kv"]
    raw = kv.numel() * kv.element_size()
    for settings in SETTINGS[:5]:
        for part in (kv, kv[:, :, :256], kv[:, :, 256:512], kv[:, :, 512:]):
            part = part.contiguous()
            blob = api.encode(part, device="cpu", **settings)
            bound = api.max_encoded_size(part, **settings)
            assert len(blob) <= bound, settings
        # A bound far above the raw size would waste the buffer a caller reserves: the worst
        # case is 2 bytes per coded value plus lossless' raw low bytes and fixed overheads.
        bound = api.max_encoded_size(kv, **settings)
        assert bound < (1.7 if settings.get("quality") == "lossless" else 1.2) * raw


def test_meta_tensors_and_bad_settings():
    meta = torch.empty(4, 2, 100, 2, 8, dtype=torch.float16, device="meta")
    assert api.max_encoded_size(meta, quality="small") == api.max_encoded_size((4, 2, 100, 2, 8), torch.float16,
                                                                              quality="small")
    with pytest.raises(ConfigError):
        api.max_encoded_size(meta, quality="tiny")
    with pytest.raises(ConfigError):
        api.max_encoded_size(meta, quality="small", preset="lmcache")
    with pytest.raises(ConfigError):
        api.max_encoded_size(meta, chunk_tokens=0)
