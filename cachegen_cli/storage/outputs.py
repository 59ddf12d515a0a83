"""Safe outputs: never overwrite an input, never leave a half-written file.

Every output that is (or will be) a regular file is written to a hidden temporary file in
the destination folder, flushed to disk, then renamed over the destination in one step
(rename is atomic on POSIX file systems within a folder).  On any error, Ctrl-C or a
terminating signal (SIGTERM, SIGHUP, ...), the temporary file is removed and the
destination is untouched.  An existing output that is not a regular file (``/dev/null``, a
FIFO, a character device) is written in place, as zstd and xz do: renaming over it would
replace the device node with a plain file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import InputError, InputNotFoundError, OutputError, OutputExistsError, SameFileError, Terminated


def _stat(path: Path, error: type, what: str) -> os.stat_result | None:
    """os.stat of ``path`` (following links); None when it does not exist; ``error`` for a symlink
    loop, a permission problem or anything else stat refuses."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return None
        cause = "symlink loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc)).lower()
        raise error(f"{what} {path}: {cause}") from None


def check_input(src: Path) -> None:
    """Refuse an input that is missing, a directory, a symlink loop or unreadable, each with its cause."""
    st = _stat(src, InputError, "cannot read")
    if st is None:
        if os.path.islink(src):
            raise InputNotFoundError(f"no such file: {src} (a dangling symlink)")
        raise InputNotFoundError(f"no such file: {src}")
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{src} is a directory, not a file")
    try:
        with open(src, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"cannot read {src}: {(exc.strerror or str(exc)).lower()}") from None


def check_output(output: Path, inputs: Iterable[Path], force: bool) -> None:
    """Refuse an output that is one of the inputs, or that exists without ``force``."""
    st = _stat(output, OutputError, "cannot write")
    for src in inputs:
        try:
            if st is not None and os.path.samefile(output, src):
                raise SameFileError(f"refusing to overwrite the input file {src}")
        except OSError:
            pass
        try:
            if output.resolve() == src.resolve():
                raise SameFileError(f"refusing to overwrite the input file {src}")
        except (OSError, RuntimeError):  # a symlink loop among the inputs: reported when read
            pass
    if st is not None and not force:
        raise OutputExistsError(f"{output} already exists; pass force=True to overwrite it",
                                cli=f"{output} already exists; use --force to overwrite it")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{output} is a directory")
    if not output.parent.exists():
        raise OutputError(f"folder {output.parent} does not exist")


def is_special(path: Path) -> bool:
    """True when ``path`` exists and is not a regular file or a directory (a device, a FIFO, a socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


#: The signals whose default action ends the process and that a program may catch; SIGINT
#: already raises KeyboardInterrupt, SIGPIPE is ignored by Python (writes fail with EPIPE).
TERMINATING_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2",
                                       "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF")
    if hasattr(signal, name)
)


def _raise_terminated(signo: int, frame) -> None:
    raise Terminated(signo)


@contextlib.contextmanager
def _cleanup_on_signals() -> Iterator[None]:
    """While the block runs, a terminating signal raises Terminated (so that ``finally`` blocks
    remove temporary files) instead of killing the process outright.  Only signals left at their
    default action are taken over, and only from the main thread; the old actions come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    for signo in TERMINATING_SIGNALS:
        try:
            if signal.getsignal(signo) is signal.SIG_DFL:
                old[signo] = signal.signal(signo, _raise_terminated)
        except (OSError, ValueError):
            pass
    try:
        yield
    finally:
        for signo, action in old.items():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(signo, action)


#: errno values that can only come from writing the output: reported as an OutputError naming it.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EROFS} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())


@contextlib.contextmanager
def _write_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in _WRITE_ERRNOS:
            raise OutputError(f"cannot write {path}: {(exc.strerror or str(exc)).lower()}") from None
        raise


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` if the block succeeds.

    When ``path`` exists and is not a regular file (``/dev/null``, a FIFO), yield ``path``
    itself: the caller writes into it in place (check_output has already required --force)."""
    path = Path(path)
    if is_special(path):
        with _cleanup_on_signals(), _write_errors(path):
            yield path
        return
    with _cleanup_on_signals():
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
        except OSError as exc:
            raise OutputError(f"cannot write to {path.parent}: {exc.strerror or exc}") from None
        tmp = Path(tmp_name)
        try:
            os.close(fd)
            # mkstemp creates 0600; give the output the permissions a plain open() would.
            umask = os.umask(0)
            os.umask(umask)
            with contextlib.suppress(OSError):
                os.chmod(tmp, 0o666 & ~umask)
            with _write_errors(path):
                yield tmp
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
