"""Every shape of KV cache real models keep, split into uniform groups (format version 3).

kvio.py reads the one regular shape: every layer with the same tokens, heads and head size,
K and V alike, batch 1.  Real caches are often not that regular:

  * sliding-window and hybrid models (Gemma 2/3, Mistral-style SWA, gpt-oss): the windowed
    layers keep only their last W tokens;
  * MLA models (DeepSeek-V2/V3, Kimi): one latent per layer, or (transformers) a K slot of
    kv_lora_rank channels and a V slot of the rope channels;
  * K and V of different head sizes, layers of different head counts;
  * a batch of sequences, padded to one length or one tensor per sequence;
  * extra tensors (input_ids, attention_mask, positions) next to the cache.

This module reads such a cache into *planes* (the [tokens, channels] values of one sequence,
layer and K / V / latent, in the internal token-major form kvio uses) and puts them into
*groups*: planes of one sequence, token count, channel count and dtype.  A group is a regular
cache [layers, 2, tokens, channels] the existing codecs encode unchanged:

  * a "kv" group pairs each layer's K and V planes (same tokens and channels);
  * a "planes" group holds single planes (a latent, or the K or the V of a layer whose K and V
    differ): each plane is cut in two halves of its channels, the first half in the K slot,
    the second in the V slot (one zero channel pads an odd count), so a plane costs what it
    holds and the codecs see the [L, 2, T, C] they know.

The *manifest* (format/parts.py writes it into the file) records every tensor's name, shape
and dtype, which planes each group holds and where each plane sits in its tensor, so that
``tensors_from_groups`` gives back exactly the tensors that were read.  Extra tensors are kept
byte for byte (or dropped on request).

Tensor forms (the axes of a K / V / latent tensor):
  HTD    [heads, tokens, head_dim]                  (a K or V, batch 1 squeezed)
  BHTD   [batch, heads, tokens, head_dim]            (HF transformers' DynamicCache)
  TC     [tokens, channels]                          (a latent)
  BTC    [batch, tokens, channels]                   (a batch of latents)
  L2THD  [layers, 2, tokens, heads, head_dim]        (the stacked layout, here with extras)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, DTypeError, LayoutError, NonFiniteError, ShapeError

KV_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
KV_DTYPE_BY_NAME = {v: k for k, v in KV_DTYPES.items()}
#: Every dtype an extra tensor may have (torch's names; little-endian bytes, as safetensors).
EXTRA_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
    "float32", "float64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}
EXTRA_DTYPE_NAMES = {v: k for k, v in EXTRA_DTYPES.items()}

MAX_LAYER_INDEX = 4095  # kvio.MAX_LAYERS - 1
MAX_CHANNELS = 1 << 16
MAX_TOKENS = (1 << 32) - 1
MAX_BATCH = 4096
MAX_TENSORS = 1 << 17

#: form -> rank
FORMS = {"HTD": 3, "BHTD": 4, "TC": 2, "BTC": 3, "L2THD": 5}
KINDS = ("key", "value", "latent")

#: Built-in naming schemes: (description, pattern with groups layer and kind).
SCHEMES = (
    ("layers.{i}.key / layers.{i}.value / layers.{i}.latent",
     re.compile(r"^layers\.(?P<layer>\d+)\.(?P<kind>key|value|latent|kv_latent)$")),
    ("past_key_values.{i}.0 / past_key_values.{i}.1", re.compile(r"^past_key_values\.(?P<layer>\d+)\.(?P<kind>0|1)$")),
    ("key_cache.{i} / value_cache.{i}", re.compile(r"^(?P<kind>key|value)_cache\.(?P<layer>\d+)$")),
    ("kv_latent.{i}", re.compile(r"^(?P<kind>kv_latent|latent_cache)\.(?P<layer>\d+)$")),
)
#: Names under which one 5-D tensor [layers, 2, tokens, heads, head_dim] is the stacked cache
#: when the file holds other tensors too (alone, any name is: kvio's stacked layout).
STACKED_NAMES = ("kv", "past_key_values", "kv_cache")
_KIND_WORDS = {"key": "key", "k": "key", "0": "key", "keys": "key", "value": "value", "v": "value", "1": "value",
               "values": "value", "latent": "latent", "kv_latent": "latent", "latent_cache": "latent", "c": "latent"}
SCHEME_HELP = ("layers.{i}.key/value (or .latent), past_key_values.{i}.{0|1}, key_cache.{i}/value_cache.{i}, "
               "kv_latent.{i}, or one [layers, 2, tokens, heads, head_dim] tensor named kv")


def _tname(name: str) -> str:
    """A tensor name for a message: quoted, and cut when absurdly long."""
    return repr(name if len(name) <= 80 else name[:60] + "...")


# ---------------------------------------------------------------- forms


def form_dims(form: str, shape: list[int] | tuple[int, ...]) -> tuple[int, int, list[tuple[int, ...]]]:
    """(tokens, channels, plane selectors) of a tensor of ``form`` and ``shape``: each selector
    indexes the leading axes down to one plane."""
    s = [int(x) for x in shape]
    if form == "HTD":
        return s[1], s[0] * s[2], [()]
    if form == "BHTD":
        return s[2], s[1] * s[3], [(b,) for b in range(s[0])]
    if form == "TC":
        return s[0], s[1], [()]
    if form == "BTC":
        return s[1], s[2], [(b,) for b in range(s[0])]
    if form == "L2THD":
        return s[2], s[3] * s[4], [(l, kv) for l in range(s[0]) for kv in range(2)]
    raise ValueError(f"unknown tensor form {form!r}")


def plane_values(t: torch.Tensor, form: str, select: tuple[int, ...]) -> torch.Tensor:
    """The [tokens, channels] values of one plane of ``t`` (a view or a copy)."""
    if form in ("BHTD", "BTC"):
        t, form = t[select[0]], "HTD" if form == "BHTD" else "TC"
    if form == "HTD":
        H, T, D = t.shape
        return t.permute(1, 0, 2).reshape(T, H * D)
    if form == "TC":
        return t
    l, kv = select
    x = t[l, kv]
    return x.reshape(x.shape[0], -1)


def put_plane(out: torch.Tensor, form: str, select: tuple[int, ...], values: torch.Tensor) -> None:
    """Inverse of plane_values: write [tokens, channels] ``values`` into ``out``'s plane."""
    if form in ("BHTD", "BTC"):
        out, form = out[select[0]], "HTD" if form == "BHTD" else "TC"
    if form == "HTD":
        H, T, D = out.shape
        out.copy_(values.reshape(T, H, D).permute(1, 0, 2))
    elif form == "TC":
        out.copy_(values)
    else:
        l, kv = select
        out[l, kv].copy_(values.reshape(out[l, kv].shape))


# ---------------------------------------------------------------- naming


@dataclass(frozen=True)
class Naming:
    """How tensor names map to (sequence, layer, K / V / latent): a built-in scheme or the user's
    regular expression (named groups ``layer``, optional ``kind`` and ``seq``)."""

    pattern: re.Pattern | None = None  # None: the built-in schemes

    def match(self, name: str) -> tuple[int, int, str] | None:
        """(seq, layer, kind) of a K / V / latent tensor's name, or None for any other tensor."""
        patterns = [p for _, p in SCHEMES] if self.pattern is None else [self.pattern]
        for p in patterns:
            m = p.fullmatch(name)
            if not m:
                continue
            groups = m.groupdict()
            layer_text = groups.get("layer") or ""
            if not (layer_text.isascii() and layer_text.isdecimal()):  # \d and int() take any script's digits
                raise LayoutError(f"tensor {_tname(name)}: layer {layer_text[:20]!r} is not a number in ASCII digits")
            if len(layer_text) > 9 or int(layer_text) > MAX_LAYER_INDEX:
                raise LayoutError(f"tensor {_tname(name)}: layer number out of range (at most {MAX_LAYER_INDEX})")
            kind_text = groups.get("kind")
            kind = "latent" if kind_text is None else _KIND_WORDS.get(kind_text.lower())
            if kind is None:
                raise LayoutError(f"tensor {_tname(name)}: kind {kind_text!r} is none of key/k/0, value/v/1, latent")
            seq_text = groups.get("seq")
            seq = 0
            if seq_text is not None:
                if not seq_text.isdecimal() or len(seq_text) > 6 or int(seq_text) >= MAX_BATCH:
                    raise LayoutError(f"tensor {_tname(name)}: sequence {seq_text[:20]!r} is not a number below {MAX_BATCH}")
                seq = int(seq_text)
            return seq, int(layer_text), kind
        return None


def parse_names(text: str | re.Pattern | None) -> Naming:
    """--names: a regular expression that fully matches the K / V / latent tensors' names, with
    named groups ``layer`` (the layer number), ``kind`` (key/k/0, value/v/1 or latent; without
    it every match is a latent) and optionally ``seq`` (the sequence of a batch)."""
    if text is None:
        return Naming()
    if isinstance(text, re.Pattern):
        pattern = text
    else:
        try:
            pattern = re.compile(str(text))
        except re.error as exc:
            raise ConfigError(f"names=: not a regular expression ({exc})",
                              cli=f"--names: not a regular expression ({exc})") from None
    if "layer" not in pattern.groupindex:
        what = "the expression needs a named group (?P<layer>...) for the layer number"
        raise ConfigError(f"names=: {what}", cli=f"--names: {what}")
    unknown = set(pattern.groupindex) - {"layer", "kind", "seq"}
    if unknown:
        what = f"unknown named group {sorted(unknown)[0]!r} (use layer, kind and seq)"
        raise ConfigError(f"names=: {what}", cli=f"--names: {what}")
    return Naming(pattern)


# ---------------------------------------------------------------- the cache model


@dataclass(frozen=True)
class Plane:
    tensor: int  # index of its tensor in PartsCache.entries
    select: tuple[int, ...]
    seq: int
    layer: int
    kind: str
    tokens: int
    channels: int
    dtype: str


@dataclass
class Group:
    """Planes of one sequence, token count, channel count and dtype, coded as one regular cache."""

    kind: str  # "kv": members are (K plane, V plane) of a layer; "planes": single planes
    seq: int
    tokens: int
    channels: int  # of each plane
    dtype: str
    members: list = field(default_factory=list)  # kv: [(Plane, Plane)]; planes: [Plane]
    first_positions: list[int] = field(default_factory=list)

    @property
    def coded_channels(self) -> int:
        """Channels of the regular cache the group is coded as (planes: half a plane, rounded up)."""
        return self.channels if self.kind == "kv" else -(-self.channels // 2)

    @property
    def num_layers(self) -> int:
        return len(self.members)

    def layers(self) -> list[int]:
        return [(m[0] if self.kind == "kv" else m).layer for m in self.members]

    def plane_kinds(self) -> list[str]:
        return ["kv" if self.kind == "kv" else m.kind for m in self.members]


@dataclass
class PartsCache:
    """A cache of any shape: its tensors in file order (K / V / latent tensors and extras), the
    manifest entry of each, and the groups its planes form."""

    tensors: list[torch.Tensor]
    entries: list[dict]
    groups: list[Group]
    metadata: dict[str, str]
    dropped: list[str] = field(default_factory=list)

    @property
    def extras(self) -> list[str]:
        return [e["name"] for e in self.entries if e["role"] == "extra"]

    @property
    def model_layers(self) -> int:
        """One more than the highest layer number (what per-layer settings are indexed by)."""
        return 1 + max((l for g in self.groups for l in g.layers()), default=-1)

    def group_data(self, g: Group) -> torch.Tensor:
        """The regular cache [layers, 2, tokens, coded channels] a group is coded as."""
        C2 = g.coded_channels
        dtype = KV_DTYPE_BY_NAME[g.dtype]
        data = torch.zeros((g.num_layers, 2, g.tokens, C2), dtype=dtype)
        for i, m in enumerate(g.members):
            if g.kind == "kv":
                for kv, p in enumerate(m):
                    data[i, kv].copy_(self._values(p))
            else:
                x = self._values(m)
                data[i, 0].copy_(x[:, :C2])
                data[i, 1, :, : g.channels - C2].copy_(x[:, C2:])
        return data

    def _values(self, p: Plane) -> torch.Tensor:
        return plane_values(self.tensors[p.tensor], self.entries[p.tensor]["form"], p.select)

    def decoded_bytes(self) -> int:
        return sum(_numel(e["shape"]) * _itemsize(e["dtype"]) for e in self.entries)

    def num_values(self) -> int:
        """K / V / latent values held (what bits per value are counted over)."""
        return sum(_numel(e["shape"]) for e in self.entries if e["role"] == "kv")

    def kv_bytes(self) -> int:
        return sum(_numel(e["shape"]) * _itemsize(e["dtype"]) for e in self.entries if e["role"] == "kv")


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _itemsize(dtype_name: str) -> int:
    return torch.empty(0, dtype=EXTRA_DTYPES[dtype_name]).element_size()


def _form_of(name: str, t: torch.Tensor, kind: str) -> str:
    rank = t.dim()
    if kind == "latent":
        forms = {2: "TC", 3: "BTC", 4: "BHTD"}
        want = "[tokens, channels], [batch, tokens, channels] or [batch, 1, tokens, channels]"
    else:
        forms = {3: "HTD", 4: "BHTD"}
        want = "[heads, tokens, head_dim] or [batch, heads, tokens, head_dim]"
    if rank not in forms:
        raise ShapeError(f"tensor {_tname(name)} has shape {list(t.shape)}; a {kind} tensor is {want}")
    return forms[rank]


def analyse(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    names: Naming | str | None = None,
    extras: str = "keep",
    hints: Mapping[str, Mapping] | None = None,
    check_values: bool = True,
) -> PartsCache:
    """Read any cache into planes and groups; every refused input is one error naming the tensor.
    ``check_values=False``: the tensors may be on the meta device (shapes, dtypes and names
    only: a file read plane by plane, storage/kvparts_files.py, whose reader checks the values).

    ``names``: a Naming (or --names text); None: the built-in schemes.  ``extras``: "keep"
    (stored exactly) or "drop" the tensors that are not K / V / latent.  ``hints``: per tensor
    name, {"first_position": p} (where its tokens start in the sequence; default: the last
    tokens of the sequence's longest layer, what a sliding window keeps)."""
    if extras not in ("keep", "drop"):
        raise ConfigError(f"extras must be 'keep' or 'drop', not {extras!r}")
    naming = names if isinstance(names, Naming) else parse_names(names)
    if not isinstance(tensors, Mapping) or not tensors:
        raise LayoutError("the file holds no tensors")
    if len(tensors) > MAX_TENSORS:
        raise LayoutError(f"{len(tensors)} tensors; cachegen reads at most {MAX_TENSORS}")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    hints = hints or {}
    floats = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.dtype in KV_DTYPES]
    entries: list[dict] = []
    kept: list[torch.Tensor] = []
    dropped: list[str] = []
    claimed: list[tuple[int, str, int, int, str]] = []  # (entry index, name, seq, layer, kind)
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise LayoutError(f"tensor name {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"{_tname(name)} is not a tensor")
        hit = naming.match(name)
        stacked = (hit is None and naming.pattern is None and t.dim() == 5 and t.shape[1] == 2
                   and (name in STACKED_NAMES or (len(tensors) == 1) or floats == [name]))
        if hit is None and not stacked:
            if extras == "drop":
                dropped.append(name)
                continue
            if t.dtype not in EXTRA_DTYPE_NAMES:
                raise DTypeError(f"extra tensor {_tname(name)} has dtype {str(t.dtype).replace('torch.', '')}, "
                                 "which cachegen cannot store")
            entries.append({"name": name, "role": "extra", "dtype": EXTRA_DTYPE_NAMES[t.dtype],
                            "shape": [int(s) for s in t.shape]})
            kept.append(t.detach() if not check_values else t.detach().cpu())
            continue
        if t.dtype not in KV_DTYPES:
            raise DTypeError(f"tensor {_tname(name)} has dtype {str(t.dtype).replace('torch.', '')}; "
                             "K, V and latent tensors must be float16, bfloat16 or float32")
        if stacked:
            entry = {"name": name, "role": "kv", "form": "L2THD", "dtype": KV_DTYPES[t.dtype],
                     "shape": [int(s) for s in t.shape]}
            if t.shape[0] - 1 > MAX_LAYER_INDEX:
                raise ShapeError(f"tensor {_tname(name)} holds {t.shape[0]} layers; cachegen handles at most "
                                 f"{MAX_LAYER_INDEX + 1}")
        else:
            seq, layer, kind = hit
            entry = {"name": name, "role": "kv", "form": _form_of(name, t, kind), "dtype": KV_DTYPES[t.dtype],
                     "shape": [int(s) for s in t.shape], "layer": layer, "kind": kind, "seq": seq}
        window = hints.get(name, {}).get("sliding_window")
        if window is not None:  # a windowed layer of a transformers Cache: rebuilt as one (as_cache)
            entry["sliding_window"] = int(window)
        claimed.append(len(entries))
        entries.append(entry)
        kept.append(t.detach() if not check_values else t.detach().cpu())
    if not claimed:
        shown = ", ".join(_tname(n) for n in list(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
        none = f"no tensor in a known KV layout among {shown}: expected {SCHEME_HELP}"
        raise LayoutError(f"{none} (or say how yours are named with names=)",
                          cli=f"{none} (or say how yours are named with --names)")
    planes = _planes(entries, kept, claimed, naming)
    for p in planes if check_values else ():  # which tensor holds NaN / Inf, before any work
        _check_finite(entries[p.tensor]["name"], plane_values(kept[p.tensor], entries[p.tensor]["form"], p.select))
    groups = _group(planes, entries, hints)
    return PartsCache(kept, entries, groups, meta, dropped)


def _check_finite(name: str, x: torch.Tensor) -> None:
    if x.numel() == 0 or bool(torch.isfinite(x).all()):
        return
    kinds = [k for k, bad in (("NaN", bool(torch.isnan(x).any())), ("Inf", bool(torch.isinf(x).any()))) if bad]
    raise NonFiniteError(f"tensor {_tname(name)} holds {' and '.join(kinds)} values; cachegen encodes finite values only")


def _planes(entries: list[dict], tensors: list[torch.Tensor], claimed: list[int], naming: Naming) -> list[Plane]:
    planes: list[Plane] = []
    slots: dict[tuple[int, int, str], str] = {}
    for i in claimed:
        e, t = entries[i], tensors[i]
        T, C, selects = form_dims(e["form"], e["shape"])
        if not 1 <= C <= MAX_CHANNELS:
            raise ShapeError(f"tensor {_tname(e['name'])} has {C} channels per token (heads x head_dim); "
                             f"cachegen handles 1 to {MAX_CHANNELS}")
        if T > MAX_TOKENS:
            raise ShapeError(f"tensor {_tname(e['name'])} has {T} tokens; cachegen handles at most {MAX_TOKENS}")
        if e["form"] in ("BHTD", "BTC") and not 1 <= e["shape"][0] <= MAX_BATCH:
            raise ShapeError(f"tensor {_tname(e['name'])} has batch size {e['shape'][0]}; cachegen handles 1 to {MAX_BATCH}")
        if e["form"] in ("BHTD", "BTC") and e["shape"][0] > 1 and e["seq"]:
            raise LayoutError(f"tensor {_tname(e['name'])} has a sequence number in its name and a batch of "
                              f"{e['shape'][0]}; give one sequence per tensor")
        for sel in selects:
            if e["form"] == "L2THD":
                seq, layer, kind = 0, sel[0], ("key", "value")[sel[1]]
            else:
                seq = e["seq"] + (sel[0] if sel else 0)
                layer, kind = e["layer"], e["kind"]
            slot = (seq, layer, kind)
            if slot in slots:
                raise LayoutError(f"tensors {_tname(slots[slot])} and {_tname(e['name'])} both name "
                                  f"{'' if not seq else f'sequence {seq} '}layer {layer}'s {kind}")
            slots[slot] = e["name"]
            planes.append(Plane(i, tuple(sel), seq, layer, kind, T, C, e["dtype"]))
    # a layer's key and value come in the same batch
    by_name = {entries[i]["name"]: entries[i] for i in claimed}
    for (seq, layer, kind), name in slots.items():
        partner = slots.get((seq, layer, "value")) if kind == "key" else None
        if partner is not None and _batch(by_name[name]) != _batch(by_name[partner]):
            raise ShapeError(f"tensor {_tname(name)} has batch size {_batch(by_name[name])} but {_tname(partner)} "
                             f"{_batch(by_name[partner])}")
    for (seq, layer, kind), name in slots.items():
        if kind != "key" or (seq, layer, "value") in slots:
            continue
        for (s2, l2, k2), other in slots.items():
            if (l2, k2) == (layer, "value") and _batch(by_name[other]) != _batch(by_name[name]):
                raise ShapeError(f"tensor {_tname(name)} has batch size {_batch(by_name[name])} but {_tname(other)} "
                                 f"{_batch(by_name[other])}")
    # every layer holds a K and a V, or a latent
    for (seq, layer, kind), name in slots.items():
        other = {"key": "value", "value": "key"}.get(kind)
        if other is not None and (seq, layer, other) not in slots:
            raise LayoutError(f"tensor {_tname(name)} has no {other}: {_missing_name(naming, name, layer, other)} "
                              "is missing")
        if kind == "latent" and ((seq, layer, "key") in slots or (seq, layer, "value") in slots):
            raise LayoutError(f"tensor {_tname(name)} is layer {layer}'s latent, but the layer has a key or value too")
    return planes


def _missing_name(naming: Naming, name: str, layer: int, other: str) -> str:
    """The partner's name by the same scheme (layers.1.key -> layers.1.value, past_key_values.0.1
    -> past_key_values.0.0), or 'its key' / 'its value' when no simple swap gives one."""
    words = {"value": ("value", "v", "1", "values"), "key": ("key", "k", "0", "keys")}
    mine = words["key" if other == "value" else "value"]
    for a, b in zip(mine, words[other]):
        at = name.find(a)
        while at >= 0:
            candidate = name[:at] + b + name[at + len(a):]
            try:
                hit = naming.match(candidate)
            except LayoutError:
                hit = None
            if hit is not None and hit[1:] == (layer, other):
                return candidate
            at = name.find(a, at + 1)
    return f"its {other}"


def _group(planes: list[Plane], entries: list[dict], hints: Mapping[str, Mapping]) -> list[Group]:
    by_slot = {(p.seq, p.layer, p.kind): p for p in planes}
    longest: dict[int, int] = {}
    for p in planes:
        longest[p.seq] = max(longest.get(p.seq, 0), p.tokens)
    groups: dict[tuple, Group] = {}

    def first_position(p: Plane) -> int:
        hint = hints.get(entries[p.tensor]["name"], {})
        pos = hint.get("first_position")
        if pos is None:
            return longest[p.seq] - p.tokens
        if isinstance(pos, (list, tuple)):
            pos = pos[p.select[0] if p.select else 0]
        return int(pos)

    def add(key: tuple, kind: str, member, p: Plane) -> None:
        g = groups.get(key)
        if g is None:
            g = groups[key] = Group(kind, p.seq, p.tokens, p.channels, p.dtype)
        g.members.append(member)
        g.first_positions.append(first_position(p))

    for seq, layer in sorted({(p.seq, p.layer) for p in planes}):
        latent = by_slot.get((seq, layer, "latent"))
        if latent is not None:
            add(("planes", seq, latent.tokens, latent.channels, latent.dtype), "planes", latent, latent)
            continue
        k, v = by_slot[(seq, layer, "key")], by_slot[(seq, layer, "value")]
        kname, vname = entries[k.tensor]["name"], entries[v.tensor]["name"]
        if k.tokens != v.tokens:
            raise ShapeError(f"tensor {_tname(kname)} holds {k.tokens} tokens but {_tname(vname)} {v.tokens}; "
                             "a layer's key and value hold the same tokens")
        if k.dtype != v.dtype:
            raise DTypeError(f"tensor {_tname(kname)} is {k.dtype}, but {_tname(vname)} is {v.dtype}; "
                             "a layer's key and value must have one dtype (all must match)")
        kb, vb = _batch(entries[k.tensor]), _batch(entries[v.tensor])
        if kb != vb:
            raise ShapeError(f"tensor {_tname(kname)} has batch size {kb} but {_tname(vname)} {vb}")
        if k.channels == v.channels:
            add(("kv", seq, k.tokens, k.channels, k.dtype), "kv", (k, v), k)
        else:  # K and V of different sizes (MLA's latent and rope parts, unequal head sizes)
            for p in (k, v):
                add(("planes", seq, p.tokens, p.channels, p.dtype), "planes", p, p)
    return list(groups.values())


def _batch(entry: dict) -> int:
    return int(entry["shape"][0]) if entry["form"] in ("BHTD", "BTC") else 1


# ---------------------------------------------------------------- back to tensors


def tensors_from_groups(manifest: dict, group_data: list[torch.Tensor], extra_bytes: list) -> dict[str, torch.Tensor]:
    """The original named tensors, in file order, from a validated manifest (format/parts.py),
    each group's decoded [layers, 2, tokens, coded channels] and each extra's raw bytes."""
    entries = manifest["tensors"]
    out: list[torch.Tensor | None] = [None] * len(entries)
    for i, e in enumerate(entries):
        if e["role"] == "kv":
            out[i] = torch.empty(e["shape"], dtype=KV_DTYPE_BY_NAME[e["dtype"]])
    for g, data in zip(manifest["groups"], group_data):
        data = data.cpu()
        C = g["channels"]
        C2 = data.shape[3]
        for j, member in enumerate(g["members"]):
            if g["kind"] == "kv":
                for kv, (ti, *sel) in enumerate(member):
                    put_plane(out[ti], entries[ti]["form"], tuple(sel), data[j, kv])
            else:
                ti, *sel = member[0]
                values = torch.cat([data[j, 0], data[j, 1, :, : C - C2]], dim=1)
                put_plane(out[ti], entries[ti]["form"], tuple(sel), values)
    for i, e in enumerate(entries):
        if e["role"] == "extra":
            raw = extra_bytes[e["part"] - len(group_data)]
            dtype = EXTRA_DTYPES[e["dtype"]]
            if len(raw):
                out[i] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(e["shape"])
            else:
                out[i] = torch.empty(e["shape"], dtype=dtype)
    return {e["name"]: t for e, t in zip(entries, out)}


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order (little-endian on every machine cachegen runs on)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def safetensors_layout(entries: list[dict], metadata: Mapping[str, str]) -> tuple[bytes, dict[str, int], int]:
    """The header of the safetensors file of tensors ``entries`` (name, dtype name, shape): tensors
    in name order, metadata keys sorted, so that the same tensors always give the same bytes;
    each tensor's data offset in the file, and the file's size."""
    import json
    import struct

    st = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
          "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
          "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
    head: dict = {}
    if metadata:
        head["__metadata__"] = {k: str(metadata[k]) for k in sorted(metadata)}
    offset = 0
    starts = {}
    for e in sorted(entries, key=lambda e: e["name"]):
        n = _numel(e["shape"]) * _itemsize(e["dtype"])
        head[e["name"]] = {"dtype": st[e["dtype"]], "shape": [int(s) for s in e["shape"]],
                           "data_offsets": [offset, offset + n]}
        starts[e["name"]] = offset
        offset += n
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    data_start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {k: data_start + v for k, v in starts.items()}, data_start + offset


def safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list:
    """A safetensors file as byte buffers: the header (safetensors_layout) and each tensor's data."""
    entries = [{"name": n, "dtype": EXTRA_DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for n, t in tensors.items()]
    head, _, _ = safetensors_layout(entries, metadata)
    return [head] + [raw_bytes(tensors[name]) for name in sorted(tensors)]
