#!/usr/bin/env python3
"""Write the golden .cgen files of tests/data/golden/ that are missing (never overwrite one).

A golden file pins what a format version means: tests/test_golden.py decodes each one and
compares the tensors with the SHA-256 recorded in ``manifest.json``, and re-encodes its
committed source with the recorded options and compares the bytes.  **A golden file of an
existing version is never regenerated**: a change that breaks one is a change of the format
and needs a new format version or a new header flag (and new golden files, which this script
then adds).  See tests/data/README.md.

Each case is cut from the real SmolLM2 caches in sample_data/ (a couple of layers, one KV
head, a few channels and tokens), so the files are a few KB.  Cases of format version 1 give
their bins table range by range (``_bins``), those of version 2 every TransformConfig field
(``_transform``); a version 3 case's source holds a cache of another shape (a windowed layer,
K and V of different sizes, an extra tensor), encoded from its tensors as read.

Usage::

    python scripts/make_golden.py            # add the cases (sources, files) that are missing
    python scripts/make_golden.py --check    # rebuild everything in memory and compare, write nothing

A new format version or flag: add its cases to CASES (new names) and run the script; it
writes their files and adds them to the manifest, leaving the existing ones untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file, save  # noqa: E402

import cachegen_cli as cg  # noqa: E402
from cachegen_cli.methods import calibration as calib  # noqa: E402
from cachegen_cli.methods.config import QuantizationConfig, QuantizationSpec, TransformConfig  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "golden"
MANIFEST = GOLDEN / "manifest.json"
STACKED = ROOT / "sample_data" / "smollm2_pydoc_520.safetensors"
PER_LAYER = ROOT / "sample_data" / "smollm2_code_96.safetensors"

LAYERS = [3, 17]  # two layers of SmolLM2's 30
TOKENS = 20  # chunks of 8: [0, 8), [8, 16), [16, 20), the last one short
CHUNK_TOKENS = 8
WINDOW = 13  # tokens the windowed layer of source_bf16_windowed keeps (chunks of 8 and 5)


def _stacked(channels: int) -> torch.Tensor:
    """[2, 2, TOKENS, 1, channels] bf16: layers LAYERS, KV head 0, its first ``channels`` dims."""
    kv = load_file(str(STACKED))["kv"]
    return kv[LAYERS, :, :TOKENS, :1, :channels].contiguous()


def _per_layer() -> dict[str, torch.Tensor]:
    """layers.{0,1}.{key,value} [1, 1, TOKENS, 32] bf16 from the per-layer sample (its layers LAYERS)."""
    t = load_file(str(PER_LAYER))
    out = {}
    for i, layer in enumerate(LAYERS):
        for kind in ("key", "value"):
            out[f"layers.{i}.{kind}"] = t[f"layers.{layer}.{kind}"][:, :1, :TOKENS, :32].contiguous()
    return out


def _token_ids() -> list[int]:
    """The first TOKENS token ids of the stacked sample (its metadata records them)."""
    from safetensors import safe_open

    with safe_open(str(STACKED), "pt") as f:
        return json.loads(f.metadata()["token_ids"])[:TOKENS]


def _sources() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Source name -> (tensors, safetensors metadata)."""
    bf16 = _stacked(32)
    per_layer = _per_layer()
    # The samples are bf16; fp32 / fp16 sources with full mantissas: the same values divided
    # by 3 (one IEEE division, then one rounding to fp16).
    fp32 = (bf16.float() / 3).contiguous()
    fp16 = fp32.half().contiguous()
    note = f"sample_data/{STACKED.name} layers {LAYERS} head 0 tokens [0, {TOKENS})"
    return {
        "source_bf16.safetensors": ({"kv": bf16}, {"source": note + " dims [0, 32)"}),
        "source_bf16_c16.safetensors": ({"kv": _stacked(16)}, {"source": note + " dims [0, 16)"}),
        "source_fp32.safetensors": ({"kv": fp32}, {"source": note + " dims [0, 32), fp32 / 3"}),
        "source_fp16.safetensors": ({"kv": fp16}, {"source": note + " dims [0, 32), fp16(fp32 / 3)"}),
        "source_bf16_per_layer.safetensors": (
            per_layer, {"source": f"sample_data/{PER_LAYER.name} layers {LAYERS} head 0 tokens [0, {TOKENS}) dims [0, 32)"}),
        # A cache of no tokens (the stacked shape with a zero-length token axis).
        "source_bf16_empty.safetensors": ({"kv": bf16[:, :, :0].contiguous()}, {"source": note + " dims [0, 32), no tokens"}),
        # Format version 3 (docs/shapes.md): a windowed layer keeping its last WINDOW tokens ...
        "source_bf16_windowed.safetensors": (
            {"layers.0.key": per_layer["layers.0.key"], "layers.0.value": per_layer["layers.0.value"],
             "layers.1.key": per_layer["layers.1.key"][:, :, TOKENS - WINDOW:].contiguous(),
             "layers.1.value": per_layer["layers.1.value"][:, :, TOKENS - WINDOW:].contiguous()},
            {"source": f"sample_data/{PER_LAYER.name} layers {LAYERS} head 0 dims [0, 32); layer 1 only its last "
                       f"{WINDOW} of tokens [0, {TOKENS})"}),
        # ... K and V of different sizes (V of an odd 15 channels: the "planes" groups' padding channel) ...
        "source_bf16_kv_sizes.safetensors": (
            {n: (t if n.endswith("key") else t[..., :15].contiguous()) for n, t in per_layer.items()},
            {"source": f"sample_data/{PER_LAYER.name} layers {LAYERS} head 0 tokens [0, {TOKENS}); "
                       "keys dims [0, 32), values dims [0, 15)"}),
        # Keys without RoPE (flags bit 2): the RoPE parameters in the source's metadata (what
        # `cachegen capture` writes).  Not the model's RoPE (the cut keeps 32 of a head's 64 dims):
        # two "heads" of 16 with a partial rotary dim of 12, a frequency row per layer, position 7;
        # and, for the rotated case, interleaved pairs over all 16 dims, one row, position 0.
        "source_bf16_rope.safetensors": (
            {"kv": bf16}, {"source": note + " dims [0, 32)", "rope": _rope_metadata(0, 16, 12, 7, (10000.0, 500000.0))}),
        "source_bf16_c16_rope.safetensors": (
            {"kv": _stacked(16)}, {"source": note + " dims [0, 16)", "rope": _rope_metadata(1, 16, 16, 0, (10000.0,))}),
        # ... and the stacked cache next to an extra tensor (stored exactly): its token ids.
        "source_bf16_extras.safetensors": (
            {"kv": bf16, "input_ids": torch.tensor([_token_ids()], dtype=torch.int64)},
            {"source": note + " dims [0, 32); input_ids: the sample's token_ids [0, 20)"}),
    }


CALIBRATION = "calibration_c16.safetensors"


def _rope_metadata(style: int, head_dim: int, rotary_dim: int, position_start: int, thetas: tuple) -> str:
    """A "rope" metadata value (methods/rope.to_metadata) with one frequency row per theta."""
    import numpy as np

    from cachegen_cli.methods import rope

    rows = [rope.from_theta(t, head_dim, rotary_dim).inv_freq[0] for t in thetas]
    return rope.to_metadata(rope.Rope(style, head_dim, rotary_dim, position_start, np.stack(rows)))


def _calibration() -> calib.Calibration:
    """A rotation for source_bf16_c16 learnt from other tokens of the same layers / channels."""
    kv = load_file(str(STACKED))["kv"][LAYERS, :, TOKENS:, 0, :16].contiguous()
    return calib.fit([kv])


def _transform(**kw) -> dict:
    """Every TransformConfig field, explicitly, so that a later change of a default or a
    --quality preset does not change what a golden case means."""
    cfg = dict(method="transform", key_step=[0.5], value_step=[0.5], sink_tokens=0, token_delta=False, rounding=0.5,
               recent_tokens=0, recent_bits=0, allocation="none")
    cfg.update(kw)
    return cfg


def _bins(key: list, value: list) -> dict:
    """A method-1 (format version 1) table, every range explicit: [start_layer, end_layer or
    None, bins] for the keys and the values (what a --bins string or a preset gives)."""
    return dict(method="bins", key=key, value=value)


#: name -> case.  ``expect``: header fields the test checks (format_version, method, flags,
#: sink_tokens, dtype code) and, for ``tables``, which kinds of table entries must occur.
CASES: dict[str, dict] = {
    "v2_lossless_bf16": dict(source="source_bf16.safetensors", config=_transform(method="lossless"),
                             expect=dict(version=2, method=3, flags=0, sink_tokens=0, dtype=2)),
    "v2_lossless_fp32": dict(source="source_fp32.safetensors", config=_transform(method="lossless"),
                             expect=dict(version=2, method=3, flags=0, sink_tokens=0, dtype=3)),
    "v2_transform": dict(source="source_bf16.safetensors", config=_transform(),
                         expect=dict(version=2, method=2, flags=0, sink_tokens=0, dtype=2)),
    "v2_refined": dict(source="source_bf16.safetensors", config=_transform(recent_tokens=6, recent_bits=2),
                       expect=dict(version=2, method=2, flags=2, sink_tokens=0, dtype=2, refine_tokens=6,
                                   refine_bits=2)),
    "v2_sinks": dict(source="source_bf16.safetensors", config=_transform(sink_tokens=2),
                     expect=dict(version=2, method=2, flags=0, sink_tokens=2, dtype=2)),
    "v2_delta_shared": dict(source="source_bf16_per_layer.safetensors",
                            config=_transform(key_step=[1.5], value_step=[1.5], sink_tokens=1, token_delta=True),
                            expect=dict(version=2, method=2, flags=0, sink_tokens=1, dtype=2, layout=2,
                                        tables=["direct", "delta", "same"])),
    "v2_rotated": dict(source="source_bf16_c16.safetensors", calibration=CALIBRATION,
                       config=_transform(sink_tokens=1),
                       expect=dict(version=2, method=2, flags=1, sink_tokens=1, dtype=2)),
    "v2_fp16": dict(source="source_fp16.safetensors",
                    config=_transform(sink_tokens=1, token_delta=True, recent_tokens=6, recent_bits=2),
                    expect=dict(version=2, method=2, flags=2, sink_tokens=1, dtype=1, refine_tokens=6,
                                refine_bits=2)),

    # ---- added for issue 16: every remaining combination the writers produce
    "v2_rotated_refined": dict(source="source_bf16_c16.safetensors", calibration=CALIBRATION,
                               config=_transform(sink_tokens=1, recent_tokens=6, recent_bits=2),
                               expect=dict(version=2, method=2, flags=3, sink_tokens=1, dtype=2, refine_tokens=6,
                                           refine_bits=2)),
    "v2_transform_fp32": dict(source="source_fp32.safetensors", config=_transform(sink_tokens=1, token_delta=True),
                              expect=dict(version=2, method=2, flags=0, sink_tokens=1, dtype=3,
                                          tables=["direct", "delta"])),
    "v2_lossless_fp16": dict(source="source_fp16.safetensors", config=_transform(method="lossless"),
                             expect=dict(version=2, method=3, flags=0, sink_tokens=0, dtype=1)),
    # refine bits 1 (the fewest), 3 (sub-cells that straddle a byte) and 8 (the most TransformConfig
    # allows); 3 bits over 9 tokens: the refined tokens span the chunks [8, 16) and [16, 20)
    "v2_refined_1bit": dict(source="source_bf16.safetensors", config=_transform(recent_tokens=6, recent_bits=1),
                            expect=dict(version=2, method=2, flags=2, sink_tokens=0, dtype=2, refine_tokens=6,
                                        refine_bits=1)),
    "v2_refined_3bits": dict(source="source_bf16.safetensors", config=_transform(sink_tokens=1, recent_tokens=9, recent_bits=3),
                             expect=dict(version=2, method=2, flags=2, sink_tokens=1, dtype=2, refine_tokens=9,
                                         refine_bits=3)),
    "v2_refined_8bits": dict(source="source_bf16.safetensors", config=_transform(recent_tokens=3, recent_bits=8),
                             expect=dict(version=2, method=2, flags=2, sink_tokens=0, dtype=2, refine_tokens=3,
                                         refine_bits=8)),
    # chunks of 96 tokens: 21 channels per stream (choose_group_v2), so two channel groups of 21
    # and 11 channels, the last one narrower; the one chunk is a short one (20 tokens)
    "v2_channel_groups": dict(source="source_bf16.safetensors", config=_transform(sink_tokens=1), chunk_tokens=96,
                              expect=dict(version=2, method=2, flags=0, sink_tokens=1, dtype=2, group=21)),
    "v2_empty": dict(source="source_bf16_empty.safetensors", config=_transform(),
                     expect=dict(version=2, method=2, flags=0, sink_tokens=0, dtype=2, num_tokens=0)),
    "v2_empty_lossless": dict(source="source_bf16_empty.safetensors", config=_transform(method="lossless"),
                              expect=dict(version=2, method=3, flags=0, sink_tokens=0, dtype=2, num_tokens=0)),
    # ---- keys without their rotary embedding (flags bit 2, 2026-12-02): with a sink, token deltas
    # and refinement (flags 6); with a rotation (flags 5)
    "v2_rope": dict(source="source_bf16_rope.safetensors",
                    config=_transform(sink_tokens=1, token_delta=True, recent_tokens=6, recent_bits=2, rope_keys=True),
                    expect=dict(version=2, method=2, flags=6, sink_tokens=1, dtype=2, refine_tokens=6, refine_bits=2,
                                rope=[0, 16, 12, 2, 7])),
    "v2_rope_rotated": dict(source="source_bf16_c16_rope.safetensors", calibration=CALIBRATION,
                            config=_transform(sink_tokens=1, rope_keys=True),
                            expect=dict(version=2, method=2, flags=5, sink_tokens=1, dtype=2, rope=[1, 16, 16, 1, 0])),
    # ---- the fixed-point rotation (flags bit 3, 2026-12-02): alone, refined, with RoPE-free keys
    "v2_fixed_rotated": dict(source="source_bf16_c16.safetensors", calibration=CALIBRATION,
                             config=_transform(sink_tokens=1),
                             expect=dict(version=2, method=2, flags=9, sink_tokens=1, dtype=2)),
    "v2_fixed_rotated_refined": dict(source="source_bf16_c16.safetensors", calibration=CALIBRATION,
                                     config=_transform(sink_tokens=1, recent_tokens=6, recent_bits=3),
                                     expect=dict(version=2, method=2, flags=11, sink_tokens=1, dtype=2,
                                                 refine_tokens=6, refine_bits=3)),
    "v2_fixed_rope_rotated": dict(source="source_bf16_c16_rope.safetensors", calibration=CALIBRATION,
                                  config=_transform(sink_tokens=1, rope_keys=True),
                                  expect=dict(version=2, method=2, flags=13, sink_tokens=1, dtype=2,
                                              rope=[1, 16, 16, 1, 0])),
    # format version 1 (method 1): LMCache's table for a small model is 32 bins everywhere; the
    # per-layer case has an odd 17 (17 symbols) and an even 16 (15 symbols)
    "v1_fp16": dict(source="source_fp16.safetensors", config=_bins([[0, None, 32]], [[0, None, 32]]),
                    expect=dict(version=1, method=1, dtype=1, bins=[[32, 32], [32, 32]])),
    "v1_fp32": dict(source="source_fp32.safetensors", config=_bins([[0, None, 32]], [[0, None, 16]]),
                    expect=dict(version=1, method=1, dtype=3, bins=[[32, 16], [32, 16]])),
    "v1_per_layer": dict(source="source_bf16_per_layer.safetensors",
                         config=_bins([[0, 1, 17], [1, None, 32]], [[0, None, 16]]),
                         expect=dict(version=1, method=1, dtype=2, layout=2, bins=[[17, 16], [32, 16]])),
    # chunks of 48 tokens: 21 channels per stream (choose_group), two channel groups
    "v1_channel_groups": dict(source="source_bf16.safetensors", config=_bins([[0, None, 32]], [[0, None, 32]]),
                              chunk_tokens=48, expect=dict(version=1, method=1, dtype=2, group=21,
                                                           bins=[[32, 32], [32, 32]])),
    "v1_empty": dict(source="source_bf16_empty.safetensors", config=_bins([[0, None, 32]], [[0, None, 32]]),
                     expect=dict(version=1, method=1, dtype=2, num_tokens=0, bins=[[32, 32], [32, 32]])),
    # format version 3, the multi-part container (docs/format.md, docs/shapes.md)
    "v3_windowed": dict(source="source_bf16_windowed.safetensors", config=_transform(sink_tokens=1, token_delta=True),
                        expect=dict(version=3, groups=[dict(kind="kv", tokens=TOKENS, channels=32, version=2, method=2),
                                                       dict(kind="kv", tokens=WINDOW, channels=32, version=2, method=2)],
                                    extras=[])),
    "v3_kv_sizes": dict(source="source_bf16_kv_sizes.safetensors", config=_transform(method="lossless"),
                        expect=dict(version=3, groups=[dict(kind="planes", tokens=TOKENS, channels=32, version=2, method=3),
                                                       dict(kind="planes", tokens=TOKENS, channels=15, version=2, method=3)],
                                    extras=[])),
    "v3_extras": dict(source="source_bf16_extras.safetensors", config=_bins([[0, None, 32]], [[0, None, 16]]),
                      expect=dict(version=3, groups=[dict(kind="kv", tokens=TOKENS, channels=32, version=1, method=1)],
                                  extras=["input_ids"])),
}


def config_of(case: dict) -> TransformConfig | QuantizationConfig:
    c = dict(case["config"])
    if c["method"] == "bins":
        specs = lambda rows: tuple(QuantizationSpec(a, b, n) for a, b, n in rows)  # noqa: E731
        return QuantizationConfig(specs(c["key"]), specs(c["value"]))
    c["key_step"], c["value_step"] = tuple(c["key_step"]), tuple(c["value_step"])
    return TransformConfig(**c)


@contextlib.contextmanager
def rotation_arithmetic(case: dict):
    """The writer's rotation arithmetic of the case: a rotated case without flags bit 3 was
    written with bit 0's float64 sums (methods/transform.FIXED_ROTATION = False)."""
    from cachegen_cli.methods import transform

    old = transform.FIXED_ROTATION
    transform.FIXED_ROTATION = bool(case["expect"].get("flags", 0) & 8) or not case.get("calibration")
    try:
        yield
    finally:
        transform.FIXED_ROTATION = old


def encode_case(case: dict, folder: Path = GOLDEN) -> bytes:
    """The case's .cgen bytes from its committed source (as tests/test_golden.py re-encodes it)."""
    from cachegen_cli.storage import kvio

    cal = folder / case["calibration"] if case.get("calibration") else None
    if case["expect"]["version"] == 3:  # a cache of another shape: its tensors as read, the multi-part file
        tensors, metadata = kvio.read_tensors(folder / case["source"])
    else:
        cache = kvio.read_safetensors(folder / case["source"])
        tensors, metadata = kvio.to_tensors(cache.data, cache.descriptor()), cache.metadata
    with rotation_arithmetic(case):
        return cg.encode(tensors, quantization=config_of(case), calibration=cal,
                         chunk_tokens=case.get("chunk_tokens", CHUNK_TOKENS), metadata=metadata, device="cpu")


def decoded_digests(blob: bytes, case: dict, folder: Path = GOLDEN) -> dict[str, dict]:
    """name -> {dtype, shape, sha256 of the tensor's little-endian bytes} of the decoded file."""
    cal = folder / case["calibration"] if case.get("calibration") else None
    out = cg.decode(blob, device="cpu", calibration=cal)
    return {name: tensor_digest(t) for name, t in sorted(out.items())}


def tensor_digest(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    # the words of the tensor's own element size (an int64 extra is 8-byte words, not pairs of int32)
    size = t.element_size()
    words = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).numpy().astype(f"<i{size}")
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "sha256": hashlib.sha256(words.tobytes()).hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rebuild in memory and compare; write nothing")
    args = ap.parse_args()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    bad = 0

    def put(path: Path, data: bytes) -> None:
        nonlocal bad
        if path.exists():
            if path.read_bytes() != data:
                print(f"differs (kept): {path.relative_to(ROOT)}")
                bad += 1
            return
        if args.check:
            print(f"missing: {path.relative_to(ROOT)}")
            bad += 1
            return
        path.write_bytes(data)
        print(f"wrote {path.relative_to(ROOT)} ({len(data)} bytes)")

    for name, (tensors, meta) in _sources().items():
        put(GOLDEN / name, save(tensors, metadata=meta))
    if not (GOLDEN / CALIBRATION).exists() and not args.check:
        # eigh's vectors depend on the LAPACK build: the calibration is fitted once and committed
        calib.save(_calibration(), GOLDEN / CALIBRATION)
        print(f"wrote {(GOLDEN / CALIBRATION).relative_to(ROOT)}")
    for name, case in CASES.items():
        blob = encode_case(case)
        put(GOLDEN / f"{name}.cgen", blob)
        kept = (GOLDEN / f"{name}.cgen").read_bytes() if (GOLDEN / f"{name}.cgen").exists() else blob
        entry = dict(case, file=f"{name}.cgen", sha256=hashlib.sha256(kept).hexdigest(),
                     decoded=decoded_digests(kept, case))
        if name in manifest:
            if manifest[name] != entry:
                print(f"manifest entry differs (kept): {name}")
                bad += 1
        elif not args.check:
            manifest[name] = entry
    if not args.check:
        MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print("ok" if not bad else f"{bad} difference(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
