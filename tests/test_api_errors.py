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
