"""A batch on this machine: worker processes (one per GPU, pinned; or CPU workers) or threads.

Overlap: while one worker codes, others read and write (the kernels release the GIL; the
file functions stream a slab at a time), and the dispatcher asks the kernel to read ahead
the inputs next in line (posix_fadvise WILLNEED), so the disk is busy while the workers code.

A worker process that dies (killed, out of memory) breaks its pool: the pool is started
again and every file it held is tried again, up to ``max_retries`` times; outputs are atomic,
so a file a dead worker was writing has no output, only a temporary file the retry removes.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .plan import BatchItem
from .work import BatchSettings, FileResult, one_line, process_file

#: Pools: "process" (spawned worker processes, each with its share of the cores), "thread"
#: (threads of this process: numba's kernels release the GIL), "auto": processes on the GPU
#: (each pins its GPU before CUDA starts), threads on the CPU, where a process's start
#: (torch, numba, the kernels: seconds) outweighs what it saves (docs/scale.md has the figures).
POOLS = ("auto", "process", "thread")

#: Workers per visible GPU by default: while one codes, the other reads and writes.
WORKERS_PER_GPU = 2

#: Files handed to the pool ahead of the workers, per worker: enough that none waits for work.
QUEUE_PER_WORKER = 2


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    from numba import cuda

    try:
        return [str(i) for i in range(len(cuda.gpus))]
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return []


def _init_process(devices, threads: int) -> None:
    """A worker process's start, before torch or numba load: its GPU and its threads.  Ctrl-C
    is left to the dispatcher, which ends the workers with SIGTERM (their outputs' temporary
    files are removed on it: storage.outputs)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices.get()
    if threads:
        for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ[name] = str(threads)


def _init_thread(threads: int) -> None:
    import numba

    if threads:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # per thread in numba


def _read_ahead(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def _died(item: BatchItem, attempts: int, cause: str) -> dict:
    return FileResult(str(item.src), str(item.dst), error=f"worker died {attempts} time(s) coding this file ({cause})",
                      error_type="WorkerDied").to_dict()


def _stop(pool) -> None:
    """End a pool now: SIGTERM to its processes (they remove their temporary files), then shut it."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.terminate()
        except (OSError, AttributeError):
            pass
    pool.shutdown(wait=True, cancel_futures=True)


def run_local(items: list[BatchItem], settings: BatchSettings, workers: int = 0, pool: str = "auto",
              on_result: Callable[[int, dict], None] | None = None, max_retries: int = 3) -> list[dict]:
    """Code ``items`` on this machine; returns one row per item, in order.  ``workers``: how
    many at once (0: WORKERS_PER_GPU per visible GPU when the device is the GPU, else as many
    as cores over threads per file); one worker runs in this thread.  ``on_result(index, row)`` is
    called as each file finishes."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    from ..errors import ConfigError
    from ..pipeline.codec import resolve_device
    from ..storage.outputs import _cleanup_on_signals

    if pool not in POOLS:
        raise ConfigError(f"unknown pool {pool!r}; choose auto, process or thread")
    gpus = visible_gpus() if resolve_device(settings.device) == "cuda" else []
    cores = cpu_count()
    if not workers:
        workers = WORKERS_PER_GPU * len(gpus) or max(1, cores // max(1, settings.threads or 1))
    results: list[dict | None] = [None] * len(items)

    def done(i: int, row: dict) -> None:
        results[i] = row
        if on_result is not None:
            on_result(i, row)

    if workers == 1 and not gpus:  # no pool: this thread, with the caller's threads
        for i, item in enumerate(items):
            done(i, process_file(str(item.src), str(item.dst), settings))
        return results  # type: ignore[return-value]

    per_worker = settings.threads or max(1, cores // workers)
    if gpus or pool == "auto":
        pool = "process" if gpus else "thread"  # on a GPU, processes: each pins its device before CUDA starts
    import dataclasses
    import multiprocessing

    if pool == "thread":
        # numba's thread count is per thread (set by the initializer); torch's is global and left alone
        job_settings = dataclasses.replace(settings, threads=0)
    else:
        job_settings = dataclasses.replace(settings, threads=per_worker)
    context = multiprocessing.get_context("spawn")  # no fork: OpenMP and CUDA do not survive one
    pending = deque(range(len(items)))
    attempts = [0] * len(items)

    def start():
        if pool == "thread":
            return ThreadPoolExecutor(workers, thread_name_prefix="cachegen-batch", initializer=_init_thread,
                                      initargs=(per_worker,))
        devices = None
        if gpus:
            devices = context.Queue()
            for k in range(workers):
                devices.put(gpus[k % len(gpus)])
        return ProcessPoolExecutor(workers, mp_context=context, initializer=_init_process,
                                   initargs=(devices, per_worker if not gpus else 0))

    with _cleanup_on_signals():  # SIGTERM here ends the workers too, as Ctrl-C does
        while pending:
            executor = start()
            running: dict = {}
            try:
                while pending or running:
                    while pending and len(running) < QUEUE_PER_WORKER * workers:
                        i = pending.popleft()
                        attempts[i] += 1
                        item = items[i]
                        running[executor.submit(process_file, str(item.src), str(item.dst), job_settings)] = i
                    for i in list(pending)[:workers]:
                        _read_ahead(items[i].src)
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    broken = any(isinstance(f.exception(), BrokenProcessPool) for f in finished)
                    if broken:  # a worker died: every file the pool still held fails with it
                        finished = set(wait(running)[0])
                    for future in finished:
                        i = running.pop(future)
                        exc = future.exception()
                        if exc is None:
                            done(i, future.result())
                        elif not isinstance(exc, BrokenProcessPool):  # e.g. a result that did not pickle
                            done(i, FileResult(str(items[i].src), str(items[i].dst), error=one_line(exc),
                                               error_type=type(exc).__name__).to_dict())
                        elif attempts[i] > max_retries:
                            done(i, _died(items[i], attempts[i], "its worker process ended"))
                        else:  # tried again in a new pool
                            pending.appendleft(i)
                    if broken:
                        break
            except BaseException:
                _stop(executor)
                raise
            executor.shutdown(wait=True)
    return results  # type: ignore[return-value]
