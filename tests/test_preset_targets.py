"""scripts/preset_targets.py's bookkeeping: the attention entropy it reports is the entropy of
the proxy queries' causal attention (checked against a direct softmax), and its report states
each preset's spreads and the KL's growth with the context from the rows it is given."""

import math

import pytest
import torch

from conftest import load_script


@pytest.fixture(scope="module")
def pt():
    return load_script("scripts/preset_targets.py", "preset_targets")


def test_attention_entropy_is_the_causal_softmax_entropy(pt):
    from cachegen_cli.model.tune import AttentionMeasure

    g = torch.Generator().manual_seed(3)
    L, T, H, D = 2, 40, 2, 8
    cache = torch.randn(L, 2, T, H * D, generator=g)
    m = AttentionMeasure(cache, H, D, queries=5)
    want, n = 0.0, 0
    for l in range(L):
        k = cache[l, 0].reshape(T, H, D).transpose(0, 1)
        for i, p in enumerate(m.pos.tolist()):
            for h in range(H):
                s = k[h, :p] @ k[h, p] / math.sqrt(D)
                prob = torch.softmax(s.double(), 0)
                want += float(-(prob * prob.log()).sum())
                n += 1
    assert pt.attention_entropy(m, cache) == pytest.approx(want / n, rel=1e-5)


def _row(text, ctx, q, kl, attn, rel=0.01):
    return dict(text=text, context=ctx, quality=q, bits_per_value=3.0, kl=kl, top1=0.97, attention_error=attn,
                rel_err=rel, attention_entropy=2.0)


def test_report_states_spreads_and_growth(pt, capsys):
    rows = [_row("a", 1024, "high", 1e-3, 0.1), _row("b", 1024, "high", 4e-3, 0.2),
            _row("a", 4096, "high", 3e-3, 0.1, rel=0.02), _row("a", 1024, "small", 2e-2, 0.3)]
    pt.report(rows)
    out = capsys.readouterr().out
    high = out.split("`--quality small`")[0]
    assert "3 caches, KL geometric mean %.2e" % (12e-9) ** (1 / 3) in high
    assert "KL 4.00x, attention error² 4.00x, relative squared error 2.00x" in high
    assert "KL at 4096 / KL at 1024 tokens: a 3.00x." in high
    assert "| b | 1024 | 3.000 | 4.00e-03 |" in high
    assert "1 caches, KL geometric mean 2.00e-02" in out.split("`--quality small`")[1]


def test_report_keeps_the_variants_apart(pt, capsys):
    rows = [_row("a", 1024, "high", 1e-3, 0.1), _row("b", 1024, "high", 4e-3, 0.1)]
    rows += [dict(r, variant="cal+sens", kl=r["kl"] / 2) for r in rows]
    pt.report(rows)
    out = capsys.readouterr().out
    assert "#### `--quality high`: 2 caches, KL geometric mean 2.00e-03, 5.33x smaller than bf16 on average" in out
    assert ("#### `--quality high`, calibrated on the other texts, with their sensitivities: 2 caches, "
            "KL geometric mean 1.00e-03") in out


def test_repeats_count_ngrams_seen_before(pt):
    # context 1 2 3 1 2 3 4: 3-grams (1,2,3) (2,3,1) (3,1,2) (1,2,3)* (2,3,4) -> 1 of 5 seen before;
    # continuation 1 2 9: the 3-grams ending at its positions are (3,4,1) (4,1,2) (1,2,9): none in the context
    assert pt.repeats([1, 2, 3, 1, 2, 3, 4], [1, 2, 9]) == (pytest.approx(0.2), 0.0)
    # continuation 1 2 3: (3,4,1) no, (4,1,2) no, (1,2,3) yes
    assert pt.repeats([1, 2, 3, 1, 2, 3, 4], [1, 2, 3])[1] == pytest.approx(1 / 3)
    assert pt.repeats([5], [5]) == (0.0, 0.0)


def test_report_correlates_log_kl_with_the_repeats(pt, capsys):
    rows = [dict(_row(t, 1024, "high", kl, 0.1), context_repeats=c, continuation_repeats=k)
            for t, kl, c, k in (("a", 1e-3, 0.1, 0.1), ("b", 2e-3, 0.3, 0.2), ("c", 4e-3, 0.2, 0.3))]
    pt.report(rows)
    out = capsys.readouterr().out
    assert "with the context's repeated 3-grams 0.50, with the continuation's 3-grams found in the context 1.00." in out


def test_report_states_kl_and_size_against_lmcache(pt, capsys):
    # KL / LMCache KL: a 1.00 (at LMCache's KL counts as at or below), b 0.80, c 1.25 -> spread 1.5625x
    # while the KL spreads 4x and LMCache's 5x; sizes 3 bits against LMCache's 10, 12, 6
    rows = [dict(_row(t, c, "small", kl, 0.1), lmcache_kl=lm, lmcache_top1=0.9, lmcache_bits_per_value=lb)
            for t, c, kl, lm, lb in (("a", 1024, 1e-3, 1e-3, 10.0), ("b", 1024, 4e-3, 5e-3, 12.0),
                                     ("c", 4096, 2e-3, 1.6e-3, 6.0))]
    pt.report(rows + [_row("a", 1024, "high", 1e-3, 0.1)])
    out = capsys.readouterr().out
    small, high = out.split("`--quality high`")[0], out.split("`--quality high`")[1]
    assert "| b | 1024 | 3.000 | 4.00e-03 |" in small and "| 5.00e-03 | 0.80 | 0.250 |" in small
    assert "| attention entropy | LMCache KL | KL / LMCache KL | size / LMCache size |" in small
    assert ("Against LMCache's CacheGen on the same cache: spread of KL / LMCache KL 1.56x (of the KL 4.00x, "
            "of LMCache's KL 5.00x); largest KL / LMCache KL 1.25, geometric mean 1.00; 2 of 3 caches at or "
            "below LMCache's KL; size / LMCache size 0.250-0.500.") in small
    assert "LMCache" not in high  # rows without LMCache's scores keep the old table
