"""Batches: many caches encoded or decoded in one call, locally or on a Ray cluster.

    from cachegen_cli.batch import run_batch
    results = run_batch(["caches/"], "encode", output_dir="out/", recursive=True, workers=2)
    failed = [r for r in results if r.status == "failed"]

``plan`` turns files and directories into (input, output) pairs, ``work`` codes one pair (and
is what every worker runs, a thread, a process or a Ray task), ``local`` and ``ray_backend``
run the pairs.  Nothing here imports torch or numba at module level: a worker process pins
its device before they load.
"""

from .run import BatchSettings, FileResult, run_batch

__all__ = ["run_batch", "BatchSettings", "FileResult"]
