"""The recent-token refinement (format version 2, FLAG_REFINED): the last tokens carry
``recent_bits`` more bits each, in their chunks' raw sections."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.pipeline import codec
from cachegen_cli.storage import kvio
from cachegen_cli.methods.config import TransformConfig, load_config_file
from cachegen_cli.format.container import FLAG_REFINED
from cachegen_cli.errors import ConfigError, SizeError
from cachegen_cli.format.params import bf16_values, pack_refinement, unpack_refinement

from conftest import SAMPLE_STACKED, realistic_kv
from test_transform import _decode, _fix_crc, _params_span


def _header(blob: bytes):
    return codec.read_header_and_index(codec.open_input(blob)[0])[0]


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_refined_tokens_have_a_finer_error(bits):
    """Unrotated: every refined value is within step / 2^(bits+1) of the original (plus float32
    rounding), the others within step / 2; the sizes of the raw sections follow the plan."""
    kv = realistic_kv(layers=2, tokens=30, heads=2, head_dim=8, dtype=torch.float32, seed=3)
    cfg = TransformConfig("transform", (0.7,), (0.7,), recent_tokens=11, recent_bits=bits)
    blob = cg.encode(kv, quantization=cfg, chunk_tokens=8, device="cpu")
    h = _header(blob)
    assert h.flags & FLAG_REFINED and h.params.refine_tokens == 11 and h.params.refine_bits == bits
    assert h.refine_start == 19
    y = cg.decode(blob, device="cpu")["kv"].double()
    x = kv.double()
    step = torch.from_numpy(bf16_values(h.params.steps)).view(2, 2, 1, 1, 1)
    err = (y - x).abs()
    slack = 1e-6 * (1 + x.abs())
    assert (err[:, :, 19:] <= step / 2 ** (bits + 1) + slack[:, :, 19:]).all()
    assert err[:, :, 19:].pow(2).mean() < err[:, :, 1:19].pow(2).mean() / (0.6 * 4 ** bits)
    assert (err[:, :, 1:19] <= step / 2 + slack[:, :, 1:19]).all()
    assert err[:, :, 1:19].max() > step.min() / 2 ** (bits + 1)  # the others are not refined
    # chunks [0,8) [8,16) [16,24) [24,30): 0, 0, 5 and 6 refined tokens
    sizes = [h.section_sizes(h.chunk_tokens_at(k), 8 * k)[0] for k in range(4)]
    per_token = 2 * 2 * 16 * bits
    assert sizes == [0, 0, -(-5 * per_token // 8), -(-6 * per_token // 8)]


def test_refinement_needs_more_bits_and_is_worth_them_on_the_real_sample():
    cache = kvio.read_safetensors(SAMPLE_STACKED)
    x = cache.data[:, :, :300].reshape(30, 2, 300, 3, 64)
    plain = cg.encode(x, quantization=TransformConfig("transform", (0.9,), (0.9,), recent_bits=0), device="cpu")
    refined = cg.encode(x, quantization=TransformConfig("transform", (0.9,), (0.9,)), device="cpu")
    assert len(refined) - len(plain) == pytest.approx(30 * 2 * 64 * 192 * 2 / 8, rel=0.01)
    e = lambda b: (cg.decode(b, device="cpu")["kv"].double() - x.double()).pow(2).mean(dim=(0, 1, 3, 4))
    ep, er = e(plain), e(refined)
    assert torch.equal(ep[:236], er[:236])  # the rest of the cache is untouched
    assert er[236:].mean() < ep[236:].mean() / 12  # 2 bits: 4x finer steps, MSE ~16x lower


def test_short_caches_and_no_refinement():
    kv = realistic_kv(layers=1, tokens=3, heads=1, head_dim=4)
    h = _header(cg.encode(kv, device="cpu"))  # default 64 recent tokens: all but the sink token
    assert h.params.refine_tokens == 2
    h = _header(cg.encode(realistic_kv(layers=1, tokens=1, heads=1, head_dim=4), device="cpu"))
    assert not h.flags & FLAG_REFINED and h.params.refine_tokens == 0
    h = _header(cg.encode(kv, quantization=TransformConfig("transform", recent_tokens=0), device="cpu"))
    assert not h.flags & FLAG_REFINED
    h = _header(cg.encode(kv, quality="lossless", device="cpu"))
    assert not h.flags & FLAG_REFINED


def test_pack_refinement_round_trip_and_padding():
    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        v = rng.integers(0, 1 << bits, 37).astype(np.uint8)
        raw = np.frombuffer(pack_refinement(v, bits), np.uint8)
        assert raw.size == -(-37 * bits // 8)
        assert np.array_equal(unpack_refinement(raw, 37, bits), v)
    raw = np.frombuffer(pack_refinement(np.array([1, 2, 3], np.uint8), 2), np.uint8).copy()
    raw[-1] |= 0x80
    with pytest.raises(SizeError, match="padding"):
        unpack_refinement(raw, 3, 2)


def _tiny_refined() -> bytes:
    kv = realistic_kv(layers=2, tokens=9, heads=1, head_dim=4, dtype=torch.bfloat16, seed=7)
    return cg.encode(kv, quality="balanced", chunk_tokens=4, device="cpu")


def test_bad_refinement_fields_are_rejected_even_with_a_valid_crc():
    blob = _tiny_refined()
    start, _ = _params_span(blob)
    at = start + 32 + 4 * 2 + 4 * 2 * 4 + 2 * 2 * 1 * 4 * 2  # after hash, steps, offsets, sink token
    assert struct.unpack_from("<IB", blob, at) == (8, 2)
    for tokens, bits, message in [(8, 0, "refinement bits"), (8, 9, "refinement bits"), (0, 2, "refined tokens"),
                                  (9, 2, "refined tokens")]:
        bad = bytearray(blob)
        struct.pack_into("<IB", bad, at, tokens, bits)
        with pytest.raises(SizeError, match=message):
            _decode(_fix_crc(bad))
    # the flag without its fields: the Params block no longer parses
    bad = bytearray(blob)
    bad[47] &= ~FLAG_REFINED
    with pytest.raises(SizeError):
        _decode(_fix_crc(bad))


def test_config_file_recent_fields(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("key_step = 0.5\nrecent_tokens = 16\nrecent_bits = 3\n")
    cfg = load_config_file(p).quantization
    assert (cfg.recent_tokens, cfg.recent_bits) == (16, 3)
    for body, message in [("recent_bits = 9\n", "recent_bits"), ("recent_tokens = -1\n", "recent_tokens"),
                          ("recent_tokens = 1.5\n", "recent_tokens")]:
        p.write_text("key_step = 0.5\n" + body)
        with pytest.raises(ConfigError, match=message):
            load_config_file(p)
