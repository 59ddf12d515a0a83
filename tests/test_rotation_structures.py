"""scripts/rotation_structures.py's fitting machinery: every structure it measures is a
rotation (so the encoder's full-calibration path measures what the structure would code),
its stages do what their cost formulas assume, and the RoPE removal is inverted exactly."""


import numpy as np
import pytest
import torch

from conftest import load_script


@pytest.fixture(scope="module")
def rs():
    return load_script("scripts/rotation_structures.py", "rotation_structures")


def _cov(C: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((C, 3 * C))
    a[: C // 8] *= 4.0  # a few strong channels, as the keys' outliers
    return a @ a.T / (3 * C)


def _sumlog(M: np.ndarray) -> float:
    return float(np.log2(np.diag(M)).sum())


@pytest.mark.parametrize("stages", [["head"], ["head", "xidx"], ["xrope", "head"], ["head", "xmatch"],
                                    ["head", "top8"], ["givens"] * 5, ["rgivens"] * 3, ["blk4"] * 2])
def test_structures_are_rotations_sorted_by_variance(rs, stages):
    H, D = 3, 8
    S = _cov(H * D)
    R = rs.fit_structure(S, stages, H, D)
    assert np.abs(R.T @ R - np.eye(H * D)).max() < 1e-12
    var = np.diag(R.T @ S @ R)
    assert (np.diff(var) <= 1e-12).all()
    # Each stage puts its groups on their principal axes, which never raises the product of the
    # variances (Hadamard's inequality per group): the Gaussian high-rate size only falls.
    assert _sumlog(R.T @ S @ R) < _sumlog(S)


def test_head_stage_is_the_per_head_pca(rs):
    H, D = 3, 8
    S = _cov(H * D, 1)
    R = rs.fit_structure(S, ["head"], H, D)
    # Nothing mixes heads: every output axis (a column, in order of variance) lies in one head.
    assert all(np.count_nonzero(np.abs(R[:, i]).reshape(H, D).sum(axis=1)) == 1 for i in range(H * D))
    want = np.sort(np.concatenate([np.linalg.eigvalsh(S[h * D:(h + 1) * D, h * D:(h + 1) * D]) for h in range(H)]))
    np.testing.assert_allclose(np.sort(np.diag(R.T @ S @ R)), want, rtol=1e-10)


def test_givens_stage_diagonalizes_disjoint_pairs(rs):
    # A covariance made of disjoint correlated pairs: one greedy stage pairs them and removes
    # every correlation; a second stage finds nothing left to do.
    C = 8
    S = np.eye(C)
    for i, j, c in ((0, 5, 0.9), (1, 2, -0.6), (3, 7, 0.3), (4, 6, 0.8)):
        S[i, j] = S[j, i] = c
    cur, R = S.copy(), np.eye(C)
    rs._givens_stage(cur, R, "givens")
    assert np.abs(cur - np.diag(np.diag(cur))).max() < 1e-12
    np.testing.assert_allclose(R.T @ S @ R, cur, atol=1e-12)
    before = R.copy()
    rs._givens_stage(cur, R, "givens")
    np.testing.assert_array_equal(R, before)


def test_costs(rs):
    # Llama-3.1-8B's shape: 8 heads of 128.
    assert rs.stage_cost("head", 8, 128) == 128
    assert rs.stage_cost("xidx", 8, 128) == 8
    assert rs.stage_cost("xrope", 8, 128) == 16
    assert rs.stage_cost("givens", 8, 128) == 2
    assert rs.stage_cost("blk4", 8, 128) == 4
    assert rs.stage_cost("top128", 8, 128) == 16


def test_rope_removal_is_inverted_and_leaves_token0(rs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 9, 2 * 8, generator=g, dtype=torch.float64)
    y = rs.rope(x, 2, 8, -1.0)
    assert torch.equal(y[:, 1], x[:, 1])  # values carry no RoPE
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0], rtol=0, atol=0)  # position 0: angle 0
    torch.testing.assert_close(rs.rope(y, 2, 8, +1.0), x, rtol=0, atol=1e-12)
    # a rotation per (token, head, frequency): every token's key norm is kept
    torch.testing.assert_close(y[:, 0].norm(dim=-1), x[:, 0].norm(dim=-1), rtol=1e-12, atol=0)
