"""The command's conventions from zstd / xz / gzip (issue "Hardening"): fast --help, `-`,
-c/--stdout, several inputs, `cachegen test`, -q / -v / --json, and the output details."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numba", "numpy", "safetensors")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_importing_the_cli_loads_neither_torch_nor_numba():
    r = _python(f"import sys, cachegen_cli.cli; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["encode", "--help"], ["decode", "--help"],
                                  ["test", "--help"], ["encode"], ["no-such-command"]])
def test_help_version_and_argument_errors_load_neither_torch_nor_numba(argv):
    r = _python(
        "import sys\n"
        f"sys.argv = ['cachegen'] + {argv!r}\n"
        "from cachegen_cli.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        f"print('LOADED', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n"
    )
    assert "LOADED []" in r.stderr, r.stderr[-2000:]


def test_the_package_still_exports_the_api_lazily():
    r = _python("import cachegen_cli as cg, sys; assert 'torch' not in sys.modules; "
                "print(cg.encode.__module__, cg.QuantizationConfig.__name__, 'decode' in dir(cg))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cachegen_cli.api", "QuantizationConfig", "True"]
