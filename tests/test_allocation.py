"""Per-plane step allocation from a calibration's sensitivities (``calibrate --sensitivity``):
the allocation rule, the calibration file's optional ``sensitivity`` tensor and its
errors, what the encoder writes with it, and the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.methods import calibration as calib
from cachegen_cli.pipeline import codec
from cachegen_cli.storage import kvio
from cachegen_cli.methods.calibration import CalibrationError
from cachegen_cli.cli import app
from cachegen_cli.methods.config import ALLOCATION_MAX_STEP, ALLOCATION_STRENGTH, MIN_STEP, TransformConfig, load_config_file
from cachegen_cli.errors import ConfigError
from cachegen_cli.format.params import bf16_values
from cachegen_cli.methods.transform import allocate

from conftest import SAMPLE_PER_LAYER as SAMPLE_CODE_96
from conftest import SAMPLE_STACKED, realistic_kv

runner = CliRunner()


def test_allocate_follows_the_weighted_rule():
    rng = np.random.default_rng(3)
    rel = np.full((6, 2), 0.7)
    rms = rng.uniform(0.5, 4.0, (6, 2))
    s = rng.uniform(0.1, 10.0, (6, 2))
    out = allocate(rel, rms, s)
    w = rms * rms * s
    want = 0.7 * (w / np.exp(np.log(w).mean())) ** (-ALLOCATION_STRENGTH / 2)
    np.testing.assert_allclose(out, np.clip(want, MIN_STEP, ALLOCATION_MAX_STEP))
    # the mean log step stays that of rel when nothing is clipped; more sensitive planes get smaller steps
    if (want < ALLOCATION_MAX_STEP).all():
        assert np.log(out).mean() == pytest.approx(np.log(0.7))
    i, j = np.unravel_index(np.argmax(w), w.shape), np.unravel_index(np.argmin(w), w.shape)
    assert out[i] < 0.7 < out[j]


def test_allocate_clips_and_ignores_planes_without_spread():
    rel = np.full((3, 2), 1.0)
    rms = np.array([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    s = np.array([[1e-12, 1.0], [1.0, 1e30], [1e12, 1.0]])
    out = allocate(rel, rms, s)
    assert out[0, 0] == ALLOCATION_MAX_STEP and out[1, 1] == 1.0  # capped; the zero plane keeps its step
    assert out[2, 0] >= MIN_STEP and out[2, 0] < 1e-3 * 2
    # a user's step above the cap is never lowered by the cap
    assert allocate(np.full((1, 2), 5.0), np.ones((1, 2)), np.array([[1e-6, 1e6]]))[0, 0] == 5.0


def _cal_with(sens: np.ndarray | None):
    other = kvio.read_safetensors(SAMPLE_STACKED).data[:, :, 300:]
    cal = calib.fit([other])
    return cal if sens is None else cal.with_sensitivity(sens, "test")


@pytest.fixture(scope="module")
def sample():
    return kvio.read_safetensors(SAMPLE_STACKED).data[:, :, :256].reshape(30, 2, 256, 3, 64)


def test_encoder_steps_follow_the_sensitivities(sample):
    sens = np.exp(np.random.default_rng(0).normal(0, 1.5, (30, 2)))
    cal = _cal_with(sens)
    plain_cal = _cal_with(None)
    assert cal.sha256 == plain_cal.sha256  # the sensitivities are not part of the file's identity
    cfg = TransformConfig("transform", (0.9,), (0.9,))
    with_s = cg.encode(sample, quantization=cfg, calibration=cal, device="cpu")
    without = cg.encode(sample, quantization=cfg, calibration=plain_cal, device="cpu")
    h_s = codec.read_header_and_index(codec.open_input(with_s)[0])[0]
    h_0 = codec.read_header_and_index(codec.open_input(without)[0])[0]
    ratio = bf16_values(h_s.params.steps) / bf16_values(h_0.params.steps)  # the same RMS: the factors
    rms = bf16_values(h_0.params.steps) / 0.9  # the planes' RMS (to bf16 precision)
    want = allocate(np.full((30, 2), 0.9), rms, sens) / 0.9
    np.testing.assert_allclose(ratio, want, rtol=2e-2)  # bf16 steps: 3 significant digits
    assert ratio.max() > 1.5 and ratio.min() < 0.5
    # decoding needs only the rotation: a calibration without sensitivities decodes it
    a = cg.decode(with_s, calibration=plain_cal, device="cpu")["kv"]
    b = cg.decode(with_s, calibration=cal, device="cpu")["kv"]
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # allocation = "none" writes the bytes of a calibration without sensitivities
    none = TransformConfig("transform", (0.9,), (0.9,), allocation="none")
    assert cg.encode(sample, quantization=none, calibration=cal, device="cpu") == without


def test_sensitivities_lower_the_error_where_it_matters(sample):
    """Planes said to matter 100x more get smaller steps and a smaller error, the others larger."""
    sens = np.ones((30, 2))
    sens[:15] = 100.0
    cal = _cal_with(sens)
    x = sample.double()
    y = cg.decode(cg.encode(sample, quality="small", calibration=cal, device="cpu"), calibration=cal,
                  device="cpu")["kv"].double()
    y0 = cg.decode(cg.encode(sample, quality="small", calibration=_cal_with(None), device="cpu"),
                   calibration=_cal_with(None), device="cpu")["kv"].double()
    err = lambda d, sl: float((d[sl] - x[sl]).pow(2).sum() / x[sl].pow(2).sum())
    assert err(y, slice(0, 15)) < 0.5 * err(y0, slice(0, 15))
    assert err(y, slice(15, 30)) > 1.5 * err(y0, slice(15, 30))


def test_sensitivity_file_round_trip_and_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    sens = np.exp(np.random.default_rng(1).normal(0, 1, (30, 2)))
    cal = _cal_with(sens)
    path = tmp_path / "cal.safetensors"
    calib.save(cal, path)
    back = calib.load(path)
    np.testing.assert_allclose(back.sensitivity, cal.sensitivity, rtol=1e-6)
    assert np.exp(np.log(back.sensitivity).mean()) == pytest.approx(1.0, rel=1e-5)
    assert back.metadata["sensitivity"] == "test" and back.sha256 == cal.sha256
    tensors = load_file(str(path))
    for name, bad, message in [
        ("shape", torch.ones(30, 3), "float32 \\[30, 2\\]"),
        ("dtype", torch.ones(30, 2, dtype=torch.float64), "float32 \\[30, 2\\]"),
        ("negative", -torch.ones(30, 2), "positive"),
        ("nan", torch.full((30, 2), float("nan")), "positive"),
    ]:
        p = tmp_path / f"{name}.safetensors"
        save_file({"rotation": tensors["rotation"], "sensitivity": bad}, str(p), metadata=cal.metadata)
        with pytest.raises(CalibrationError, match=message):
            calib.load(p)
    p = tmp_path / "extra.safetensors"
    save_file({"rotation": tensors["rotation"], "other": torch.ones(2)}, str(p), metadata=cal.metadata)
    with pytest.raises(CalibrationError, match="unknown tensor"):
        calib.load(p)
    with pytest.raises(CalibrationError):
        cal.with_sensitivity(np.zeros((30, 2)))
    with pytest.raises(CalibrationError):
        cal.with_sensitivity(np.ones((29, 2)))


def test_config_allocation_field(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('key_step = 0.5\nvalue_step = 0.6\nallocation = "none"\n')
    assert load_config_file(p).quantization.allocation == "none"
    p.write_text('key_step = 0.5\n')
    assert load_config_file(p).quantization.allocation == "sensitivity"
    p.write_text('key_step = 0.5\nallocation = "some"\n')
    with pytest.raises(ConfigError, match="allocation"):
        load_config_file(p)
    with pytest.raises(ConfigError, match="allocation"):
        TransformConfig("transform", allocation="x")


def test_cli_calibrate_errors(tmp_path):
    out = tmp_path / "c.safetensors"
    r = runner.invoke(app, ["calibrate", str(SAMPLE_STACKED), "--model", str(tmp_path), "-o", str(out)])
    assert r.exit_code != 0 and "only used with --sensitivity" in r.output and "Traceback" not in r.output
    assert not out.exists()
    # a cache without token ids cannot be scored by the model
    noids = tmp_path / "noids.safetensors"
    from safetensors.torch import save_file

    save_file({"kv": realistic_kv(layers=30, tokens=40, heads=3, head_dim=64)}, str(noids))
    r = runner.invoke(app, ["calibrate", str(noids), "--sensitivity", "-o", str(out)])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and not out.exists(), r.output


def test_cli_calibrate_with_sensitivity(smol, tmp_path):
    out = tmp_path / "s.safetensors"
    r = runner.invoke(app, ["calibrate", str(SAMPLE_CODE_96), "--sensitivity", "-q", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "rotation and sensitivities" in r.output
    cal = calib.load(out)
    assert cal.sensitivity.shape == (30, 2) and (cal.sensitivity > 0).all()
    assert np.exp(np.log(cal.sensitivity).mean()) == pytest.approx(1.0, rel=1e-5)
    assert cal.sensitivity.max() > 10 * cal.sensitivity.min()  # planes differ by orders of magnitude
    assert "SmolLM2" in cal.metadata["sensitivity"]
    x = kvio.read_safetensors(SAMPLE_CODE_96).data.reshape(30, 2, 96, 3, 64)
    blob = cg.encode(x, quality="small", calibration=out, device="cpu")
    assert cg.decode(blob, calibration=out, device="cpu")["kv"].shape == x.shape


def test_the_allocations_log_and_exp_are_within_a_few_ulps_of_libms():
    """kernels/allocation.py's logarithm and exponential (the same bits on the CPU and a GPU):
    within 4 ulps of numpy's over the whole float64 range, the IEEE special values kept."""
    from cachegen_cli.kernels import cpu_transform as k2

    rng = np.random.default_rng(5)
    x = np.concatenate([np.exp(rng.uniform(-700, 700, 20000)), rng.uniform(-740, 709, 20000),
                        [5e-324, 2.2e-308, 1.0, 2.0, 0.5, 1.7976931348623157e308]])
    lg, ex = np.empty_like(x), np.empty_like(x)
    k2.elementary(x, lg, ex)
    with np.errstate(all="ignore"):
        want_l, want_e = np.log(x), np.exp(x)
    ok = (x > 0) & (want_l != 0)
    assert (np.abs(lg - want_l)[ok] <= 4 * np.spacing(np.abs(want_l[ok]))).all()
    assert lg[x == 1.0][0] == 0.0
    normal = (want_e > 1e-300) & np.isfinite(want_e)
    assert (ex[np.isinf(want_e)] == np.inf).all()
    assert (np.abs(ex - want_e)[normal] <= 4 * np.spacing(want_e[normal])).all()
    special = np.array([0.0, np.inf, -1.0, np.nan, 800.0, -800.0])
    sl, se = np.empty(6), np.empty(6)
    k2.elementary(special, sl, se)
    assert sl[0] == -np.inf and sl[1] == np.inf and np.isnan(sl[2]) and np.isnan(sl[3])
    assert se[0] == 1.0 and se[1] == np.inf and se[4] == np.inf and se[5] == 0.0 and np.isnan(se[3])
