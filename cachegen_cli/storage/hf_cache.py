"""transformers Cache objects (DynamicCache, windowed layers included) to and from named tensors.

``encode`` takes a Cache directly (``tensors_of``), and ``decode(..., as_cache=True)`` returns
one ready for ``model.generate(past_key_values=...)`` (``to_cache``).  transformers is
imported only here, and only when a Cache is asked for (it is the optional ``eval`` extra).

A layer of a DynamicCache holds ``keys`` and ``values`` [batch, heads, tokens, head_dim]; a
DynamicSlidingWindowLayer keeps only the last ``sliding_window - 1`` tokens and counts every
token it has seen in ``cumulative_length``.  Those two numbers are what a windowed layer needs
besides its tensors, so they go into the manifest (its ``sliding_window``, and the position of
its first kept token); a cache without windowed layers is a regular per-layer cache.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import InputError, LayoutError


def tensors_of(cache) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(tensors named layers.{i}.key / layers.{i}.value [batch, heads, tokens, head_dim],
    hints for kvparts.analyse or None when no layer is windowed)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise InputError(f"unsupported Cache object {type(cache).__name__}: it has no layers (transformers >= 4.56)")
    tensors: dict[str, torch.Tensor] = {}
    hints: dict[str, dict] = {}
    windowed = False
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        states = [x for name in ("conv_states", "recurrent_states")
                  for x in (getattr(layer, name, None) or {}).values() if x is not None]
        if states:  # they would be lost: refuse rather than drop them
            raise LayoutError(f"layer {i} of the {type(cache).__name__} holds linear-attention (conv / recurrent) "
                              "states: cachegen encodes attention K / V only")
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue  # an empty layer (a KV-sharing consumer, a linear-attention layer not yet run)
        if k.numel() == 0 and k.dim() == 1:
            continue
        tensors[f"layers.{i}.key"], tensors[f"layers.{i}.value"] = k, v
        seen = getattr(layer, "cumulative_length", None)
        seen = int(seen) if seen is not None else int(k.shape[-2])
        hint = {"first_position": max(seen - int(k.shape[-2]), 0)}
        if getattr(layer, "is_sliding", False):
            windowed = True
            hint["sliding_window"] = int(layer.sliding_window)
        hints[f"layers.{i}.key"] = hints[f"layers.{i}.value"] = hint
    if not tensors:
        raise LayoutError(f"the {type(cache).__name__} holds no keys and values (was it filled by a forward pass?)")
    return tensors, (hints if windowed else None)


def layer_tensors(tensors: Mapping[str, torch.Tensor], entries: list[dict]) -> dict[int, tuple]:
    """{layer: (key [B, H, T, D], value [B, H, T, D], sliding_window or None, first_position)} from
    decoded tensors and their manifest entries (format v3) or per-layer / stacked entries (v1 / v2)."""
    out: dict[int, list] = {}
    for e in entries:
        if e.get("role", "kv") != "kv":
            continue
        t = tensors[e["name"]]
        if e["form"] == "L2THD":
            for l in range(t.shape[0]):
                out[l] = [t[l, 0].permute(1, 0, 2).unsqueeze(0), t[l, 1].permute(1, 0, 2).unsqueeze(0), None, 0]
            continue
        if e["kind"] == "latent":
            raise LayoutError(f"tensor {e['name'][:60]!r} is a latent: a transformers Cache holds keys and values "
                              "(decode it to tensors instead)")
        if e.get("seq", 0):
            raise LayoutError(f"tensor {e['name'][:60]!r} is sequence {e['seq']} of a ragged batch: a transformers "
                              "Cache holds one padded batch (decode it to tensors instead)")
        x = t.unsqueeze(0) if e["form"] == "HTD" else t
        slot = out.setdefault(e["layer"], [None, None, None, 0])
        slot[0 if e["kind"] == "key" else 1] = x
        if e.get("sliding_window"):
            slot[2] = int(e["sliding_window"])
        if "first_position" in e:
            slot[3] = int(e["first_position"])
    return {l: tuple(v) for l, v in out.items()}


def to_cache(tensors: Mapping[str, torch.Tensor], entries: list[dict], config=None, dtype: torch.dtype | None = None):
    """A transformers DynamicCache holding the decoded keys and values, windowed layers as
    DynamicSlidingWindowLayer (from the file, or from ``config``'s layer types when given),
    each counting the tokens it has seen; ``dtype``: convert the tensors (e.g. to the model's)."""
    try:
        from transformers import DynamicCache
    except ImportError:
        from ..errors import ConfigError

        raise ConfigError("as_cache needs transformers: pip install 'cachegen[eval]'") from None
    layers = layer_tensors(tensors, entries)
    if not layers:
        raise LayoutError("the file holds no keys and values")
    data = []
    for i in range(max(layers) + 1):
        if i not in layers:
            data.append((None, None))
            continue
        k, v, window, _ = layers[i]
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        data.append((k, v, torch.tensor(window)) if window and config is None else (k, v))
    cache = DynamicCache(ddp_cache_data=data, config=config)
    for i, layer in enumerate(cache.layers):
        if i in layers and hasattr(layer, "cumulative_length") and getattr(layer, "keys", None) is not None:
            layer.cumulative_length = layers[i][3] + int(layers[i][0].shape[-2])
    return cache
