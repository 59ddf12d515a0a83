"""The reference decoder on every .cgen the test suite writes (issue 16; loaded by conftest.py).

tests/test_reference_decoder.py compares reference/cgen_reference.py with cachegen on files
chosen for it; this plugin extends that to every file any test writes, so that a new writer
path (a flag, a shape, a CLI option) cannot produce bytes that only cachegen reads.  It wraps
the package's output points:

  * ``cachegen_cli.api.encode`` (also ``cachegen_cli.encode``): the bytes it returns, with the
    calibration it was given;
  * ``cachegen_cli.storage.outputs.atomic_output``: every regular file it completes that starts
    with the .cgen magic (``encode_file``, the CLI, the batch runner's threads), with the
    calibration ``encode_file`` was given (a context variable set by its wrapper);
  * and, after a test that passed, the ``*.cgen`` files left in its ``tmp_path`` that the two
    points above did not see: those of CLI runs in a subprocess and of the batch runner's
    worker processes (without a calibration: a rotated one is counted, not compared).

At the end of each test's call (and teardown) phase, each recorded blob is decoded by cachegen
(``device="cpu"``) and, where cachegen decodes it, by the reference decoder, and the tensors
are compared exactly: names and order, dtypes, shapes and bit patterns (both decoders are
defined by integer / IEEE-exact arithmetic, so they must agree bit for bit on every machine).
A disagreement, or the reference refusing a file cachegen decodes, fails the test that wrote
the blob.  Not compared, each counted in the session's one-line summary: blobs already checked
(same SHA-256 and calibration), blobs over the size caps (the reference's range coder runs
symbol by symbol in Python: ~2 us a value), blobs cachegen itself refuses (deliberately broken
ones), rotated files written without a calibration the plugin saw, and blobs of tests that
failed anyway.  Files other processes write outside the test's ``tmp_path`` are not seen.

``CACHEGEN_CONFORMANCE=0`` turns it off (e.g. to profile the suite); the caps can be changed
with ``CACHEGEN_CONFORMANCE_MAX_BLOB`` (bytes of the file, default 2 MB) and
``CACHEGEN_CONFORMANCE_MAX_DECODED`` (bytes of the decoded tensors, read from the header,
default 1 MiB: about a second of the reference); ``CACHEGEN_CONFORMANCE_LOG=FILE`` appends a
line per blob (seconds in each decoder, sizes, origin).  On the test files run while this was
written (about half the suite) the checks took ~5% of the run time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import shutil
import stat
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

ENV = "CACHEGEN_CONFORMANCE"
MAGIC = b"\x89CGEN\r\n\x1a"
ROOT = Path(__file__).resolve().parent.parent

#: element size -> the integer dtype whose view of a tensor gives its bit patterns
_BIT_VIEWS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

#: what each skip counter means, in the summary's order
REASONS = {
    "duplicate": "already checked",
    "too_large": "over the size cap",
    "refused": "refused by cachegen (deliberately broken)",
    "no_calibration": "rotated, calibration not seen",
    "test_failed": "written by a failing test",
}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "no", "off", "false", "")


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def decoded_bytes(blob: bytes) -> int | None:
    """Bytes of the tensors the blob announces, from its first bytes only (docs/format.md: every
    field needed is at a fixed offset); None when it does not start like a .cgen file."""
    if len(blob) < 48 or blob[:8] != MAGIC:
        return None
    version = struct.unpack_from("<H", blob, 8)[0]
    if version == 3:
        return struct.unpack_from("<Q", blob, 24)[0]
    if version in (1, 2) and len(blob) >= 64:
        tokens, layers, channels = struct.unpack_from("<QII", blob, 16)
        word = 4 if blob[42] == 3 else 2
        return layers * 2 * tokens * channels * word
    return None


def _compare(theirs: dict, mine: dict) -> str | None:
    """None when cachegen's tensors and the reference's (name -> (dtype name, words)) are the same
    names in the same order with the same dtypes, shapes and bit patterns; else what differs."""
    import torch

    if list(theirs) != list(mine):
        return f"tensor names / order: cachegen {list(theirs)}, reference {list(mine)}"
    for name, (dtype_name, words) in mine.items():
        t = theirs[name].detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") != dtype_name or list(t.shape) != list(words.shape):
            return f"{name}: cachegen {t.dtype} {list(t.shape)}, reference {dtype_name} {list(words.shape)}"
        if words.dtype.itemsize != t.element_size():
            return f"{name}: element sizes {t.element_size()} and {words.dtype.itemsize}"
        bits = t.view(getattr(torch, _BIT_VIEWS[t.element_size()])).numpy().view(words.dtype)
        differ = int((bits != words).sum())
        if differ:
            return f"{name}: {differ} of {words.size} values differ"
    return None


def _rotated(blob: bytes) -> bool:
    return len(blob) >= 64 and struct.unpack_from("<H", blob, 8)[0] == 2 and bool(blob[47] & 1)


_UNSET = object()


class Recorder:
    """Blobs written during the current test, and the session's counters."""

    def __init__(self) -> None:
        self.max_blob = _int_env("CACHEGEN_CONFORMANCE_MAX_BLOB", 2_000_000)
        self.max_decoded = _int_env("CACHEGEN_CONFORMANCE_MAX_DECODED", 1 << 20)
        self.pending: list[tuple[bytes, str | None, str]] = []
        self.seen: set[tuple[str, str | None]] = set()
        self.shas: set[str] = set()  # of every blob checked, whatever its calibration
        self.counts: Counter = Counter()
        self.mismatches: list[str] = []
        self.log = os.environ.get("CACHEGEN_CONFORMANCE_LOG")
        self.seconds = 0.0  # spent checking (the summary reports it: the plugin's cost to the suite)
        self.split = (0.0, 0.0)  # the last check's seconds in cachegen's decode and in the reference's
        self.lock = threading.Lock()
        self.calibration = contextvars.ContextVar("cgen_conformance_calibration", default=None)
        self._tmp = Path(tempfile.mkdtemp(prefix="cgen-conformance-"))
        self._ref = None

    # ---- recording (called from the wrapped package functions)

    def calibration_path(self, calibration) -> str | None:
        """A path the reference decoder can read for ``calibration`` (a path, or a Calibration
        object saved once), copied so that a test editing its file afterwards changes nothing."""
        if calibration is None:
            return None
        try:
            if isinstance(calibration, (str, os.PathLike)):
                data = Path(calibration).read_bytes()
            else:
                from cachegen_cli.methods import calibration as calib, parts_calibration

                path = self._tmp / f"object-{id(calibration)}.safetensors"
                # a version-3 calibration (caches of several shapes) has its own file form
                (parts_calibration.save if hasattr(calibration, "planes") else calib.save)(calibration, path)
                data = path.read_bytes()
        except Exception:  # an unreadable calibration: the encode call reports it, not this plugin
            return None
        path = self._tmp / (hashlib.sha256(data).hexdigest()[:32] + ".safetensors")
        if not path.exists():
            path.write_bytes(data)
        return str(path)

    def record(self, blob, calibration, origin: str) -> None:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            return  # e.g. a CUDA tensor of encode_to_device: not on the host
        blob = bytes(blob)
        if blob[:8] != MAGIC:
            return
        with self.lock:
            self.pending.append((blob, self.calibration_path(calibration), origin))

    def record_file(self, path: Path, calibration=_UNSET, origin: str | None = None,
                    skip_checked: bool = False) -> None:
        """Record the .cgen file at ``path`` (not a FIFO or a device: those are not read back)."""
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or a device written in place: not read back
                return
            with open(path, "rb") as f:
                if f.read(8) != MAGIC:
                    return
                if st.st_size > self.max_blob:
                    with self.lock:
                        self.counts["too_large"] += 1
                    return
                f.seek(0)
                blob = f.read()
        except OSError:
            return
        if skip_checked and hashlib.sha256(blob).hexdigest() in self.shas:
            return  # written by the package in this process: already recorded with its calibration
        self.record(blob, self.calibration.get() if calibration is _UNSET else calibration, origin or f"file {path}")

    # ---- checking

    def reference(self):
        if self._ref is None:
            sys.path.insert(0, str(ROOT / "reference"))
            import cgen_reference

            self._ref = cgen_reference
        return self._ref

    def take(self) -> list[tuple[bytes, str | None, str]]:
        with self.lock:
            out, self.pending = self.pending, []
        return out

    def check_pending(self) -> None:
        """Compare every blob recorded since the last call; raise AssertionError on a disagreement."""
        problems = []
        for item in self.take():
            start = time.perf_counter()
            try:
                problem = self.check(*item)
            finally:
                took = time.perf_counter() - start
                self.seconds += took
                if self.log:  # CACHEGEN_CONFORMANCE_LOG: one line per blob, to see what the checks cost
                    with open(self.log, "a") as f:
                        print(f"{took:.3f}s {len(item[0])} bytes, {decoded_bytes(item[0])} decoded, cachegen "
                              f"{self.split[0]:.3f}s, reference {self.split[1]:.3f}s, {item[2]}", file=f)
                self.split = (0.0, 0.0)
            if problem:
                problems.append(problem)
        if problems:
            self.mismatches.extend(problems)
            raise AssertionError("reference decoder and cachegen disagree (tests/cgen_conformance.py):\n"
                                 + "\n".join(problems))

    def discard_pending(self) -> None:
        n = len(self.take())
        self.counts["test_failed"] += n

    def check(self, blob: bytes, calibration: str | None, origin: str) -> str | None:
        """None when the two decoders agree (or the blob is skipped), else what differs."""
        sha = hashlib.sha256(blob).hexdigest()
        key = (sha, calibration)
        if key in self.seen:
            self.counts["duplicate"] += 1
            return None
        self.seen.add(key)
        self.shas.add(sha)
        size = decoded_bytes(blob)
        if len(blob) > self.max_blob or size is None or size > self.max_decoded:
            self.counts["too_large" if size is not None else "refused"] += 1
            return None
        if _rotated(blob) and calibration is None:
            self.counts["no_calibration"] += 1
            return None
        from cachegen_cli.api import using_threads
        from cachegen_cli.errors import CacheGenError

        start = time.perf_counter()
        try:
            # One thread: these blobs are small, and waking numba's pool costs ~0.1 s a call on a
            # loaded machine (the values do not depend on the thread count; tests/test_cli.py
            # checks that)
            with using_threads(1):
                theirs = _ORIGINAL["decode"](blob, device="cpu", calibration=calibration)
        except CacheGenError:
            self.counts["refused"] += 1
            return None
        ref = self.reference()
        middle = time.perf_counter()
        try:
            mine = ref.decode(blob, calibration)
        except ref.FormatViolation as exc:
            return f"{origin}: cachegen decodes it, the reference refuses it: {exc}"
        except Exception as exc:  # a crash of the reference is a finding too, not a reason to stop
            return f"{origin}: the reference decoder raised {type(exc).__name__}: {exc}"
        finally:
            self.split = (middle - start, time.perf_counter() - middle)
        problem = _compare(theirs, mine.tensors)
        if problem:
            return f"{origin}: {problem}"
        self.counts["checked"] += 1
        return None

    def summary(self) -> str:
        c = self.counts
        skipped = ", ".join(f"{c[k]} {what}" for k, what in REASONS.items() if c[k])
        line = (f"cgen conformance: {c['checked']} .cgen blobs decoded identically by the reference decoder"
                f" and cachegen in {self.seconds:.1f} s; skipped: {skipped or 'none'}")
        if self.mismatches:
            line += f"; {len(self.mismatches)} DISAGREED"
        return line


_ORIGINAL: dict = {}
#: at most this many .cgen files left in a test's tmp_path are looked at
MAX_LEFT_FILES = 64
RECORDER: Recorder | None = None


def mark_checked(blob: bytes, calibration=None) -> None:
    """A test compared ``blob`` with both decoders itself (tests/test_reference_decoder.py): the
    session's recorder need not decode it again (the reference takes ~2 us a value)."""
    if RECORDER is not None:
        sha = hashlib.sha256(bytes(blob)).hexdigest()
        RECORDER.seen.add((sha, RECORDER.calibration_path(calibration)))
        RECORDER.shas.add(sha)


def install() -> Recorder:
    """Wrap the package's output points (once per process) and return the recorder."""
    global RECORDER
    if RECORDER is not None:
        return RECORDER
    import cachegen_cli
    from cachegen_cli import api
    from cachegen_cli.storage import outputs

    rec = Recorder()
    _ORIGINAL.update(encode=api.encode, encode_file=api.encode_file, atomic_output=outputs.atomic_output,
                     decode=api.decode)

    @functools.wraps(_ORIGINAL["encode"])
    def encode(*args, **kwargs):
        blob = _ORIGINAL["encode"](*args, **kwargs)
        rec.record(blob, kwargs.get("calibration"), "cachegen_cli.encode")
        return blob

    @functools.wraps(_ORIGINAL["encode_file"])
    def encode_file(*args, **kwargs):
        token = rec.calibration.set(kwargs.get("calibration"))
        try:
            return _ORIGINAL["encode_file"](*args, **kwargs)
        finally:
            rec.calibration.reset(token)

    @contextlib.contextmanager
    def atomic_output(path):
        with _ORIGINAL["atomic_output"](path) as tmp:
            yield tmp
        rec.record_file(Path(path))  # only once the block succeeded and the file is in place

    atomic_output.__doc__ = _ORIGINAL["atomic_output"].__doc__
    replacements = {id(_ORIGINAL["encode"]): encode, id(_ORIGINAL["encode_file"]): encode_file,
                    id(_ORIGINAL["atomic_output"]): atomic_output}
    # Rebind every name already bound to the originals (``from .storage.outputs import
    # atomic_output`` in api.py, ``from .api import encode`` in the package); modules imported
    # later read the patched module attributes.
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "cachegen_cli" or name.startswith("cachegen_cli.")):
            continue
        for attr, value in list(vars(module).items()):
            new = replacements.get(id(value))
            if new is not None and attr in ("encode", "encode_file", "atomic_output"):
                setattr(module, attr, new)
    assert cachegen_cli.encode is encode and api.atomic_output is atomic_output
    RECORDER = rec
    return rec


class Plugin:
    """The pytest hooks: check after each test's call and teardown, summarise at the end."""

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder

    def _after(self, item=None):
        try:
            outcome = yield
        except BaseException:
            self.rec.discard_pending()
            raise
        self.rec.check_pending()
        if item is not None:  # after the check above: the files it saw are known by their SHA-256
            self._left_in_tmp_path(item)
            self.rec.check_pending()
        return outcome

    def _left_in_tmp_path(self, item) -> None:
        """.cgen files the test left in its tmp_path that were not recorded when written: those of
        a CLI run in a subprocess (or the batch runner's worker processes)."""
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if not isinstance(tmp, Path):
            return
        try:
            paths = sorted(tmp.rglob("*.cgen"))[:MAX_LEFT_FILES]
        except OSError:
            return
        for path in paths:
            if not path.is_symlink():
                self.rec.record_file(path, calibration=None, origin=f"left in tmp_path: {path}", skip_checked=True)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._after(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        return (yield from self._after())

    def pytest_sessionfinish(self, session):
        try:  # blobs of session-scoped fixtures torn down after the last test
            self.rec.check_pending()
        except AssertionError as exc:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            print(exc, file=sys.stderr)
        finally:
            shutil.rmtree(self.rec._tmp, ignore_errors=True)  # the copies of the calibrations

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line(self.rec.summary())


def register(config) -> None:
    if enabled():
        config.pluginmanager.register(Plugin(install()), "cgen-conformance")
