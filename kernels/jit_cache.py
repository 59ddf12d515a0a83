"""Where compiled CPU and CUDA kernels are cached, keyed by the kernels' own source.

Numba's on-disk cache checks only the timestamp of the file that holds the
jitted function, not of the device functions it inlines from other modules.
Keying the cache folder on a hash of every kernel source file (and the numba
version) means an edited helper can never be served stale machine code, while
a user's second `cachegen` run skips the few seconds of compilation.

Must be imported before any ``@njit(cache=True)`` decorator runs.
"""

import os

import numba
from numba.core import config

from .cache_state import cache_dir, source_digest


def _source_digest() -> str:
    return source_digest(numba.__version__)


def configure() -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return  # the user chose a place: respect it
    target = cache_dir(numba.__version__)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # read-only home: numba falls back to its own locations or compiles each time
    config.CACHE_DIR = str(target)


def configure_cuda() -> None:
    """The same folder for numba-cuda's kernel cache (its own config module, read apart from
    numba's): called by kernels/launch.py, so that the CPU paths never import numba.cuda."""
    from numba.core import config as cpu_config

    try:
        from numba.cuda.core import config as cuda_config
    except ImportError:  # an older numba-cuda: it reads numba's own config
        return
    if cpu_config.CACHE_DIR and not os.environ.get("NUMBA_CACHE_DIR"):
        cuda_config.CACHE_DIR = cpu_config.CACHE_DIR


configure()
