"""Where compiled CPU kernels are cached, keyed by the kernels' own source.

Numba's on-disk cache checks only the timestamp of the file that holds the
jitted function, not of the device functions it inlines from other modules.
Keying the cache folder on a hash of every kernel source file (and the numba
version) means an edited helper can never be served stale machine code, while
a user's second `cachegen` run skips the few seconds of compilation.

Must be imported before any ``@njit(cache=True)`` decorator runs.
"""

import hashlib
import os
from pathlib import Path

import numba
from numba.core import config


def _source_digest() -> str:
    digest = hashlib.sha256(numba.__version__.encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def configure() -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return  # the user chose a place: respect it
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = base / "cachegen" / f"numba-{_source_digest()}"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # read-only home: numba falls back to its own locations or compiles each time
    config.CACHE_DIR = str(target)


configure()
