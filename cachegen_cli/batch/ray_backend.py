"""A batch on a Ray cluster (``pip install 'cachegen[ray]'``).

``ray.init()`` attaches to the cluster named by RAY_ADDRESS, or to one started on this
machine with ``ray start``, or else starts a local one.  Each task gets a few (input, output)
*paths* and codes them with work.process_file: the caches never enter Ray's object store,
only the result rows do.  So every node must see the paths at the same place (a shared file
system) and have cachegen installed.

Tasks ask for ``num_cpus`` (CPU coding: the file's numba threads) or ``num_gpus=0.5`` (GPU
coding, two tasks per GPU as the local backend's two workers; one task per GPU slot, each a
process of its own; Ray pins the task's process to its GPU through CUDA_VISIBLE_DEVICES, and a GPU task's
process is not reused for another task, as Ray does by default, so that a CUDA context never
outlives its GPU assignment).  A task whose worker process dies is run again
(``max_retries``); its files that a dead attempt finished are valid outputs by then and are
kept (work.py), one it was writing has only a temporary file, which the retry removes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import CacheGenError
from .local import WORKERS_PER_GPU
from .plan import BatchItem
from .work import BatchSettings, FileResult, process_files

INSTALL_HINT = "--backend ray needs Ray: pip install 'cachegen[ray]'"

#: Most files one task codes: a task is the unit of retry and of progress.
MAX_FILES_PER_TASK = 64


class RayMissingError(CacheGenError, ImportError):
    """Ray (the ``ray`` extra) is not installed."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayMissingError("Ray is not installed: pip install 'cachegen[ray]'", cli=INSTALL_HINT) from None
    return ray


def files_per_task(num_files: int, slots: int, gpu: bool = False) -> int:
    """About two tasks per slot (so a slow node does not hold the batch's end), at most
    MAX_FILES_PER_TASK; ``gpu``: one task per slot, since each GPU task starts a process of its
    own (torch, CUDA and the kernels: ~5 s on the H200 host, more than 25 files' coding)."""
    per_slot = 1 if gpu else 2
    return max(1, min(MAX_FILES_PER_TASK, math.ceil(num_files / max(1, per_slot * slots))))


def run_ray(items: list[BatchItem], settings: BatchSettings, on_result: Callable[[int, dict], None] | None = None,
            max_retries: int = 3, num_cpus: float | None = None, num_gpus: float | None = None,
            per_task: int | None = None) -> list[dict]:
    """Code ``items`` as Ray tasks; returns one row per item, in order.  ``num_gpus``: per task
    (default: 1 / local.WORKERS_PER_GPU when the device is cuda, or auto on a cluster with GPUs,
    so that as on the local backend one task codes while another reads and writes; else 0); ``num_cpus``:
    per task (default: settings.threads or 1; the file's numba threads).  ``per_task``: files per
    task (default: files_per_task)."""
    import dataclasses

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(log_to_driver=False)
    resources = ray.cluster_resources()
    if num_gpus is None:
        on_gpus = settings.device == "cuda" or (settings.device == "auto" and resources.get("GPU", 0) > 0)
        num_gpus = 1 / WORKERS_PER_GPU if on_gpus else 0
    if num_cpus is None:
        num_cpus = settings.threads or 1
    if num_gpus:
        slots = int(resources.get("GPU", 0) / num_gpus + 1e-9)
    else:
        slots = int(resources.get("CPU", 0) // max(num_cpus, 1e-9))
    if slots < 1:  # Ray would wait for ever for resources no node has
        from ..errors import ConfigError

        what = f"{num_gpus} GPU(s)" if num_gpus else f"{num_cpus} CPU(s)"
        raise ConfigError(f"the Ray cluster has no room for a task of {what} (it has "
                          f"{resources.get('GPU', 0):g} GPU(s), {resources.get('CPU', 0):g} CPU(s))")
    task_settings = dataclasses.replace(settings, threads=int(num_cpus) if not num_gpus else settings.threads)
    step = per_task or files_per_task(len(items), slots, gpu=bool(num_gpus))
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=max_retries, retry_exceptions=False,
                        max_calls=1 if num_gpus else 0)(process_files)
    groups = {}
    for first in range(0, len(items), step):
        indices = list(range(first, min(len(items), first + step)))
        pairs = [(str(items[i].src.absolute()), str(items[i].dst.absolute())) for i in indices]
        groups[remote.remote(pairs, task_settings)] = indices
    results: list[dict | None] = [None] * len(items)
    waiting = list(groups)
    try:
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            for ref in ready:
                indices = groups[ref]
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died more than max_retries times
                    cause = " ".join(str(exc).split())[:200]
                    rows = [FileResult(str(items[i].src), str(items[i].dst), error=f"Ray task failed after "
                                       f"{max_retries + 1} attempt(s): {type(exc).__name__}: {cause}",
                                       error_type="WorkerDied").to_dict() for i in indices]
                for i, row in zip(indices, rows):
                    results[i] = row
                    if on_result is not None:
                        on_result(i, row)
    except BaseException:
        for ref in waiting:  # Ctrl-C: stop the rest (a task being cancelled removes its temporary file)
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - cancelling is best effort
                pass
        raise
    return results  # type: ignore[return-value]
