"""Where the compiled CPU kernels are cached, and whether that cache is still empty, found
without importing numba (the CLI's "compiling kernels (first run only)" note)."""

import hashlib
import os
from importlib import metadata
from pathlib import Path


def numba_version() -> str:
    try:
        return metadata.version("numba")
    except metadata.PackageNotFoundError:
        return "unknown"


def source_digest(version: str | None = None) -> str:
    """A hash of the numba version and of every kernel source file."""
    digest = hashlib.sha256((version or numba_version()).encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir(version: str | None = None) -> Path:
    """The folder numba caches the kernels in (NUMBA_CACHE_DIR when the user set it)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cachegen" / f"numba-{source_digest(version)}"


def cold_cache(device: str = "cpu") -> bool:
    """True when no kernel for ``device`` ("cpu"; "cuda": the kernels of kernels/cuda*.py) has
    been compiled into the cache yet: the first run compiles them."""
    try:
        return not any(cache_dir().rglob("cuda*.nbi" if device == "cuda" else "*.nbi"))
    except OSError:
        return True
