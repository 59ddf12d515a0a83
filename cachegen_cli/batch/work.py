"""One file of a batch, as every worker codes it (a thread, a worker process, a Ray task).

A worker gets paths, never tensors: it reads its input and writes its output itself, through
the library's file functions (atomic outputs: a worker killed mid-file leaves no output, at
most a hidden ``.NAME.*.tmp`` beside it, which the next attempt at that output removes).

Resuming: unless ``force``, an output that already exists is checked first and the file is
skipped when the output is complete and valid and not older than its input:

- a ``.cgen`` output: its header and index parse, every chunk's CRC-32 matches (the reader's
  own checks, without decoding), and its descriptor (layout, names, shapes, dtype, metadata)
  is the input's;
- a decoded ``.safetensors`` output: its size and its header are byte for byte those that
  decoding the input writes (computed from the input's .cgen header).  safetensors holds no
  checksum of the data; the data is trusted because outputs appear only by an atomic rename
  after a complete write.

An existing output that fails these checks is coded again (the row says why).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CacheGenError

#: For tests only: when this variable names a file that exists, the first worker to remove it
#: ends its own process in the middle of writing an output (as a worker killed by the OOM
#: killer or a lost node would), once.  Unset (the default), nothing happens.
EXIT_ONCE_ENV = "CACHEGEN_TEST_EXIT_ONCE"

STATUSES = ("done", "skipped", "failed")


@dataclass
class BatchSettings:
    """How every file of a batch is coded: picklable, so it travels to worker processes and Ray tasks."""

    op: str  # "encode" or "decode"
    device: str = "auto"
    #: numba / torch threads per file (0: leave them as they are)
    threads: int = 0
    #: code every file again, also over complete outputs
    force: bool = False
    #: keyword arguments of api.encode_file / api.decode_file (quality, preset, calibration, ...)
    options: dict = field(default_factory=dict)
    #: when the batch started (time.time()): an output made since then was made by this batch
    started: float = 0.0


@dataclass
class FileResult:
    """What became of one file: ``status`` is done, skipped (a complete output was there) or failed."""

    input: str
    output: str
    status: str = "failed"
    input_bytes: int | None = None
    output_bytes: int | None = None
    #: uncompressed / compressed bytes (encode: input / output; decode: output / input)
    ratio: float | None = None
    seconds: float = 0.0
    device: str | None = None
    host: str | None = None
    worker: int | None = None
    error: str | None = None
    error_type: str | None = None
    note: str | None = None
    #: ``error`` as the `cachegen` command words it (its flags, not the API's keywords); None: the same
    cli_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def one_line(exc: BaseException, cli: bool = False) -> str:
    """A user's one line for an error of one file (the CLI's rules, without the CLI); ``cli``: a
    CacheGenError's CLI wording (cli_message: flags instead of keywords)."""
    if isinstance(exc, CacheGenError):
        text = exc.cli_message if cli else str(exc)
    elif isinstance(exc, MemoryError):
        text = "out of memory"
    elif isinstance(exc, OSError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if getattr(exc, "filename", None) else "")
    else:
        text = f"internal error ({type(exc).__name__}: {exc})"
    return " ".join(str(text).split())


def device_name(device: str) -> str:
    """'cpu', or 'cuda:N' with N the GPU's index on its machine (the first CUDA_VISIBLE_DEVICES entry)."""
    from ..pipeline.codec import resolve_device

    if resolve_device(device) != "cuda":
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return f"cuda:{visible or 0}"


def check_cgen(path: Path):
    """The header of a complete, intact .cgen file: header, index, every chunk's place and CRC-32
    (the decoder's checks, without decoding).  Raises the FormatError a decode would."""
    from ..pipeline import codec

    reader, closer = codec.open_input(path, mapped=False)
    try:
        h, _, offsets, size = codec.read_header_and_index(reader)
        for _ in codec.iter_chunks(reader, h, offsets, size):
            pass
        return h
    finally:
        del reader
        closer.close()


def _descriptor_key(descriptor: dict) -> str:
    return json.dumps(descriptor, sort_keys=True, default=list)


def output_problem(settings: BatchSettings, src: Path, dst: Path) -> str | None:
    """None when ``dst`` is a complete, valid output of ``src`` (see the module's docstring);
    else why not.  Raises FileNotFoundError when there is no output at all."""
    st = os.stat(dst)
    if not os.path.isfile(dst):
        return "the output is not a regular file"
    if st.st_mtime < os.stat(src).st_mtime:
        return "the input is newer than the output"
    try:
        if settings.op == "encode":
            from ..storage import kvio

            h = check_cgen(dst)
            with kvio.SafetensorsSource(src, settings.options.get("layout", "auto")) as source:
                c = source.cache
                same = ((h.num_layers, h.num_tokens, h.num_channels, h.dtype)
                        == (c.num_layers, c.num_tokens, c.num_channels, c.dtype_name)
                        and _descriptor_key(h.descriptor) == _descriptor_key(c.descriptor()))
            return None if same else "the output holds another cache than the input"
        from ..format.container import read_header_and_index
        from ..storage.kvio import ITEMSIZES, safetensors_header

        with open(src, "rb") as f:
            h, _, _, _ = read_header_and_index(f)
        header, _ = safetensors_header(h.descriptor, h.dtype)
        size = len(header) + h.num_layers * 2 * h.num_tokens * h.num_channels * ITEMSIZES[h.dtype]
        if st.st_size != size:
            return f"the output has {st.st_size:,} bytes, not {size:,}"
        with open(dst, "rb") as f:
            if f.read(len(header)) != header:
                return "the output's safetensors header is not the input's"
        return None
    except CacheGenError as exc:
        return f"the output is not valid ({one_line(exc)})"


def _remove_stale_temporaries(dst: Path) -> None:
    """Remove what a killed earlier attempt at ``dst`` left (storage.outputs names its
    temporary files ``.NAME.<random>.tmp``, beside the output)."""
    pattern = os.path.join(glob.escape(str(dst.parent)), f".{glob.escape(dst.name)}.*.tmp")
    for leftover in glob.glob(pattern):
        try:
            os.unlink(leftover)
        except OSError:
            pass


def _exit_once_progress():
    marker = os.environ.get(EXIT_ONCE_ENV)
    if not marker:
        return None

    def progress(done: int, total: int) -> None:
        try:
            os.unlink(marker)
        except OSError:  # gone: another worker took it, or it was never armed
            return
        os._exit(75)

    return progress


def _sizes(row: FileResult, src: Path, dst: Path, op: str) -> None:
    row.input_bytes, row.output_bytes = src.stat().st_size, dst.stat().st_size
    big, small = (row.input_bytes, row.output_bytes) if op == "encode" else (row.output_bytes, row.input_bytes)
    row.ratio = round(big / small, 4) if small else None


def process_file(src: str, dst: str, settings: BatchSettings) -> dict:
    """Code one file (or skip it, its output complete); the result as FileResult.to_dict().
    Every error of the file becomes a failed row; Ctrl-C and terminating signals propagate."""
    t = time.perf_counter()
    row = FileResult(input=src, output=dst, host=socket.gethostname(), worker=os.getpid())
    src_path, dst_path = Path(src), Path(dst)
    try:
        if not settings.force and os.path.lexists(dst_path):
            try:
                problem = output_problem(settings, src_path, dst_path)
            except FileNotFoundError:  # the input vanished, or a dangling symlink
                problem = "missing"
            if problem is None:
                made_now = settings.started and dst_path.stat().st_mtime >= settings.started
                row.status = "done" if made_now else "skipped"
                row.note = "written by an earlier attempt of this batch" if made_now else "complete output kept"
                _sizes(row, src_path, dst_path, settings.op)
                return _timed(row, t)
            row.note = f"coded again: {problem}"
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(dst_path)
        row.device = device_name(settings.device)
        from .. import api

        # force: an existing output is known to be incomplete, invalid, stale or unwanted (the
        # check above); the library still refuses to write over the input itself.
        common = dict(force=True, device=settings.device, threads=settings.threads or None,
                      progress=_exit_once_progress())
        if settings.op == "encode":
            api.encode_file(src_path, dst_path, **common, **settings.options)
        else:
            api.decode_file(src_path, dst_path, **common, **settings.options)
        row.status = "done"
        _sizes(row, src_path, dst_path, settings.op)
    except Exception as exc:  # noqa: BLE001 - one file's failure is its row; the batch goes on
        row.status, row.error, row.error_type = "failed", one_line(exc), type(exc).__name__
        cli = one_line(exc, cli=True)
        row.cli_error = cli if cli != row.error else None
    return _timed(row, t)


def _timed(row: FileResult, started: float) -> dict:
    row.seconds = round(time.perf_counter() - started, 4)
    return row.to_dict()


def process_files(pairs: list[tuple[str, str]], settings: BatchSettings) -> list[dict]:
    """process_file over several files in turn (one Ray task's share of a batch)."""
    return [process_file(src, dst, settings) for src, dst in pairs]
