"""``cachegen tune`` on caches of several shapes (format version 3: windowed layers, K and V of
different sizes, MLA latents, batches, layers missing).

The tuner of model/tune.py, with the cache as planes (storage/kvparts.py) instead of one
[L, 2, T, C] block.  A multi-part file takes per-layer steps at each group's own layer numbers
(pipeline/parts.group_quantization: a layer's K step for its key or latent, its V step for its
value), so the tuned unit is a *slot* (layer, K/V): the planes of that layer's key (or latent)
or value, every sequence of a batch included.  The three steps are model/tune.py's:

1. sensitivities by perturbation: the cache encoded once at the probe step, then each slot's
   decoded planes alone put into the original (the Fisher estimate of model/tune.py needs the
   regular cache's layout);
2. the allocation (``allocation_shape``) over the slots the cache has (a missing layer or a
   latent's unused V slot takes the geometric mean, so it changes nothing), each slot's floor the
   largest of its groups' (``min_steps`` of each group's file, with its rotation when calibrated);
3. the bisection on the real encode -> decode (the multi-part file, through the public API).

Measures: with the model (``--target-kl``), the KL of the next-token distributions with the
model's own cache class rebuilt from the planes (evaluate's layered path, as ``cachegen eval``
scores such files); without (``--target-error``), the attention proxy of model/tune.py per
(sequence, layer) for K / V planes (heads from each tensor's shape, K and V head sizes may
differ), and the relative squared error for a latent (it has no attention of its own to proxy).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DTypeError, LayoutError, ShapeError
from ..methods.config import TransformConfig
from . import tune as base


def tune_any_file(kv_path, output=None, **kw) -> dict[str, Any]:
    """``cachegen tune`` for a cache of any shape: model/tune.tune_file's arguments and checks; a
    regular cache goes there, one of several shapes (or with every layer windowed) is tuned here."""
    checked = base.tune_file(kv_path, output, checked_only=True, **kw)
    parts = irregular_cache(checked["src"])
    if parts is None:
        return base.tune_file(kv_path, output, **kw)
    names = ("target_kl", "target_error", "model_path", "text_path", "calibration_path", "continuation", "max_step",
             "strength", "loaded", "log")
    args = {n: kw.get(n) for n in names}
    args["log"] = args["log"] or (lambda m: None)
    for n, default in (("continuation", base.DEFAULT_CONTINUATION), ("max_step", base.DEFAULT_MAX_STEP),
                       ("strength", base.DEFAULT_STRENGTH)):
        if args[n] is None:
            args[n] = default
    return tune_parts_file(parts, checked["src"], checked["dst"], **args)


def irregular_cache(path: Path):
    """The storage.kvparts.PartsCache of a .safetensors KV file that is not one regular cache
    (extras dropped: they are not tuned), else None (a regular cache, or a .cgen file)."""
    from ..format.container import MAGIC
    from ..storage import kvio, kvparts

    with open(path, "rb") as f:
        if f.read(8) == MAGIC:
            return None
    tensors, metadata = kvio.read_tensors(path)
    try:
        cache = kvio.from_tensors(tensors, "auto", metadata)
    except (LayoutError, ShapeError, DTypeError):
        return kvparts.analyse(tensors, metadata, None, "drop")
    ids = metadata.get("token_ids")
    if ids is not None and ids.startswith("[") and ids.count(",") + 1 != cache.num_tokens:
        # every layer windowed (Mistral-style SWA): one shape, but not a prefix of its context, so
        # scored as the model's own cache class as eval does (the layered path)
        return kvparts.analyse(tensors, metadata, None, "drop")
    return None


def _col(kind: str) -> int:
    return 1 if kind == "value" else 0


def _name_planes(pc) -> dict[tuple[int, int], list]:
    """slot (layer, K/V column) -> [(tensor name, form, select)] of its planes."""
    out: dict[tuple[int, int], list] = {}
    for g in pc.groups:
        for m in g.members:
            for p in (m if g.kind == "kv" else (m,)):
                e = pc.entries[p.tensor]
                out.setdefault((p.layer, _col(p.kind)), []).append((e["name"], e["form"], p.select))
    return out


def _tensors(pc) -> dict[str, torch.Tensor]:
    return {e["name"]: t for e, t in zip(pc.entries, pc.tensors) if e["role"] == "kv"}


def mixed(original: dict, decoded: dict, planes: list) -> dict:
    """``original`` with the given planes taken from ``decoded`` (tensors copied only where changed)."""
    from ..storage import kvparts

    out = dict(original)
    for name, form, select in planes:
        if out[name] is original[name]:
            out[name] = original[name].clone()
        kvparts.put_plane(out[name], form, select, kvparts.plane_values(decoded[name], form, select))
    return out


class PartsMeasure(base.Measure):
    """A damage of decoded tensors (the names of the tuning cache) against the original ones."""

    def __init__(self, pc) -> None:
        self.original = _tensors(pc)
        self.slots = _name_planes(pc)
        self.evaluations = 0

    def slot_cost(self, decoded: dict, slot: tuple[int, int]) -> float:
        return self.cost(mixed(self.original, decoded, self.slots[slot]))


class PartsAttentionMeasure(PartsMeasure):
    """model/tune.AttentionMeasure per (sequence, layer) with a K and a V plane (the cache's own
    keys at ``queries`` positions as proxy queries), the relative squared error for a latent; the
    cost is the mean over those units of the squared relative error."""

    kind = "error"

    def __init__(self, pc, queries: int = base.ATTENTION_QUERIES) -> None:
        super().__init__(pc)
        by_seq_layer: dict[tuple[int, int], dict] = {}
        for g in pc.groups:
            for m in g.members:
                for p in (m if g.kind == "kv" else (m,)):
                    e = pc.entries[p.tensor]
                    heads = {"HTD": lambda s: s[0], "BHTD": lambda s: s[1], "L2THD": lambda s: s[3]}.get(
                        e["form"], lambda s: 1)(e["shape"])
                    by_seq_layer.setdefault((p.seq, p.layer), {})[p.kind] = (e["name"], e["form"], p.select, int(heads))
        self.units = []
        for (seq, layer), kinds in sorted(by_seq_layer.items()):
            if "latent" in kinds:
                self.units.append(("latent", kinds["latent"], None))
            else:
                self.units.append(("kv", kinds["key"], kinds["value"]))
        self.queries = queries
        self.ref = [self._unit_state(u) for u in self.units]

    def _plane(self, tensors: dict, where) -> torch.Tensor:
        from ..storage import kvparts

        name, form, select, _ = where
        return kvparts.plane_values(tensors[name], form, select).float()

    def _unit_state(self, unit):
        kind, a, b = unit
        x = self._plane(self.original, a)
        if kind == "latent":
            return (x, float(x.pow(2).sum()))
        T = x.shape[0]
        if T < 2:
            return None
        n = min(self.queries, T - 1)
        pos = torch.unique(torch.linspace(1, T - 1, n).round().long())
        mask = torch.arange(T).unsqueeze(0) < pos.unsqueeze(1)
        H = a[3]
        q = x.reshape(T, H, -1).transpose(0, 1)[:, pos]
        o = self._attend(q, mask, x, self._plane(self.original, b), H)
        return (q, mask, o, float(o.pow(2).sum()))

    @staticmethod
    def _attend(q, mask, k, v, H):
        T = k.shape[0]
        K, V = k.reshape(T, H, -1).transpose(0, 1), v.reshape(T, H, -1).transpose(0, 1)
        scores = torch.matmul(q, K.transpose(1, 2)) / math.sqrt(K.shape[-1])
        return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), V)

    def _unit_cost(self, i: int, tensors: dict) -> float:
        kind, a, b = self.units[i]
        state = self.ref[i]
        if state is None:  # fewer than 2 tokens: no query sees a key
            return 0.0
        if kind == "latent":
            x, norm = state
            err = float((self._plane(tensors, a) - x).pow(2).sum())
        else:
            q, mask, o, norm = state
            err = float((self._attend(q, mask, self._plane(tensors, a), self._plane(tensors, b), a[3]) - o).pow(2).sum())
        return err / norm if norm > 0 else err

    def cost(self, decoded: dict) -> float:
        self.evaluations += 1
        return sum(self._unit_cost(i, decoded) for i in range(len(self.units))) / max(len(self.units), 1)

    def target_cost(self, target: float) -> float:
        return target * target

    def value(self, cost: float) -> float:
        return math.sqrt(max(cost, 0.0))


class PartsKLMeasure(PartsMeasure):
    """Mean KL(original || decoded) of the model's next-token distributions, the cache rebuilt
    as the model's own cache class (evaluate's layered path).  The tuning cache's tensors are
    ``layers.{i}.key`` / ``.value`` [1, heads, tokens, head_dim]; the sensitivities score the first
    ``sensitivity_tokens`` continuation tokens only (as model/tune.KLMeasure)."""

    kind = "kl"

    def __init__(self, pc, model, context_ids: list[int], continuation_ids: list[int],
                 sensitivity_tokens: int = base.SENSITIVITY_TOKENS) -> None:
        from . import evaluate

        super().__init__(pc)
        self.model = model
        self.layers_count = 1 + max(l for l, _ in self.slots)
        layers = self._layers(self.original)
        ref = evaluate.LayeredReference(model, list(context_ids), list(continuation_ids), 0, layers, torch.empty(0), [])
        logits = evaluate._layered_logits(model, layers, ref.continuation_ids[:-1], ref.num_tokens)
        ref.logprobs = torch.log_softmax(logits.double(), dim=-1)
        self.ref = ref
        n = max(1, min(sensitivity_tokens, len(continuation_ids) - 1))
        self.sub_ref = evaluate.LayeredReference(model, ref.context_ids, ref.continuation_ids[: n + 1], 0, layers,
                                                 ref.logprobs[:n], [])
        self._sub = False

    def _layers(self, tensors: dict) -> list:
        return [(tensors[f"layers.{i}.key"], tensors[f"layers.{i}.value"]) for i in range(self.layers_count)]

    def cost(self, decoded: dict) -> float:
        from . import evaluate

        self.evaluations += 1
        return float(evaluate.score_layered(self.sub_ref if self._sub else self.ref, self._layers(decoded))["kl_mean"])

    def slot_cost(self, decoded: dict, slot: tuple[int, int]) -> float:
        self._sub = True
        try:
            return super().slot_cost(decoded, slot)
        finally:
            self._sub = False


def roundtrip(tensors: dict, cfg: TransformConfig, calibration=None) -> tuple[dict, int]:
    """Encode the tensors with ``cfg`` through the public API (a multi-part file) and decode them."""
    from .. import api

    threads = torch.get_num_threads()  # numba's parallel kernels may reset OpenMP's thread count: keep torch's
    try:
        blob = api.encode(tensors, quantization=cfg, calibration=calibration, device="cpu", extras="drop")
        out = api.decode(blob, device="cpu", calibration=calibration)
    finally:
        torch.set_num_threads(threads)
    return out, len(blob)


def slot_floors(pc, calibration=None) -> dict[tuple[int, int], float]:
    """Each slot's smallest step whose levels do not clip (model/tune.min_steps of each group's
    file, with its rotation when calibrated), the largest over the slot's groups and halves."""
    from ..methods.parts_calibration import PartsCalibration, group_calibration, slots_of_group
    from ..storage import kvio

    out: dict[tuple[int, int], float] = {}
    if calibration is not None and not isinstance(calibration, PartsCalibration):  # a regular cache's own
        floors = base.min_steps(kvio.from_tensors(_tensors(pc)).data, calibration)
        return {(l, kv): float(floors[l, kv]) for l in range(floors.shape[0]) for kv in range(2)}
    for g in pc.groups:
        gcal = None if calibration is None else group_calibration(calibration, g.kind, g.channels, slots_of_group(g))
        floors = base.min_steps(pc.group_data(g), gcal)
        for j, m in enumerate(g.members):
            if g.kind == "kv":
                pairs = [((m[0].layer, 0), floors[j, 0]), ((m[1].layer, 1), floors[j, 1])]
            else:
                pairs = [((m.layer, _col(m.kind)), max(floors[j, 0], floors[j, 1]))]
            for slot, f in pairs:
                out[slot] = max(out.get(slot, 0.0), float(f))
    return out


def tune_parts(pc, measure: PartsMeasure, target: float, *, calibration=None, probe_step: float = base.PROBE_STEP,
               max_step: float = base.DEFAULT_MAX_STEP, strength: float = base.DEFAULT_STRENGTH,
               log=None) -> base.TuneResult:
    """Per-layer K / V relative steps for the multi-part cache ``pc`` (model/tune.tune's search)."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    L = pc.model_layers
    slots = sorted(measure.slots)
    original = measure.original
    log(f"measuring the sensitivity of {len(slots)} planes (layer x K/V) at relative step {probe_step}")
    decoded, _ = roundtrip(original, TransformConfig("transform", (probe_step,), (probe_step,)), calibration)
    present = np.zeros((L, 2), bool)
    w = np.zeros((L, 2), np.float64)
    for layer, col in slots:
        present[layer, col] = True
        w[layer, col] = max(measure.slot_cost(decoded, (layer, col)), 0.0) / probe_step**2
    top = float(w[present].max(initial=0.0))
    if top > 0:  # a slot the cache does not have: the geometric mean, which moves no other step
        w[present] = np.maximum(w[present], top * 1e-6)
        w[~present] = math.exp(float(np.log(w[present]).mean()))
    else:
        w[:] = 1.0
    shape = base.allocation_shape(w, strength)
    floor = np.full((L, 2), base.MIN_STEP)
    for slot, f in slot_floors(pc, calibration).items():
        floor[slot] = f

    def evaluate(steps: np.ndarray) -> tuple[float, int]:
        out, nbytes = roundtrip(original, base.config_from_steps(steps), calibration)
        return measure.cost(out), nbytes

    best, trials = base.search_scale(evaluate, shape, measure.target_cost(target), start=probe_step,
                                     max_step=max_step, floor=floor, log=log)
    return base.TuneResult(best.steps, w, measure.kind, float(target), measure.value(best.cost), best.bytes,
                           pc.num_values(), pc.kv_bytes(), best.scale, trials, int(measure.evaluations),
                           time.perf_counter() - t0, calibration is not None)


def tune_parts_file(pc, src: Path, dst: Path, *, target_kl, target_error, model_path, text_path, calibration_path,
                    continuation: int, max_step: float, strength: float, loaded: Any, log) -> dict[str, Any]:
    """tune_file's work for a multi-part cache ``pc`` of ``src`` (its arguments already checked)."""
    from ..methods.calibration import CalibrationError
    from ..methods.parts_calibration import PartsCalibration, load_any

    t_start = time.perf_counter()
    cal = None
    if calibration_path is not None:
        cal = load_any(calibration_path)
        # the calibration of the file encode will write: version 3 for a multi-part one, else a regular one
        # (a cache of one shape scored as the model's cache class, e.g. every layer windowed)
        if not isinstance(cal, PartsCalibration) and len(pc.groups) > 1:
            raise CalibrationError(f"{calibration_path} is a calibration of one regular shape; {src} is a cache of "
                                   "several shapes (use `cachegen calibrate` on such caches)")
    target = float(target_kl if target_kl is not None else target_error)
    T = max((g.tokens for g in pc.groups), default=0)
    dtypes = sorted({g.dtype for g in pc.groups})
    info: dict[str, Any] = {"file": str(src), "output": str(dst), "num_layers": pc.model_layers, "tokens": T,
                            "dtype": dtypes[0] if len(dtypes) == 1 else "/".join(dtypes), "layered": True,
                            "groups": len(pc.groups),
                            "calibration": str(calibration_path) if calibration_path is not None else None}
    if T < 2:
        raise base.TuneError(f"{src} holds {T} token(s); tuning needs at least 2")
    if target_error is not None:
        log(f"attention-output proxy on {len(pc.groups)} group(s) of planes")
        measure: PartsMeasure = PartsAttentionMeasure(pc)
        info.update(measure="attention", tuning_tokens=T)
    else:
        measure, tuning = _kl_measure(pc, src, model_path, text_path, continuation, loaded, log, info)
        pc = tuning
    result = tune_parts(pc, measure, target, calibration=cal, max_step=max_step, strength=strength, log=log)
    return base.write_result(result, src, dst, calibration_path, info, t_start)


def _kl_measure(pc, src: Path, model_path, text_path, continuation: int, loaded, log, info: dict):
    """(PartsKLMeasure, the tuning cache) for ``--target-kl``: with a text, the file's own cache
    scored on the text's next tokens; without, the model's cache of the context's first tokens
    (a windowed layer's cache of a shorter context is not a slice of the file's), scored on the
    held-out rest."""
    from ..errors import InputError
    from ..storage import kvparts
    from . import evaluate
    from .capture import ModelError, TextError, _resolve_loaded, model_id, read_text, resolve_model_path, text_sha256

    ids = evaluate._token_ids(src, pc.metadata)
    layers = {}
    for layer, (k, v, _, _) in _layer_tensors(pc).items():
        if k is None or v is None or k.shape[0] != 1:
            raise InputError(f"{src}: layer {layer} is not one sequence's key and value; target_kl= scores batch-1 "
                             "caches of keys and values (use target_error= for latents and batches)",
                             cli=f"{src}: layer {layer} is not one sequence's key and value; --target-kl scores "
                             "batch-1 caches of keys and values (use --target-error for latents and batches)")
        layers[layer] = (k, v)
    text = read_text(text_path) if text_path is not None else None
    if text is not None:
        want = pc.metadata.get("text_sha256")
        if want is not None and want != text_sha256(text):
            raise TextError(f"{text_path} is not the text {src.name} was captured from (sha256 mismatch)")
    model, tokenizer = _resolve_loaded(loaded, resolve_model_path(model_path), log)
    dtype = next(iter(layers.values()))[0].dtype
    mid = model_id(model)
    if text is not None:
        T0, cont = len(ids), evaluate.text_continuation(tokenizer, text, text_path, ids, continuation)
        where = f"the next {continuation} tokens of {Path(text_path).name}"
        tuning = {f"layers.{l}.{kind}": t for l, kv in sorted(layers.items()) for kind, t in zip(("key", "value"), kv)}
    else:
        n = min(continuation, (len(ids) - 1) // 2)
        if n < 8:
            few = f"{src} holds only {len(ids)} tokens: too few to hold out a continuation to score; pass"
            raise base.TuneError(f"{few} text_path= (the text it was captured from)",
                                 cli=f"{few} --text (the text it was captured from)")
        T0 = len(ids) - n - 1
        cont = ids[T0:]
        where = f"the last {n} tokens of the context (held out; tuned on the model's cache of the first {T0} tokens)"
        log(f"rebuilding the cache of the first {T0} tokens with the model")
        tuning = {f"layers.{l}.{kind}": t.to(dtype) for l, kv in enumerate(evaluate.prefill(model, ids[:T0]))
                  for kind, t in zip(("key", "value"), kv)}
    # the file must be this model's cache: its layers and each layer's K / V shapes per token
    model_layers = {int(n.split(".")[1]) for n in tuning}
    if sorted(layers) != sorted(model_layers):
        raise ModelError(f"the cache holds layers {sorted(layers)[:8]}..., the model {mid} keeps "
                         f"{len(model_layers)}: it is not this model's cache")
    for l, (k, v) in layers.items():
        mk, mv = tuning[f"layers.{l}.key"], tuning[f"layers.{l}.value"]
        if (k.shape[1], k.shape[3], v.shape[1], v.shape[3]) != (mk.shape[1], mk.shape[3], mv.shape[1], mv.shape[3]):
            raise ModelError(f"layer {l} of the cache holds K {list(k.shape)} and V {list(v.shape)}, the model {mid} "
                             f"keeps K {list(mk.shape)} and V {list(mv.shape)}: it is not this model's cache")
    tuned = kvparts.analyse(tuning, {}, None, "drop")
    log(f"scoring the original cache on {where}")
    measure = PartsKLMeasure(tuned, model, ids[:T0], cont)
    info.update(measure="kl", tuning_tokens=T0, scored=where, scored_tokens=len(cont) - 1, model=mid)
    return measure, tuned


def _layer_tensors(pc) -> dict:
    from ..storage import hf_cache

    tensors = {e["name"]: t for e, t in zip(pc.entries, pc.tensors)}
    return hf_cache.layer_tensors(tensors, pc.entries)
