"""A fast seeded run of the .cgen fuzzer (scripts/fuzz.py; docs/reliability.md): mutated and
generated files of every method, version 1, 2 (rotated too) and 3, with their CRCs recomputed
so the mutations reach the parsers and decoders.  Only CacheGenErrors may come out, no case
may hang, methods 1 and 2 decode finite values only, and memory stays bounded by the output
limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("CACHEGEN_FUZZ_CASES", "3000"))
#: Per case, seconds; a decode of these few-hundred-byte files takes milliseconds (the bound
#: leaves room for the kernels' first compilation and a loaded machine).
TIME_BOUND = 30.0
#: Peak memory: a decode whose output is N bytes holds at most its float32 form (2 N for a
#: 16-bit cache), the output (N) and the per-layer tensors cut from it (N) at once, measured
#: 4.6 N for a per-layer bfloat16 file of method 2 (2026-12-01: 290 MiB for 64 MiB); so a
#: case may raise the peak RSS by at most 5 x the output limit plus this slack (the
#: interpreter's and numpy's own buffers, the input file).
RSS_SLACK = 64 << 20


def rss_bound(limit: int) -> int:
    return 5 * limit + RSS_SLACK


def _fuzz():
    return load_script("scripts/fuzz.py", "cachegen_fuzz")


@pytest.fixture(scope="module")
def fuzz():
    return _fuzz()


@pytest.fixture(scope="module")
def seeds(fuzz):
    return fuzz.seed_files()


def test_seeds_cover_every_method_and_version(fuzz, seeds):
    import struct

    from cachegen_cli.format import parts as parts_format
    from cachegen_cli.pipeline import parts as parts_codec

    versions = [struct.unpack_from("<H", b, 8)[0] for _, b in seeds]
    kinds = {(v, b[44]) for v, (_, b) in zip(versions, seeds) if v in (1, 2)}
    assert kinds == {(1, 1), (2, 2), (2, 3)}
    rotated = [(n, b) for v, (n, b) in zip(versions, seeds) if v == 2 and b[47] & 1]
    assert len(rotated) >= 5  # full and per-block rotations, bfloat16 and float32
    v3 = [b for v, (_, b) in zip(versions, seeds) if v == 3]
    group_versions = {gv for b in v3 for gv in parts_codec.group_versions(parts_format.PartsFile(b))}
    assert len(v3) >= 3 and group_versions == {1, 2}
    for _, blob in seeds:
        assert fuzz.check(blob) == "ok"
        assert bytes(fuzz.fix_crcs(bytearray(blob))) == blob  # the repair changes nothing valid
    # a rotated seed decodes only with its calibration: check() hands it over
    assert fuzz.check(rotated[0][1], calibration=None) == "CalibrationError"


def test_a_mutated_v3_file_goes_through_the_v3_decoder(fuzz, seeds, monkeypatch):
    """A v3 case reaches the package's v3 reader (PartsFile, the manifest checks, the groups),
    not the v1 / v2 reader (which would refuse version 3 at once), and a payload byte flipped in a
    group with every CRC repaired reaches the group's decoder."""
    from cachegen_cli.format import parts as parts_format

    calls = []
    real = parts_format.PartsFile.__init__

    def spy(self, buffer):
        calls.append(1)
        return real(self, buffer)

    monkeypatch.setattr(parts_format.PartsFile, "__init__", spy)
    name, blob = next((n, b) for n, b in seeds if n == "v3-windowed-balanced")
    assert fuzz.check(blob) == "ok" and calls
    pf = parts_format.PartsFile(blob)
    offset, size, _, _ = pf.parts[0]
    b = bytearray(blob)
    at = offset + fuzz.chunk_offsets(bytes(blob[offset : offset + size]))[0] + 40 + 2
    b[at] ^= 0x40
    assert fuzz.check(bytes(b)) == "ChecksumError"  # the part's CRC
    assert fuzz.check(bytes(fuzz.fix_crcs(b))) != "ChecksumError"
    outcomes = {}
    for case in range(400):
        n, mutated = fuzz.make_case(11, case, seeds)
        if n.startswith("v3-"):
            o = fuzz.check(mutated)
            outcomes[o] = outcomes.get(o, 0) + 1
    assert outcomes.get("ok", 0) and outcomes.get("SizeError", 0), outcomes  # past the CRCs, into the checks
    assert outcomes.get("ChecksumError", 0) < sum(outcomes.values()) // 4, outcomes


def test_fuzz_seeded_run(fuzz, seeds):
    t = time.perf_counter()
    r = fuzz.run_cases(20240601, range(CASES), seeds, time_bound=TIME_BOUND)
    assert not r["failures"], r["failures"][:5]
    counts = r["counts"]
    # the recomputed CRCs let most mutations past the checksums
    assert counts.get("ChecksumError", 0) < CASES // 5, counts
    assert counts.get("ok", 0) > CASES // 50, counts
    assert counts.get("SizeError", 0) > CASES // 10, counts
    assert counts.get("OutputTooLargeError", 0), counts  # the limit is passed to every decoder
    assert time.perf_counter() - t < CASES * 0.05 + 120
    assert r["max_case_growth"] <= rss_bound(fuzz.MAX_OUTPUT), r  # each case's own peak (scripts/fuzz.py _CasePeak)


def test_fuzz_peak_memory(tmp_path):
    """In a fresh process: a seeded run, then a valid file decoding to exactly the output limit and
    one a token over it; no case raises the RSS by more than rss_bound of its limit, and the file
    at the limit does allocate its output (so the bound is measured, not vacuous)."""
    import torch

    import cachegen_cli as cg

    limit = 16 << 20
    x = torch.zeros(2, 2, 2048, 8, 128, dtype=torch.bfloat16)  # 16 MiB, all but one channel zero
    x[:, :, :, :, 0] = 1.0
    per_layer = {f"layers.{i}.{n}": x[i, j].permute(1, 0, 2).unsqueeze(0).contiguous()
                 for i in range(2) for j, n in enumerate(("key", "value"))}
    (tmp_path / "at.cgen").write_bytes(cg.encode(per_layer, quality="balanced", device="cpu"))
    (tmp_path / "over.cgen").write_bytes(cg.encode(torch.cat([x, x[:, :, :1]], dim=2), quality="balanced",
                                                   device="cpu"))
    code = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("f", {str(ROOT / "scripts" / "fuzz.py")!r})
f = importlib.util.module_from_spec(spec); spec.loader.exec_module(f)
seeds = f.seed_files()
r = f.run_cases(20240602, range(1000), seeds)
out = dict(run=r["max_case_growth"], failures=len(r["failures"]))
for name in ("at", "over"):
    blob = open({str(tmp_path)!r} + "/" + name + ".cgen", "rb").read()
    mem = f._CasePeak()
    out[name] = f.check(blob, max_output_size={limit})
    out[name + "_growth"], out["exact"] = mem.growth(), mem.exact
print(json.dumps(out))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["failures"] == 0 and m["at"] == "ok" and m["over"] == "OutputTooLargeError", m
    assert m["run"] <= rss_bound(fuzz_limit()), m  # every case of the run, at the default limit
    assert m["at_growth"] <= rss_bound(limit), m  # the file at the limit
    assert m["over_growth"] <= RSS_SLACK, m  # refused from its header, before allocating
    if m["exact"]:  # (Linux: each case's own peak) the file at the limit did allocate: the bound is not vacuous
        assert m["at_growth"] >= limit, m


def fuzz_limit() -> int:
    return _fuzz().MAX_OUTPUT


def test_a_crc_repaired_mutation_reaches_the_decoder(fuzz, seeds):
    """A flipped payload byte with the chunk CRC fixed is not a ChecksumError."""
    name, blob = next((n, b) for n, b in seeds if n.startswith("v2-balanced-bfloat16"))
    b = bytearray(blob)
    at = fuzz.chunk_offsets(blob)[0]
    b[at + 40 + 2] ^= 0x40
    assert fuzz.check(bytes(b)) == "ChecksumError"
    assert fuzz.check(bytes(fuzz.fix_crcs(b))) != "ChecksumError"
