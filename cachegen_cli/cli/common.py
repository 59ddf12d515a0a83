"""What the cachegen commands share: the consoles, one line on stderr per error, the text
helpers, and the model loader of the commands that run a language model."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console

from ..errors import CacheGenError, Terminated

# Wider than Rich's 80-column default when piped, so the per-layer table stays whole; and
# soft-wrapped then, so a long path or message is never split into lines.
_PIPED = not sys.stdout.isatty()
out = Console(highlight=False, width=None if not _PIPED else 120, soft_wrap=_PIPED)
err = Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _describe(exc: BaseException) -> tuple[str, int]:
    """(one line fit for a user, exit code) of an error; re-raises one the CLI does not describe."""
    if isinstance(exc, CacheGenError):
        return _escape(exc.cli_message), exc.exit_code
    if isinstance(exc, MemoryError):
        return "out of memory", 1
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        return _escape(f"{exc.strerror or exc}{where}"), 1
    if os.environ.get("CACHEGEN_DEBUG"):
        raise exc
    return _escape(f"internal error ({type(exc).__name__}: {exc}); rerun with CACHEGEN_DEBUG=1 for details"), 70


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Turn every error into one line on stderr and an exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except Terminated as exc:  # SIGTERM, SIGHUP, ...: the temporary output is gone; the conventional status
        _fail(f"interrupted by {exc.name}", 128 + exc.signo)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - the CLI promises no tracebacks
        message, code = _describe(exc)
        _fail(message, code)


def _is_terminal(stream) -> bool:
    """True when ``stream`` is a terminal (the tests replace this)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(" ".join(str(text).split()))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


#: Models loaded in this process, by resolved path (the CLI tests call several commands in one process).
_LOADED: dict[str, tuple[Any, Any]] = {}


def _loader(model: Optional[Path], log: Callable[[str], None]) -> tuple[Path, Callable[[], tuple[Any, Any]]]:
    """Resolve the model path now (a clear error before any work) and return a memoised loader."""
    from ..model.capture import load_model, require_eval_extra, resolve_model_path

    require_eval_extra()  # the one-line install hint comes before anything else
    resolved = resolve_model_path(model)

    def load() -> tuple[Any, Any]:
        key = str(resolved.resolve())
        if key not in _LOADED:
            log(f"loading the model {resolved.name}")
            _LOADED[key] = load_model(resolved, log=log)
        return _LOADED[key]

    return resolved, load


def _logger(enabled: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if enabled:
            err.print(f"[dim]{_escape(message)}[/]", highlight=False, soft_wrap=True)

    return log
