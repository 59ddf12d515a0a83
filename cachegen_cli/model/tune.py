"""The tuner behind ``cachegen tune``: per-layer relative steps that just meet a quality target.

The transform codec (format version 2) quantizes each (layer, K/V) *plane* with
a uniform step = relative step x the plane's RMS.  Planes differ by about two
orders of magnitude in how much an error in them hurts the model, so one step
for every plane wastes bits.  The tuner:

1. **estimates a sensitivity per plane** ``w_i``: the damage of quantizing that
   plane alone at relative step s is about ``w_i s^2``.  With the model, from its
   Fisher information (:meth:`KLMeasure.gradient_weights`: one forward and a few
   backward passes); otherwise (or with ``sensitivity="perturb"``) by measuring:
   the whole cache is encoded once at a probe step ``s0`` with the real codec,
   then each decoded plane alone replaces the original one, ``w_i = c_i / s0^2``.
2. **allocates steps.**  Every plane costs about ``-log2(step)`` bits per value
   and adds about ``w_i step_i^2`` damage; the smallest file for a given total
   damage has ``w_i step_i^2`` equal across planes, i.e. ``step_i = g u_i`` with
   ``u_i = (w_i / geomean(w))^-1/2``; by default the tuner goes half way,
   ``u_i ~ w_i^-1/4`` (``strength`` 0.5: smaller files and better transfer to
   other caches, measured in docs/tune.md).  Steps are clipped to ``[floor_i, max_step]``
   (``floor_i``: the smallest step whose levels do not clip, :func:`min_steps`)
   and rounded to 4 significant digits (what the config file stores, so the
   file reproduces what was measured).
3. **searches the global scale g** by bisection in log space on the real
   encode -> decode -> damage of the whole cache, and keeps the largest ``g``
   that meets the target.

The damage ("cost") is additive over planes and comes from a :class:`Measure`:

- :class:`KLMeasure` (``--target-kl``): the mean KL(original || decoded) of the
  model's next-token distributions over a scored continuation, computed by
  ``cachegen_cli.evaluate.score`` (the code behind ``cachegen eval``).
- :class:`AttentionMeasure` (``--target-error``, no model): the relative error
  of attention outputs computed from the cache alone (see the class).  Its
  cost is the mean over layers of the squared relative error; the target is
  given on its square root (an RMS relative error).

Functions take and return arrays and plain objects; nothing here prints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..methods.calibration import Calibration
from ..methods.config import MAX_STEP, MIN_STEP, TransformConfig
from ..errors import CacheGenError, ConfigError

#: Relative step of the sensitivity probe (the middle of the useful range: KL ~1e-2 on SmolLM2).
PROBE_STEP = 0.5
#: Largest relative step the tuner hands out.  Beyond ~2 x RMS most values round to their mean,
#: the plane's structure goes, and the small-step sensitivity no longer predicts the damage.
DEFAULT_MAX_STEP = 2.0
#: How far the allocation follows the sensitivities (u = w^(-strength/2)): 1 is the textbook
#: optimum of the quadratic model; 0.5 measured smaller files *and* a KL that transferred better
#: to other caches (docs/tune.md), the sensitivities of one cache being only an estimate.
DEFAULT_STRENGTH = 0.5
#: Significant digits of the steps written to the config file.
STEP_DIGITS = 4
#: Continuation tokens scored for the KL (as ``cachegen eval``) and, of those, for the per-plane sensitivities.
DEFAULT_CONTINUATION = 128
SENSITIVITY_TOKENS = 64
#: Proxy queries per layer for the attention measure.
ATTENTION_QUERIES = 256
#: Backward passes of the gradient (Fisher) sensitivity estimate.
GRADIENT_SAMPLES = 4

Log = Callable[[str], None]


class TuneError(CacheGenError):
    """The target cannot be met, or the inputs cannot be tuned on."""


# --- encoding --------------------------------------------------------------------


def roundtrip(data: torch.Tensor, num_kv_heads: int, head_dim: int, cfg: TransformConfig,
              calibration: Calibration | None = None) -> tuple[torch.Tensor, int]:
    """Encode ``data`` [L, 2, T, C] with ``cfg`` through the public API and decode it back.

    Returns (decoded [L, 2, T, C] in ``data``'s dtype, size of the .cgen bytes)."""
    from .. import api

    L, _, T, C = data.shape
    threads = torch.get_num_threads()  # numba's parallel kernels may reset OpenMP's thread count: keep torch's
    try:
        blob = api.encode(data.reshape(L, 2, T, num_kv_heads, head_dim), quantization=cfg, calibration=calibration,
                          device="cpu")
        out = api.decode(blob, device="cpu", calibration=calibration)["kv"].reshape(L, 2, T, C)
    finally:
        torch.set_num_threads(threads)
    return out, len(blob)


def config_from_steps(steps: np.ndarray, name: str = "tuned") -> TransformConfig:
    """A TransformConfig with one key and one value step per layer (``steps`` [L, 2])."""
    return TransformConfig("transform", tuple(float(s) for s in steps[:, 0]),
                           tuple(float(s) for s in steps[:, 1]), allocation="none", name=name)


# --- measures --------------------------------------------------------------------


class Measure:
    """An additive damage ("cost") of a decoded cache against the original."""

    #: what the user's target is on: "kl" (cost itself) or "error" (sqrt of the cost)
    kind = "cost"

    def cost(self, data: torch.Tensor) -> float:
        raise NotImplementedError

    def plane_cost(self, decoded: torch.Tensor, layer: int, kv: int) -> float:
        """Cost of the original cache with only plane (layer, kv) taken from ``decoded``."""
        raise NotImplementedError

    def target_cost(self, target: float) -> float:
        return target

    def value(self, cost: float) -> float:
        """The user-facing number (KL, or RMS relative error) of a cost."""
        return cost


def reference_from_cache(model: Any, data: torch.Tensor, num_kv_heads: int, head_dim: int,
                         context_ids: list[int], continuation_ids: list[int]) -> Any:
    """An ``evaluate.Reference`` whose original cache is ``data`` itself (no prefill):
    the cache a file holds *is* the original the tuner compares against."""
    from . import evaluate

    if len(continuation_ids) < 2:
        raise TuneError("the scored continuation needs at least 2 tokens")
    ref = evaluate.Reference(model, list(context_ids), list(continuation_ids), 0, num_kv_heads, head_dim,
                             data.dtype, data, data, torch.empty(0), [], {})
    t0 = time.perf_counter()
    logits = evaluate.teacher_forced_logits(model, evaluate.ref_layers(ref, data), ref.continuation_ids[:-1],
                                            ref.num_tokens)
    ref.logprobs = torch.log_softmax(logits.double(), dim=-1)
    ref.seconds["score"] = time.perf_counter() - t0
    return ref


class KLMeasure(Measure):
    """Mean KL(original || decoded) of the next-token distributions (nats), via ``evaluate.score``.

    ``ref`` is an ``evaluate.Reference`` (from ``evaluate.build_reference`` or
    :func:`reference_from_cache`); greedy generation is not run.  The
    per-plane sensitivities score only the first ``sensitivity_tokens``
    continuation tokens (teacher forcing is causal, so the reference log-probs
    are a prefix of the full ones)."""

    kind = "kl"

    def __init__(self, ref: Any, sensitivity_tokens: int = SENSITIVITY_TOKENS) -> None:
        self.ref = replace(ref, generate=0, greedy_tokens=[])
        n = max(1, min(sensitivity_tokens, len(ref.continuation_ids) - 1))
        self.sub_ref = replace(self.ref, continuation_ids=ref.continuation_ids[: n + 1], logprobs=ref.logprobs[:n])
        self.original = ref.cache
        self.evaluations = 0

    def _kl(self, ref: Any, data: torch.Tensor) -> float:
        from . import evaluate

        self.evaluations += 1
        return float(evaluate.score(ref, data)["kl_mean"])

    def cost(self, data: torch.Tensor) -> float:
        return self._kl(self.ref, data)

    def plane_cost(self, decoded: torch.Tensor, layer: int, kv: int) -> float:
        data = self.original.clone()
        data[layer, kv] = decoded[layer, kv]
        return self._kl(self.sub_ref, data)

    def gradient_weights(self, samples: int = GRADIENT_SAMPLES, sink_tokens: int = 1, seed: int = 0) -> np.ndarray:
        """float64 [L, 2]: the sensitivities w from the Fisher information of the cache (no probe encode).

        For a small perturbation d of the cache, KL(p || p_d) ~ 1/2 d^T F d with F the Fisher
        information.  Quantization noise of step s x rms is about uniform, variance (s rms)^2 / 12
        per value, so the expected KL of plane i alone is s^2 rms_i^2 tr(F_i) / 24, i.e.
        w_i = rms_i^2 tr(F_i) / 24 (tr(F_i) from :func:`fisher_traces`).  The first
        ``sink_tokens`` tokens, which the codec keeps verbatim, are left out."""
        data = self.ref.cache
        sink = min(sink_tokens, data.shape[2])
        x = data[:, :, sink:].double()
        rms2 = (x - x.mean(dim=2, keepdim=True)).pow(2).mean(dim=(2, 3)).numpy()  # [L, 2]
        tr = fisher_traces(self.ref, samples, sink_tokens, seed)
        self.evaluations += 1
        return rms2 * tr / 24.0


def fisher_traces(ref: Any, samples: int = GRADIENT_SAMPLES, sink_tokens: int = 1, seed: int = 0,
                  per_token: bool = False) -> np.ndarray:
    """float64 [L, 2]: tr(F_i) of each plane's block of the Fisher information of the mean
    next-token log-likelihood over ``ref``'s scored continuation, tokens below ``sink_tokens`` left out
    (``per_token``: [L, 2, T], each token's share, the sink tokens' entries 0).

    tr(F_i) = E_y ||grad_i (1/n) sum_t log p_t(y_t)||^2 x n with y_t drawn from the original
    next-token distributions (Hutchinson-style; the cross terms between positions vanish in
    expectation): one forward pass and ``samples`` backward passes."""
    from . import evaluate

    model = ref.model
    dtype = next(model.parameters()).dtype
    data = ref.cache
    L, _, T, C = data.shape
    sink = min(sink_tokens, T)
    leaves = [(k.requires_grad_(True), v.requires_grad_(True))
              for k, v in evaluate.layers_from_internal(data, ref.num_kv_heads, ref.head_dim, dtype)]
    flat = [t for kv in leaves for t in kv]
    ids = ref.continuation_ids[:-1]
    n = len(ids)
    kwargs = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.arange(ref.num_tokens, ref.num_tokens + n, dtype=torch.long).unsqueeze(0),
        evaluate._cache_kw(model): evaluate.make_cache(model, leaves),
        "use_cache": True,
    }
    if "cache_position" in evaluate.forward_params(model):
        kwargs["cache_position"] = torch.arange(ref.num_tokens, ref.num_tokens + n, dtype=torch.long)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            logp = torch.log_softmax(model(**kwargs).logits[0].float(), dim=-1)  # [n, vocab]
            gen = torch.Generator().manual_seed(seed)
            probs = logp.detach().exp()
            tr = np.zeros((L, 2, T), np.float64)
            for i in range(samples):
                y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                total = logp[torch.arange(n), y].sum()
                grads = torch.autograd.grad(total, flat, retain_graph=i + 1 < samples)
                for l in range(L):
                    for kv in range(2):
                        g2 = grads[2 * l + kv][:, :, sink:].double().pow(2).sum(dim=(0, 1, 3))  # [T - sink]
                        tr[l, kv, sink:] += g2.numpy()
    finally:
        for p in params:
            p.requires_grad_(True)
    tr /= samples * n
    return tr if per_token else tr.sum(axis=2)


#: Backward passes per sample cache of the calibration sensitivities (a one-off cost, so more
#: than the tuner's: the per-plane estimates are noisy).
CALIBRATION_SAMPLES = 8


def sensitivity_from_caches(model: Any, caches: list[tuple[torch.Tensor, list[int]]], num_kv_heads: int,
                            head_dim: int, *, continuation: int = DEFAULT_CONTINUATION,
                            samples: int = CALIBRATION_SAMPLES, sink_tokens: int = 1, log: Log | None = None) -> np.ndarray:
    """float64 [L, 2]: how much an error of a given size in each (layer, K/V) plane changes the
    model's predictions, per value (the mean diagonal Fisher information of the plane), from
    sample caches with their token ids, normalized to a geometric mean of 1.

    Each cache [L, 2, T, C] is split as ``cachegen tune`` does without a text: its last
    ``min(continuation, (T - 1) // 2)`` tokens are held out and scored on the cache of the
    tokens before them.  Each cache's estimate is normalized before the caches are averaged
    (texts differ in how predictable they are; the allocation needs the shape)."""
    if not caches:
        raise TuneError("sensitivities need at least one sample cache")
    total = None
    for i, (data, ids) in enumerate(caches):
        L, _, T, C = data.shape
        if len(ids) != T:
            raise TuneError(f"sample {i}: {len(ids)} token ids for {T} tokens")
        n = min(continuation, (T - 1) // 2)
        if n < 8:
            raise TuneError(f"sample {i} holds only {T} tokens: too few to hold out a continuation to score")
        T0 = T - n - 1
        part = data[:, :, :T0].contiguous()
        ref = reference_from_cache(model, part, num_kv_heads, head_dim, ids[:T0], ids[T0:T])
        t0 = time.perf_counter()
        per_value = fisher_traces(ref, samples, sink_tokens) / max((T0 - min(sink_tokens, T0)) * C, 1)
        per_value = np.maximum(per_value, 1e-300)
        per_value /= np.exp(np.log(per_value).mean())
        total = per_value if total is None else total + per_value
        if log:
            log(f"sensitivity of sample {i + 1}/{len(caches)}: {T0} tokens, {n} scored ({time.perf_counter() - t0:.0f} s)")
    s = total / len(caches)
    return s / np.exp(np.log(s).mean())


class AttentionMeasure(Measure):
    """Relative error of attention outputs, from the cache alone (no model).

    For each layer and KV head, the cache's own keys at ``queries`` positions
    spread evenly over the context serve as proxy queries (a real query of a
    later token is not in the cache; keys live in the same RoPE'd space and
    their dot products with the other keys are of the same kind).  Query ``p``
    attends causally to the keys of tokens ``0 .. p-1`` (itself excluded, else
    it would mostly attend to itself): ``o_p = softmax(K[<p] q_p / sqrt(D)) V[<p]``.
    The queries stay the original keys; the decoded keys and values replace
    the originals.  Per layer, ``e_l = ||O' - O|| / ||O||`` over all heads and
    queries; the cost is ``mean_l e_l^2`` and the user's target is on
    ``sqrt(cost)``, the RMS over layers of the relative error.
    """

    kind = "error"

    def __init__(self, data: torch.Tensor, num_kv_heads: int, head_dim: int, queries: int = ATTENTION_QUERIES) -> None:
        L, _, T, C = data.shape
        if T < 2:
            raise TuneError(f"the cache holds {T} token(s); the attention measure needs at least 2")
        self.L, self.H, self.D = L, num_kv_heads, head_dim
        n = min(queries, T - 1)
        self.pos = torch.unique(torch.linspace(1, T - 1, n).round().long())
        self.original = data
        keys = torch.arange(T)
        self.mask = keys.unsqueeze(0) < self.pos.unsqueeze(1)  # [P, T]: key j visible to query p when j < p
        self.q = [self._heads(data[l, 0])[:, self.pos] for l in range(L)]
        self.out = [self._attend(l, data[l, 0], data[l, 1]) for l in range(L)]
        self.norm2 = [float(o.pow(2).sum()) for o in self.out]
        self.evaluations = 0

    def _heads(self, plane: torch.Tensor) -> torch.Tensor:
        T = plane.shape[0]
        return plane.float().reshape(T, self.H, self.D).transpose(0, 1)  # [H, T, D]

    def _attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        K, V = self._heads(k), self._heads(v)
        scores = torch.matmul(self.q[layer], K.transpose(1, 2)) / math.sqrt(self.D)  # [H, P, T]
        scores = scores.masked_fill(~self.mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), V)

    def layer_cost(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> float:
        o = self._attend(layer, k, v)
        err = float((o - self.out[layer]).pow(2).sum())
        return err / self.norm2[layer] if self.norm2[layer] > 0 else err

    def cost(self, data: torch.Tensor) -> float:
        self.evaluations += 1
        return sum(self.layer_cost(l, data[l, 0], data[l, 1]) for l in range(self.L)) / self.L

    def plane_cost(self, decoded: torch.Tensor, layer: int, kv: int) -> float:
        self.evaluations += 1
        k = decoded[layer, 0] if kv == 0 else self.original[layer, 0]
        v = decoded[layer, 1] if kv == 1 else self.original[layer, 1]
        return self.layer_cost(layer, k, v) / self.L

    def target_cost(self, target: float) -> float:
        return target * target

    def value(self, cost: float) -> float:
        return math.sqrt(max(cost, 0.0))


# --- the three steps ----------------------------------------------------------------


def measure_sensitivity(data: torch.Tensor, num_kv_heads: int, head_dim: int, measure: Measure, *,
                        probe_step: float = PROBE_STEP, calibration: Calibration | None = None,
                        log: Log | None = None) -> np.ndarray:
    """float64 [L, 2]: w = cost of quantizing that plane alone at ``probe_step`` / probe_step^2."""
    log = log or (lambda m: None)
    L = data.shape[0]
    decoded, _ = roundtrip(data, num_kv_heads, head_dim,
                           TransformConfig("transform", (probe_step,), (probe_step,)), calibration)
    w = np.zeros((L, 2), np.float64)
    t0 = time.perf_counter()
    for l in range(L):
        for kv in range(2):
            w[l, kv] = max(measure.plane_cost(decoded, l, kv), 0.0) / probe_step**2
        if l == 0 or (l + 1) % 10 == 0:
            log(f"sensitivity: layer {l + 1}/{L} ({time.perf_counter() - t0:.0f} s)")
    return w


def _round_sig(x: np.ndarray, digits: int = STEP_DIGITS) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.floor(np.log10(np.abs(x)))
    f = 10.0 ** (digits - 1 - e)
    return np.round(x * f) / f


def allocation_shape(weights: np.ndarray, strength: float = 1.0) -> np.ndarray:
    """u [L, 2] with geometric mean 1 and ``w_i u_i^2`` equal: the relative step of each plane.
    Planes with (near) zero weight are floored at 1e-6 of the largest weight.  ``strength`` < 1
    shrinks the allocation towards one step for all (u = w^(-strength/2)), 0 gives uniform steps."""
    w = np.asarray(weights, np.float64)
    top = float(w.max(initial=0.0))
    if not np.isfinite(w).all() or top <= 0:
        return np.ones_like(w)
    w = np.maximum(w, top * 1e-6)
    u = w ** (-0.5 * strength)
    return u / math.exp(float(np.log(u).mean()))


def min_steps(data: torch.Tensor, calibration: Calibration | None = None, sink_tokens: int = 1) -> np.ndarray:
    """float64 [L, 2]: the smallest relative step of each plane whose levels fit the codec's
    +-TRANSFORM_QMAX without clipping (largest |coordinate - mean| / (QMAX x RMS), plus 1 % for the
    bf16 rounding of the stored step), at least MIN_STEP.  Below it the outliers clip and the damage
    grows again (measured: KL 2.1e-3 at a uniform step of 0.12 against 1.3e-4 at these floors)."""
    from ..kernels.transform import TRANSFORM_QMAX

    L, _, T, C = data.shape
    out = np.full((L, 2), MIN_STEP, np.float64)
    sink = min(sink_tokens, T)
    if T - sink < 1:
        return out
    for l in range(L):
        for kv in range(2):
            y = data[l, kv, sink:].double()
            if calibration is not None:
                y = y @ torch.from_numpy(calibration.dense(l, kv)).double()
            y = y - y.mean(dim=0, keepdim=True)
            rms = float(y.pow(2).mean().sqrt())
            if rms > 0:
                out[l, kv] = max(MIN_STEP, 1.01 * float(y.abs().max()) / (TRANSFORM_QMAX * rms))
    return out


def steps_for(shape: np.ndarray, scale: float, max_step: float = DEFAULT_MAX_STEP,
              floor: np.ndarray | float = MIN_STEP) -> np.ndarray:
    """Relative steps [L, 2] = scale x shape, clipped to [floor, max_step], rounded as written to files."""
    floor = np.minimum(np.maximum(np.asarray(floor, np.float64), MIN_STEP), max_step)
    s = np.clip(scale * np.asarray(shape, np.float64), floor, max_step)
    s = _round_sig(s)
    up = _round_sig(floor * (1 + 10.0 ** -(STEP_DIGITS - 1)))  # the floor, rounded up
    return np.clip(np.maximum(s, np.minimum(up, max_step)), MIN_STEP, max_step)


@dataclass
class Trial:
    scale: float
    cost: float
    bytes: int
    steps: np.ndarray = field(repr=False)


def search_scale(evaluate: Callable[[np.ndarray], tuple[float, int]], shape: np.ndarray, target_cost: float, *,
                 start: float = PROBE_STEP, max_step: float = DEFAULT_MAX_STEP, floor: np.ndarray | float = MIN_STEP,
                 rel_tol: float = 0.03, max_trials: int = 16, log: Log | None = None) -> tuple[Trial, list[Trial]]:
    """Largest global scale whose steps meet ``target_cost``: bracket by doubling / halving, then
    bisect in log space until the bracket is within ``rel_tol``.  ``evaluate(steps)`` returns
    (cost, bytes).  Returns the best trial that meets the target (fewest bytes) and all trials."""
    log = log or (lambda m: None)
    trials: list[Trial] = []
    seen: dict[bytes, Trial] = {}

    def run(scale: float) -> Trial:
        steps = steps_for(shape, scale, max_step, floor)
        key = steps.tobytes()
        if key not in seen:
            cost, nbytes = evaluate(steps)
            seen[key] = Trial(scale, cost, nbytes, steps)
            trials.append(seen[key])
            log(f"scale {scale:.4g}: cost {cost:.4g} (target {target_cost:.4g}), {nbytes:,} bytes")
        t = seen[key]
        return Trial(scale, t.cost, t.bytes, t.steps)

    lo_limit = float(np.min(np.maximum(floor, MIN_STEP) / shape))  # every step at its floor below this
    hi_limit = max_step / float(np.min(shape))  # every step at max_step above this
    t = run(start)
    lo = hi = None
    if t.cost <= target_cost:
        lo = t
        while len(trials) < max_trials and lo.scale < hi_limit:
            t = run(min(lo.scale * 2, hi_limit))
            if t.cost <= target_cost:
                lo = t
            else:
                hi = t
                break
    else:
        hi = t
        while len(trials) < max_trials and hi.scale > lo_limit:
            t = run(max(hi.scale / 2, lo_limit))
            if t.cost <= target_cost:
                lo = t
                break
            hi = t
    if lo is None:
        met = (f"the target cannot be met even with the smallest steps (cost {hi.cost:.3g} at relative step "
               f"{float(hi.steps.min()):.3g}); use a looser target or")
        raise TuneError(f"{met} quality='lossless'", cli=f"{met} --quality lossless")
    while hi is not None and len(trials) < max_trials and hi.scale / lo.scale > 1 + rel_tol:
        t = run(math.sqrt(lo.scale * hi.scale))
        if t.cost <= target_cost:
            lo = t
        else:
            hi = t
    ok = [t for t in trials if t.cost <= target_cost]
    best = min(ok, key=lambda t: (t.bytes, -t.scale))
    return best, trials


# --- the whole tuner ----------------------------------------------------------------


@dataclass
class TuneResult:
    steps: np.ndarray  # [L, 2] relative steps (K, V)
    weights: np.ndarray  # [L, 2] sensitivities w_i
    kind: str  # "kl" or "error"
    target: float
    achieved: float  # KL or RMS relative error on the tuning cache
    file_bytes: int
    values: int
    original_bytes: int
    scale: float
    trials: list[Trial]
    evaluations: int
    seconds: float
    calibration: bool = False

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.file_bytes / max(self.values, 1)

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(self.file_bytes, 1)

    @property
    def config(self) -> TransformConfig:
        return config_from_steps(self.steps)


def tune(data: torch.Tensor, num_kv_heads: int, head_dim: int, measure: Measure, target: float, *,
         calibration: Calibration | None = None, weights: np.ndarray | None = None,
         probe_step: float = PROBE_STEP, max_step: float = DEFAULT_MAX_STEP, uniform: bool = False,
         sensitivity: str = "gradient", strength: float = DEFAULT_STRENGTH, log: Log | None = None) -> TuneResult:
    """Per-layer relative steps for ``data`` [L, 2, T, C] that meet ``target`` (on ``measure``) with the
    smallest file.  ``weights``: sensitivities from an earlier :func:`measure_sensitivity` (else measured
    here: ``sensitivity="gradient"`` (the Fisher estimate, with a KLMeasure) or ``"perturb"`` (one probe
    encode, then each plane alone); the attention measure always perturbs); ``uniform=True`` searches one
    step for every plane instead (a baseline)."""
    log = log or (lambda m: None)
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise ConfigError(f"the target must be a positive number, got {target!r}")
    if not MIN_STEP <= max_step <= MAX_STEP:
        raise ConfigError(f"the largest step must be between {MIN_STEP} and {MAX_STEP}, got {max_step}")
    t0 = time.perf_counter()
    L = data.shape[0]
    if calibration is not None:
        calibration.check_shape(L, data.shape[3])
    if uniform:
        weights = np.ones((L, 2))
    elif weights is None:
        if sensitivity == "gradient" and isinstance(measure, KLMeasure):
            log(f"estimating the sensitivity of {L} layers x K/V from the model's gradients")
            weights = measure.gradient_weights()
        elif sensitivity in ("gradient", "perturb"):
            log(f"measuring the sensitivity of {L} layers x K/V at relative step {probe_step}")
            weights = measure_sensitivity(data, num_kv_heads, head_dim, measure, probe_step=probe_step,
                                          calibration=calibration, log=log)
        else:
            raise ConfigError(f"unknown sensitivity method {sensitivity!r}; use gradient or perturb")
    shape = allocation_shape(weights, strength)
    floor = min_steps(data, calibration)

    def evaluate(steps: np.ndarray) -> tuple[float, int]:
        decoded, nbytes = roundtrip(data, num_kv_heads, head_dim, config_from_steps(steps), calibration)
        return measure.cost(decoded), nbytes

    best, trials = search_scale(evaluate, shape, measure.target_cost(target), start=probe_step,
                                max_step=max_step, floor=floor, log=log)
    values = int(data.numel())
    return TuneResult(best.steps, np.asarray(weights, np.float64), measure.kind, float(target),
                      measure.value(best.cost), best.bytes, values, values * data.element_size(), best.scale,
                      trials, int(getattr(measure, "evaluations", 0)), time.perf_counter() - t0,
                      calibration is not None)


# --- the config file ------------------------------------------------------------------


def _toml_list(values: np.ndarray, per_line: int = 8) -> str:
    items = [f"{float(v):.{STEP_DIGITS}g}" for v in values]
    lines = [", ".join(items[i : i + per_line]) for i in range(0, len(items), per_line)]
    return "[\n" + "".join(f"    {line},\n" for line in lines) + "]"


def to_toml(result: TuneResult, *, source: str = "", calibration_path: str | None = None) -> str:
    """The config file ``cachegen encode --config`` reads (docs/config.md)."""
    what = "mean KL" if result.kind == "kl" else "attention RMS relative error"
    unit = " nats" if result.kind == "kl" else ""
    comment = (f"cachegen tune{' of ' + source if source else ''}: {what} target {result.target:.4g}{unit}, "
               f"achieved {result.achieved:.4g} on the tuning cache at {result.bits_per_value:.3f} bits/value")
    lines = [
        "# Written by `cachegen tune`: per-layer relative quantization steps (format version 2).",
        f"# Use: cachegen encode KV.safetensors --config THIS_FILE"
        + (f" --calibration {calibration_path}" if calibration_path else ""),
    ]
    if result.calibration:
        lines.append("# The steps were tuned with a calibration (rotation); encode with the same one.")
    lines += [
        f"comment = {_toml_string(comment)}",
        'method = "transform"',
        "sink_tokens = 1",
        "token_delta = true",
        'allocation = "none"  # the steps below are already per layer: no calibration sensitivities on top',
        f"key_step = {_toml_list(result.steps[:, 0])}",
        f"value_step = {_toml_list(result.steps[:, 1])}",
        "",
    ]
    return "\n".join(lines)


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --- files ----------------------------------------------------------------------------


def default_output(src) -> "Path":
    from pathlib import Path

    src = Path(src)
    return src.with_name(src.stem + ".tune.toml")


def tune_file(
    kv_path,
    output=None,
    *,
    target_kl: float | None = None,
    target_error: float | None = None,
    model_path=None,
    text_path=None,
    calibration_path=None,
    continuation: int = DEFAULT_CONTINUATION,
    max_step: float = DEFAULT_MAX_STEP,
    strength: float = DEFAULT_STRENGTH,
    force: bool = False,
    loaded: Any = None,
    log: Log | None = None,
    checked_only: bool = False,
) -> dict[str, Any]:
    """``cachegen tune``: tune a KV .safetensors file and write the config file (atomically).
    (A cache of several shapes: model/tune_parts.tune_any_file, which checks the arguments here
    with ``checked_only``.)

    ``target_kl`` (needs the model and the token ids ``cachegen capture`` stores) or
    ``target_error`` (no model).  The KL is scored on the ``continuation`` tokens of
    ``text_path`` after the context or, without a text, on the last tokens of the
    context itself (held out: the tuning cache is then the cache of the tokens
    before them, an exact prefix of the file's cache).  ``loaded``: an already
    loaded (model, tokenizer) or a function returning one, called once the inputs
    are checked.  Returns a JSON-able summary."""
    from pathlib import Path

    from . import evaluate
    from ..methods.calibration import load as load_calibration
    from ..errors import InputError, InputNotFoundError
    from ..storage.outputs import atomic_output, check_output

    log = log or (lambda m: None)
    t_start = time.perf_counter()
    # Messages name this function's keywords; cli= the `cachegen tune` flags they come from.
    given = [(kw, flag) for kw, flag, v in (("target_kl=", "--target-kl", target_kl),
                                          ("target_error=", "--target-error", target_error)) if v is not None]
    if not given:
        raise ConfigError("give one target: target_kl= (with the model) or target_error= (without)",
                          cli="give one target: --target-kl (with the model) or --target-error (without)")
    if len(given) > 1:
        raise ConfigError("give only one of target_kl= and target_error=",
                          cli="give only one of --target-kl and --target-error")
    target = float(target_kl if target_kl is not None else target_error)
    if not (math.isfinite(target) and target > 0):
        raise ConfigError(f"{given[0][0]} must be a positive number, got {target:g}",
                          cli=f"{given[0][1]} must be a positive number, got {target:g}")
    if target_error is not None and (model_path is not None or text_path is not None):
        raise ConfigError("model_path= and text_path= are only used with target_kl=; target_error= needs no model",
                          cli="--model and --text are only used with --target-kl; --target-error needs no model")
    if not isinstance(continuation, int) or continuation < 1:
        raise ConfigError(f"continuation= must be at least 1, got {continuation}",
                          cli=f"--continuation must be at least 1, got {continuation}")
    if not MIN_STEP <= max_step <= MAX_STEP:
        raise ConfigError(f"max_step= must be between {MIN_STEP} and {MAX_STEP}, got {max_step:g}",
                          cli=f"--max-step must be between {MIN_STEP} and {MAX_STEP}, got {max_step:g}")
    if not 0 <= strength <= 1:
        raise ConfigError(f"strength= must be between 0 and 1, got {strength:g}",
                          cli=f"--strength must be between 0 and 1, got {strength:g}")
    src = Path(kv_path)
    from ..storage.outputs import check_input

    check_input(src)
    dst = Path(output) if output is not None else default_output(src)
    inputs = [src] + [Path(p) for p in (calibration_path, text_path) if p is not None]
    check_output(dst, inputs, force)
    if checked_only:
        return {"src": src, "dst": dst}
    cal = load_calibration(calibration_path) if calibration_path is not None else None
    kv = evaluate.read_kv_file(src)
    if kv.kind != "safetensors":
        raise InputError(f"{src} is a .cgen file; tune needs the original cache (.safetensors from cachegen capture)")
    L, _, T, C = kv.data.shape
    if cal is not None:
        cal.check_shape(L, C)
    if T < 2:
        raise TuneError(f"{src} holds {T} token(s); tuning needs at least 2")
    info: dict[str, Any] = {"file": str(src), "output": str(dst), "num_layers": L, "tokens": T,
                            "dtype": str(kv.data.dtype).replace("torch.", ""),
                            "calibration": str(calibration_path) if calibration_path is not None else None}
    if target_error is not None:
        data = kv.data
        log(f"attention-output proxy on {T} tokens")
        measure: Measure = AttentionMeasure(data, kv.num_kv_heads, kv.head_dim)
        info.update(measure="attention", tuning_tokens=T)
    else:
        from .capture import ModelError, TextError, _resolve_loaded, model_id, read_text, resolve_model_path, text_sha256

        try:
            ids = evaluate.context_of(kv)
        except evaluate.NoTokenIdsError as exc:
            first = str(exc).split(';')[0]
            raise evaluate.NoTokenIdsError(
                f"{first}; target_kl= needs a cache made by `cachegen capture` (use target_error= to tune without a "
                "model)", cli=f"{first}; --target-kl needs a cache made by `cachegen capture` (use --target-error to "
                "tune without a model)") from None
        text = read_text(text_path) if text_path is not None else None
        if text is not None:
            want = kv.metadata.get("text_sha256")
            if want is not None and want != text_sha256(text):
                raise TextError(f"{text_path} is not the text {src.name} was captured from (sha256 mismatch)")
        resolved = resolve_model_path(model_path)
        model, tokenizer = _resolve_loaded(loaded, resolved, log)
        Lm, Hm, Dm = evaluate.model_shape(model)
        if (L, kv.num_kv_heads, kv.head_dim) != (Lm, Hm, Dm):
            raise ModelError(f"the cache has {L} layers x {kv.num_kv_heads} KV heads x {kv.head_dim} dims, the "
                             f"model {model_id(model)} {Lm} x {Hm} x {Dm}: it is not this model's cache")
        if text is not None:
            T0, cont = T, evaluate.text_continuation(tokenizer, text, text_path, ids, continuation)
            where = f"the next {continuation} tokens of {Path(text_path).name}"
        else:
            n = min(continuation, (T - 1) // 2)
            if n < 8:
                few = f"{src} holds only {T} tokens: too few to hold out a continuation to score; pass"
                raise TuneError(f"{few} text_path= (the text it was captured from)",
                                cli=f"{few} --text (the text it was captured from)")
            T0 = T - n - 1
            cont = ids[T0:T]
            where = f"the last {n} tokens of the context (held out; tuned on the first {T0} tokens)"
        data = kv.data[:, :, :T0].contiguous()
        log(f"scoring the original cache on {where}")
        ref = reference_from_cache(model, data, kv.num_kv_heads, kv.head_dim, ids[:T0], cont)
        measure = KLMeasure(ref)
        info.update(measure="kl", tuning_tokens=T0, scored=where, scored_tokens=len(cont) - 1,
                    model=model_id(model))
    result = tune(data, kv.num_kv_heads, kv.head_dim, measure, target, calibration=cal, max_step=max_step,
                  strength=strength, log=log)
    return write_result(result, src, dst, calibration_path, info, t_start)


def write_result(result, src: Path, dst: Path, calibration_path, info: dict, t_start: float) -> dict:
    """Write ``result`` as the TOML config file ``dst`` (atomically) and return ``info`` with its
    figures: what tune_file (and tune_parts.tune_any_file) report."""
    from ..storage.outputs import atomic_output

    body = to_toml(result, source=src.name, calibration_path=str(calibration_path) if calibration_path else None)
    with atomic_output(dst) as tmp:
        tmp.write_text(body, encoding="utf-8")
    info.update(
        kind=result.kind, target=result.target, achieved=result.achieved, bits_per_value=result.bits_per_value,
        ratio=result.ratio, file_bytes=result.file_bytes, original_bytes=result.original_bytes,
        key_step=[float(s) for s in result.steps[:, 0]], value_step=[float(s) for s in result.steps[:, 1]],
        sensitivity_key=[float(w) for w in result.weights[:, 0]],
        sensitivity_value=[float(w) for w in result.weights[:, 1]],
        trials=len(result.trials), evaluations=result.evaluations, seconds=time.perf_counter() - t_start,
    )
    return info
