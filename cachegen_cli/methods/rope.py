"""Where a cache's RoPE parameters come from, for coding its keys without their rotary
embedding (format version 2, flags bit 2; kernels/rope.py has the arithmetic).

A model turns each key pair (a, b) of a head by the angle position x f_j; the file records
the frequencies f_j themselves (float64, one row for every layer or one per layer), the pair
layout (``style``), the head size, the rotary dimension and the position of token 0, so a
reader needs nothing else (Llama 3's scaled frequencies, partial rotary dims, a cache slice
that does not start at position 0 all fit).

Sources, in the order the encoder takes them: an explicit :class:`Rope` (API ``rope=``,
CLI ``--rope-theta``), the calibration's (a calibration fitted on keys without RoPE records
it), the cache's safetensors metadata key ``rope`` (``cachegen capture`` writes it).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from ..errors import ConfigError
from ..format.params import MAX_ROPE_POSITION, Rope, check_rope
from ..kernels import rope as rope_kernels
from ..kernels.rope import STYLE_HALF, STYLE_INTERLEAVED

METADATA_KEY = "rope"
STYLE_NAMES = {"half": STYLE_HALF, "interleaved": STYLE_INTERLEAVED}


def from_theta(theta: float, head_dim: int, rotary_dim: int | None = None, style: str = "half",
               position_start: int = 0) -> Rope:
    """The plain RoPE of ``theta``: f_j = theta^(-2j / rotary_dim), as transformers computes it
    (in float32: ``1 / theta ** (arange(0, r, 2) / r)``), widened to float64."""
    r = head_dim if rotary_dim is None else int(rotary_dim)
    if not (isinstance(theta, (int, float)) and float(theta) > 1.0 and np.isfinite(theta)):
        raise ConfigError(f"a RoPE theta is a number above 1, got {theta!r}", cli=f"--rope-theta {theta!r}: a number above 1")
    if style not in STYLE_NAMES:
        raise ConfigError(f"RoPE style {style!r} (one of {', '.join(STYLE_NAMES)})")
    inv = 1.0 / (float(theta) ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    return Rope(STYLE_NAMES[style], int(head_dim), r, int(position_start), inv.double().numpy()[None, :])


def from_model(model, position_start: int = 0) -> Rope:
    """The RoPE a transformers model applies to its keys: its rotary embedding's ``inv_freq``
    buffer (what the model multiplies the positions by, scaling included) and its config's head
    size and partial rotary factor.  Raises ConfigError for a model without one."""
    cfg = model.config
    emb = None
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
            emb = module
            break
    if emb is None:
        raise ConfigError(f"{type(model).__name__} has no rotary embedding with an inv_freq buffer")
    inv = emb.inv_freq.detach().to("cpu", torch.float64).numpy()
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    rope = Rope(STYLE_HALF, head_dim, 2 * inv.size, int(position_start), inv[None, :].copy())
    check_rope(rope, 1, head_dim, 0)
    return rope


def to_metadata(rope: Rope) -> str:
    """The metadata value of ``rope`` (JSON; the frequencies as float64 hex, so they round-trip)."""
    return json.dumps({"style": {v: k for k, v in STYLE_NAMES.items()}[rope.style], "head_dim": rope.head_dim,
                       "rotary_dim": rope.rotary_dim, "position_start": rope.position_start,
                       "inv_freq": [[float(v).hex() for v in row] for row in np.asarray(rope.inv_freq)]},
                      separators=(",", ":"))


def from_metadata(value: str) -> Rope:
    """Inverse of :func:`to_metadata` (ConfigError for a value it cannot have written)."""
    try:
        d = json.loads(value)
        rows = [[float.fromhex(v) for v in row] for row in d["inv_freq"]]
        rope = Rope(STYLE_NAMES[d["style"]], int(d["head_dim"]), int(d["rotary_dim"]), int(d["position_start"]),
                    np.asarray(rows, np.float64))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ConfigError(f"the cache's {METADATA_KEY!r} metadata is not a RoPE description ({e})") from None
    return rope


def for_cache(rope: Rope, num_layers: int, num_channels: int, num_tokens: int) -> Rope:
    """``rope`` checked against a cache (ConfigError naming what does not fit)."""
    from ..errors import SizeError

    try:
        check_rope(rope, num_layers, num_channels, num_tokens)
    except SizeError as e:
        raise ConfigError(f"the RoPE parameters do not fit the cache: {e}") from None
    return rope


def unturn(x: torch.Tensor, rope: Rope, sink: int = 0, first_token: int = 0) -> torch.Tensor:
    """A float32 copy of a cache [L, 2, T, C] with the keys' rotary embedding removed (tokens
    before ``sink`` left as they are), exactly as the encoder computes it: for tools (calibrate,
    scripts) that need the coordinates the codec quantizes."""
    y = x.detach().to("cpu", torch.float32).contiguous().clone()
    rope_kernels.turn_keys(y.numpy(), rope.inv_freq, rope, first_token, sink, False)
    return y


__all__ = ["Rope", "resolve", "from_theta", "from_model", "to_metadata", "from_metadata", "for_cache", "unturn",
           "MAX_ROPE_POSITION", "METADATA_KEY"]


def resolve(cache, cfg, calibration=None) -> Rope | None:
    """The RoPE the encoder removes from ``cache``'s keys: None unless ``cfg.rope_keys`` or the
    calibration was fitted on keys without RoPE; then the cache's own (given, or its metadata's)
    or the calibration's frequencies at position 0.  ConfigError when there is none."""
    cal_rope = getattr(calibration, "rope", None)
    if not (cfg.method == "transform" and (cfg.rope_keys or cal_rope is not None)):
        return None
    rope = cache.rope
    if rope is None and METADATA_KEY in cache.metadata:
        rope = from_metadata(cache.metadata[METADATA_KEY])
    if rope is None:
        rope = cal_rope
    if rope is None:
        raise ConfigError("coding the keys without RoPE needs the cache's RoPE parameters: a cache from "
                          "`cachegen capture`, a calibration fitted with them, or rope=...",
                          cli="--rope-keys needs the cache's RoPE parameters: capture it with `cachegen capture`, "
                              "or give --rope-theta")
    return for_cache(rope, cache.num_layers, cache.num_channels, cache.num_tokens)
