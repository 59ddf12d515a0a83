"""capture -> encode -> decode -> eval on models whose caches are not one regular shape (issue 12).

Tiny randomly initialised transformers models, built offline from config objects (no
download) with a byte-level tokenizer made in place: a Gemma-2-style hybrid (sliding-window
and full layers alternate, 1 KV head of head_dim 256), a Mistral-style model (every layer
windowed), and a DeepSeek-V3-style MLA model (the cache holds a 32-channel latent as K and an
8-channel rope part as V).  Each is saved as a Hugging Face folder and driven through the CLI
as a user would (``--model FOLDER``).  Plus the real SmolLM2 with a multi-part file (its
cache and an extra tensor).  Marked ``model``: they load transformers models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
PYDOC = ROOT / "sample_data" / "texts" / "pydoc_topics.txt"
SAMPLE_CODE_96 = ROOT / "sample_data" / "smollm2_code_96.safetensors"
CODE = ROOT / "sample_data" / "texts" / "json_decoder.py.txt"
CONTEXT, WINDOW = 48, 16

runner = CliRunner()
pytestmark = pytest.mark.model


def _byte_tokenizer():
    """A byte-level BPE tokenizer without merges: one token per byte, vocabulary 256, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=1024)
    if family == "gemma2":
        return tf.Gemma2Config(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                               sliding_window=WINDOW, **common)
    if family == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                sliding_window=WINDOW, **common)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
                                   q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                   moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                   first_k_dense_replace=1, n_group=1, topk_group=1, **common)
    raise ValueError(family)


#: family -> (layer -> (K shape, V shape)) the model keeps for CONTEXT tokens
KEEPS = {
    "gemma2": {0: ([1, 1, WINDOW - 1, 256],) * 2, 1: ([1, 1, CONTEXT, 256],) * 2,
               2: ([1, 1, WINDOW - 1, 256],) * 2, 3: ([1, 1, CONTEXT, 256],) * 2},
    "mistral": {0: ([1, 2, WINDOW - 1, 16],) * 2, 1: ([1, 2, WINDOW - 1, 16],) * 2},
    "deepseek_v3": {0: ([1, 1, CONTEXT, 32], [1, 1, CONTEXT, 8]), 1: ([1, 1, CONTEXT, 32], [1, 1, CONTEXT, 8])},
}


@pytest.fixture(scope="module", params=list(KEEPS))
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    family = request.param
    folder = tmp_path_factory.mktemp(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family))
    model.save_pretrained(str(folder))
    _byte_tokenizer().save_pretrained(str(folder))
    return family, folder


def _ok(*args) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.stdout


def _tensors(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}, f.metadata()


def test_capture_encode_decode_eval(tiny, tmp_path):
    family, folder = tiny
    kv = tmp_path / "kv.safetensors"
    _ok("capture", "--model", folder, "--text", PYDOC, "--tokens", CONTEXT, "-o", kv, "-q")
    captured, meta = _tensors(kv)
    # the cache the model really keeps: windowed layers hold their last tokens, MLA its latent and rope part
    assert {n: list(t.shape) for n, t in captured.items()} == {
        f"layers.{l}.{k}": list(shapes[i]) for l, shapes in KEEPS[family].items() for i, k in enumerate(("key", "value"))}
    assert meta["layout"] == "per-layer" and len(json.loads(meta["token_ids"])) == CONTEXT

    lossless, lossy = tmp_path / "lossless.cgen", tmp_path / "balanced.cgen"
    _ok("encode", kv, "-o", lossless, "--quality", "lossless", "--device", "cpu", "-q")
    _ok("encode", kv, "-o", lossy, "--quality", "balanced", "--device", "cpu", "-q")
    decoded = tmp_path / "decoded.safetensors"
    _ok("decode", lossless, "-o", decoded, "--device", "cpu", "-q")
    back, back_meta = _tensors(decoded)
    assert back_meta == meta and list(sorted(back)) == list(sorted(captured))
    assert all(torch.equal(back[n], captured[n]) and back[n].dtype == captured[n].dtype for n in captured)

    def evaluate(path):
        out = _ok("eval", path, "--model", folder, "--text", PYDOC, "--continuation", 16, "--generate", 4, "--json", "-q")
        return json.loads(out)

    exact = evaluate(lossless)
    assert exact["kl_mean"] < 1e-6 and exact["top1_agreement"] == 1.0 and exact["greedy_agreement"] == 1.0
    assert exact["cache_rel_mse"] == 0.0
    assert exact["layer_tokens"] == [KEEPS[family][l][0][2] for l in sorted(KEEPS[family])]
    coded = evaluate(lossy)
    assert 0.0 < coded["cache_rel_mse"] < 0.05 and coded["kl_mean"] >= 0.0 and coded["bits_per_value"] < 16
    assert evaluate(kv)["kl_mean"] < 1e-6  # the uncompressed capture scores as its own reference (to rounding)


def test_eval_refuses_another_models_cache(tiny, tmp_path):
    family, folder = tiny
    kv = tmp_path / "kv.safetensors"
    _ok("capture", "--model", folder, "--text", PYDOC, "--tokens", CONTEXT, "-o", kv, "-q")
    tensors, meta = _tensors(kv)
    first = next(n for n in tensors if n.endswith(".key"))
    tensors[first] = tensors[first][:, :, 1:].contiguous()
    tensors[first.replace("key", "value")] = tensors[first.replace("key", "value")][:, :, 1:].contiguous()
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad, metadata=meta)
    r = runner.invoke(app, ["eval", str(bad), "--model", str(folder), "--text", str(PYDOC), "--continuation", "4",
                            "--generate", "0", "-q"])
    assert r.exit_code == 1 and r.stderr.strip().startswith("error:") and "it is not this model's cache" in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_python_cache_objects_round_trip(tiny):
    """encode takes the model's DynamicCache (windowed layers included); decode(as_cache=True)
    gives one that continues generation exactly as the original."""
    family, folder = tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer(PYDOC.read_text())["input_ids"][:CONTEXT]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    blob = cg.encode(cache, quality="lossless", device="cpu")
    rebuilt = cg.decode(blob, device="cpu", as_cache=True)
    assert type(rebuilt).__name__ == "DynamicCache" and len(rebuilt.layers) == len(cache.layers)
    for a, b in zip(cache.layers, rebuilt.layers):
        assert type(a) is type(b) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.get_seq_length() == b.get_seq_length()
        if getattr(a, "is_sliding", False):
            assert b.sliding_window == a.sliding_window
    nxt = torch.tensor([[7]])
    with torch.no_grad():
        want = model.generate(torch.cat([ids, nxt[:, :1]], 1), past_key_values=cache, max_new_tokens=5, do_sample=False)
        got = model.generate(torch.cat([ids, nxt[:, :1]], 1), past_key_values=rebuilt, max_new_tokens=5, do_sample=False)
    assert torch.equal(want, got)


def test_smollm2_multi_part_file_through_eval(smol, tmp_path):
    """The real SmolLM2 cache plus an extra tensor: a multi-part file, scored by eval's layered path."""
    tensors, meta = _tensors(SAMPLE_CODE_96)
    tensors["input_ids"] = torch.tensor(json.loads(meta["token_ids"]))
    src = tmp_path / "code96_ids.safetensors"
    save_file(tensors, src, metadata=meta)
    enc = tmp_path / "code96_ids.cgen"
    _ok("encode", src, "-o", enc, "--quality", "lossless", "--device", "cpu", "-q")
    assert enc.read_bytes()[8] == 3
    r = json.loads(_ok("eval", enc, "--text", CODE, "--continuation", 8, "--generate", 2, "--json", "-q"))
    # the cache decodes bit for bit; the model's two runs over it agree to float rounding (the
    # layered path and the reference may sum in other orders, by thread count and machine)
    assert r["kl_mean"] < 1e-6 and r["top1_agreement"] == 1.0 and r["num_layers"] == 30


def test_calibrate_and_tune_on_the_models_cache(tiny, tmp_path):
    """calibrate and tune --target-kl on each tiny model's cache (multi-part for Gemma-2 and the
    MLA model, regular for Mistral): the tuned config meets the target on the tuning cache, and a
    calibrated file encoded with it decodes and scores.  Shapes and code paths only: random
    models say nothing about the quality a real model gets."""
    family, folder = tiny
    kv = tmp_path / "kv.safetensors"
    _ok("capture", "--model", folder, "--text", PYDOC, "--tokens", CONTEXT, "-o", kv, "-q")
    cal = tmp_path / "cal.safetensors"
    _ok("calibrate", kv, "-o", cal)
    tuned = tmp_path / "tuned.toml"
    r = json.loads(_ok("tune", kv, "--target-kl", 0.05, "--model", folder, "--calibration", cal, "-o", tuned,
                       "--json", "-q"))
    assert r["achieved"] <= 0.05 and r["kind"] == "kl"
    assert r["layered"]  # tuned over the planes, scored as the model's own cache (windowed layers: not a prefix)
    assert len(r["key_step"]) == len(KEEPS[family])
    enc, dec = tmp_path / "kv.cgen", tmp_path / "dec.safetensors"
    _ok("encode", kv, "-o", enc, "--config", tuned, "--calibration", cal, "--device", "cpu", "-q")
    _ok("decode", enc, "-o", dec, "--calibration", cal, "--device", "cpu", "-q")
    back, _ = _tensors(dec)
    assert {n: list(t.shape) for n, t in back.items()} == {n: list(t.shape) for n, t in _tensors(kv)[0].items()}
    out = json.loads(_ok("eval", dec, "--model", folder, "--text", PYDOC, "--continuation", 16, "--generate", 2,
                         "--json", "-q"))
    assert out["kl_mean"] >= 0.0 and 0.0 < out["cache_rel_mse"] < 1.0
