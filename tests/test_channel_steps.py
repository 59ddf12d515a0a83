"""scripts/channel_steps.py's per-channel step factors: a geometric mean of 1 in every plane (about
the same bits), the more sensitive channel the finer step, within the clip; gamma 0 is no change."""

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def cs():
    return load_script("scripts/channel_steps.py", "channel_steps")


def test_channel_factors(cs):
    rng = np.random.default_rng(4)
    F = np.exp(rng.normal(0, 3, (3, 2, 16)))
    F[0, 0, 0] = 1e12  # far past the clip
    a = cs.channel_factors(F, 1.0)
    assert np.allclose(np.log(a).mean(axis=2), 0, atol=1e-12)
    order = np.argsort(F[1, 1])
    assert np.all(np.diff(a[1, 1][order]) >= 0)  # a_c grows with F_c: step / a_c finer where F is larger
    ratio = a.max(axis=2) / a.min(axis=2)
    assert np.all(ratio <= cs.CLIP ** 2 * (1 + 1e-12))
    assert np.allclose(cs.channel_factors(F, 0.0), 1.0)


def test_component_fisher_and_unscaling(cs):
    rng = np.random.default_rng(7)
    D = 6
    R, _ = np.linalg.qr(rng.normal(size=(2, D, D)))
    g = rng.normal(size=(2, 50, D))
    G = np.einsum("btc,btd->bcd", g, g)
    want = ((g @ R) ** 2).sum(axis=1)  # each component's summed squared gradient
    assert np.allclose(cs.component_fisher(R, G), want)
    a = np.exp(rng.uniform(-2, 0, (2, D)))
    P = R * a[:, None, :]  # components scaled: y' = x P
    x = rng.normal(size=(2, 9, D))
    decoded = np.einsum("btd,bcd->btc", x @ P, P)  # what a decoder rotating back by P^T gives
    assert np.allclose(np.einsum("btc,bce->bte", decoded, cs.unscale_matrix(P)), x)
