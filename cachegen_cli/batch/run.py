"""run_batch: files and directories in, one FileResult per file out, on a backend."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from ..errors import ConfigError
from .plan import BatchItem, plan_batch
from .work import BatchSettings, FileResult

BACKENDS = ("local", "ray")

#: Keyword arguments of the file functions a batch passes on.
ENCODE_OPTIONS = {"preset", "bins", "quantization", "quality", "calibration", "chunk_tokens", "layout", "names",
                  "extras", "rope_keys", "rope_theta", "rope_start"}
DECODE_OPTIONS = {"calibration", "max_output_size"}


def run_batch(
    inputs: Sequence[str | os.PathLike],
    op: str = "encode",
    *,
    output_dir: str | os.PathLike | None = None,
    recursive: bool = False,
    backend: str = "local",
    workers: int = 0,
    pool: str = "auto",
    device: str = "auto",
    threads: int = 0,
    force: bool = False,
    max_retries: int = 3,
    on_start: Callable[[list[BatchItem]], None] | None = None,
    on_result: Callable[[int, FileResult], None] | None = None,
    ray_options: dict | None = None,
    **options,
) -> list[FileResult]:
    """Encode or decode (``op``) every file of ``inputs`` (files and directories; see plan.py
    for which files and where their outputs go) and return one FileResult per file, in order.

    A file's failure is its result (``status="failed"``, ``error``) and the batch goes on.
    Unless ``force``, a file whose output is already complete and valid is skipped (work.py
    says what is checked); an incomplete or invalid output is written again, atomically.
    ``backend``: "local" (``workers`` at once in a ``pool`` of "process"es or "thread"s, or
    "auto": threads on the CPU, on the GPU two processes per visible GPU, each pinned to it)
    or "ray" (tasks on a Ray cluster; ``ray_options``: num_cpus / num_gpus / per_task of
    ray_backend.run_ray).  ``threads``: numba threads per
    file (0: the cores shared among the workers).  ``options``: what encode_file or
    decode_file takes (quality, preset, bins, calibration, chunk_tokens, layout;
    calibration, max_output_size).  ``on_start(items)`` is called once planned,
    ``on_result(index, result)`` as each file ends (in the calling thread)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose local or ray")
    allowed = ENCODE_OPTIONS if op == "encode" else DECODE_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"{op} takes no option {', '.join(unknown)}")
    for name, value in (("workers", workers), ("threads", threads), ("max_retries", max_retries)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be a non-negative whole number, not {value!r}")
    if options.get("calibration") is not None:  # workers get a path, read by each
        options["calibration"] = os.fspath(options["calibration"])
    items = plan_batch(list(inputs), op, output_dir, recursive)
    settings = BatchSettings(op=op, device=device, threads=threads, force=force, options=options,
                             started=time.time())
    if on_start is not None:
        on_start(items)
    results: list[FileResult | None] = [None] * len(items)

    def done(i: int, row: dict) -> None:
        results[i] = FileResult(**row)
        if on_result is not None:
            on_result(i, results[i])

    todo = []
    for i, item in enumerate(items):
        if item.problem is not None:
            done(i, FileResult(str(item.src), str(item.dst), error=item.problem, error_type="InputNotFoundError").to_dict())
        else:
            todo.append(i)
    if todo:
        chosen = [items[i] for i in todo]
        if backend == "ray":
            from .ray_backend import run_ray

            run_ray(chosen, settings, lambda k, row: done(todo[k], row), max_retries, **(ray_options or {}))
        else:
            from .local import run_local

            run_local(chosen, settings, workers, pool, lambda k, row: done(todo[k], row), max_retries)
    return results  # type: ignore[return-value]
