"""Model-level quality of a KV cache: does the model still say the same with the decoded cache?

``cachegen eval`` (and ``scripts/quality_report.py``) use this module.  The
recipe:

1. **Rebuild the original cache.**  The token ids of the context are in the
   file's metadata (``cachegen capture`` writes them, ``cachegen encode``
   carries them into the .cgen file).  One prefill pass of the model over
   them gives the cache the model would use; it is rounded to the file's
   dtype (bf16 for ``cachegen capture``), exactly as the capture stored it,
   so the reference is the *uncompressed* cache and an uncompressed file
   scores KL = 0 and top-1 = 1 exactly.
2. **Score a continuation with each cache.**  The ``C`` text tokens after the
   context, ``c_0 .. c_{C-1}``, are fed after the cache at positions
   ``T .. T+C-1`` (the positions continue after the context, so RoPE sees
   what it saw in one long pass); the logits at each position predict the
   next text token ``c_1 .. c_C``.  So ``C + 1`` tokens of text after the
   context are needed and ``C`` predictions are scored.  From the two sets of
   logits: perplexity of each, their ratio, the mean KL divergence
   KL(original || decoded) of the next-token distributions (nats, in
   float64), and top-1 agreement (same argmax).
3. **Greedy generation.**  From each cache, ``c_0`` is fed and ``N`` tokens
   are generated greedily; the two sequences are compared position by
   position (the share of equal positions, the share up to the first
   divergence, and its index).

The cache is handed to the model as a ``transformers.DynamicCache`` built
layer by layer with ``update`` (transformers 4.36 to 5.x), in the model's
dtype (float32 on the CPU): the decoded bf16 values are upcast exactly, as
the rebuilt reference is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..storage import kvio
from .capture import (
    Log,
    ModelError,
    TextError,
    _resolve_loaded,
    forward_params,
    model_id,
    prefill,
    read_text,
    resolve_model_path,
    text_sha256,
    tokenize,
)
from ..errors import FormatError, InputError, InputNotFoundError

_ITEMSIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}

DEFAULT_CONTINUATION = 128
DEFAULT_GENERATE = 32


class NoTokenIdsError(InputError):
    """The KV file does not say which tokens it is the cache of."""


# --- layouts ----------------------------------------------------------------------


def internal_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[(key, value)] per layer, each [1, H, T, D] -> [L, 2, T, H*D] (the codec's internal form)."""
    out = []
    for k, v in layers:
        _, H, T, D = k.shape
        out.append(torch.stack([k[0].transpose(0, 1).reshape(T, H * D), v[0].transpose(0, 1).reshape(T, H * D)]))
    return torch.stack(out)


def layers_from_internal(data: torch.Tensor, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[L, 2, T, H*D] -> [(key, value)] per layer, each [1, H, T, D] of ``dtype``, contiguous."""
    L, _, T, _ = data.shape
    x = data.to(dtype).reshape(L, 2, T, num_kv_heads, head_dim).permute(0, 1, 3, 2, 4)
    return [(x[l, 0].unsqueeze(0).contiguous(), x[l, 1].unsqueeze(0).contiguous()) for l in range(L)]


def make_cache(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A fresh transformers DynamicCache holding ``layers`` (it is extended, not the tensors, as the model runs)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56: no config argument
        cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _cache_kw(model: Any) -> str:
    # transformers 5.x calls it `cache` (past_key_values is a deprecated alias); 4.x `past_key_values`.
    return "cache" if "cache" in forward_params(model) else "past_key_values"


def _forward(model: Any, cache: Any, ids: list[int], start: int) -> torch.Tensor:
    """Logits [len(ids), vocab] of ``ids`` fed after ``cache`` at positions start, start+1, ..."""
    n = len(ids)
    kwargs = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.arange(start, start + n, dtype=torch.long).unsqueeze(0),
        _cache_kw(model): cache,
        "use_cache": True,
    }
    if "cache_position" in forward_params(model):  # transformers 4.x derives the mask from it
        kwargs["cache_position"] = torch.arange(start, start + n, dtype=torch.long)
    with torch.no_grad():
        out = model(**kwargs)
    return out.logits[0].float()


def teacher_forced_logits(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int], start: int) -> torch.Tensor:
    return _forward(model, make_cache(model, layers), ids, start)


def greedy(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], first: int, start: int, n: int) -> list[int]:
    """Feed ``first`` at position ``start`` after the cache, then ``n`` greedy tokens; returns those n."""
    cache = make_cache(model, layers)
    out: list[int] = []
    token = first
    for i in range(n):
        logits = _forward(model, cache, [token], start + i)
        token = int(logits[-1].argmax())
        out.append(token)
    return out


# --- the reference ------------------------------------------------------------------


@dataclass
class Reference:
    """The original cache of a context and what the model does with it."""

    model: Any
    context_ids: list[int]
    continuation_ids: list[int]  # C + 1 tokens: c_0 .. c_C
    generate: int
    num_kv_heads: int
    head_dim: int
    storage_dtype: torch.dtype
    cache: torch.Tensor  # [L, 2, T, H*D] in storage_dtype: the rebuilt original, rounded like the capture
    live_cache: torch.Tensor  # [L, 2, T, H*D] in the model's dtype, before rounding
    logprobs: torch.Tensor  # [C, vocab] float64
    greedy_tokens: list[int]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids)

    @property
    def targets(self) -> torch.Tensor:
        return torch.tensor(self.continuation_ids[1:], dtype=torch.long)

    @property
    def nll(self) -> torch.Tensor:
        t = self.targets
        return -self.logprobs[torch.arange(len(t)), t]


def model_shape(model: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the model's config."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    if callable(get):
        cfg = get()
    layers = int(cfg.num_hidden_layers)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return layers, heads, int(head_dim)


def build_reference(
    model: Any,
    context_ids: list[int],
    continuation_ids: list[int],
    generate: int = DEFAULT_GENERATE,
    storage_dtype: torch.dtype = torch.bfloat16,
) -> Reference:
    """Prefill ``context_ids``, round the cache to ``storage_dtype``, score ``continuation_ids`` with it."""
    if len(continuation_ids) < 2:
        raise ValueError("the continuation needs at least 2 tokens (one input, one target)")
    _, heads, head_dim = model_shape(model)
    seconds = {}
    t0 = time.perf_counter()
    live_layers = prefill(model, context_ids)
    seconds["prefill"] = time.perf_counter() - t0
    live = internal_from_layers(live_layers)
    del live_layers
    cache = live.to(storage_dtype)
    ref = Reference(model, list(context_ids), list(continuation_ids), generate, heads, head_dim, storage_dtype,
                    cache, live, torch.empty(0), [], seconds)
    t0 = time.perf_counter()
    layers = ref_layers(ref, cache)
    logits = teacher_forced_logits(model, layers, ref.continuation_ids[:-1], ref.num_tokens)
    ref.logprobs = torch.log_softmax(logits.double(), dim=-1)
    seconds["score"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref.greedy_tokens = greedy(model, layers, ref.continuation_ids[0], ref.num_tokens, generate)
    seconds["generate"] = time.perf_counter() - t0
    return ref


def text_continuation(tokenizer, text: str, text_path, ids: list[int], continuation: int) -> list[int]:
    """The ``continuation + 1`` token ids of ``text`` after the cache's context ``ids`` (the
    last one is only predicted), after checking that the model's tokenizer splits the text
    into those ids."""
    all_ids = tokenize(tokenizer, text)
    T = len(ids)
    if all_ids[:T] != ids:
        raise ModelError(f"the model's tokenizer does not split {Path(text_path).name} into the file's token ids: "
                         "is this the model the cache was captured with?")
    after = len(all_ids) - T
    if after < continuation + 1:
        def message(flag: str, space: str) -> str:  # the keyword (continuation=N) or the CLI's flag
            hint = f"use {flag}{space}{after - 1} or less" if after >= 2 else "the text has no tokens left to score"
            return (f"{Path(text_path).name} has {after} tokens after the {T}-token context; {flag}{space}"
                    f"{continuation} needs {continuation + 1} (the last one is only predicted); {hint}")

        raise TextError(message("continuation=", ""), cli=message("--continuation", " "))
    return all_ids[T : T + continuation + 1]


def ref_layers(ref: Reference, data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dtype = next(ref.model.parameters()).dtype
    return layers_from_internal(data, ref.num_kv_heads, ref.head_dim, dtype)


def score(ref: Reference, data: torch.Tensor) -> dict[str, Any]:
    """Scores of a candidate cache ``data`` [L, 2, T, H*D] (any float dtype) against the reference."""
    if tuple(data.shape) != tuple(ref.cache.shape):
        raise InputError(f"the cache has shape {list(data.shape)}, the reference {list(ref.cache.shape)} "
                         "(layers, K/V, tokens, channels)")
    t0 = time.perf_counter()
    layers = ref_layers(ref, data.cpu())
    logits = teacher_forced_logits(ref.model, layers, ref.continuation_ids[:-1], ref.num_tokens)
    lp = torch.log_softmax(logits.double(), dim=-1)
    t1 = time.perf_counter()
    gen = greedy(ref.model, layers, ref.continuation_ids[0], ref.num_tokens, ref.generate)
    t2 = time.perf_counter()
    return _metrics(ref, lp, gen, ref.cache.double(), data.cpu().double(), t1 - t0, t2 - t1)


def _metrics(ref, lp: torch.Tensor, gen: list[int], x: torch.Tensor, y: torch.Tensor, score_s: float,
             generate_s: float) -> dict[str, Any]:
    """The quality fields of a candidate: its log-probabilities ``lp`` and greedy tokens ``gen``
    against the reference's, and its values ``y`` against the reference's ``x`` (float64)."""
    t = ref.targets
    idx = torch.arange(len(t))
    nll_o, nll_d = ref.nll, -lp[idx, t]
    p_o = ref.logprobs.exp()
    kl = (p_o * (ref.logprobs - lp)).sum(dim=-1).clamp_min(0.0)
    top1 = (ref.logprobs.argmax(dim=-1) == lp.argmax(dim=-1)).double()
    n = ref.generate
    same = [a == b for a, b in zip(ref.greedy_tokens, gen)]
    first_div = next((i for i, s in enumerate(same) if not s), None)
    ref2 = float(x.pow(2).sum())
    err2 = float((y - x).pow(2).sum())
    ppl_o, ppl_d = math.exp(float(nll_o.mean())), math.exp(float(nll_d.mean()))
    return {
        "context_tokens": ref.num_tokens,
        "continuation_tokens": len(t),
        "generate_tokens": n,
        "ppl_original": ppl_o,
        "ppl_decoded": ppl_d,
        "ppl_ratio": ppl_d / ppl_o,
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float(top1.mean()),
        "greedy_agreement": (sum(same) / n) if n else 1.0,
        "greedy_prefix_agreement": ((n if first_div is None else first_div) / n) if n else 1.0,
        "greedy_first_divergence": first_div,
        "greedy_original": list(ref.greedy_tokens),
        "greedy_decoded": gen,
        "cache_rel_mse": err2 / ref2 if ref2 > 0 else err2,
        "cache_max_abs_error": float((y - x).abs().max()) if x.numel() else 0.0,
        "seconds": {"score": score_s, "generate": generate_s},
    }


# --- simple baselines -----------------------------------------------------------------


def _bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest bf16 value >= x, for x >= 0 finite (float32 in and out)."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    up = ((bits + 0xFFFF) & ~0xFFFF).to(torch.int32)
    return up.view(torch.float32)


def absmax_roundtrip(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-(layer, K/V, token) abs-max quantization to signed ``bits``-bit integers and back.

    The scale of each token vector (all H*D channels of one layer and K or V)
    is its abs-max / (2^(bits-1) - 1), stored as bf16 rounded up (so no value
    clips); the values round to the nearest integer.  No entropy coding.
    Returns the reconstruction in ``data``'s dtype.
    """
    qmax = (1 << (bits - 1)) - 1
    x = data.float()
    scale = _bf16_round_up(x.abs().amax(dim=-1, keepdim=True) / qmax)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(x / safe), -qmax, qmax)
    return (q * scale).to(data.dtype)


def absmax_bits_per_value(bits: int, channels: int, scale_bits: int = 16) -> float:
    """Size of :func:`absmax_roundtrip`'s output: ``bits`` per value plus one bf16 scale per token vector."""
    return bits + scale_bits / channels


# --- files -------------------------------------------------------------------------


@dataclass
class KVFile:
    path: Path
    kind: str  # "cgen" or "safetensors"
    data: torch.Tensor  # [L, 2, T, H*D], the file's dtype
    num_kv_heads: int
    head_dim: int
    layout: str
    metadata: dict[str, str]
    file_bytes: int

    @property
    def values(self) -> int:
        return int(self.data.numel())

    @property
    def original_bytes(self) -> int:
        return self.values * _ITEMSIZE[self.data.dtype]


def read_kv_file(path: str | Path, calibration=None) -> KVFile:
    """A .cgen file (decoded on the CPU; a rotated one with its ``calibration``, a path or a
    Calibration) or a KV .safetensors file, in the internal form."""
    path = Path(path)
    from ..storage.outputs import check_input

    check_input(path)
    with open(path, "rb") as f:
        magic = f.read(8)
    size = path.stat().st_size
    from ..pipeline import codec
    from ..format import container

    if magic == container.MAGIC or path.suffix == ".cgen":
        from ..api import decode

        blob = path.read_bytes()
        header = codec.read_header_and_index(container.BufferReader(blob))[0]
        descriptor = header.descriptor
        tensors = decode(blob, device="cpu", calibration=calibration)
        cache = kvio.from_tensors(tensors, descriptor["layout"], descriptor.get("metadata", {}))
        kind = "cgen"
    else:
        cache = kvio.read_safetensors(path)
        kind = "safetensors"
    return KVFile(path, kind, cache.data, cache.num_kv_heads, cache.head_dim, cache.layout, dict(cache.metadata), size)


def context_of(kv: KVFile) -> list[int]:
    """The context token ids from the file's metadata; NoTokenIdsError when absent or inconsistent."""
    import json

    raw = kv.metadata.get("token_ids")
    if raw is None:
        raise NoTokenIdsError(
            f"{kv.path} carries no token ids in its metadata; eval needs a cache made by "
            "`cachegen capture` (and encoded with `cachegen encode`, which keeps the metadata)"
        )
    try:
        ids = [int(i) for i in json.loads(raw)]
    except (ValueError, TypeError):
        raise NoTokenIdsError(f"{kv.path}: the token_ids metadata is not a JSON list of integers") from None
    if len(ids) != kv.data.shape[2]:
        raise NoTokenIdsError(f"{kv.path}: the metadata lists {len(ids)} token ids but the cache holds "
                              f"{kv.data.shape[2]} tokens")
    return ids


def evaluate_file(
    kv_path: str | Path,
    text_path: str | Path,
    *,
    model_path: str | Path | None = None,
    continuation: int = DEFAULT_CONTINUATION,
    generate: int = DEFAULT_GENERATE,
    loaded: tuple[Any, Any] | None = None,
    log: Log | None = None,
    calibration=None,
) -> dict[str, Any]:
    """``cachegen eval``: score a .cgen (or KV .safetensors) file against the cache it was made from.
    ``calibration``: the calibration file (path) or Calibration a rotated file was encoded with.

    ``loaded`` is an already loaded ``(model, tokenizer)`` for ``model_path``, or a
    function returning one (called once the inputs are checked).
    Returns a JSON-able dict (see :func:`score` for the quality fields).
    """
    log = log or (lambda message: None)
    if continuation < 1:
        from ..errors import ConfigError

        raise ConfigError(f"continuation= must be at least 1, got {continuation}",
                          cli=f"--continuation must be at least 1, got {continuation}")
    if generate < 0:
        from ..errors import ConfigError

        raise ConfigError(f"generate= must be 0 or more, got {generate}", cli=f"--generate must be 0 or more, got {generate}")
    t_start = time.perf_counter()
    text = read_text(text_path)
    try:
        kv = read_kv_file(kv_path, calibration)
        layered = kv.data.shape[2] != len(_token_ids(kv.path, kv.metadata))
    except (InputError, FormatError) as exc:
        if isinstance(exc, (NoTokenIdsError, InputNotFoundError)) or (isinstance(exc, FormatError)
                                                                       and not _is_parts(kv_path)):
            raise
        layered = True
    if layered:  # windowed layers, MLA, extras ...: the model's own cache class, layer by layer
        return _evaluate_layered(read_kv_layers(kv_path, calibration), text, text_path, model_path, continuation, generate,
                                 loaded, log, t_start)
    ids = context_of(kv)
    want = kv.metadata.get("text_sha256")
    got = text_sha256(text)
    if want is not None and want != got:
        raise TextError(
            f"{text_path} is not the text {kv.path.name} was captured from (its sha256 is {got[:12]}..., "
            f"the file's metadata says {want[:12]}...)"
        )
    resolved = resolve_model_path(model_path)
    if loaded is None:
        log(f"loading the model {resolved.name}")
    model, tokenizer = _resolve_loaded(loaded, resolved, log)
    warnings = []
    L, H, D = model_shape(model)
    if (kv.data.shape[0], kv.num_kv_heads, kv.head_dim) != (L, H, D):
        raise ModelError(
            f"the cache has {kv.data.shape[0]} layers x {kv.num_kv_heads} KV heads x {kv.head_dim} dims, "
            f"the model {model_id(model)} {L} x {H} x {D}: it is not this model's cache"
        )
    mid = model_id(model)
    sha = (getattr(model, "cachegen_source", None) or {}).get("model_sha256")
    if kv.metadata.get("model") and kv.metadata["model"] != mid:
        warnings.append(f"the cache was captured with {kv.metadata['model']}, this is {mid}")
    elif kv.metadata.get("model_sha256") and sha and kv.metadata["model_sha256"] != sha:
        warnings.append("the cache was captured with a different model file of the same name")
    cont = text_continuation(tokenizer, text, text_path, ids, continuation)
    log(f"rebuilding the original cache ({len(ids)} tokens) and scoring {continuation} tokens")
    ref = build_reference(model, ids, cont, generate, kv.data.dtype)
    log("scoring the decoded cache")
    result = score(ref, kv.data)
    if kv.kind == "cgen":
        size = {"file_bytes": kv.file_bytes, "bits_per_value": 8 * kv.file_bytes / kv.values,
                "ratio": kv.original_bytes / kv.file_bytes}
    else:
        size = {"file_bytes": kv.file_bytes, "bits_per_value": 8.0 * _ITEMSIZE[kv.data.dtype], "ratio": 1.0}
    out = {
        "file": str(kv.path),
        "kind": kv.kind,
        "text": str(text_path),
        "model": mid,
        "captured_with_model": kv.metadata.get("model"),
        "dtype": str(kv.data.dtype).replace("torch.", ""),
        "num_layers": int(kv.data.shape[0]),
        "original_bytes": kv.original_bytes,
        **size,
        **result,
        "greedy_original_text": tokenizer.decode(result["greedy_original"]),
        "greedy_decoded_text": tokenizer.decode(result["greedy_decoded"]),
        "warnings": warnings,
    }
    out["seconds"] = {
        "reference_prefill": ref.seconds["prefill"],
        "reference_score": ref.seconds["score"],
        "reference_generate": ref.seconds["generate"],
        "decoded_score": result["seconds"]["score"],
        "decoded_generate": result["seconds"]["generate"],
        "total": time.perf_counter() - t_start,
    }
    return out


def tensors_to_internal(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Named tensors in either layout (what ``cachegen_cli.decode`` returns) -> [L, 2, T, H*D]."""
    return kvio.from_tensors(dict(tensors)).data


# --- caches of any shape (windowed layers, MLA, extra tensors) -----------------------


def _is_parts(path) -> bool:
    from ..format import parts as parts_format

    try:
        with open(path, "rb") as f:
            return parts_format.is_parts_file(f.read(10))
    except OSError:
        return False


def _token_ids(path: Path, metadata: Mapping[str, str]) -> list[int]:
    import json

    raw = metadata.get("token_ids")
    if raw is None:
        raise NoTokenIdsError(
            f"{path} carries no token ids in its metadata; eval needs a cache made by "
            "`cachegen capture` (and encoded with `cachegen encode`, which keeps the metadata)"
        )
    try:
        return [int(i) for i in json.loads(raw)]
    except (ValueError, TypeError):
        raise NoTokenIdsError(f"{path}: the token_ids metadata is not a JSON list of integers") from None


@dataclass
class LayeredKV:
    """A KV file of any shape, as the (key, value) [1, heads, tokens, head_dim] of each layer."""

    path: Path
    kind: str  # "cgen" or "safetensors"
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    metadata: dict[str, str]
    file_bytes: int

    @property
    def values(self) -> int:
        return sum(int(k.numel() + v.numel()) for k, v in self.layers.values())

    @property
    def original_bytes(self) -> int:
        return sum(int(k.numel() * k.element_size() + v.numel() * v.element_size()) for k, v in self.layers.values())

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.layers.values()))[0].dtype


def read_kv_layers(path: str | Path, calibration=None) -> LayeredKV:
    """A .cgen file of any format version (decoded on the CPU) or a KV .safetensors of any
    shape, layer by layer (batch 1; latent-only files have no transformers cache)."""
    from ..api import _decode_tensors, _version
    from ..format import container, parts as parts_format
    from ..storage import hf_cache, kvparts
    from ..storage.outputs import check_input

    path = Path(path)
    check_input(path)
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic == container.MAGIC or path.suffix == ".cgen":
        blob = path.read_bytes()
        tensors, entries = _decode_tensors(blob, "cpu", calibration, None)
        if _version(blob) == 3:
            metadata = parts_format.PartsFile(blob).manifest["metadata"]
        else:
            from ..pipeline import codec

            metadata = codec.read_header_and_index(container.BufferReader(blob))[0].descriptor.get("metadata", {})
        kind = "cgen"
    else:
        tensors, metadata = kvio.read_tensors(path)
        entries = kvparts.analyse(tensors, metadata).entries
        kind = "safetensors"
    layers = {}
    for layer, (k, v, _, _) in hf_cache.layer_tensors(tensors, entries).items():
        if k is None or v is None or k.shape[0] != 1:
            raise InputError(f"{path}: layer {layer} is not one sequence's key and value; eval scores batch-1 caches")
        layers[layer] = (k, v)
    return LayeredKV(path, kind, layers, dict(metadata), path.stat().st_size)


def make_layered_cache(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], seen: int) -> Any:
    """The model's own cache class (DynamicCache from its config: windowed layers as
    DynamicSlidingWindowLayer) holding ``layers``, each layer counting ``seen`` tokens."""
    from transformers import DynamicCache

    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k.to(dtype), v.to(dtype), i)
    for layer in cache.layers:
        if isinstance(getattr(layer, "cumulative_length", None), int):
            layer.cumulative_length = seen
    return cache


def _layered_logits(model: Any, layers, ids: list[int], start: int) -> torch.Tensor:
    return _forward(model, make_layered_cache(model, layers, start), ids, start)


def _layered_greedy(model: Any, layers, first: int, start: int, n: int) -> list[int]:
    cache = make_layered_cache(model, layers, start)
    out: list[int] = []
    token = first
    for i in range(n):
        token = int(_forward(model, cache, [token], start + i)[-1].argmax())
        out.append(token)
    return out


@dataclass
class LayeredReference:
    """Reference of a cache of any shape: the model's own cache, rounded like the capture."""

    model: Any
    context_ids: list[int]
    continuation_ids: list[int]
    generate: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # in the storage dtype
    logprobs: torch.Tensor
    greedy_tokens: list[int]
    seconds: dict[str, float] = field(default_factory=dict)

    num_tokens = property(lambda self: len(self.context_ids))
    targets = property(lambda self: torch.tensor(self.continuation_ids[1:], dtype=torch.long))
    nll = property(lambda self: -self.logprobs[torch.arange(len(self.targets)), self.targets])


def build_layered_reference(model: Any, context_ids: list[int], continuation_ids: list[int], generate: int,
                            storage_dtype: torch.dtype) -> LayeredReference:
    seconds = {}
    t0 = time.perf_counter()
    layers = [(k.to(storage_dtype), v.to(storage_dtype)) for k, v in prefill(model, context_ids)]
    seconds["prefill"] = time.perf_counter() - t0
    ref = LayeredReference(model, list(context_ids), list(continuation_ids), generate, layers, torch.empty(0), [], seconds)
    t0 = time.perf_counter()
    logits = _layered_logits(model, layers, ref.continuation_ids[:-1], ref.num_tokens)
    ref.logprobs = torch.log_softmax(logits.double(), dim=-1)
    seconds["score"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref.greedy_tokens = _layered_greedy(model, layers, ref.continuation_ids[0], ref.num_tokens, generate)
    seconds["generate"] = time.perf_counter() - t0
    return ref


def score_layered(ref: LayeredReference, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    logits = _layered_logits(ref.model, layers, ref.continuation_ids[:-1], ref.num_tokens)
    lp = torch.log_softmax(logits.double(), dim=-1)
    t1 = time.perf_counter()
    gen = _layered_greedy(ref.model, layers, ref.continuation_ids[0], ref.num_tokens, ref.generate)
    t2 = time.perf_counter()
    flat = lambda ls: torch.cat([t.reshape(-1).double() for kv in ls for t in kv])  # noqa: E731
    return _metrics(ref, lp, gen, flat(ref.layers), flat(layers), t1 - t0, t2 - t1)


def _evaluate_layered(kv: LayeredKV, text: str, text_path, model_path, continuation: int, generate: int, loaded,
                      log: Log, t_start: float) -> dict[str, Any]:
    ids = _token_ids(kv.path, kv.metadata)
    want = kv.metadata.get("text_sha256")
    got = text_sha256(text)
    if want is not None and want != got:
        raise TextError(f"{text_path} is not the text {kv.path.name} was captured from (its sha256 is {got[:12]}..., "
                        f"the file's metadata says {want[:12]}...)")
    resolved = resolve_model_path(model_path)
    if loaded is None:
        log(f"loading the model {resolved.name}")
    model, tokenizer = _resolve_loaded(loaded, resolved, log)
    mid = model_id(model)
    warnings = []
    if kv.metadata.get("model") and kv.metadata["model"] != mid:
        warnings.append(f"the cache was captured with {kv.metadata['model']}, this is {mid}")
    cont = text_continuation(tokenizer, text, text_path, ids, continuation)
    log(f"rebuilding the original cache ({len(ids)} tokens) and scoring {continuation} tokens")
    ref = build_layered_reference(model, ids, cont, generate, kv.dtype)
    if sorted(kv.layers) != list(range(len(ref.layers))):
        raise ModelError(f"the cache holds layers {sorted(kv.layers)[:8]}..., the model {mid} keeps "
                         f"{len(ref.layers)}: it is not this model's cache")
    for l, (k, v) in enumerate(ref.layers):
        dk, dv = kv.layers[l]
        if dk.shape != k.shape or dv.shape != v.shape:
            raise ModelError(f"layer {l} of the cache holds K {list(dk.shape)} and V {list(dv.shape)}, the model "
                             f"{mid} keeps K {list(k.shape)} and V {list(v.shape)}: it is not this model's cache")
    log("scoring the decoded cache")
    result = score_layered(ref, [kv.layers[l] for l in range(len(ref.layers))])
    if kv.kind == "cgen":
        size = {"file_bytes": kv.file_bytes, "bits_per_value": 8 * kv.file_bytes / kv.values,
                "ratio": kv.original_bytes / kv.file_bytes}
    else:
        size = {"file_bytes": kv.file_bytes, "bits_per_value": 8.0 * _ITEMSIZE[kv.dtype], "ratio": 1.0}
    out = {
        "file": str(kv.path), "kind": kv.kind, "text": str(text_path), "model": mid,
        "captured_with_model": kv.metadata.get("model"), "dtype": str(kv.dtype).replace("torch.", ""),
        "num_layers": len(kv.layers), "layer_tokens": [int(kv.layers[l][0].shape[-2]) for l in sorted(kv.layers)],
        "original_bytes": kv.original_bytes, **size, **result,
        "greedy_original_text": tokenizer.decode(result["greedy_original"]),
        "greedy_decoded_text": tokenizer.decode(result["greedy_decoded"]),
        "warnings": warnings,
    }
    out["seconds"] = {"reference_prefill": ref.seconds["prefill"], "reference_score": ref.seconds["score"],
                      "reference_generate": ref.seconds["generate"], "decoded_score": result["seconds"]["score"],
                      "decoded_generate": result["seconds"]["generate"], "total": time.perf_counter() - t_start}
    return out
