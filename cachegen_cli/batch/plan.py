"""Which files a batch codes, and where each output goes.

A file named on the command line is coded as given, whatever its name.  A directory
contributes its files of the operation's input kind (encode: ``*.safetensors`` but not
``*.decoded.safetensors``, which are decode's outputs; decode: ``*.cgen``), only its top
level unless ``recursive``; hidden files (a temporary output is ``.NAME.*.tmp``) and
symlinked directories are passed over (no loops).  With ``output_dir`` a directory's files
keep their path below it (``caches/a/b.safetensors`` -> ``OUT/a/b.cgen``) and a named file
goes to ``OUT/`` by its name; without, each output sits beside its input, under the
single-file default name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

OPERATIONS = ("encode", "decode")


@dataclass(frozen=True)
class BatchItem:
    """One file of a batch: the input, its output, and how the batch found it."""

    src: Path
    dst: Path
    #: an error found while planning (a named input that does not exist): reported, not coded
    problem: str | None = None


def output_name(op: str, name: str) -> str:
    """The output's file name for an input's: the single-file defaults of api.py."""
    stem = Path(name).stem
    return stem + ".cgen" if op == "encode" else stem + ".decoded.safetensors"


def wanted(op: str, name: str) -> bool:
    """True for a file a directory scan picks for ``op``."""
    if name.startswith("."):
        return False
    if op == "encode":
        return name.endswith(".safetensors") and not name.endswith(".decoded.safetensors")
    return name.endswith(".cgen")


def _scan(folder: Path, op: str, recursive: bool, skip: Path | None) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        here = Path(root)
        # sorted, so that a batch's order (and its --json rows) does not depend on the file system
        dirs[:] = sorted(d for d in dirs if recursive and not d.startswith(".")
                         and (skip is None or (here / d).resolve() != skip))
        found += [here / f for f in sorted(files) if wanted(op, f) and (here / f).is_file()]
    return found


def plan_batch(inputs: list[str | os.PathLike], op: str, output_dir: str | os.PathLike | None = None,
               recursive: bool = False) -> list[BatchItem]:
    """The batch's files in order (inputs in the order given, a directory's files sorted).

    Raises ConfigError when two inputs would write the same output; a named input that is
    missing becomes an item with a ``problem`` (the batch reports it and goes on)."""
    if op not in OPERATIONS:
        raise ConfigError(f"unknown batch operation {op!r}; choose encode or decode")
    out_root = Path(output_dir) if output_dir is not None else None
    skip = out_root.resolve() if out_root is not None and out_root.exists() else None
    items: list[BatchItem] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw)
        if str(raw) == "-":
            raise ConfigError("a batch reads files, not stdin ('-')")
        if path.is_dir():
            found = _scan(path, op, recursive, skip)
            for src in found:
                rel = src.relative_to(path)
                dst = (out_root / rel.parent if out_root is not None else src.parent) / output_name(op, src.name)
                items.append(BatchItem(src, dst))
            if not found:  # as zstd does, a directory that gives nothing to do is an error, not a silent success
                kind = ".safetensors" if op == "encode" else ".cgen"
                items.append(BatchItem(path, path, f"{path} is a directory with no {kind} files"
                                       + ("" if recursive else " (-r also reads its subfolders)")))
        else:
            dst = (out_root if out_root is not None else path.parent) / output_name(op, path.name)
            problem = None if path.is_file() else (f"no such file: {path}" if not path.exists()
                                                   else f"{path} is not a regular file")
            items.append(BatchItem(path, dst, problem))
    unique, writers = [], {}
    for item in items:
        key = item.src.resolve() if item.problem is None else item.src
        if key in seen:  # the same file named twice (or inside two named directories)
            continue
        seen.add(key)
        target = item.dst.resolve() if item.dst.parent.exists() else item.dst.absolute()
        if target in writers:
            raise ConfigError(f"{writers[target]} and {item.src} would both write {item.dst}")
        writers[target] = item.src
        unique.append(item)
    return unique
