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
