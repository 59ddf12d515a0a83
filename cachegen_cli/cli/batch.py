"""`cachegen encode|decode` over many files: directories, --output-dir, --workers, --backend ray.

The library (cachegen_cli.batch) does the work; this prints one progress bar over the batch
(files and bytes) on a terminal, one ``error: FILE: message`` line per failed file as it
fails, and a summary table at the end (or with --json one row per file on stdout)."""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .common import _escape, _human, err, out


class Backend(str, Enum):
    local = "local"
    ray = "ray"


OUTPUT_DIR_HELP = "Write the outputs here, a directory's files under their path below it (a batch)."
RECURSIVE_HELP = "Also the files in the directories' subdirectories."
WORKERS_HELP = ("Files coded at once \\[default: 0: one per GPU on the GPU, else one per core "
                "over -T]; more than one makes a batch.")
BACKEND_HELP = "local (this machine) or ray (a Ray cluster: RAY_ADDRESS, `ray start`, or a local one; pip install 'cachegen\\[ray]')."


def is_batch(inputs: list[Path], output_dir: Optional[Path], recursive: bool, workers: int, backend: Backend) -> bool:
    """A batch when asked for (--output-dir, -r, -j, --backend ray) or when an input is a directory."""
    return (output_dir is not None or recursive or workers > 0 or backend is not Backend.local
            or any(str(p) != "-" and p.is_dir() for p in inputs))


def check_batch_options(output: Optional[Path], stdout: bool, inputs: list[Path]) -> None:
    from ..errors import ConfigError

    if output is not None:
        raise ConfigError("-o/--output names one output; a batch (a directory, --output-dir, -r, -j or "
                          "--backend) takes --output-dir")
    if stdout:
        raise ConfigError("-c/--stdout takes one file, not a batch")
    if any(str(p) == "-" for p in inputs):
        raise ConfigError("a batch reads files, not stdin ('-')")


def run(op: str, inputs: list[Path], *, output_dir: Optional[Path], recursive: bool, backend: Backend,
        workers: int, device: str, threads: int, force: bool, quiet: bool, verbose: bool, as_json: bool,
        options: dict) -> None:
    """Run the batch and report it; exits 1 when any file failed."""
    from ..batch import run_batch

    show_bar = not quiet and not as_json and err.is_terminal
    bar = task = None
    state = {"files": 0, "done": 0}
    started = time.perf_counter()

    def on_start(items) -> None:
        nonlocal bar, task
        sizes = 0
        for item in items:
            try:
                sizes += item.src.stat().st_size if item.problem is None else 0
            except OSError:
                pass
        state["files"] = len(items)
        if not show_bar:
            return
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        bar = Progress(TextColumn(f"{op} [progress.description]{{task.description}}"), BarColumn(),
                       DownloadColumn(binary_units=False), TextColumn("{task.fields[files]}"), TimeElapsedColumn(),
                       TimeRemainingColumn(), console=err, transient=True)
        bar.start()
        task = bar.add_task("", total=sizes or None, files=f"0/{len(items)} files")

    def on_result(index: int, r) -> None:
        if r.status == "failed":
            err.print(f"[bold red]error:[/] {_escape(r.input)}: {_escape(r.cli_error or r.error or '')}", markup=True,
                      highlight=False, soft_wrap=True)
        state["done"] += 1
        if bar is not None:
            bar.update(task, advance=r.input_bytes or _size(r.input), files=f"{state['done']}/{state['files']} files")

    try:
        results = run_batch(inputs, op, output_dir=output_dir, recursive=recursive, backend=backend.value,
                            workers=workers, device=device, threads=threads, force=force, on_start=on_start,
                            on_result=on_result, **options)
    finally:
        if bar is not None:
            bar.stop()
    took = time.perf_counter() - started
    if as_json:
        sys.stdout.write(json.dumps([_cli_row(r) for r in results], indent=2) + "\n")
    elif not quiet:
        _summary(op, results, took, verbose)
    if any(r.status == "failed" for r in results):
        raise typer.Exit(1)


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _summary(op: str, results: list, took: float, verbose: bool) -> None:
    from rich import box
    from rich.table import Table

    if verbose:
        files = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, title=f"{op}: each file")
        for col in ("input", "output", "status", "in", "out", "ratio", "s", "device"):
            files.add_column(col, justify="right" if col in ("in", "out", "ratio", "s") else "left")
        for r in results:
            files.add_row(_escape(r.input), _escape(r.output), r.status, _human(r.input_bytes or 0),
                          _human(r.output_bytes or 0), f"{r.ratio:.2f}x" if r.ratio else "-", f"{r.seconds:.2f}",
                          r.device or "-")
        out.print(files)
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, title=f"{op}: {len(results)} file(s) in {took:.1f} s")
    for col in ("status", "files", "in", "out", "ratio", "files/s", "MB/s in"):
        table.add_column(col, justify="left" if col == "status" else "right")
    for status in ("done", "skipped", "failed"):
        rows = [r for r in results if r.status == status]
        if not rows:
            continue
        size_in = sum(r.input_bytes or 0 for r in rows)
        size_out = sum(r.output_bytes or 0 for r in rows)
        big, small = (size_in, size_out) if op == "encode" else (size_out, size_in)
        rate = status == "done" and took > 0
        table.add_row(status, str(len(rows)), _human(size_in), _human(size_out) if size_out else "-",
                      f"{big / small:.2f}x" if small and big else "-",
                      f"{len(rows) / took:.2f}" if rate else "-", f"{size_in / took / 1e6:.1f}" if rate else "-")
    out.print(table)


def _cli_row(r) -> dict:
    """A result's JSON row for the command: its error in the command's words (its flags)."""
    d = r.to_dict()
    cli = d.pop("cli_error", None)
    if cli:
        d["error"] = cli
    return d
