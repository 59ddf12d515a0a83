#!/usr/bin/env python3
"""Would per-channel steps pay (issue "Smaller at the same quality on every cache", item 3: the
bits where the model needs them)?  A sensitivity calibration scales each (layer, K/V) plane's
step by the model's mean Fisher information of the plane; within a plane every channel has the
same step.  The Fisher information per channel varies 200-400x inside a plane (median over the
planes of SmolLM2's 1024-token caches), so this measures per-channel steps from the other texts'
per-channel Fisher information (leave one out, each text's normalised to a geometric mean of 1):
step_c = the plane's step x a_c^-1, a_c = (F_c / geometric mean over the plane's channels)^(gamma/2),
clipped to [1/8, 8] and renormalised to a geometric mean of 1 (about the same bits).

The format has one step per plane, so the files are emulated: each channel is multiplied by a_c
before encoding (a float32 cache: no rounding), one step per plane in the scaled domain (the
plane's relative step corrected for the scaled RMS, so its absolute step stays the per-plane
variant's), and the decoded channel divided by a_c.  The size is the real file's (its tables and
entropy of the scaled channels); a format with per-channel steps would add about one byte per
channel.  Variants: "plane" (the per-plane allocation of methods/transform.allocate from the same
sensitivities, steps as `cachegen tune` writes them) and "channelG" for each gamma, without a
rotation; with ``--calibrated`` the same with calibrate's default rotation (measure_calibrated:
the Fisher information of the rotated, RoPE-free components from the gradients' second moments).
The caches are scripts/preset_targets.py's 13 (SmolLM2-135M-Instruct, 1024 and 4096 tokens),
``--quality balanced`` with its steps times each scale; LMCache's KL and exact size on each cache.

    python scripts/channel_steps.py --scales 2,2.5,3 --gammas 1,0.5 --json docs/results/DATE_channel_steps.json
    python scripts/recent_tiers.py --report docs/results/DATE_channel_steps.json   # the same tables
    python scripts/channel_steps.py --calibrated --scales 2,2.5,3 --gammas 0.5 --json ...   # with the rotation
    python scripts/channel_steps.py --report RESULTS   # the tables again
    python scripts/channel_steps.py --spread    # the Fisher information's spread inside the planes
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from dataclasses import replace  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods.config import QUALITY_PRESETS  # noqa: E402
from cachegen_cli.methods.transform import allocate  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402
import preset_targets  # noqa: E402
import rope_gain  # noqa: E402

CT = preset_targets.CHUNK_TOKENS
#: a_c's clip
CLIP = 8.0
#: measure_calibrated: no component's step so fine that its levels would pass this (the format's
#: levels stop at TRANSFORM_QMAX = 127; today's per-plane steps stay well inside it)
LEVEL_REACH = 100.0


def sampled_gradients(ref, samples: int, seed: int = 0):
    """Yield, for each of ``samples`` continuations drawn from the model's own next-token
    distributions over ref's continuation (tune.fisher_traces' Hutchinson-style estimate), the
    gradient of their summed log-likelihood with respect to the cache: float32 [L, 2, T, C] in
    the cache's layout (keys as the model holds them, with their RoPE).  One forward pass."""
    model = ref.model
    dtype = next(model.parameters()).dtype
    L, _, T, C = ref.cache.shape
    leaves = [(k.requires_grad_(True), v.requires_grad_(True))
              for k, v in evaluate.layers_from_internal(ref.cache, ref.num_kv_heads, ref.head_dim, dtype)]
    flat = [t for kv in leaves for t in kv]
    ids = ref.continuation_ids[:-1]
    n = len(ids)
    kwargs = {"input_ids": torch.tensor([ids]), "position_ids": torch.arange(T, T + n).unsqueeze(0),
              evaluate._cache_kw(model): evaluate.make_cache(model, leaves), "use_cache": True}
    if "cache_position" in evaluate.forward_params(model):
        kwargs["cache_position"] = torch.arange(T, T + n)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            logp = torch.log_softmax(model(**kwargs).logits[0].float(), dim=-1)
            gen = torch.Generator().manual_seed(seed)
            probs = logp.detach().exp()
            for i in range(samples):
                y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                grads = torch.autograd.grad(logp[torch.arange(n), y].sum(), flat, retain_graph=i + 1 < samples)
                g = torch.stack([torch.stack([grads[2 * l], grads[2 * l + 1]]) for l in range(L)])  # [L, 2, 1, H, T, D]
                yield g[:, :, 0].permute(0, 1, 3, 2, 4).reshape(L, 2, T, C).float()
    finally:
        for p in params:
            p.requires_grad_(True)


def channel_fisher(ref, samples: int = 8, sink: int = 1, seed: int = 0) -> np.ndarray:
    """float64 [L, 2, C]: each channel's mean diagonal Fisher information of the next-token
    log-likelihood over ref's continuation (tune.fisher_traces' estimate, summed over the tokens
    from ``sink`` on instead of over the channels)."""
    L, _, T, C = ref.cache.shape
    out = torch.zeros(L, 2, C, dtype=torch.float64)
    for g in sampled_gradients(ref, samples, seed):
        out += g[:, :, sink:].double().pow(2).sum(dim=2)
    return (out / (samples * (len(ref.continuation_ids) - 1))).numpy()


def gradient_moments(ref, rope, heads: int, samples: int = 8, sink: int = 1, seed: int = 0) -> np.ndarray:
    """float64 [L, 2, H, D, D]: per (layer, K/V, KV head) the second moment, summed over the
    samples and tokens from ``sink`` on and divided as channel_fisher's, of the gradients with
    respect to the coded coordinates before a rotation: the keys without their RoPE (the gradient
    turned back by the same angles: RoPE is orthogonal per token), the values as they are.  A
    rotation R's components then have the Fisher information diag(R^T G R)."""
    from cachegen_cli.methods import rope as rope_methods

    L, _, T, C = ref.cache.shape
    D = C // heads
    out = torch.zeros(L, 2, heads, D, D, dtype=torch.float64)
    for g in sampled_gradients(ref, samples, seed):
        g = rope_methods.unturn(g, rope, sink).double()[:, :, sink:].reshape(L, 2, T - sink, heads, D)
        out += torch.einsum("lkthc,lkthd->lkhcd", g, g)
    return (out / (samples * (len(ref.continuation_ids) - 1))).numpy()


def component_fisher(R: np.ndarray, G: np.ndarray) -> np.ndarray:
    """[..., D]: diag(R^T G R) per block, the Fisher information of the components y = x R (R
    [..., D, D], G the gradients' second moments [..., D, D])."""
    return np.einsum("...cd,...ce,...ed->...d", R, G, R)


def unscale_matrix(P: np.ndarray) -> np.ndarray:
    """(P P^T)^-1 per block: a decoder that rotated back by P^T what was coded as x P gives x' =
    y' P^T, and x = y' P^-1 = x' (P P^T)^-1."""
    return np.linalg.inv(np.einsum("...cd,...ed->...ce", P, P))


def gm(x, axis=None, keepdims=False):
    return np.exp(np.log(x).mean(axis, keepdims=keepdims))


def channel_factors(FA: np.ndarray, gamma: float) -> np.ndarray:
    """a [L, 2, C]: (FA / its geometric mean over each plane's channels)^(gamma / 2), clipped to
    [1/CLIP, CLIP], with a geometric mean of 1 per plane."""
    a = np.clip((FA / gm(FA, 2, True)) ** (gamma / 2), 1 / CLIP, CLIP)
    return a / gm(a, 2, True)


def spread(log) -> None:
    """Per text (1024-token caches): the median over the planes of the largest / smallest
    channel's Fisher information, for keys and values apart."""
    model, tok = capture.load_model(capture.find_default_model())
    refs = rope_gain.references(model, tok, [1024], preset_targets.CONTINUATION, preset_targets.texts())
    print("| text | keys: median max / min F in a plane | values |")
    print("|---|---:|---:|")
    for (name, _), ref in refs.items():
        F = np.maximum(channel_fisher(ref), 1e-30)
        r = F.max(axis=2) / F.min(axis=2)
        print(f"| {name} | {np.median(r[:, 0]):.0f}x | {np.median(r[:, 1]):.0f}x |", flush=True)


def _row(ref, name, ctx, variant, scale, decoded, bits, lm, log) -> dict:
    """One result row (the decoded cache scored against ref's continuation), logged."""
    s = evaluate.score(ref, decoded.to(ref.cache.dtype))
    row = dict(text=name, context=ctx, schedule=variant, step_scale=scale, bits_per_value=bits / ref.cache.numel(),
               kl=s["kl_mean"], top1=s["top1_agreement"], **lm)
    log(f"# {name} {ctx} {variant} x{scale:g}: {row['bits_per_value']:.3f} bits "
        f"({row['bits_per_value'] / lm['lmcache_bits_per_value']:.3f} of LMCache) KL {row['kl']:.2e} "
        f"({row['kl'] / lm['lmcache_kl']:.2f} of LMCache) top1 {row['top1']:.3f}")
    return row


def measure(scales, gammas, log) -> list[dict]:
    model, tok = capture.load_model(capture.find_default_model())
    refs = rope_gain.references(model, tok, [1024, 4096], preset_targets.CONTINUATION, preset_targets.texts())
    F = {}
    for (name, ctx), ref in refs.items():
        if ctx == 1024:
            t0 = time.perf_counter()
            F[name] = np.maximum(channel_fisher(ref), 1e-30)
            log(f"# Fisher information of {name} ({time.perf_counter() - t0:.0f} s)")
    base = QUALITY_PRESETS["balanced"]
    rows = []
    for (name, ctx), ref in refs.items():
        L, _, T, C = ref.cache.shape
        x = ref.cache.float()
        lm = preset_targets.lmcache_scores(ref, ref.cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim))
        others = [o for o in F if o != name]
        FA = sum(F[o] / gm(F[o]) for o in others) / len(others)
        plane_s = FA.mean(2)
        body = x[:, :, 1:]
        rms = (body - body.mean(2, keepdim=True)).pow(2).mean(dim=(2, 3)).sqrt().double().numpy()
        for variant in ["plane"] + [f"channel{g:g}" for g in gammas]:
            a = np.ones((L, 2, C)) if variant == "plane" else channel_factors(FA, float(variant[7:]))
            at = torch.from_numpy(a).float()[:, :, None, :]
            xs = x * at
            bs = xs[:, :, 1:]
            rms_s = (bs - bs.mean(2, keepdim=True)).pow(2).mean(dim=(2, 3)).sqrt().double().numpy()
            for sc in scales:
                rel = allocate(np.full((L, 2), sc * base.key_step[0]), rms, plane_s)
                rel_s = rel * rms / rms_s
                cfg = replace(base, key_step=tuple(rel_s[:, 0]), value_step=tuple(rel_s[:, 1]), allocation="none")
                blob = cg.encode(xs.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim), quantization=cfg,
                                 chunk_tokens=CT, device="cpu")
                dec = evaluate.tensors_to_internal(cg.decode(blob, device="cpu")).float() / at
                rows.append(_row(ref, name, ctx, variant, sc, dec, 8 * len(blob), lm, log))
    return rows


def measure_calibrated(scales, gammas, log) -> list[dict]:
    """As measure, with calibrate's default rotation (per KV head, keys without their RoPE) fitted
    leave one out on the other texts' 1024-token caches: variants "cal+plane" (per-plane steps from
    the other texts' sensitivities) and "cal+channelG" (per-component steps from the other texts'
    Fisher information of this rotation's components).  Emulated through the calibration: R' =
    R diag(a) / max(a) codes a_j y_j / max(a) with one step per plane (the plane's relative step
    divided by max(a), so component j's step is the plane's / a_j), and the decoded cache is
    corrected back, x = x' (P P^T)^-1 in the RoPE-free coordinates (P: R' as the codec's
    fixed-point rotation rounds it; with P = R' that is x' R diag(max(a)^2 / a^2) R^T).  Float32
    caches (the decoded x' is corrected without a bfloat16 rounding, which the correction would
    magnify); bits counted with the sink token at two bytes a value, as a bfloat16 file holds it."""
    from cachegen_cli.methods import rope as rope_methods
    from cachegen_cli.kernels import rope as rope_kernels
    from cachegen_cli.kernels.fixed_rotation import R_BITS, fixed_matrix
    from cachegen_cli.methods.calibration import Calibration
    from cachegen_cli.model.calibrate import fit_samples

    model, tok = capture.load_model(capture.find_default_model())
    refs = rope_gain.references(model, tok, [1024, 4096], preset_targets.CONTINUATION, preset_targets.texts())
    model_rope = rope_methods.from_model(model)
    base_refs = {n: r for (n, c), r in refs.items() if c == 1024}
    G = {}
    for name, ref in base_refs.items():
        t0 = time.perf_counter()
        G[name] = gradient_moments(ref, model_rope, ref.num_kv_heads)
        log(f"# gradient moments of {name} ({time.perf_counter() - t0:.0f} s)")
    base = QUALITY_PRESETS["balanced"]
    rows = []
    for (name, ctx), ref in refs.items():
        L, _, T, C = ref.cache.shape
        H, D = ref.num_kv_heads, ref.head_dim
        others = [o for o in base_refs if o != name]
        cal = fit_samples([base_refs[o].cache for o in others], H, [model_rope] * len(others))
        R = cal.rotation.astype(np.float64)  # [L, 2, H, D, D]: y = x R per head
        FA = 0
        for o in others:
            f = component_fisher(R, G[o]).reshape(L, 2, C)
            FA = FA + np.maximum(f, 1e-30) / gm(np.maximum(f, 1e-30))
        FA = FA / len(others)
        plane_s = FA.mean(2)
        x = ref.cache.float()
        lm = preset_targets.lmcache_scores(ref, ref.cache.reshape(L, 2, T, H, D))
        body = x[:, :, 1:]
        rms = (body - body.mean(2, keepdim=True)).pow(2).mean(dim=(2, 3)).sqrt().double().numpy()
        sink = base.sink_tokens
        sink_extra = 8 * 2 * sink * L * 2 * C  # bits a float32 file's sink holds past a bfloat16 one's
        rope = cal.rope
        # the coded components' largest distance from their means (what the levels must reach)
        free_x = rope_methods.unturn(x, rope, sink)[:, :, sink:].double().reshape(L, 2, T - sink, H, D)
        comp = torch.einsum("lkthc,lkhcd->lkthd", free_x, torch.from_numpy(R))
        reach = (comp - comp.mean(2, keepdim=True)).abs().amax(2).reshape(L, 2, C).numpy()
        for variant in ["cal+plane"] + [f"cal+channel{g:g}" for g in gammas]:
            for sc in scales:
                rel0 = allocate(np.full((L, 2), sc * base.key_step[0]), rms, plane_s)
                if variant == "cal+plane":
                    a = np.ones((L, 2, C))
                else:
                    # a component's step no finer than its levels allow (|level| <= LEVEL_REACH)
                    a = np.minimum(channel_factors(FA, float(variant[11:])),
                                   LEVEL_REACH * (rel0 * rms)[:, :, None] / np.maximum(reach, 1e-30))
                top = a.max(axis=2)  # [L, 2]
                ascaled = (a / top[:, :, None]).reshape(L, 2, H, D)
                cal_v = Calibration((R * ascaled[:, :, :, None, :]).astype(np.float32), dict(cal.metadata))
                # The codec rotates by P = round(R' 2^R_BITS) / 2^R_BITS and back by P^T: x' = y' P^T for
                # the decoded y', so x = y' P^-1 = x' (P P^T)^-1 (P's rounding undone exactly, not R's)
                corr = unscale_matrix(fixed_matrix(cal_v.rotation, False) / float(1 << R_BITS))
                rel = rel0 / top
                cfg = replace(base, key_step=tuple(rel[:, 0]), value_step=tuple(rel[:, 1]), allocation="none")
                blob = cg.encode(x.reshape(L, 2, T, H, D), quantization=cfg, calibration=cal_v, chunk_tokens=CT,
                                 device="cpu")
                dec = evaluate.tensors_to_internal(cg.decode(blob, device="cpu", calibration=cal_v)).float()
                if variant != "cal+plane":
                    free = rope_methods.unturn(dec, rope, sink)
                    blocks = free[:, :, sink:].double().reshape(L, 2, T - sink, H, D)
                    fixed = torch.einsum("lkthc,lkhce->lkthe", blocks, torch.from_numpy(corr))
                    free[:, :, sink:] = fixed.reshape(L, 2, T - sink, C).float()
                    turned = free.contiguous().numpy()
                    rope_kernels.turn_keys(turned, rope.inv_freq, rope, 0, sink, True)
                    dec = torch.from_numpy(turned)
                rows.append(_row(ref, name, ctx, variant, sc, dec, 8 * len(blob) - sink_extra, lm, log))
    return rows


def report(rows: list[dict]) -> None:
    """Each channel variant's KL and bits against the per-plane variant's at the same step scale,
    then recent_tiers' tables (the LMCache bar, and the KL at the same bits)."""
    import recent_tiers

    calibrated = any(r["schedule"].startswith("cal+") for r in rows)
    print("Against the per-plane steps at the same step scale:\n")
    print("| variant | scale | KL / per-plane KL: geometric mean | range | bits / per-plane bits |")
    print("|---|---:|---:|---|---|")
    by = {(r["text"], r["context"], r["schedule"], r["step_scale"]): r for r in rows}
    for v in dict.fromkeys(r["schedule"] for r in rows):
        if v in ("plane", "cal+plane"):
            continue
        for sc in dict.fromkeys(r["step_scale"] for r in rows):
            ref = "cal+plane" if v.startswith("cal+") else "plane"
            pairs = [(by[k[:2] + (v, sc)], r) for k, r in by.items() if k[2] == ref and k[3] == sc]
            ks = [a["kl"] / b["kl"] for a, b in pairs]
            bs = [a["bits_per_value"] / b["bits_per_value"] for a, b in pairs]
            print(f"| {v} | {sc:g} | {gm(np.array(ks)):.2f} | {min(ks):.2f}-{max(ks):.2f} | {min(bs):.3f}-{max(bs):.3f} |")
    print()
    recent_tiers.report(rows, 0.7, reference="cal+plane" if calibrated else "plane")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="2,2.5,3")
    ap.add_argument("--gammas", default="1,0.5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--calibrated", action="store_true",
                    help="with calibrate's default rotation: per-plane against per-component steps")
    ap.add_argument("--report", type=pathlib.Path, default=None, metavar="RESULTS",
                    help="no measuring: the tables of an earlier results file")
    ap.add_argument("--spread", action="store_true", help="only the Fisher information's spread inside the planes")
    args = ap.parse_args()
    if args.report:
        old = json.loads(args.report.read_text())
        print(f"Rows of `{old['info']['command']}` (commit {old['info']['commit']}, {old['info']['date']}).\n")
        report(old["rows"])
        return 0
    torch.set_num_threads(args.threads)
    if args.spread:
        spread(print)
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    run = measure_calibrated if args.calibrated else measure
    rows = run([float(x) for x in args.scales.split(",")], [float(x) for x in args.gammas.split(",")], log)
    info = rope_gain.run_info("channel_steps.py")
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"Generated by `{info['command']}` at commit {info['commit']}, {info['date']}.\n")
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
