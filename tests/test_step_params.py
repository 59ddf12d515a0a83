"""methods.transform.step_params: the compiled per-coordinate pass (kernels/cpu_transform.
plane_offsets_rms) gives the bits of the numpy expressions it replaced (their IEEE operations
one by one, numpy's pairwise order for the sum over channels), so files keep their bytes."""

import numpy as np
import pytest

from cachegen_cli.methods import transform as tc


def _numpy_step_params(sums, sumsq, n, rel):
    C = sums.shape[2]
    mean = sums / n if n > 0 else np.zeros_like(sums)
    offsets_bits = tc._bf16_bits(np.clip(mean, -tc.BF16_MAX, tc.BF16_MAX))
    m = tc.bf16_values(offsets_bits)
    with np.errstate(over="ignore", invalid="ignore"):
        resid = np.maximum(sumsq - 2.0 * m * sums + n * m * m, 0.0).sum(axis=2)
    rms = np.sqrt(resid / max(n * C, 1))
    step = np.where(rel * rms > 1e-30, rel * rms, 1.0)
    steps_bits = tc._bf16_bits(np.minimum(step, 3.0e38))
    return offsets_bits, m, steps_bits, tc.bf16_values(steps_bits)


@pytest.mark.parametrize("seed", range(40))
def test_step_params_matches_the_numpy_expressions(seed):
    rng = np.random.default_rng(seed)
    L, C, n = int(rng.integers(1, 4)), int(rng.choice([1, 5, 8, 64, 127, 129, 192, 1000, 1024, 3000])), \
        int(rng.integers(0, 3000))
    scale = 10.0 ** rng.integers(-20, 30)
    mean = rng.standard_t(3, size=(L, 2, C)) * scale
    sums = mean * n + rng.normal(size=mean.shape) * scale
    sumsq = mean ** 2 * n + np.abs(rng.normal(size=mean.shape)) * scale * scale * max(n, 1)
    if seed % 5 == 0:
        sums[..., 0] = 1e300  # a mean past bfloat16's range: clipped
    if seed % 7 == 0:
        sums[:] = 0.0
        sumsq[:] = 0.0  # no spread: step 1
    rel = rng.random((L, 2))
    want = _numpy_step_params(sums, sumsq, n, rel)
    got = tc.step_params(sums, sumsq, n, rel)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        assert np.array_equal(np.asarray(w).view(np.uint8), np.asarray(g).view(np.uint8))


from cachegen_cli.kernels import cuda_pipeline  # noqa: E402
from cachegen_cli.kernels.cuda import cuda  # noqa: E402


@cuda.jit
def _one_pairwise_sum(x, out):
    if cuda.grid(1) == 0:
        out[0] = cuda_pipeline._pairwise(x, x.shape[0])


@pytest.mark.parametrize("n", [0, 1, 7, 8, 127, 128, 129, 1000, 1024, 4097, 70000])
def test_pairwise_sum_is_numpys_on_the_cpu_and_the_device(n):
    """transform.pairwise_sum (the CPU's njit and the CUDA device function share it) gives np.sum's
    bits: leaves of 128, halves at multiples of 8, the stack walk past one level."""
    from cachegen_cli.kernels import cpu_transform

    a = np.random.default_rng(n).standard_normal(n) * 10.0 ** np.random.default_rng(n + 1).integers(-8, 8, n)
    want = np.sum(a)
    assert cpu_transform._pairwise_sum(a, 0, n) == want

    out = np.zeros(1)
    _one_pairwise_sum[1, 1](a, out)
    assert out[0] == want
