"""A fast seeded run of the .cgen fuzzer (scripts/fuzz.py; docs/reliability.md): mutated and
generated files of every method, version 1 and 2, with their CRCs recomputed so the
mutations reach the parsers and decoders.  Only CacheGenErrors may come out, no case may
hang, and methods 1 and 2 decode finite values only."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("CACHEGEN_FUZZ_CASES", "3000"))
#: Per case, seconds; a decode of these few-hundred-byte files takes milliseconds (the bound
#: leaves room for the kernels' first compilation and a loaded machine).
TIME_BOUND = 30.0


def _fuzz():
    spec = importlib.util.spec_from_file_location("cachegen_fuzz", ROOT / "scripts" / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fuzz():
    return _fuzz()


@pytest.fixture(scope="module")
def seeds(fuzz):
    return fuzz.seed_files()


def test_seeds_cover_every_method_and_version(fuzz, seeds):
    import struct

    kinds = {(struct.unpack_from("<H", b, 8)[0], b[44]) for _, b in seeds}
    assert kinds == {(1, 1), (2, 2), (2, 3)}
    for _, blob in seeds:
        assert fuzz.check(blob) == "ok"
        assert bytes(fuzz.fix_crcs(bytearray(blob))) == blob  # the repair changes nothing valid


def test_fuzz_seeded_run(fuzz, seeds):
    t = time.perf_counter()
    r = fuzz.run_cases(20240601, range(CASES), seeds, time_bound=TIME_BOUND)
    assert not r["failures"], r["failures"][:5]
    counts = r["counts"]
    # the recomputed CRCs let most mutations past the checksums
    assert counts.get("ChecksumError", 0) < CASES // 5, counts
    assert counts.get("ok", 0) > CASES // 50, counts
    assert counts.get("SizeError", 0) > CASES // 10, counts
    assert time.perf_counter() - t < CASES * 0.05 + 120


def test_a_crc_repaired_mutation_reaches_the_decoder(fuzz, seeds):
    """A flipped payload byte with the chunk CRC fixed is not a ChecksumError."""
    name, blob = next((n, b) for n, b in seeds if n.startswith("v2-balanced-bfloat16"))
    b = bytearray(blob)
    at = fuzz.chunk_offsets(blob)[0]
    b[at + 40 + 2] ^= 0x40
    assert fuzz.check(bytes(b)) == "ChecksumError"
    assert fuzz.check(bytes(fuzz.fix_crcs(b))) != "ChecksumError"
