"""Bad KV inputs: each gets its own error type and a one-line message."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import cachegen_cli as cg
from cachegen_cli.storage import kvio
from cachegen_cli.errors import (
    ConfigError,
    DTypeError,
    InputNotFoundError,
    LayoutError,
    NonFiniteError,
    NotSafetensorsError,
    ShapeError,
)

from conftest import per_layer, realistic_kv


def test_missing_file(tmp_path):
    with pytest.raises(InputNotFoundError):
        kvio.read_safetensors(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 8 + b"{}", b"\x10\x00\x00\x00\x00\x00\x00\x00{bad json}xxxxx"])
def test_not_safetensors(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(NotSafetensorsError):
        kvio.read_safetensors(path)


def test_unknown_layouts():
    with pytest.raises(LayoutError):
        kvio.from_tensors({"a": torch.zeros(2, 2), "b": torch.zeros(2)})
    with pytest.raises(LayoutError):
        kvio.from_tensors({"weights": torch.zeros(3, 4)})
    with pytest.raises(LayoutError):
        kvio.from_tensors({})
    tensors = per_layer(realistic_kv(layers=2))
    del tensors["layers.1.value"]
    with pytest.raises(LayoutError, match="layers.1.value is missing"):
        kvio.from_tensors(tensors)
    with pytest.raises(LayoutError):
        kvio.from_tensors(realistic_kv(), layout="diagonal")


def test_wrong_dtype():
    with pytest.raises(DTypeError, match="int32"):
        kvio.from_tensors(torch.zeros(2, 2, 4, 1, 4, dtype=torch.int32))
    with pytest.raises(DTypeError):
        kvio.from_tensors(torch.zeros(2, 2, 4, 1, 4, dtype=torch.float64))
    tensors = per_layer(realistic_kv(layers=2))
    tensors["layers.1.key"] = tensors["layers.1.key"].float()
    with pytest.raises(DTypeError, match="all must match"):
        kvio.from_tensors(tensors)


def test_wrong_rank_and_shapes():
    with pytest.raises(LayoutError):
        kvio.from_tensors(torch.zeros(2, 3, 4, 1, 4))  # dim 1 must be 2
    with pytest.raises(ShapeError):
        kvio.from_tensors(torch.zeros(2, 3, 4, 1, 4), layout="stacked")
    tensors = per_layer(realistic_kv(layers=2))
    tensors["layers.0.value"] = tensors["layers.0.value"][:, :, :3]
    with pytest.raises(ShapeError):
        kvio.from_tensors(tensors)
    with pytest.raises(ShapeError, match="batch size 2"):
        kvio.from_tensors({"layers.0.key": torch.zeros(2, 1, 3, 4), "layers.0.value": torch.zeros(2, 1, 3, 4)})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite(bad):
    kv = realistic_kv(layers=3)
    kv[2, 1, 5, 0, 0] = bad
    with pytest.raises(NonFiniteError, match="layer 2"):
        cg.encode(kv)


def test_bad_settings():
    kv = realistic_kv(layers=3)
    with pytest.raises(ConfigError):
        cg.encode(kv, chunk_tokens=0)
    with pytest.raises(ConfigError):
        cg.encode(kv, chunk_tokens=100000)
    with pytest.raises(ConfigError, match="unknown preset"):
        cg.encode(kv, preset="gpt-9")
    with pytest.raises(ConfigError):
        cg.encode(kv, bins="2")
    with pytest.raises(ConfigError):
        cg.encode(kv, bins="k:0-2=16;v:0-=16")  # key layer 2 uncovered
    with pytest.raises(ConfigError):
        cg.encode(kv, bins="k:zero=16")
    with pytest.raises(ConfigError):
        cg.encode(kv, preset="lmcache", bins="16")


def test_files_in_both_layouts_read_back(tmp_path):
    kv = realistic_kv(layers=2, tokens=12)
    save_file({"cache": kv}, tmp_path / "a.safetensors", metadata={"m": "1"})
    cache = kvio.read_safetensors(tmp_path / "a.safetensors")
    assert cache.layout == "stacked" and cache.metadata == {"m": "1"} and cache.num_tokens == 12
    save_file(per_layer(kv, batch=False), tmp_path / "b.safetensors")
    cache = kvio.read_safetensors(tmp_path / "b.safetensors")
    assert cache.layout == "per-layer" and torch.equal(cache.data, kv.reshape(2, 2, 12, -1))


@pytest.mark.parametrize("dtype, words, mask", [(np.uint16, 0x7F80, 0x7F80), (np.uint16, 0xFFC1, 0x7C00),
                                                (np.uint32, 0x7F800001, 0x7F800000)])
def test_first_nonfinite_row_finds_the_first_bad_row_at_any_place(dtype, words, mask):
    """kernels/checks.first_nonfinite_row, by steps of STEP_WORDS words: a bad word at a step's
    first and last places, in a row's last partial step, and a word with only some of the
    exponent bits set (finite) is not one."""
    from cachegen_cli.kernels import checks

    n = 2 * checks.STEP_WORDS + 5
    bits = np.zeros((4, n), dtype)
    bits[:, ::3] = mask ^ (mask >> 1)  # most exponent bits, not all: finite
    assert checks.first_nonfinite_row(bits, mask) == -1
    for row, at in ((3, n - 1), (2, checks.STEP_WORDS), (2, checks.STEP_WORDS - 1), (1, 0)):
        bits[row, at] = words
        assert checks.first_nonfinite_row(bits, mask) == row
    assert checks.first_nonfinite_row(np.zeros((0, 5), dtype), mask) == -1
