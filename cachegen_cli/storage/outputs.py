"""Safe outputs: never overwrite an input, never leave a half-written file.

Every output is written to a hidden temporary file in the destination folder,
flushed to disk, then renamed over the destination in one step (rename is
atomic on POSIX file systems within a folder).  On any error, or Ctrl-C, the
temporary file is removed and the destination is untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import OutputError, OutputExistsError, SameFileError


def check_output(output: Path, inputs: Iterable[Path], force: bool) -> None:
    """Refuse an output that is one of the inputs, or that exists without ``force``."""
    for src in inputs:
        try:
            if output.exists() and src.exists() and os.path.samefile(output, src):
                raise SameFileError(f"refusing to overwrite the input file {src}")
        except OSError:
            pass
        if output.resolve() == src.resolve():
            raise SameFileError(f"refusing to overwrite the input file {src}")
    if output.exists() and not force:
        raise OutputExistsError(f"{output} already exists; use --force to overwrite it")
    if output.exists() and output.is_dir():
        raise OutputError(f"{output} is a directory")
    if not output.parent.exists():
        raise OutputError(f"folder {output.parent} does not exist")


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` if the block succeeds."""
    path = Path(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    except OSError as exc:
        raise OutputError(f"cannot write to {path.parent}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp creates 0600; give the output the permissions a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
