"""One exception type per way things go wrong.

Every error the library raises on purpose is a CacheGenError whose message is a
single line fit to show a user; the CLI prints it and exits non-zero.
"""

from __future__ import annotations


class CacheGenError(Exception):
    """Base of every error cachegen raises on purpose.

    ``str(error)`` speaks of the library's arguments; ``cli_message``, which the ``cachegen``
    command prints, may name its flags instead (``cli=`` when raised; else the same text)."""

    exit_code = 1

    def __init__(self, *args, cli: str | None = None) -> None:
        super().__init__(*args)
        self._cli = cli

    @property
    def cli_message(self) -> str:
        return self._cli if self._cli is not None else str(self)


# --- input KV files and tensors -------------------------------------------------


class InputError(CacheGenError):
    """The KV input cannot be used."""


class InputNotFoundError(InputError):
    """The input path does not exist or is not a file."""


class NotSafetensorsError(InputError):
    """The input file is not a readable safetensors file."""


class LayoutError(InputError):
    """The tensors are in neither supported layout."""


class DTypeError(InputError):
    """A tensor has a dtype other than float16, bfloat16 or float32."""


class ShapeError(InputError):
    """A tensor has the wrong rank or inconsistent dimensions."""


class NonFiniteError(InputError):
    """A tensor holds NaN or infinite values."""


# --- configuration --------------------------------------------------------------


class ConfigError(CacheGenError):
    """A quantization table, preset, chunk size or config file is invalid."""

    exit_code = 2


# --- .cgen files ----------------------------------------------------------------


class FormatError(CacheGenError):
    """A .cgen file cannot be read."""


class BadMagicError(FormatError):
    """The data does not start with the .cgen magic: not a .cgen file."""


class UnsupportedVersionError(FormatError):
    """A format version, method or field value this reader does not know."""


class TruncatedError(FormatError):
    """The file ends before a structure it announces."""


class ChecksumError(FormatError):
    """A CRC-32 does not match: the file is corrupted."""


class SizeError(FormatError):
    """A size or count is out of range or inconsistent with the rest of the file."""


# --- outputs --------------------------------------------------------------------


class OutputError(CacheGenError):
    """The output cannot be written where asked."""


class OutputExistsError(OutputError):
    """The output exists and --force was not given."""


class SameFileError(OutputError):
    """The output path is the input file."""


# --- signals --------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """A terminating signal (SIGTERM, SIGHUP, ...) arrived while an output was being written;
    raised so that the temporary file is removed.  ``signo``: the signal; the CLI exits 128+signo."""

    def __init__(self, signo: int) -> None:
        import signal

        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"signal {signo}"
        super().__init__(name)
        self.signo = signo
        self.name = name


class OutputTooLargeError(SizeError):
    """The decoded cache the header announces is larger than the caller's max_output_size."""
