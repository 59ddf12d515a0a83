#!/usr/bin/env python3
"""Structured calibration rotations: which cheap structure keeps a full rotation's size gain?

A full C x C rotation (C = heads x head_dim) costs C multiply-adds per value; one block per
KV head (calibration version 2) costs head_dim but keeps only ~1/6 of the gain
(scripts/rotation_blocks.py).  This script fits other orthogonal structures, each a product
of cheap *stages*, on the covariance of sample caches and measures them through today's
encoder: every structure is multiplied out into the dense C x C matrix it equals and given
to ``cg.encode`` as a version 1 (full) calibration, so no format change is needed to
measure it.  A stage partitions the C current coordinates into groups and rotates each group
onto its own principal axes (PCA of the current covariance restricted to the group):

* ``head``: one group per KV head (D channels): D multiply-adds per value;
* ``xidx``: one group per within-head index i (the H coordinates h*D + i): H per value;
* ``xrope``: one group per RoPE frequency j (dims j and j + D/2 of every head, rotate-half
  RoPE as Llama / SmolLM2 use): 2H per value;
* ``xmatch``: like ``xidx`` after pairing each head's coordinates with head 0's by
  correlation (an assignment; a permutation costs no arithmetic): H per value;
* ``top<m>``: the m coordinates of largest variance in one group, the others left alone:
  m^2 / C per value;
* ``blk<k>``: disjoint groups of k coordinates, agglomerated greedily by correlation (pairs,
  then pairs of pairs), each rotated onto its axes: k per value (a butterfly-like stage with
  k-point kernels);
* ``givens``: a greedy Jacobi stage: disjoint pairs of coordinates, most correlated first
  (weight -log(1 - rho^2), the high-rate bits a 2 x 2 rotation saves), each pair rotated
  onto its axes: 2 per value (4 multiply-adds per pair).

The output coordinates of every structure are put in order of decreasing variance (a
permutation, free) so that neighbouring coordinates have similar tables, as in a full PCA.

Reports bits/value (the real encoder's bytes) at each ``--quality``, the change against no
rotation, the share of the full rotation's gain kept, the relative squared error of the
decoded cache (sum (x' - x)^2 / sum (x - mean)^2 over tokens past the sink; the step of a
plane does not depend on the rotation, docs/config.md, so this is the "equal error" check),
optionally (``--kl``) the model-level KL and top-1 agreement (cachegen_cli.model.evaluate),
and the cost per value for this model's shape and for Llama-3.1-8B's (8 KV heads of 128).
``--attribution`` adds where the full rotation's gain comes from: the full rotation applied
to a subset of the (layer, K/V) planes only (identity elsewhere; planes are coded
independently, so the savings add up), and the log-determinant split of the Gaussian
high-rate gain into within-head and cross-head parts.

    python scripts/rotation_structures.py --texts docs --qualities balanced      # quick look, one text
    python scripts/rotation_structures.py --only "per head" "givens x32" --attribution balanced  # 3 texts
    python scripts/rotation_structures.py --derope --kl --only "per head"       # keys without RoPE first
    python scripts/rotation_structures.py --analysis [--derope]                 # covariance only, seconds
    python scripts/rotation_structures.py --heads 2 --texts docs --qualities balanced  # a smaller C

``--derope`` removes RoPE from the keys first (KVTC's step; not in the format, so only
measured): the keys are coded at the captured cache's absolute steps and put back before the
error and KL are taken.  Results: docs/results/2026-12-01d_rotation_structures.md.

Calibrations are fitted on the other texts' caches (leave one out), skipping the sink token
as ``calibration.fit`` does.  Caches are rebuilt with the model (as rotation_blocks.py) and
kept under build/rotation_structures/ so that runs without ``--kl`` skip the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import shlex
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from quality_report import TEXTS, _machine, text_references  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import calibration  # noqa: E402
from cachegen_cli.methods.config import QUALITY_PRESETS  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / "build" / "rotation_structures"
SINK = 1  # the codec's default sink: stored verbatim, left out of the fit (as calibration.fit)
LLAMA = (8, 128)  # Llama-3.1-8B: KV heads, head_dim


# ---- fitting: covariance, stages ------------------------------------------------------------

def covariance(samples: list[torch.Tensor]) -> np.ndarray:
    """Centred covariance [L, 2, C, C] float64 of caches [L, 2, T, C] past the sink tokens."""
    L, _, _, C = samples[0].shape
    s2 = torch.zeros(L, 2, C, C, dtype=torch.float64)
    s1 = torch.zeros(L, 2, C, dtype=torch.float64)
    n = 0
    for s in samples:
        x = s[:, :, SINK:].to(torch.float64)
        s2 += torch.einsum("lktc,lktd->lkcd", x, x)
        s1 += x.sum(dim=2)
        n += x.shape[2]
    mean = s1 / n
    return (s2 / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)).numpy()


def _rotate_groups(S: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """The C x C rotation that puts each group of coordinates on its principal axes."""
    C = S.shape[0]
    R = np.eye(C)
    for g in groups:
        if len(g) < 2:
            continue
        _, v = np.linalg.eigh(S[np.ix_(g, g)])
        R[np.ix_(g, g)] = v[:, ::-1]
    return R


#: The step the rate-aware Givens stages assume: balanced's relative step (0.5 x the plane's
#: RMS).  One calibration serves every quality, so the fit cannot know the step it will meet.
FIT_REL_STEP = 0.5


def _pair_weights(S: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, bits saved per pair) for every pair of coordinates of covariance S.
    ``givens``: the Gaussian high-rate saving -0.5 log2(1 - rho^2), which also counts pairs far
    below the quantizer's step (already ~free); ``rgivens``: the saving of the rate model
    h(v) = 0.5 log2(1 + 12 v / step^2) (a Gaussian channel with the quantizer's noise), so
    pairs below the step are worth ~nothing."""
    C = S.shape[0]
    iu, ju = np.triu_indices(C, 1)
    a = np.diag(S)
    ai, aj, c = a[iu], a[ju], S[iu, ju]
    if kind == "givens":
        rho2 = np.clip(c * c / np.maximum(ai * aj, 1e-300), 0.0, 1.0 - 1e-15)
        return iu, ju, -0.5 * np.log2(1.0 - rho2)
    s2 = (FIT_REL_STEP ** 2) * np.trace(S) / C
    m, r = 0.5 * (ai + aj), np.sqrt((0.5 * (ai - aj)) ** 2 + c * c)
    h = lambda v: 0.5 * np.log2(1.0 + 12.0 * np.maximum(v, 0.0) / s2)  # noqa: E731
    return iu, ju, h(ai) + h(aj) - h(m + r) - h(m - r)


def _givens_stage(S: np.ndarray, R: np.ndarray, kind: str) -> None:
    """One stage of disjoint Jacobi rotations, pairs chosen greedily by decreasing saving;
    updates S (the current covariance) and R (the rotation so far) in place."""
    C = S.shape[0]
    iu, ju, w = _pair_weights(S, kind)
    used = np.zeros(C, bool)
    I, J = [], []
    for k in np.argsort(-w, kind="stable"):
        if w[k] < 1e-9 or len(I) == C // 2:  # nothing left worth a rotation, or every coordinate paired
            break
        i, j = iu[k], ju[k]
        if not used[i] and not used[j]:
            used[i] = used[j] = True
            I.append(i)
            J.append(j)
    if not I:
        return
    I, J = np.array(I), np.array(J)
    # The angle that diagonalizes each 2 x 2 block, the larger variance on the first coordinate.
    t = 0.5 * np.arctan2(2.0 * S[I, J], S[I, I] - S[J, J])
    c, s = np.cos(t), np.sin(t)
    for M in (R,):  # columns of R: new axis i = c e_i + s e_j, j = -s e_i + c e_j
        Mi, Mj = M[:, I].copy(), M[:, J].copy()
        M[:, I], M[:, J] = Mi * c + Mj * s, Mj * c - Mi * s
    Si, Sj = S[I, :].copy(), S[J, :].copy()
    S[I, :], S[J, :] = c[:, None] * Si + s[:, None] * Sj, c[:, None] * Sj - s[:, None] * Si
    Si, Sj = S[:, I].copy(), S[:, J].copy()
    S[:, I], S[:, J] = Si * c + Sj * s, Sj * c - Si * s


def _match_heads(S: np.ndarray, H: int, D: int) -> np.ndarray:
    """A permutation of the coordinates within each head so that coordinate i of every head
    is one strongly correlated with coordinate i of head 0 (greedy assignment on |rho|,
    largest first; scipy is not a dependency)."""
    d = np.sqrt(np.maximum(np.diag(S), 1e-300))
    rho = np.abs(S / d[:, None] / d[None, :])
    perm = np.arange(H * D)
    for h in range(1, H):
        block = rho[0:D, h * D:(h + 1) * D]
        taken_r, taken_c = np.zeros(D, bool), np.zeros(D, bool)
        for k in np.argsort(-block, axis=None, kind="stable"):
            i, j = divmod(int(k), D)
            if not taken_r[i] and not taken_c[j]:
                taken_r[i] = taken_c[j] = True
                perm[h * D + i] = h * D + j
    return perm


def _block_groups(S: np.ndarray, k: int) -> list[np.ndarray]:
    """Disjoint groups of k (a power of 2) coordinates that belong together: pairs matched
    greedily by their pairwise Gaussian mutual information, then pairs of pairs by the sum of
    their members' (the agglomeration a butterfly with k-point kernels would use)."""
    C = S.shape[0]
    d = np.sqrt(np.maximum(np.diag(S), 1e-300))
    w = -0.5 * np.log2(1.0 - np.clip((S / d[:, None] / d[None, :]) ** 2, 0.0, 1.0 - 1e-15))
    np.fill_diagonal(w, 0.0)
    groups = [np.array([i]) for i in range(C)]
    while len(groups[0]) < k and len(groups) > 1:
        M = np.zeros((len(groups), C))
        for g, members in enumerate(groups):
            M[g, members] = 1.0
        A = M @ w @ M.T
        iu, ju = np.triu_indices(len(groups), 1)
        used = np.zeros(len(groups), bool)
        merged = []
        for t in np.argsort(-A[iu, ju], kind="stable"):
            a, b = iu[t], ju[t]
            if not used[a] and not used[b]:
                used[a] = used[b] = True
                merged.append(np.concatenate([groups[a], groups[b]]))
        merged += [groups[g] for g in np.flatnonzero(~used)]  # an odd one out stays as it is
        groups = merged
    return groups


def stage_groups(kind: str, S: np.ndarray, H: int, D: int) -> list[np.ndarray]:
    if kind == "head":
        return [np.arange(h * D, (h + 1) * D) for h in range(H)]
    if kind == "xidx":
        return [np.arange(H) * D + i for i in range(D)]
    if kind == "xrope":
        half = D // 2
        return [np.concatenate([np.arange(H) * D + j, np.arange(H) * D + j + half]) for j in range(half)]
    if kind.startswith("top"):
        m = int(kind[3:])
        return [np.argsort(-np.diag(S), kind="stable")[:m]]
    if kind.startswith("blk"):
        return _block_groups(S, int(kind[3:]))
    raise ValueError(kind)


def fit_structure(S: np.ndarray, stages: list[str], H: int, D: int) -> np.ndarray:
    """The dense rotation R (columns: output axes, by decreasing variance) of one plane whose
    covariance is S: the product of the stages, each fitted on the covariance the previous
    ones leave."""
    C = S.shape[0]
    R = np.eye(C)
    cur = S.copy()
    for kind in stages:
        if kind in ("givens", "rgivens"):
            _givens_stage(cur, R, kind)
            continue
        G = np.eye(C)
        if kind == "xmatch":
            G = G[:, _match_heads(cur, H, D)]  # column i picks coordinate perm[i]: a permutation first
            kind = "xidx"
        P = G.T @ cur @ G
        G = G @ _rotate_groups(P, stage_groups(kind, P, H, D))
        R = R @ G
        cur = G.T @ cur @ G
    var = np.einsum("ci,cd,di->i", R, S, R)
    return R[:, np.argsort(-var, kind="stable")]


def stage_cost(kind: str, H: int, D: int) -> float:
    """Multiply-adds per value of one stage for H heads of D."""
    C = H * D
    if kind == "head":
        return D
    if kind in ("xidx", "xmatch"):
        return H
    if kind == "xrope":
        return 2 * H
    if kind in ("givens", "rgivens"):
        return 2
    if kind.startswith("top"):
        m = int(kind[3:])
        return m * m / C
    if kind.startswith("blk"):
        return int(kind[3:])
    raise ValueError(kind)


def structures(H: int, D: int, C: int) -> dict[str, tuple[list[str] | None, str]]:
    """name -> (stages, how its cost scales); stages None: the package's own fit (full / per head).
    ``top`` sizes are fractions of C so that the Llama cost uses the same fraction."""
    t8, t4, t2 = C // 8, C // 4, C // 2
    out = {
        "none": ([], "0"),
        "full": (None, "C"),
        "per head": (None, "D"),
        "head → xidx": (["head", "xidx"], "D + H"),
        "xidx → head": (["xidx", "head"], "H + D"),
        "xrope → head": (["xrope", "head"], "2H + D"),
        "head → xmatch": (["head", "xmatch"], "D + H"),
        "head → xidx → head": (["head", "xidx", "head"], "2D + H"),
        "xrope → head → xidx": (["xrope", "head", "xidx"], "2H + D + H"),
        f"head → top{t8}": (["head", f"top{t8}"], "D + C/64"),
        f"head → top{t4}": (["head", f"top{t4}"], "D + C/16"),
        f"head → top{t2}": (["head", f"top{t2}"], "D + C/4"),
        "head → givens x8": (["head"] + ["givens"] * 8, "D + 16"),
        "head → givens x32": (["head"] + ["givens"] * 32, "D + 64"),
    }
    for n in (8, 16, 32, 64):
        out[f"givens x{n}"] = (["givens"] * n, f"{2 * n}")
    for n in (8, 16, 32, 64):
        out[f"rgivens x{n}"] = (["rgivens"] * n, f"{2 * n}")
    for k, n in ((4, 8), (8, 4), (8, 8), (16, 4)):
        out[f"blk{k} x{n}"] = ([f"blk{k}"] * n, f"{k * n}")
    out.update({
        "xrope → rgivens x16": (["xrope"] + ["rgivens"] * 16, "2H + 32"),
        "xrope → head → rgivens x16": (["xrope", "head"] + ["rgivens"] * 16, "2H + D + 32"),
    })
    return out


def structure_cost(name: str, stages: list[str] | None, H: int, D: int, llama: bool = False) -> float:
    """Cost per value; for Llama's shape the ``top`` stages keep their fraction of C."""
    if stages is None:
        return H * D if name == "full" else D
    total = 0.0
    for k in stages:
        if llama and k.startswith("top"):
            k = f"top{int(k[3:]) * (H * D) // (SMOL_C or 1)}"
        total += stage_cost(k, H, D)
    return total


SMOL_C = 0  # set in main: the measured model's C (so Llama's top-m keeps the same m / C)


def fit_calibration(name: str, stages, others: list[torch.Tensor], S: np.ndarray, H: int, D: int):
    if name == "full":
        return calibration.fit(others, skip_tokens=SINK, blocks=1)
    if name == "per head":
        return calibration.fit(others, skip_tokens=SINK, blocks=H)
    if name == "none":
        return None
    L, _, C, _ = S.shape
    rot = np.empty((L, 2, C, C), np.float32)
    for layer in range(L):
        for kv in range(2):
            R = fit_structure(S[layer, kv], stages, H, D)
            # float64 -> float32 keeps the matrix orthonormal to ~1e-7, well within the 1e-4 readers check
            rot[layer, kv] = R.astype(np.float32)
    return calibration.Calibration(rot, {"format": calibration.FORMAT_NAME, "version": calibration.FORMAT_VERSION,
                                         "structure": name})


def masked(cal: calibration.Calibration, mask: np.ndarray) -> calibration.Calibration:
    """The calibration with the identity on the planes where ``mask`` [L, 2] is False."""
    L, _, _, C, _ = cal.rotation.shape
    rot = np.array(cal.rotation[:, :, 0])
    rot[~mask] = np.eye(C, dtype=np.float32)
    return calibration.Calibration(rot, dict(cal.metadata))


# ---- measuring ------------------------------------------------------------------------------

#: SmolLM2-135M's RoPE base (sample_data/README.md; rotate-half pairs d, d + D/2, positions from 0).
ROPE_THETA = 100000.0


def rope(cache: torch.Tensor, heads: int, head_dim: int, sign: float) -> torch.Tensor:
    """The keys of ``cache`` [L, 2, T, C] rotated by sign x their RoPE angle (sign -1: the
    position removed, as KVTC does before its PCA; +1: put back), in float64; values untouched."""
    L, _, T, C = cache.shape
    x = cache.double().reshape(L, 2, T, heads, head_dim).clone()
    half = head_dim // 2
    inv = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    ang = sign * torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]  # [T, half]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[:, 0, ..., :half].clone(), x[:, 0, ..., half:].clone()
    x[:, 0, ..., :half] = a * c - b * s
    x[:, 0, ..., half:] = b * c + a * s
    return x.reshape(L, 2, T, C)


def plane_rms(cache: torch.Tensor) -> np.ndarray:
    """[L, 2] RMS around the channel means past the sink (what the encoder's steps are relative to)."""
    x = cache[:, :, SINK:].double()
    return (x - x.mean(dim=2, keepdim=True)).pow(2).mean(dim=(2, 3)).sqrt().numpy()


def measure(cache: torch.Tensor, heads: int, head_dim: int, quality: str, cal, ref=None, original=None) -> dict:
    """Bits/value and relative error of one encode + decode; ``original``: the cache the error is
    measured against after putting RoPE back on the keys (``cache`` then has it removed)."""
    layers = evaluate.layers_from_internal(cache, heads, head_dim, torch.bfloat16)
    tensors = capture.layers_to_tensors(layers, "stacked", torch.bfloat16)
    if original is None:
        blob = cg.encode(tensors, quality=quality, calibration=cal, device="cpu")
    else:
        # Steps are relative to each plane's RMS around its channel means, and removing RoPE
        # moves much of the keys' energy into those means: the keys' relative steps are scaled
        # so that their absolute steps (so the error) stay those of the cache as captured.
        preset = QUALITY_PRESETS[quality]
        f = (plane_rms(original) / plane_rms(cache))[:, 0]
        cfg = dataclasses.replace(preset, key_step=tuple(float(preset.key_step[0] * v) for v in f),
                                  name=f"{quality} (key steps of the captured cache)")
        blob = cg.encode(tensors, quantization=cfg, calibration=cal, device="cpu")
    data = evaluate.tensors_to_internal(cg.decode(blob, device="cpu", calibration=cal))
    if original is not None:
        # back to the source dtype, as a decoder that puts RoPE back would write it
        data, cache = rope(data, heads, head_dim, +1.0).to(cache.dtype), original
    x = cache[:, :, SINK:].double()
    y = data[:, :, SINK:].double()
    err = float((y - x).pow(2).sum()) / float((x - x.mean(dim=2, keepdim=True)).pow(2).sum())
    row = {"bits": 8 * len(blob) / cache.numel(), "rel_err": err}
    if ref is not None:
        s = evaluate.score(ref, data)
        row.update(kl=s["kl_mean"], top1=s["top1_agreement"])
    return row


def logdet_split(S: np.ndarray, H: int, D: int) -> tuple[float, float, float]:
    """Gaussian high-rate gain in bits/value of one plane's covariance (held-out data): (full
    PCA, per-head PCA, what the per-index cross-head groups of raw channels alone give) =
    0.5 / C x (sum log2 diag - log2 det of the blocks)."""
    C = S.shape[0]
    eps = 1e-12 * np.trace(S) / C  # a floor: near-singular directions would dominate a log

    def ld(M):
        w = np.linalg.eigvalsh(M)
        return np.log2(np.maximum(w, eps)).sum()

    diag = np.log2(np.maximum(np.diag(S), eps)).sum()
    full = diag - ld(S)
    head = diag - sum(ld(S[h * D:(h + 1) * D, h * D:(h + 1) * D]) for h in range(H))
    xidx = diag - sum(ld(S[np.ix_(g, g)]) for g in stage_groups("xidx", S, H, D))
    return 0.5 * full / C, 0.5 * head / C, 0.5 * xidx / C


def analysis(caches: dict, H: int, D: int) -> None:
    """Where the correlation a full rotation removes sits (no encoder: the covariance of all
    the texts' caches pooled).  Prints two markdown tables."""
    L = next(iter(caches.values())).shape[0]
    S = covariance(list(caches.values()))
    C = H * D
    eps = 1e-12

    def ld(M):
        return np.log2(np.maximum(np.linalg.eigvalsh(M), eps * np.trace(M) / len(M))).sum()

    gains = np.zeros((L, 2, 4))  # full, per head, same index across heads, RoPE pair across heads
    cls = np.zeros((L, 2, 6))  # pair-MI sums: cross same / cross partner / cross other / in partner / in other; outlier
    head = np.arange(C) // D
    dim = np.arange(C) % D
    for layer in range(L):
        for kv in range(2):
            P = S[layer, kv]
            diag = np.log2(np.maximum(np.diag(P), eps * np.trace(P) / C)).sum()
            gains[layer, kv, 0] = diag - ld(P)
            gains[layer, kv, 1] = diag - sum(ld(P[h * D:(h + 1) * D, h * D:(h + 1) * D]) for h in range(H))
            for k, kind in ((2, "xidx"), (3, "xrope")):
                gains[layer, kv, k] = diag - sum(ld(P[np.ix_(g, g)]) for g in stage_groups(kind, P, H, D))
            d = np.sqrt(np.maximum(np.diag(P), 1e-300))
            mi = -0.5 * np.log2(1.0 - np.clip((P / d[:, None] / d[None, :]) ** 2, 0, 1 - 1e-15))
            iu, ju = np.triu_indices(C, 1)
            w = mi[iu, ju]
            cross = head[iu] != head[ju]
            same = dim[iu] == dim[ju]
            partner = np.abs(dim[iu] - dim[ju]) == D // 2
            top = np.argsort(-np.diag(P))[: max(1, C // 20)]  # the top 5 % channels by variance
            out = np.isin(iu, top) | np.isin(ju, top)
            cls[layer, kv] = [w[cross & same].sum(), w[cross & partner].sum(), w[cross & ~same & ~partner].sum(),
                              w[~cross & partner].sum(), w[~cross & ~partner].sum(), w[cross & out].sum()]
    gains *= 0.5 / C
    print("Gaussian high-rate gain (bits/value: 0.5 x mean over channels of log2 variance minus log2 "
          "eigenvalue, of the groups each structure rotates; a proxy, not the coded size), covariance of the "
          "three 1024-token caches pooled, mean over the layers of each range:\n")
    print("| layers | K full | K per head | K same index across heads | K RoPE pair across heads | V full | V per head "
          "| V same index | V RoPE pair |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for a, b in [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L), (0, L)]:
        g = gains[a:b].mean(axis=0)
        print(f"| {a}-{b - 1} | " + " | ".join(f"{g[kv, k]:.3f}" for kv in range(2) for k in range(4)) + " |")
    print("\nWhere the pairwise correlation sits: share of the sum over channel pairs of -0.5 log2(1 - rho^2) "
          "(pairwise mutual information of Gaussians; it overcounts, but shows which pairs carry it), all layers; "
          "'partner': dims d and d + D/2 (one rotate-half RoPE pair); 'outlier': pairs across heads that involve "
          "one of the plane's top 5 % channels by variance:\n")
    print("| plane | across heads, same dim | across heads, RoPE partner | across heads, other | within head, "
          "RoPE partner | within head, other | across heads with an outlier channel |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kv, name in ((0, "K"), (1, "V")):
        t = cls[:, kv].sum(axis=0)
        tot = t[:5].sum()
        print(f"| {name} | " + " | ".join(f"{x / tot:.1%}" for x in t[:5]) + f" | {t[5] / tot:.1%} |")
    iu, ju = np.triu_indices(C, 1)
    cross, same = head[iu] != head[ju], dim[iu] == dim[ju]
    partner = np.abs(dim[iu] - dim[ju]) == D // 2
    n = [cross & same, cross & partner, cross & ~same & ~partner, ~cross & partner, ~cross & ~partner]
    print("| share of the pairs | " + " | ".join(f"{m.sum() / len(iu):.1%}" for m in n) + " | |")


# ---- main -----------------------------------------------------------------------------------

def load_caches(context: int, want_refs: bool):
    """{text: cache [L, 2, T, C] bf16}, heads, head_dim, and the references when ``want_refs``."""
    path = CACHE_DIR / f"caches_{context}.pt"
    if not want_refs and path.is_file():
        saved = torch.load(path)
        return saved["caches"], saved["heads"], saved["head_dim"], None
    model, tokenizer = capture.load_model(None)
    refs = text_references(model, tokenizer, context)
    r0 = next(iter(refs.values()))
    caches = {k: r.cache for k, r in refs.items()}
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    torch.save({"caches": caches, "heads": r0.num_kv_heads, "head_dim": r0.head_dim}, path)
    return caches, r0.num_kv_heads, r0.head_dim, refs


def main() -> None:
    global SMOL_C
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), help="held-out texts to measure (default: all)")
    ap.add_argument("--qualities", nargs="+", default=["high", "balanced", "small"])
    ap.add_argument("--only", nargs="+", default=None, help="structure names to run (default: all)")
    ap.add_argument("--kl", action="store_true", help="also score with the model (KL, top-1)")
    ap.add_argument("--attribution", nargs="*", default=None, metavar="QUALITY",
                    help="also: where the full rotation's gain comes from, at these qualities (default balanced)")
    ap.add_argument("--analysis", action="store_true", help="only the covariance analysis (no encoder)")
    ap.add_argument("--derope", action="store_true",
                    help="remove RoPE from the keys before fitting and coding (a format change: measured only)")
    ap.add_argument("--heads", type=int, default=None, help="use only the first N KV heads (C = N x head_dim)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.time()
    caches, H, D, refs = load_caches(args.context, args.kl)
    if args.heads is not None:  # a smaller C from the same model: how a structure's share scales with C
        if args.kl or not 1 <= args.heads <= H:
            raise SystemExit(f"error: --heads needs 1..{H} and no --kl")
        H = args.heads
        caches = {k: c[..., : H * D].contiguous() for k, c in caches.items()}
    originals = None
    if args.derope:
        # KVTC's step before its PCA: keys without their position; coded as bf16 (a rounding
        # ~400x below the coding error); token 0 (the sink) is at angle 0, so it is unchanged.
        originals = caches
        caches = {k: rope(c, H, D, -1.0).to(torch.bfloat16) for k, c in caches.items()}
    if args.analysis:
        print(f"Generated by `python scripts/rotation_structures.py {shlex.join(sys.argv[1:])}` on "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; SmolLM2-135M-Instruct "
              f"({H} KV heads of {D}), {args.context}-token caches of {', '.join(caches)}.\n")
        analysis(caches, H, D)
        return
    C = H * D
    SMOL_C = C
    L = next(iter(caches.values())).shape[0]
    structs = structures(H, D, C)
    names = [n for n in structs if args.only is None or n in args.only or n in ("none", "full")]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = {}  # (text, quality, name) -> row
    attr = {}  # (text, quality, subset) -> bits
    split = []  # per text: [L, 2, 3] log-det gains
    for text in args.texts:
        others = [c for o, c in caches.items() if o != text]
        S = covariance(others)
        cache = caches[text]
        ref = refs[text] if refs else None
        cals = {}
        for name in names:
            t0 = time.perf_counter()
            cals[name] = fit_calibration(name, structs[name][0], others, S, H, D)
            log(f"# {text}: fitted {name} ({time.perf_counter() - t0:.1f} s)")
        for q in args.qualities:
            for name in names:
                rows[text, q, name] = r = measure(cache, H, D, q, cals[name], ref,
                                                  originals[text] if originals else None)
                log(f"# {text} {q} {name}: {r['bits']:.4f} bits, rel err {r['rel_err']:.4e}"
                    + (f", KL {r['kl']:.2e}" if "kl" in r else ""))
            if originals:  # the baseline that needs no format change: the captured cache, no rotation
                rows[text, q, "captured"] = r = measure(originals[text], H, D, q, None, ref)
                log(f"# {text} {q} captured, no rotation: {r['bits']:.4f} bits, rel err {r['rel_err']:.4e}")
        if args.attribution is not None:
            split.append(np.array([[logdet_split(covariance([cache])[layer, kv], H, D) for kv in range(2)]
                                   for layer in range(L)]))
            full = cals["full"]
            thirds = [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L)]
            subsets = {"K only": np.tile([True, False], (L, 1)), "V only": np.tile([False, True], (L, 1))}
            for a, b in thirds:
                m = np.zeros((L, 2), bool)
                m[a:b] = True
                subsets[f"layers {a}-{b - 1} (K+V)"] = m
            for q in args.attribution or ["balanced"]:
                for sub, mask in subsets.items():
                    attr[text, q, sub] = measure(cache, H, D, q, masked(full, mask), None,
                                                 originals[text] if originals else None)["bits"]
                    log(f"# {text} {q} attribution {sub}: {attr[text, q, sub]:.4f}")
    report(args, rows, attr, split, names, structs, H, D, C, L, time.time() - t_start)


def report(args, rows, attr, split, names, structs, H, D, C, L, seconds) -> None:
    texts = args.texts
    cmd = "python scripts/rotation_structures.py " + shlex.join(sys.argv[1:])
    print(f"Generated by `{cmd}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} "
          f"({seconds / 60:.0f} min); {_machine()}; SmolLM2-135M-Instruct ({H} KV heads of {D}, C = {C}), "
          f"{args.context}-token contexts of {', '.join(texts)} (quality_report.py's texts); each structure fitted "
          f"on the other texts' caches (leave one out: {', '.join(t for t in TEXTS)}), measured with the real "
          "encoder (cg.encode, device cpu) as a dense full-rotation calibration. Values are means over the "
          "measured texts.\n")
    kl = "kl" in next(iter(rows.values()))
    print("Cost: multiply-adds per value to apply the rotation (encode; decoding costs the same), for this model "
          f"({H} x {D}) and for Llama-3.1-8B's shape ({LLAMA[0]} x {LLAMA[1]}, C = {LLAMA[0] * LLAMA[1]}). "
          "'kept': (bits none - bits structure) / (bits none - bits full). 'rel err': sum (x' - x)^2 / "
          "sum (x - mean)^2 over tokens past the sink.\n")
    cap = args.derope
    if cap:
        print("With --derope every row (none included) codes the keys without RoPE, at the absolute key steps of "
              "the captured cache; 'vs captured' compares with the captured cache coded without a rotation "
              "(today's no-calibration file).\n")
    print("| structure | cost formula | cost here | cost Llama-8B | quality | bits/value | vs none | kept | rel err |"
          + (" vs captured |" if cap else "") + (" KL | top-1 |" if kl else ""))
    print("|---|---|---:|---:|---|---:|---:|---:|---:|" + ("---:|" if cap else "") + ("---:|---:|" if kl else ""))
    mean = lambda q, n, k: float(np.mean([rows[t, q, n][k] for t in texts]))  # noqa: E731
    for q in args.qualities:
        b0, bf = mean(q, "none", "bits"), mean(q, "full", "bits")
        if cap:
            print(f"| captured cache, no rotation | | | | {q} | {mean(q, 'captured', 'bits'):.3f} | | | "
                  f"{mean(q, 'captured', 'rel_err'):.3e} | |"
                  + (f" {mean(q, 'captured', 'kl'):.2e} | {mean(q, 'captured', 'top1'):.3f} |" if kl else ""))
        for n in names:
            stages, formula = structs[n]
            b = mean(q, n, "bits")
            kept = (b0 - b) / (b0 - bf) if b0 != bf else float("nan")
            line = (f"| {n} | {formula} | {structure_cost(n, stages, H, D):.0f} | "
                    f"{structure_cost(n, stages, *LLAMA, llama=True):.0f} | {q} | {b:.3f} | {b / b0 - 1:+.2%} | "
                    f"{kept:.0%} | {mean(q, n, 'rel_err'):.3e} |")
            if cap:
                line += f" {b / mean(q, 'captured', 'bits') - 1:+.2%} |"
            if kl:
                line += f" {mean(q, n, 'kl'):.2e} | {mean(q, n, 'top1'):.3f} |"
            print(line)
    if len(texts) > 1:
        print("\nPer text, share of the full rotation's gain kept (bits none - bits structure over bits none - "
              "bits full):\n")
        print("| structure | " + " | ".join(f"{t} {q}" for q in args.qualities for t in texts) + " |")
        print("|---|" + "---:|" * (len(texts) * len(args.qualities)))
        for n in names:
            if n in ("none", "full"):
                continue
            cells = []
            for q in args.qualities:
                for t in texts:
                    b0, bf, b = (rows[t, q, k]["bits"] for k in ("none", "full", n))
                    cells.append(f"{(b0 - b) / (b0 - bf):.0%}")
            print(f"| {n} | " + " | ".join(cells) + " |")
    if attr:
        print("\n### Where the full rotation's gain comes from\n")
        print("The full (leave-one-out) rotation on a subset of the planes only, identity elsewhere; bits/value "
              "saved against no rotation (share of the whole rotation's saving), mean over the texts:\n")
        subs = list(dict.fromkeys(k[2] for k in attr))
        aq = list(dict.fromkeys(k[1] for k in attr))
        print("| planes rotated | " + " | ".join(aq) + " |")
        print("|---|" + "---:|" * len(aq))
        for sub in subs + ["all (full)"]:
            cells = []
            for q in aq:
                b0, bf = mean(q, "none", "bits"), mean(q, "full", "bits")
                b = bf if sub == "all (full)" else float(np.mean([attr[t, q, sub] for t in texts]))
                cells.append(f"{b0 - b:.3f} ({(b0 - b) / (b0 - bf):.0%})")
            print(f"| {sub} | " + " | ".join(cells) + " |")
        sp = np.mean(split, axis=0)  # [L, 2, 3]
        print("\nGaussian high-rate gain of each text's own covariance (0.5 x mean over channels of log2 "
              "variance minus log2 eigenvalue, bits/value; an upper-bound-like proxy, not the coded size: "
              "the encoder cannot save bits on coordinates already below its step). 'cross-head' = full - per "
              "head; 'same index' = what rotating only the H raw channels of each within-head index together "
              "gives:\n")
        print("| layers | K full | K per head | K cross-head | K same index | V full | V per head | V cross-head "
              "| V same index |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for a, b in [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L), (0, L)]:
            s = sp[a:b].mean(axis=0)
            cells = []
            for kv in range(2):
                cells += [f"{s[kv, 0]:.2f}", f"{s[kv, 1]:.2f}", f"{s[kv, 0] - s[kv, 1]:.2f}", f"{s[kv, 2]:.2f}"]
            print(f"| {a}-{b - 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
