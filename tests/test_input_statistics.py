"""The fixed-point rotation's offsets and steps from the rows before it (methods/transform.
rotated_step_params, since 2026-12-07): the rotated means and the plane's sum of squares, which
the rotation keeps, against the rotated values' own statistics (step_params of their sums), on
the real sample cache; and the device's kernels (cuda_pipeline.plane_steps(rotated=...), under
numba's simulator without a GPU) against the CPU's function, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cachegen_cli.kernels import cpu_transform as k2
from cachegen_cli.kernels import cuda_pipeline
from cachegen_cli.kernels import fixed_rotation as fx
from cachegen_cli.methods import calibration
from cachegen_cli.methods import transform as tc
from cachegen_cli.storage import kvio

SAMPLES = Path(__file__).resolve().parent.parent / "sample_data"
_NO_ROTATION = np.zeros((0, 0, 0, 0, 0), np.float32)


def _sums(src: np.ndarray, sink: int) -> tuple[np.ndarray, np.ndarray]:
    """transform_stats_carry's sums / sumsq of float32 rows [L, 2, T, C] (tokens sink..)."""
    L, _, T, C = src.shape
    s1, s2, b1, b2 = (np.zeros((L, 2, C)) for _ in range(4))
    k2.transform_stats_carry(np.ascontiguousarray(src, np.float32).view(np.uint32), _NO_ROTATION, sink, 0, T,
                             s1, s2, b1, b2, 0)
    return s1, s2


@pytest.mark.parametrize("blocks", [3, 1])
def test_input_statistics_give_the_rotated_values_offsets_and_steps(blocks):
    """On a real cache (the pydoc sample, rotated by a calibration fitted on the code sample):
    the offsets from the rotated input means are the rotated values' own (bfloat16) means on
    almost every channel and at most one bfloat16 unit from them, and the steps, from the plane's
    sum of squares before the rotation, are within one bfloat16 unit of theirs."""
    fit_on = kvio.read_safetensors(SAMPLES / "smollm2_code_96.safetensors").data
    cache = kvio.read_safetensors(SAMPLES / "smollm2_pydoc_520.safetensors").data[:8, :, :200]
    cal = calibration.fit([fit_on[:8]], blocks=blocks)
    x = cache.to(torch.float32).numpy()
    L, _, T, C = x.shape
    sink = 1
    rint = fx.fixed_matrix(cal.rotation, False)
    y = np.zeros_like(x)
    fx.rotate_rows(x, torch.from_numpy(rint), sink, y)
    rel = np.full((L, 2), 0.3)
    want = tc.step_params(*_sums(y, sink), T - sink, rel)
    got = tc.rotated_step_params(*_sums(x, sink), T - sink, rint, rel)
    same = want[0] == got[0]
    assert same.mean() > 0.99, f"{(~same).sum()} of {same.size} offsets differ"
    apart = np.abs(want[0].astype(np.int32) - got[0].astype(np.int32))
    assert apart.max() <= 1
    assert np.abs(want[2].astype(np.int32) - got[2].astype(np.int32)).max() <= 1
    assert np.allclose(got[3], want[3], rtol=2 ** -7)


def _device_steps(sums, sumsq, n, rint, rel, sens=None, rms_sums=None):
    L, _, C = sums.shape
    out = [np.zeros((L, 2, C), np.int32), np.zeros((L, 2, C), np.float32), np.zeros((L, 2), np.int32),
           np.zeros((L, 2), np.float64)]
    bad = np.zeros(1, np.int32)
    alloc = None if sens is None else (sens, tc.ALLOCATION_STRENGTH, tc.MIN_STEP, tc.ALLOCATION_MAX_STEP)
    scratch = None if rms_sums is None else (*rms_sums, np.zeros((L, 2, C), np.int32), np.zeros((L, 2, C), np.float32))
    cuda_pipeline.plane_steps(sums, sumsq, n, tc.BF16_MAX, rel, *out, np.zeros((L, 2, C)), np.zeros((4, 2 * L)),
                              bad, allocation=alloc, rms_sums=scratch,
                              rotated=(rint, np.zeros((L, 2, C), np.float32), np.zeros((L, 2, C))))
    return out, bad[0]


@pytest.mark.parametrize("C, blocks, n, allocated, keys_apart", [
    (16, 2, 9, False, False), (130, 2, 77, True, False), (64, 1, 300, False, True), (32, 4, 0, False, False)])
def test_device_plane_steps_from_inputs_is_rotated_step_params(C, blocks, n, allocated, keys_apart):
    """plane_steps(rotated=...) gives rotated_step_params' bits (the channel sum past numpy's
    pairwise stack at C > 128, an allocation, the keys' RMS from their own sums, no tokens); a
    sum that is not finite is flagged."""
    rng = np.random.default_rng(C + n)
    L = 3
    D = C // blocks
    q, _ = np.linalg.qr(rng.normal(size=(L * 2 * blocks, D, D)))
    rint = fx.fixed_matrix(q.reshape(L, 2, blocks, D, D).astype(np.float32), False)
    mean = rng.standard_t(3, size=(L, 2, C)) * 10.0
    sums = mean * n + rng.normal(size=mean.shape)
    sumsq = mean ** 2 * n + np.abs(rng.normal(size=mean.shape)) * max(n, 1)
    sums[1, 1] = 0.0
    sumsq[1, 1] = 0.0
    rel = rng.random((L, 2))
    sens = np.exp(rng.normal(size=(L, 2)) * 3) if allocated else None
    rms_sums = (sums * 1.5 + 3, sumsq * 4) if keys_apart else None
    want = tc.rotated_step_params(sums, sumsq, n, rint, rel, sens, rms_sums)
    if keys_apart:
        assert not np.array_equal(want[2][:, 0], tc.rotated_step_params(sums, sumsq, n, rint, rel)[2][:, 0])
        assert np.array_equal(want[2][:, 1], tc.rotated_step_params(sums, sumsq, n, rint, rel)[2][:, 1])
    out, bad = _device_steps(sums, sumsq, n, rint, rel, sens, rms_sums)
    assert np.array_equal(out[0].astype(np.uint16), want[0]) and np.array_equal(out[1], want[1].astype(np.float32))
    assert np.array_equal(out[2].astype(np.uint16), want[2]) and np.array_equal(out[3], want[3])
    assert bad == 0
    sumsq[2, 0, C - 1] = np.nan
    assert _device_steps(sums, sumsq, n, rint, rel, sens, rms_sums)[1] == 1
