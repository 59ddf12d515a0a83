"""calibrate and tune on caches of several shapes (format version 3; issue 12's leftovers).

A version-3 calibration holds one rotation per plane kind of each layer, of that plane's own
width (methods/parts_calibration.py); each group's file is rotated with its members' rotations
and the reference decoder (written from docs/format.md) decodes it to the same bits.  tune
searches per-layer K / V steps over the planes.  Synthetic caches: shapes and code paths only,
no claim about quality (the tiny models' runs are in tests/test_model_shapes.py)."""

from __future__ import annotations

import json
import struct
import tomllib

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import cachegen_cli as cg
from cachegen_cli.cli import app
from cachegen_cli.errors import ConfigError
from cachegen_cli.format import parts as fmt
from cachegen_cli.methods import calibration as calib
from cachegen_cli.methods import parts_calibration as pcal
from cachegen_cli.methods.calibration import CalibrationError
from cachegen_cli.model import tune_parts
from cachegen_cli.storage import kvparts

from conftest import realistic_kv
from test_reference_decoder import assert_same_values
from test_shapes import mla, sliding

runner = CliRunner()


def _ok(*args) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.stdout


def _fail(*args, code: int = 1) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == code, r.output
    line = r.stderr.strip()
    assert line.startswith("error:") and "\n" not in line, r.stderr
    return line


def _shapes(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {n: list(f.get_tensor(n).shape) for n in f.keys()}, f.metadata()


def _latents(layers=2, tokens=30, channels=9):
    g = torch.Generator().manual_seed(5)
    return {f"layers.{i}.latent": (torch.randn(tokens, channels, generator=g) @ torch.randn(channels, channels, generator=g))
            .to(torch.bfloat16) for i in range(layers)}


def _rotated_groups(blob: bytes) -> list[bool]:
    pf = fmt.PartsFile(blob)
    return [bool(bytes(pf.view[o + 47:o + 48])[0] & 1) for o, _, k, _ in pf.parts if k == fmt.PART_GROUP]


def test_calibrate_writes_a_rotation_per_plane_of_its_own_width(tmp_path):
    src = tmp_path / "mla.safetensors"
    save_file(mla(layers=2, tokens=30, rank=32, rope=7), src)
    cal = tmp_path / "mla.cal.safetensors"
    out = _ok("calibrate", src, "-o", cal)
    assert "calibration version 3" in out
    shapes, meta = _shapes(cal)
    # K (32 channels) and V (7) differ in size: each plane is coded in halves, one block per half;
    # 7 channels are coded as 2 x 4, the padding channel the last of block 1
    assert shapes == {f"rotation.{l}.{k}": s for l in range(2) for k, s in (("key", [2, 16, 16]), ("value", [2, 4, 4]))}
    assert meta["format"] == "cachegen-calibration" and meta["version"] == "3"
    loaded = pcal.load_any(cal)
    value = loaded.planes[(0, "value")][1]
    assert value[3, 3] == 1.0 and not value[3, :3].any() and not value[:3, 3].any()  # the padding maps to itself

    sw = tmp_path / "sw.safetensors"
    save_file(sliding(full=30, window=9, heads=2, head_dim=8), sw)
    _ok("calibrate", sw, "-o", tmp_path / "sw.cal.safetensors")
    _ok("calibrate", sw, "-o", tmp_path / "sw.head.cal.safetensors", "--per-head")
    full, _ = _shapes(tmp_path / "sw.cal.safetensors")
    head, _ = _shapes(tmp_path / "sw.head.cal.safetensors")
    assert full == {f"rotation.{l}.{k}": [1, 16, 16] for l in range(4) for k in ("key", "value")}
    assert head == {f"rotation.{l}.{k}": [2, 8, 8] for l in range(4) for k in ("key", "value")}
    for c in (full, head):  # every block orthonormal (load checks it too)
        for key, r in pcal.load_any(tmp_path / "sw.cal.safetensors").planes.items():
            r64 = r.astype(np.float64)
            assert np.abs(np.einsum("bcd,bce->bde", r64, r64) - np.eye(r.shape[-1])).max() < 1e-5


CASES = {
    "sliding window + extras": lambda: sliding(full=30, window=9),
    "MLA K/V of different sizes": lambda: mla(layers=2, tokens=30),
    "latents, odd channels": _latents,
    "batch of 2": lambda: {f"layers.{i}.{k}": realistic_kv(layers=1, tokens=24, seed=i)[0, j].permute(1, 0, 2)
                           .unsqueeze(0).repeat(2, 1, 1, 1).contiguous() for i in range(2)
                           for j, k in enumerate(("key", "value"))},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_head", [False, True])
def test_rotated_groups_decode_alike_in_cachegen_and_the_reference(case, per_head, tmp_path):
    kv = CASES[case]()
    cal = pcal.fit_parts([kvparts.analyse(kv, {}, None, "drop")], per_head=per_head)
    path = tmp_path / "cal.safetensors"
    pcal.save(cal, path)
    blob = cg.encode(kv, quality="balanced", calibration=path, device="cpu")
    assert blob[8] == 3 and all(_rotated_groups(blob))
    assert_same_values(blob, path)  # bit for bit, the reference reading the rotation rules of docs/format.md
    back = cg.decode(blob, calibration=cal, device="cpu")
    for name, t in kv.items():
        if t.is_floating_point():
            err = float((back[name].float() - t.float()).pow(2).mean() / t.float().pow(2).mean())
            assert err < 0.05, name
        else:
            assert torch.equal(back[name], t)
    # a rotation the file was not encoded with, or none, is refused
    with pytest.raises(CalibrationError, match="encoded with"):
        cg.decode(blob, device="cpu")
    other = pcal.fit_parts([kvparts.analyse({n: (t * 1.5 + 1).to(t.dtype) if t.is_floating_point() else t
                                             for n, t in kv.items()}, {}, None, "drop")], per_head=per_head)
    with pytest.raises(CalibrationError, match="not the one"):
        cg.decode(blob, calibration=other, device="cpu")
    from cachegen_cli import api

    assert api.test_file(_write(tmp_path / "x.cgen", blob), calibration=path, device="cpu")["num_groups"] >= 1


def _write(path, blob):
    path.write_bytes(blob)
    return path


def test_a_small_group_written_lossless_needs_no_rotation():
    """The small-cache rule may write a group unrotated (its shortest exact encoding); that group
    decodes without its rotation, the others with theirs."""
    kv = mla(layers=2, tokens=3)
    cal = pcal.fit_parts([kvparts.analyse(kv, {}, None, "drop")])
    blob = cg.encode(kv, quality="balanced", calibration=cal, device="cpu")
    back = cg.decode(blob, calibration=cal, device="cpu")
    assert all(back[n].shape == t.shape for n, t in kv.items())
    assert_same_values(blob, _save(cal))


def _save(cal):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "cal.safetensors"
    pcal.save(cal, path)
    return path


def test_calibrations_of_the_other_kind_are_refused(tmp_path):
    regular = realistic_kv(layers=2, tokens=24)
    reg_cal = calib.fit([regular.reshape(2, 2, 24, -1)])
    with pytest.raises(ConfigError, match="one shape"):
        cg.encode(sliding(), calibration=reg_cal, device="cpu")
    parts_cal = pcal.fit_parts([kvparts.analyse(sliding(), {}, None, "drop")])
    with pytest.raises(CalibrationError, match="version 3"):
        cg.encode(regular, calibration=parts_cal, device="cpu")
    # a plane the calibration has no rotation for, or one of another width
    with pytest.raises(CalibrationError, match="no rotation for layer"):
        cg.encode(sliding(layers=6), calibration=parts_cal, device="cpu")
    with pytest.raises(CalibrationError, match="coded channels"):
        cg.encode(sliding(head_dim=4), calibration=parts_cal, device="cpu")
    # and the CLI says so in one line
    src, cal = tmp_path / "kv.safetensors", tmp_path / "cal.safetensors"
    save_file({"kv": regular}, src)
    pcal.save(parts_cal, cal)
    assert "version 3" in _fail("encode", src, "-o", tmp_path / "kv.cgen", "--calibration", cal)
    sw = tmp_path / "sw.safetensors"
    save_file(sliding(), sw)
    assert "--sensitivity applies to caches of one regular shape" in _fail("calibrate", sw, "-o", tmp_path / "c.safetensors",
                                                                           "--sensitivity", code=2)  # an option


def test_a_tampered_version_3_calibration_is_refused(tmp_path):
    cal = pcal.fit_parts([kvparts.analyse(sliding(), {}, None, "drop")])
    bad = dict(cal.planes)
    bad[(0, "key")] = bad[(0, "key")] * 1.1
    path = tmp_path / "bad.safetensors"
    pcal.save(pcal.PartsCalibration(bad, cal.metadata), path)
    with pytest.raises(CalibrationError, match="not orthonormal"):
        pcal.load_any(path)
    from safetensors.torch import save_file as save

    save({"rotation.0.key": torch.eye(4).unsqueeze(0), "bias": torch.zeros(3)}, tmp_path / "x.safetensors",
         metadata={"format": "cachegen-calibration", "version": "3"})
    with pytest.raises(CalibrationError, match="unknown tensor"):
        pcal.load_any(tmp_path / "x.safetensors")


@pytest.mark.parametrize("case", ["sliding window + extras", "MLA K/V of different sizes", "latents, odd channels"])
def test_tune_without_a_model_meets_the_target_on_multi_part_caches(case, tmp_path):
    kv = CASES[case]()
    src = tmp_path / "kv.safetensors"
    save_file(kv, src)
    cal = tmp_path / "cal.safetensors"
    _ok("calibrate", src, "-o", cal)
    out = tmp_path / "tuned.toml"
    r = json.loads(_ok("tune", src, "--target-error", 0.05, "-o", out, "--calibration", cal, "--json", "-q"))
    assert r["layered"] and r["achieved"] <= 0.05 and r["file_bytes"] > 0
    config = tomllib.loads(out.read_text())
    pc = kvparts.analyse(kv, {}, None, "drop")
    assert len(config["key_step"]) == len(config["value_step"]) == pc.model_layers
    # the config encodes the file it was tuned on to what the tuner measured
    enc = tmp_path / "kv.cgen"
    _ok("encode", src, "-o", enc, "--config", out, "--calibration", cal, "--device", "cpu", "-q")
    assert enc.stat().st_size == r["file_bytes"] + _extras_bytes(kv)
    decoded = cg.decode(enc, calibration=cal, device="cpu")
    measure = tune_parts.PartsAttentionMeasure(pc)
    assert measure.value(measure.cost(decoded)) == pytest.approx(r["achieved"], rel=1e-9)


def _extras_bytes(kv) -> int:
    """What keeping the extras adds to the tuner's file (it tunes the K / V / latent planes alone)."""
    with_extras = cg.encode(kv, quality="lossless", device="cpu")
    without = cg.encode(kv, quality="lossless", device="cpu", extras="drop")
    return len(with_extras) - len(without)


def test_tune_steps_follow_each_slot():
    """Slots of a missing layer take the geometric mean weight (their steps never reach a file);
    a slot whose damage is larger gets a smaller step than one of the same size that matters less."""
    g = torch.Generator().manual_seed(3)
    kv = {}
    for i in (0, 2):  # layer 1 missing (a hybrid model's linear-attention layer)
        for k in ("key", "value"):
            kv[f"layers.{i}.{k}"] = torch.randn(1, 2, 40, 8, generator=g).to(torch.bfloat16)
    pc = kvparts.analyse(kv, {}, None, "drop")
    measure = tune_parts.PartsAttentionMeasure(pc)
    result = tune_parts.tune_parts(pc, measure, 0.05)
    w = result.weights
    present = w[[0, 0, 2, 2], [0, 1, 0, 1]]
    assert w[1, 0] == w[1, 1] == pytest.approx(float(np.exp(np.log(present).mean())))
    assert result.achieved <= 0.05
    assert set(map(tuple, np.argwhere(result.steps != result.steps[1, 0]))) <= {(0, 0), (0, 1), (2, 0), (2, 1)}


def test_group_rotation_sha_is_what_the_group_file_records():
    kv = sliding()
    cal = pcal.fit_parts([kvparts.analyse(kv, {}, None, "drop")])
    blob = cg.encode(kv, quality="high", calibration=cal, device="cpu")
    pf = fmt.PartsFile(blob)
    for gi, g in enumerate(pf.manifest["groups"]):
        want = pcal.group_calibration(cal, g["kind"], g["channels"], pcal.member_slots(g, pf.manifest["tensors"]))
        part = bytes(pf.part(gi))
        # the Params block follows the 64-byte header and the descriptor: its first 32 bytes are the SHA-256
        (desc_size,) = struct.unpack_from("<I", part, 12)
        assert part[64 + desc_size:64 + desc_size + 32] == want.sha256
