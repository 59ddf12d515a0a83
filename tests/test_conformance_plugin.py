"""tests/cgen_conformance.py, the plugin that runs the reference decoder on every .cgen the suite
writes: it sees the package's outputs, and it reports a disagreement instead of passing it."""

from __future__ import annotations

import struct
import types

import numpy as np
import pytest
import torch

import cachegen_cli as cg
import cgen_conformance as conf
from conftest import realistic_kv

pytestmark = pytest.mark.skipif(not conf.enabled(), reason="CACHEGEN_CONFORMANCE=0")


def _kv(dtype=torch.bfloat16, tokens=12):
    return realistic_kv(layers=2, tokens=tokens, heads=1, head_dim=8, dtype=dtype)


@pytest.fixture
def rec():
    """A fresh recorder (the session's keeps its own pending blobs and counters)."""
    return conf.Recorder()


def test_the_package_output_points_are_wrapped():
    """encode's bytes and encode_file's file (with its calibration) reach the session's recorder."""
    from cachegen_cli import api
    from cachegen_cli.storage import outputs

    assert conf.RECORDER is not None
    assert cg.encode is api.encode and api.encode is not conf._ORIGINAL["encode"]
    assert outputs.atomic_output is api.atomic_output is not conf._ORIGINAL["atomic_output"]
    before = len(conf.RECORDER.pending)
    blob = cg.encode(_kv(), quality="balanced", chunk_tokens=8, device="cpu")
    assert conf.RECORDER.pending[before:][0][:2] == (blob, None)


def test_a_written_file_is_recorded_with_its_calibration(tmp_path):
    from cachegen_cli.methods import calibration as calib
    from safetensors.torch import save_file

    kv = _kv(tokens=20)
    cal = tmp_path / "cal.safetensors"
    calib.save(calib.fit([kv.reshape(2, 2, 20, 8)]), cal)
    src = tmp_path / "kv.safetensors"
    save_file({"kv": kv}, str(src))
    before = len(conf.RECORDER.pending)
    cg.encode_file(src, tmp_path / "kv.cgen", quality="balanced", calibration=cal, chunk_tokens=8, device="cpu")
    (blob, cal_copy, origin), = [p for p in conf.RECORDER.pending[before:] if p[2].startswith("file")]
    assert blob == (tmp_path / "kv.cgen").read_bytes() and blob[47] & 1, "a rotated file"
    assert open(cal_copy, "rb").read() == cal.read_bytes() and str(tmp_path / "kv.cgen") in origin
    cal.write_bytes(b"edited after the encode")  # the recorder kept its own copy: the check below still decodes
    conf.RECORDER.check_pending()


def test_agreeing_decoders_pass_and_are_counted(rec):
    for kw in (dict(quality="lossless"), dict(preset="lmcache"), dict(quality="small")):
        rec.record(cg.encode(_kv(torch.float16), chunk_tokens=8, device="cpu", **kw), None, "test")
    v3 = cg.encode({"layers.0.key": _kv()[0, 0].transpose(0, 1), "layers.0.value": _kv()[0, 1].transpose(0, 1),
                    "input_ids": torch.arange(12)}, quality="balanced", chunk_tokens=8, device="cpu")
    assert struct.unpack_from("<H", v3, 8)[0] == 3
    rec.record(v3, None, "test")
    rec.record(v3, None, "test")
    rec.check_pending()
    assert rec.counts["checked"] == 4 and rec.counts["duplicate"] == 1 and not rec.mismatches
    assert "4 .cgen blobs" in rec.summary() and "1 already checked" in rec.summary()


def _fake_reference(real, edit):
    """A reference module whose decode returns the real result changed by ``edit``."""
    def decode(blob, calibration=None):
        d = real.decode(blob, calibration)
        edit(d)
        return d

    return types.SimpleNamespace(decode=decode, FormatViolation=real.FormatViolation)


def test_a_value_that_differs_fails(rec):
    real = rec.reference()

    def flip(d):
        words = next(iter(d.tensors.values()))[1]
        words.reshape(-1)[5] ^= 1  # one bit of one value

    rec._ref = _fake_reference(real, flip)
    rec.record(cg.encode(_kv(), quality="balanced", chunk_tokens=8, device="cpu"), None, "cachegen_cli.encode")
    with pytest.raises(AssertionError, match=r"cachegen_cli.encode: kv: 1 of 384 values differ"):
        rec.check_pending()
    assert rec.mismatches and "DISAGREED" in rec.summary()


def test_other_names_or_shapes_fail(rec):
    real = rec.reference()

    def rename(d):
        d.tensors = {k + "x": v for k, v in d.tensors.items()}

    rec._ref = _fake_reference(real, rename)
    rec.record(cg.encode(_kv(), quality="high", chunk_tokens=8, device="cpu"), None, "o")
    with pytest.raises(AssertionError, match="names / order"):
        rec.check_pending()

    def reshape(d):
        d.tensors = {k: (n, w.reshape(-1)) for k, (n, w) in d.tensors.items()}

    rec._ref = _fake_reference(real, reshape)
    rec.record(cg.encode(_kv(), quality="small", chunk_tokens=8, device="cpu"), None, "o")
    with pytest.raises(AssertionError, match=r"kv: cachegen torch.bfloat16 \[2, 2, 12, 1, 8\], reference bfloat16 \[384\]"):
        rec.check_pending()


def test_a_file_only_the_reference_refuses_fails(rec):
    real = rec.reference()

    def refuse(blob, calibration=None):
        raise real.FormatViolation("a rule cachegen does not check")

    rec._ref = types.SimpleNamespace(decode=refuse, FormatViolation=real.FormatViolation)
    rec.record(cg.encode(_kv(), preset="lmcache", chunk_tokens=8, device="cpu"), None, "o")
    with pytest.raises(AssertionError, match="cachegen decodes it, the reference refuses it: a rule"):
        rec.check_pending()


def test_skipped_blobs_are_counted_not_compared(rec, tmp_path):
    good = cg.encode(_kv(), quality="balanced", chunk_tokens=8, device="cpu")
    broken = good[:-1]  # truncated: cachegen refuses it
    rec.record(broken, None, "o")
    rec.check_pending()
    rec.max_decoded = 100  # this cache decodes to 768 bytes
    rec.record(cg.encode(_kv(), quality="high", chunk_tokens=8, device="cpu"), None, "o")
    rec.check_pending()
    rec.max_decoded = 1 << 20
    # a rotated file without its calibration
    from cachegen_cli.methods import calibration as calib

    cal = calib.fit([_kv(tokens=20).reshape(2, 2, 20, 8)])
    rotated = cg.encode(_kv(), quality="balanced", calibration=cal, chunk_tokens=8, device="cpu")
    rec.record(rotated, None, "o")
    rec.check_pending()
    assert (rec.counts["refused"], rec.counts["too_large"], rec.counts["no_calibration"], rec.counts["checked"]) == (1, 1, 1, 0)
    # with the Calibration object it was encoded with, it is compared (saved for the reference)
    rec.record(rotated, cal, "o")
    rec.check_pending()
    assert rec.counts["checked"] == 1
    # a huge announced size is refused from the header, before either decoder allocates
    huge = bytearray(good)
    struct.pack_into("<Q", huge, 16, 1 << 31)
    assert conf.decoded_bytes(bytes(huge)) == 2 * 2 * (1 << 31) * 8 * 2
    not_cgen = tmp_path / "x.cgen"
    not_cgen.write_bytes(b"not a cgen file")
    rec.record_file(not_cgen)
    assert not rec.pending


def test_a_failing_test_discards_its_blobs(rec):
    rec.record(cg.encode(_kv(), quality="balanced", chunk_tokens=8, device="cpu"), None, "o")
    rec.discard_pending()
    assert rec.counts["test_failed"] == 1 and not rec.pending


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False), ("no", False)])
def test_the_env_var_turns_it_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(conf.ENV, raising=False)
    else:
        monkeypatch.setenv(conf.ENV, value)
    assert conf.enabled() is on


def test_bit_views_match_numpy_words():
    """The comparison views a tensor as the integer of its element size, as the reference's words."""
    t = torch.tensor([1.5, -2.0], dtype=torch.float32)
    bits = t.view(getattr(torch, conf._BIT_VIEWS[4])).numpy().view(np.uint32)
    assert list(bits) == [0x3FC00000, 0xC0000000]


def test_files_left_in_tmp_path_are_recorded_once(rec, tmp_path):
    """A .cgen another process wrote into the test's tmp_path (a subprocess CLI run) is checked;
    one the package wrote in this process and that was checked already is not recorded again."""
    unseen = conf._ORIGINAL["encode"](_kv(), quality="balanced", chunk_tokens=8, device="cpu")  # not recorded
    seen = conf._ORIGINAL["encode"](_kv(), quality="small", chunk_tokens=8, device="cpu")
    rec.record(seen, None, "o")
    rec.check_pending()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.cgen").write_bytes(unseen)
    (tmp_path / "b.cgen").write_bytes(seen)
    (tmp_path / "c.safetensors").write_bytes(unseen)  # only *.cgen names are looked at
    conf.Plugin(rec)._left_in_tmp_path(types.SimpleNamespace(funcargs={"tmp_path": tmp_path}))
    assert [(b, c) for b, c, _ in rec.pending] == [(unseen, None)] and "left in tmp_path" in rec.pending[0][2]
    rec.check_pending()
    assert rec.counts["checked"] == 2


def test_a_crash_of_the_reference_fails(rec):
    real = rec.reference()

    def crash(blob, calibration=None):
        raise KeyError("tensors")

    rec._ref = types.SimpleNamespace(decode=crash, FormatViolation=real.FormatViolation)
    rec.record(cg.encode(_kv(), quality="lossless", chunk_tokens=8, device="cpu"), None, "o")
    with pytest.raises(AssertionError, match="the reference decoder raised KeyError"):
        rec.check_pending()
    assert rec.counts["checked"] == 0


def test_a_disagreement_fails_the_test_that_wrote_the_blob(tmp_path):
    """End to end, in a pytest run of its own: the hooks check after each test, fail the one whose
    blob the decoders read differently (here a reference made to flip one bit), pass the others,
    and print the summary line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "import cgen_conformance\n\n\n"
        "def pytest_configure(config):\n"
        "    cgen_conformance.register(config)\n")
    (tmp_path / "test_inner.py").write_text(
        "import torch, types\n"
        "import cachegen_cli as cg\n"
        "import cgen_conformance as conf\n\n\n"
        "def kv():\n"
        "    return torch.linspace(-3, 3, 2 * 2 * 9 * 8).reshape(2, 2, 9, 1, 8).to(torch.bfloat16)\n\n\n"
        "def test_agrees():\n"
        "    cg.encode(kv(), quality='balanced', chunk_tokens=8, device='cpu')\n\n\n"
        "def test_disagrees():\n"
        "    real = conf.RECORDER.reference()\n\n"
        "    def decode(blob, calibration=None):\n"
        "        d = real.decode(blob, calibration)\n"
        "        next(iter(d.tensors.values()))[1].reshape(-1)[3] ^= 1\n"
        "        return d\n\n"
        "    conf.RECORDER._ref = types.SimpleNamespace(decode=decode, FormatViolation=real.FormatViolation)\n"
        "    cg.encode(kv(), quality='small', chunk_tokens=8, device='cpu')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop(conf.ENV, None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed" in r.stdout and "FAILED test_inner.py::test_disagrees" in r.stdout
    assert "kv: 1 of 288 values differ" in r.stdout
    assert "cgen conformance: 1 .cgen blobs decoded identically" in r.stdout and "1 DISAGREED" in r.stdout
