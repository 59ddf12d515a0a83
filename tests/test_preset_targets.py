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


def _lm_row(text, quality, scale, bits, kl, lm_kl, lm_bits=5.0):
    return dict(_row(text, 1024, quality, kl, 0.1), variant="cal+sens", step_scale=scale, bits_per_value=bits,
                lmcache_kl=lm_kl, lmcache_top1=0.9, lmcache_bits_per_value=lm_bits)


def test_choice_against_lmcache_follows_the_page_caches_only(pt, capsys):
    """The rule reads only the page caches: the smallest page mean among the tables whose page
    caches all stay at or below factor x LMCache's KL, whatever the held-out caches do."""
    rows = [_lm_row("page a", "small", 1, 2.0, 1e-3, 2e-3), _lm_row("held", "small", 1, 2.0, 9e-3, 1e-3),
            _lm_row("page a", "small", 2, 1.5, 2.5e-3, 2e-3),  # 1.25 > 0.7: not eligible, though smaller
            _lm_row("page a", "balanced", 2, 1.8, 1.2e-3, 2e-3), _lm_row("held", "balanced", 2, 1.4, 5e-4, 1e-3)]
    pt.choose_against_lmcache(rows, 0.7)
    out = capsys.readouterr().out
    assert "| small | cal+sens | 2 | 1 | 1.500 | 1.25 | no |" in out
    assert "Chosen: --quality balanced, variant cal+sens, steps x 2 (page mean 1.800 bits/value)" in out
    assert "Held-out (1 caches): KL / LMCache KL 0.50-0.50, 1 of 1 at or below LMCache's KL, 1 at or below 0.7x" in out
    # the bar: balanced x2 is <= 1.6 bits and <= 0.35 x 5 bits only on its held-out cache
    assert "each on every one of the caches: none." in out
    pt.choose_against_lmcache([dict(r, bits_per_value=1.5) for r in rows[3:]], 0.7)
    assert "each on every one of the caches: balanced cal+sens x2." in capsys.readouterr().out


def test_flatness_table_states_the_log_spreads(pt, capsys):
    # KL 1e-3 and 4e-3 against LMCache's 1e-3 and 4e-3: the ratio is flat, its log's sd 0
    rows = [_lm_row("a", "small", 1, 2.0, 1e-3, 1e-3), _lm_row("b", "small", 1, 2.0, 4e-3, 4e-3)]
    pt.lmcache_flatness(rows)
    out = capsys.readouterr().out
    assert f"| small | cal+sens | 1 | 4.00x | 1.00x | {math.log(4) / 2:.2f} | 0.00 | 1.00 |" in out
    assert "LMCache's KL itself: spread 4.00x" in out


def test_page_standing(pt):
    rows = [dict(text="page a", bits_per_value=2.0, kl=0.02, lmcache_kl=0.05),
            dict(text="held", bits_per_value=1.0, kl=0.09, lmcache_kl=0.1),
            dict(text="page b", bits_per_value=1.0, kl=0.03, lmcache_kl=0.05)]
    assert pt.page_standing(rows) == (2, 1.5, pytest.approx(0.6))
    held = rows[1:2]
    assert pt.page_standing(held) is None
    assert pt.page_standing(held, all_without_page=True) == (1, 1.0, pytest.approx(0.9))
