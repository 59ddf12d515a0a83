"""The Python API's argument errors (issue "Hardening"): paths, clear CacheGenErrors, short
reprs, and messages that speak of its arguments rather than the command's flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import cachegen_cli as cg
from cachegen_cli.errors import CacheGenError, ConfigError, InputError, InputNotFoundError

from conftest import realistic_kv

FLAG = re.compile(r"(^|\s|\()--[a-z]")


@pytest.fixture(scope="module")
def blob() -> bytes:
    return cg.encode(realistic_kv(layers=2, tokens=10, heads=1, head_dim=4), device="cpu")


def test_decode_takes_a_path(blob, tmp_path):
    p = tmp_path / "kv.cgen"
    p.write_bytes(blob)
    want = cg.decode(blob, device="cpu")["kv"]
    assert torch.equal(cg.decode(str(p), device="cpu")["kv"], want)
    assert torch.equal(cg.decode(p, device="cpu")["kv"], want)


def test_decode_of_a_missing_path_or_a_wrong_type_is_a_cachegen_error(tmp_path):
    with pytest.raises(InputNotFoundError, match="no such file"):
        cg.decode(str(tmp_path / "missing.cgen"))
    for bad in (123, None, [1, 2]):
        with pytest.raises(InputError, match="decode takes the bytes of a .cgen file"):
            cg.decode(bad)


def test_encode_summary_has_a_short_repr(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "kv.safetensors"
    save_file({"kv": realistic_kv(layers=4, tokens=64, heads=2, head_dim=8).contiguous()}, str(src))
    s = cg.encode_file(src, tmp_path / "kv.cgen", device="cpu")
    r = repr(s)
    assert r.startswith("EncodeSummary(") and "\n" not in r and len(r) < 300
    assert f"file_bytes={s.file_bytes}" in r


@pytest.mark.parametrize("kwargs", [
    dict(bins="x:0-=32"), dict(bins="k:0-=32"), dict(bins="k:zz"), dict(preset="lmcache", quality="high"),
    dict(quality="lossless", calibration="CAL"), dict(preset="lmcache", calibration="CAL"),
])
def test_api_messages_do_not_name_cli_flags(kwargs, tmp_path):
    if kwargs.get("calibration") == "CAL":
        from cachegen_cli.methods import calibration as cal

        kv = realistic_kv(layers=2, tokens=24, heads=1, head_dim=4)
        cal.save(cal.fit([kv.reshape(2, 2, 24, 4).float()]), tmp_path / "c.safetensors")
        kwargs = dict(kwargs, calibration=tmp_path / "c.safetensors")
    with pytest.raises(CacheGenError) as e:
        cg.encode(realistic_kv(layers=2, tokens=10, heads=1, head_dim=4), device="cpu", **kwargs)
    assert not FLAG.search(str(e.value)), str(e.value)
    assert e.value.cli_message  # the command's wording may name the flags


def test_cli_wording_keeps_the_flags():
    e = ConfigError("a calibration does not apply to quality 'lossless'", cli="--calibration does not apply")
    assert str(e) == "a calibration does not apply to quality 'lossless'"
    assert e.cli_message == "--calibration does not apply"
    assert ConfigError("plain").cli_message == "plain"


def test_an_existing_output_speaks_of_force_not_the_flag(blob, tmp_path):
    from cachegen_cli.errors import OutputExistsError

    src = tmp_path / "kv.cgen"
    src.write_bytes(blob)
    out = tmp_path / "kv.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError) as e:
        cg.decode_file(src, out, device="cpu")
    assert "force=True" in str(e.value) and not FLAG.search(str(e.value))
    assert "--force" in e.value.cli_message
    assert out.read_bytes() == b"keep me"


# --- issue "API errors name CLI flags": the library names its keywords, the command its flags


def _raised(fn) -> CacheGenError:
    with pytest.raises(CacheGenError) as e:
        fn()
    return e.value


def test_output_limit_names_the_keyword_and_the_cli_its_flag(blob, tmp_path):
    from typer.testing import CliRunner

    from cachegen_cli.cli import app

    e = _raised(lambda: cg.decode(blob, device="cpu", max_output_size=10))
    assert "max_output_size=" in str(e) and not FLAG.search(str(e)), str(e)
    assert "--max-output-size" in e.cli_message
    src = tmp_path / "kv.cgen"
    src.write_bytes(blob)
    e = _raised(lambda: cg.decode_file(src, tmp_path / "o.safetensors", device="cpu", max_output_size=10))
    assert str(src) in str(e) and "max_output_size=" in str(e) and not FLAG.search(str(e)), str(e)
    assert str(src) in e.cli_message and "--max-output-size" in e.cli_message  # the file named, the flag kept
    r = CliRunner().invoke(app, ["decode", str(src), "-o", str(tmp_path / "o.safetensors"), "--max-output-size", "10",
                                 "--device", "cpu"])
    assert r.exit_code == 1 and "--max-output-size" in r.stderr and "max_output_size=" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:")


def test_names_names_the_keyword():
    e = _raised(lambda: cg.encode({"blk.0.k": torch.zeros(2, 3)}, names="(", device="cpu"))
    assert str(e).startswith("names=: not a regular expression") and e.cli_message.startswith("--names:")
    e = _raised(lambda: cg.encode({"blk.0.k": torch.zeros(2, 3)}, device="cpu"))
    assert "names=" in str(e) and not FLAG.search(str(e)) and "--names" in e.cli_message


def test_model_commands_name_their_keywords(tmp_path):
    from cachegen_cli.model import capture, evaluate, tune

    text = tmp_path / "t.txt"
    text.write_text("hello world")
    kv = tmp_path / "kv.safetensors"
    from safetensors.torch import save_file

    save_file({"kv": realistic_kv(layers=2, tokens=10, heads=1, head_dim=4)}, str(kv))
    cases = [
        (lambda: tune.tune_file(kv), "target_kl=", "--target-kl"),
        (lambda: tune.tune_file(kv, target_kl=0.1, target_error=0.1), "target_error=", "--target-error"),
        (lambda: tune.tune_file(kv, target_kl=-1.0), "target_kl=", "--target-kl"),
        (lambda: tune.tune_file(kv, target_error=0.1, text_path=text), "text_path=", "--text"),
        (lambda: tune.tune_file(kv, target_error=0.1, continuation=0), "continuation=", "--continuation"),
        (lambda: tune.tune_file(kv, target_error=0.1, max_step=1e9), "max_step=", "--max-step"),
        (lambda: tune.tune_file(kv, target_error=0.1, strength=2.0), "strength=", "--strength"),
        (lambda: evaluate.evaluate_file(kv, text, continuation=0), "continuation=", "--continuation"),
        (lambda: evaluate.evaluate_file(kv, text, generate=-1), "generate=", "--generate"),
        (lambda: capture.capture_file(text, tmp_path / "o.safetensors", 0), "num_tokens=", "--tokens"),
    ]
    for fn, keyword, flag in cases:
        e = _raised(fn)
        assert keyword in str(e) and not FLAG.search(str(e)), str(e)
        assert flag in e.cli_message, e.cli_message


def test_no_library_error_message_names_a_flag():
    """Every message the library raises (outside cli/) is free of `--flag`s: the string literals
    given to a raise, and the module-level strings it raises by name; cli= texts are the
    command's and may name them ("pip install --no-deps" names pip's, not ours)."""
    import ast

    root = Path(cg.__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("cli", "kernels"):
            continue
        tree = ast.parse(path.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            for arg in node.exc.args:  # the message, not the cli= keyword
                texts = [c.value for c in ast.walk(arg) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                texts += [consts[n.id] for n in ast.walk(arg) if isinstance(n, ast.Name) and n.id in consts]
                for t in texts:
                    if FLAG.search(t.replace("--no-deps", "")):
                        found.append(f"{rel}:{node.lineno}: {t!r}")
    assert not found, found


def test_batch_rows_carry_both_wordings(blob, tmp_path):
    """run_batch's row: ``error`` in the API's words, ``cli_error`` in the command's; the
    command's batch prints and writes the latter."""
    import json

    from typer.testing import CliRunner

    from cachegen_cli.batch import run_batch
    from cachegen_cli.cli import app

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "kv.cgen").write_bytes(blob)
    (row,) = run_batch([str(tmp_path / "in")], "decode", output_dir=str(tmp_path / "out"), device="cpu",
                       max_output_size=10)
    assert row.status == "failed" and "max_output_size=" in row.error and not FLAG.search(row.error), row
    assert "--max-output-size" in row.cli_error
    r = CliRunner().invoke(app, ["decode", str(tmp_path / "in"), "--output-dir", str(tmp_path / "out2"),
                                 "--max-output-size", "10", "--device", "cpu", "--json"])
    assert r.exit_code == 1
    (cli_row,) = json.loads(r.stdout)
    assert "--max-output-size" in cli_row["error"] and "cli_error" not in cli_row
