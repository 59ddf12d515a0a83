"""scripts/recent_tiers.py's bookkeeping: the tiers' bits per token, the splice of one-span files
(a single tier decodes to exactly the one-span file's values, and the accounted bits are within
half a percent of its size), and the equal-bits comparison of its report."""

import math

import pytest
import torch

from conftest import load_script


@pytest.fixture(scope="module")
def rt():
    return load_script("scripts/recent_tiers.py", "recent_tiers")


def test_token_bits_follow_the_tiers(rt):
    tiers = rt.parse_schedule("2:3,5:1")
    assert rt.token_bits(tiers, 8, 1) == [0, 0, 0, 1, 1, 1, 3, 3]
    assert rt.token_bits(tiers, 3, 1) == [0, 3, 3]  # the sink token never
    with pytest.raises(SystemExit):
        rt.parse_schedule("8:1,4:2")


def test_one_tier_is_the_one_span_file(rt):
    import cachegen_cli as cg
    from cachegen_cli.methods.config import QUALITY_PRESETS
    from cachegen_cli.model import evaluate

    g = torch.Generator().manual_seed(5)
    L, T, H, D = 2, 300, 2, 16
    kv = (torch.randn(L, 2, T, H, D, generator=g) * torch.linspace(0.2, 3.0, D)).to(torch.bfloat16)
    cfg = QUALITY_PRESETS["balanced"]
    data, total, _ = rt.tiered(kv, cfg, None, [(64, 2)], cfg.sink_tokens)
    real = cg.encode(kv, quantization=cfg, chunk_tokens=rt.CHUNK_TOKENS, device="cpu")
    assert torch.equal(data, evaluate.tensors_to_internal(cg.decode(real, device="cpu")))
    assert abs(8 * len(real) / total - 1) < 0.005
    two, _, _ = rt.tiered(kv, cfg, None, [(16, 3), (64, 2)], cfg.sink_tokens)
    assert not torch.equal(two[:, :, T - 16:], data[:, :, T - 16:])  # the nearest tokens refined further
    assert torch.equal(two[:, :, : T - 16], data[:, :, : T - 16])


def test_equal_bits_interpolates_log_kl(rt):
    def row(sched, bits, kl):
        return dict(text="a", context=1024, schedule=sched, bits_per_value=bits, kl=kl)

    rows = [row("64:2", 2.0, 1e-2), row("64:2", 1.0, 4e-2), row("x", 1.5, 1e-2), row("x", 2.5, 1e-3)]
    (sched, n, g, lo, hi), = rt.equal_bits(rows)
    assert (sched, n) == ("x", 1)  # only bits = 2.0 lies within x's range
    assert g == pytest.approx(math.sqrt(1e-2 * 1e-3) / 1e-2) == lo == hi
