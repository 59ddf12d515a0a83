"""Bytes and quality of LMCache's serdes on the same KV chunks: cachegen's (every quality and
the lmcache preset) against LMCache's fp8 and TurboQuant serdes and its legacy CacheGen.

The chunks are a real cache cut into LMCache's chunk layout [2, layers, tokens, hidden]
(full chunks of --chunk-tokens tokens, as LMCache stores them).  Each serde runs through
LMCache's own code: the serde registry (create_serde_processor) and AsyncSerdeProcessor for
cachegen, fp8 and TurboQuant; the legacy CacheGen through its encode_function /
decode_function_gpu / do_dequantize (LMCache's CPU fallbacks of its CUDA kernels run them
on a machine without a GPU).  A serde that cannot run here is listed with the reason.

Quality: the relative squared error of the cache (sum (x' - x)^2 / sum x^2) and the
model-free attention-output error of `cachegen tune` (model/tune.py AttentionMeasure: RMS
over layers of ||O' - O|| / ||O|| with the cache's own keys as queries), on the chunks put
back together; and, when the text the cache was captured from is known (--text, or the
metadata's text_file next to the cache), the model-level quality `cachegen eval` measures
(model/evaluate.py): the chunks' context is rebuilt by the model (SmolLM2-135M-Instruct by
default, --model), the decoded chunks are swapped in, and the next --continuation tokens of
the text are scored: mean KL(original || decoded) of the next-token distributions and top-1
agreement.  The model runs on the CPU (the serdes where they can: TurboQuant needs CUDA).

    python scripts/lmcache_compare.py sample_data/smollm2_pydoc_520.safetensors [--markdown] [--no-kl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cachegen_cli.storage import kvio  # noqa: E402


def _lmcache():
    import lmcache.v1.distributed.serde as serde
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryFormat, TensorMemoryAllocator
    from lmcache.v1.platform import consume_fd

    import cachegen_cli.integrations.lmcache_serde  # noqa: F401  (registers "cachegen")

    return serde, MemoryLayoutDesc, MemoryFormat, TensorMemoryAllocator, consume_fd


class _Runner:
    """Serialize / deserialize chunks through an LMCache SerdeProcessor, as its serde wrapper does."""

    def __init__(self, kind: str, kwargs: dict) -> None:
        serde, self.Desc, self.Fmt, Alloc, self.consume = _lmcache()
        self.proc = serde.create_serde_processor(serde.SerdeConfig(kind, dict(kwargs)))
        self.alloc = Alloc(torch.empty(256 << 20, dtype=torch.uint8))

    def _wait(self, fd, query, task) -> bool:
        while True:
            if select.select([fd], [], [], 1.0)[0]:
                self.consume(fd)
            done = query(task)
            if done is not None:
                return done

    def roundtrip(self, chunk: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """(stored bytes, estimate, decoded chunk)."""
        p = self.proc
        src = self.alloc.allocate([chunk.shape], [chunk.dtype], fmt=self.Fmt.KV_2LTD)
        src.tensor.copy_(chunk)
        estimate = p.estimate_serialized_size(self.Desc([chunk.shape], [chunk.dtype]))
        tmp = self.alloc.allocate([torch.Size([estimate])], [torch.uint8], fmt=self.Fmt.BINARY_BUFFER)
        if not self._wait(p.get_serialize_event_fd(), p.query_serialize_result, p.submit_serialize([src], [tmp])):
            try:  # the processor only reports False: call its serializer once more for the reason
                p._serializer.serialize(src, tmp)
            finally:
                src.ref_count_down()
                tmp.ref_count_down()
            raise RuntimeError("serialize failed")
        stored = bytes(tmp.byte_array)  # narrowed to the bytes written (set_used_size): what L2 stores
        load = self.alloc.allocate([torch.Size([estimate])], [torch.uint8], fmt=self.Fmt.BINARY_BUFFER)
        load.tensor[: len(stored)].copy_(torch.frombuffer(bytearray(stored), dtype=torch.uint8))
        out = self.alloc.allocate([chunk.shape], [chunk.dtype], fmt=self.Fmt.KV_2LTD)
        if not self._wait(p.get_deserialize_event_fd(), p.query_deserialize_result, p.submit_deserialize([load], [out])):
            raise RuntimeError("deserialize failed (see LMCache's log above)")
        decoded = out.tensor.clone()
        for obj in (src, tmp, load, out):
            obj.ref_count_down()
        return len(stored), estimate, decoded

    def close(self) -> None:
        self.proc.close()


def legacy_cachegen(chunk: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[int, int, torch.Tensor]:
    """LMCache's legacy CacheGen (lmcache/storage_backend/serde), with the bins table its
    CacheGenConfig gives a model of this many layers (32 bins for K layers < 10 and V layers < 2,
    16 above), as CacheGenSerializer.serialize / CacheGenDeserializer.deserialize call it.
    (Its v1 wrapper's module imports every storage backend: redis, aiofile, ...)"""
    from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig, CacheGenGPUEncoderOutput, QuantizationSpec
    from lmcache.storage_backend.serde.cachegen_decoder import decode_function_gpu, do_dequantize
    from lmcache.storage_backend.serde.cachegen_encoder import encode_function

    _, L, T, C = chunk.shape
    small = L < 10
    cfg = CacheGenConfig(
        nlayers=L,
        kspecs=[QuantizationSpec(start_layer=0, end_layer=L, bins=32)] if small else
        [QuantizationSpec(start_layer=0, end_layer=10, bins=32), QuantizationSpec(start_layer=10, end_layer=L, bins=16)],
        vspecs=[QuantizationSpec(start_layer=0, end_layer=L, bins=32)] if small else
        [QuantizationSpec(start_layer=0, end_layer=2, bins=32), QuantizationSpec(start_layer=2, end_layer=L, bins=16)])

    def bins(specs):
        table = torch.zeros(L)
        for s in specs:
            table[s.start_layer : s.end_layer] = s.bins
        return table

    kb, vb = bins(cfg.kspecs), bins(cfg.vspecs)
    x = chunk.view(2, L, T, num_kv_heads, head_dim).permute(1, 0, 2, 3, 4)
    blob = encode_function(x, cfg, kb, vb, T).to_bytes()
    out = CacheGenGPUEncoderOutput.from_bytes(blob)
    ntok = out.max_tensors_key.shape[1]
    buffer = torch.zeros((ntok, 2 * L * C), dtype=torch.uint8)
    k, v = decode_function_gpu(out.cdf, out.data_chunks, out.max_tensors_key.shape[0], ntok, buffer)
    k = do_dequantize(k, kb, out.max_tensors_key)
    v = do_dequantize(v, vb, out.max_tensors_value)
    decoded = torch.stack([k, v]).reshape(2, L, ntok, C).to(chunk.dtype)
    return len(blob), len(blob), decoded


METHODS = [
    ("cachegen quality=lossless", "cachegen", {"quality": "lossless"}),
    ("cachegen quality=high", "cachegen", {"quality": "high"}),
    ("cachegen quality=balanced", "cachegen", {"quality": "balanced"}),
    ("cachegen quality=small", "cachegen", {"quality": "small"}),
    ("cachegen preset=lmcache", "cachegen", {"preset": "lmcache"}),
    ("LMCache fp8 (float8_e4m3fn)", "fp8", {}),
    ("LMCache fp8 (float8_e5m2)", "fp8", {"fp8_dtype": "float8_e5m2"}),
    ("LMCache turboquant (turboquant_k8v4)", "turboquant", {"preset": "turboquant_k8v4", "head_dim": None}),
    ("LMCache turboquant (turboquant_4bit_nc)", "turboquant", {"preset": "turboquant_4bit_nc", "head_dim": None}),
    ("LMCache legacy CacheGen", "legacy", {}),
]


def _text_of(path: Path, metadata: dict, text: Path | None) -> Path | None:
    """The text the cache was captured from: ``text``, else the metadata's text_file (relative to
    the cache's folder, as sample_data/ records it) when its SHA-256 is the metadata's."""
    if text is not None:
        return text
    name = metadata.get("text_file")
    if not name:
        return None
    found = path.parent / name
    if not found.is_file():
        return None
    from cachegen_cli.model.capture import read_text, text_sha256

    want = metadata.get("text_sha256")
    return found if want is None or text_sha256(read_text(found)) == want else None


def kl_reference(cache, whole: int, text_path: Path, model_path: Path | None, continuation: int, log=print):
    """evaluate.Reference of the chunks' context (the file's first ``whole`` token ids), rebuilt by
    the model as `cachegen eval` does, scoring the next ``continuation`` tokens of the text."""
    from cachegen_cli.model import evaluate
    from cachegen_cli.model.capture import load_model, read_text

    ids = [int(i) for i in json.loads(cache.metadata["token_ids"])][:whole]
    model, tokenizer = load_model(model_path, log=log)
    cont = evaluate.text_continuation(tokenizer, read_text(text_path), text_path, ids, continuation)
    log(f"model {evaluate.model_id(model)}: reference over "
        f"{len(ids)} context tokens, {continuation} scored")
    return evaluate.build_reference(model, ids, cont, 0, cache.data.dtype)


def compare(path: Path, chunk_tokens: int = 256, log=print, *, kl: bool = True, text: Path | None = None,
            model: Path | None = None, continuation: int = 128) -> dict:
    from cachegen_cli.model.tune import AttentionMeasure

    cache = kvio.read_safetensors(path)
    L, T, C, H, D = cache.num_layers, cache.num_tokens, cache.num_channels, cache.num_kv_heads, cache.head_dim
    whole = (T // chunk_tokens) * chunk_tokens
    if whole == 0:
        raise SystemExit(f"{path}: {T} tokens, fewer than one chunk of {chunk_tokens}")
    internal = cache.data[:, :, :whole]  # [L, 2, T, C]
    lm = internal.permute(1, 0, 2, 3).contiguous()  # LMCache's [2, L, T, C]
    chunks = [lm[:, :, t : t + chunk_tokens].contiguous() for t in range(0, whole, chunk_tokens)]
    raw = internal.numel() * internal.element_size()
    x = internal.double()
    measure = AttentionMeasure(internal, H, D)
    ref = None
    text_path = _text_of(path, cache.metadata, text) if kl else None
    if kl and text_path is None:
        log("no KL: the text the cache was captured from is not known (--text)")
    if text_path is not None:
        from cachegen_cli.model import evaluate

        ref = kl_reference(cache, whole, text_path, model, continuation, log)
        ref_score = evaluate.score(ref, internal)  # the chunks as stored: KL to float rounding of the rebuild
    rows = []
    for label, kind, kwargs in METHODS:
        t0 = time.perf_counter()
        try:
            if kind == "legacy":
                parts = [legacy_cachegen(c, H, D) for c in chunks]
            else:
                if kwargs.get("head_dim", 0) is None:
                    kwargs = dict(kwargs, head_dim=D)
                runner = _Runner(kind, kwargs)
                try:
                    parts = [runner.roundtrip(c) for c in chunks]
                finally:
                    runner.close()
        except Exception as exc:  # a serde that cannot run here: say why
            rows.append({"method": label, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
            log(f"{label}: cannot run: {rows[-1]['error']}")
            continue
        seconds = time.perf_counter() - t0
        stored = sum(p[0] for p in parts)
        estimate = sum(p[1] for p in parts)
        decoded = torch.cat([p[2] for p in parts], dim=2).permute(1, 0, 2, 3).contiguous()  # [L, 2, T, C]
        y = decoded.double()
        quality = {}
        if ref is not None:
            from cachegen_cli.model import evaluate

            scored = evaluate.score(ref, decoded)
            quality = {"kl": scored["kl_mean"], "top1": scored["top1_agreement"]}
        rows.append({
            "method": label,
            "bytes": stored,
            "estimate": estimate,
            "ratio": raw / stored,
            "bits_per_value": 8 * stored / internal.numel(),
            "rel_mse": float((y - x).pow(2).sum() / x.pow(2).sum()),
            "attention_error": measure.value(measure.cost(decoded)),
            "seconds": seconds,
            **quality,
        })
        log(f"{label}: {stored:,} bytes, {seconds:.1f} s")
    out = {"file": str(path), "chunks": len(chunks), "chunk_tokens": chunk_tokens, "shape": [2, L, whole, C],
           "raw_bytes": raw, "rows": rows}
    if ref is not None:
        from cachegen_cli.model import evaluate

        out["kl"] = {"text": str(text_path), "model": evaluate.model_id(ref.model), "context_tokens": whole,
                     "continuation_tokens": continuation, "stored_chunks_kl": ref_score["kl_mean"],
                     "stored_chunks_top1": ref_score["top1_agreement"]}
    return out


def triton_interpreter_on_cpu() -> None:
    """Let LMCache's TurboQuant serde run its Triton kernels in Triton's interpreter
    (TRITON_INTERPRET=1, set before triton is imported) on CPU tensors: its device choice
    (which requires CUDA) returns the CPU, and its fp8 format is the one of an SM >= 8.9 GPU
    (e4m3, as on an H100 / H200).  The kernels are LMCache's own; the interpreter runs each
    program with numpy, so float rounding may differ from a GPU's in the last bits."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--triton-interpret: triton was imported before TRITON_INTERPRET could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    import lmcache.v1.distributed.serde.turboquant.decode_kernel as decode_kernel
    import lmcache.v1.distributed.serde.turboquant.turboquant as turboquant

    turboquant._select_cuda_device = lambda *args, **kwargs: torch.device("cpu")
    decode_kernel._FP8_E4B15[0] = 0


def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("lmcache", "torch", "numba"))


def markdown(result: dict) -> str:
    kl = result.get("kl")
    lines = [
        f"{result['chunks']} chunks of {result['chunk_tokens']} tokens, LMCache layout {result['shape']} "
        f"(bf16, {result['raw_bytes']:,} bytes) from `{result['file']}`",
    ]
    if kl:
        lines.append(f"KL and top-1: model {kl['model']}, the {kl['context_tokens']}-token context rebuilt, the next "
                     f"{kl['continuation_tokens']} tokens of `{kl['text']}` scored; the stored chunks themselves score "
                     f"KL {kl['stored_chunks_kl']:.1e}, top-1 {kl['stored_chunks_top1']:.3f} (the rebuild's rounding)")
    head = ("| serde | stored bytes | estimate (buffer) | ratio vs bf16 | bits/value | cache rel. sq. error | "
            "attention-output error |" + (" KL | top-1 |" if kl else ""))
    lines += ["", head, "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if kl else "")]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | cannot run here: {r['error']} | | | | | |" + (" | |" if kl else ""))
            continue
        line = (f"| {r['method']} | {r['bytes']:,} | {r['estimate']:,} | {r['ratio']:.2f}x | "
                f"{r['bits_per_value']:.2f} | {r['rel_mse']:.2e} | {r['attention_error']:.2e} |")
        if kl:
            line += f" {r['kl']:.2e} | {r['top1']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", type=Path, help="a KV safetensors file (either cachegen layout)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="LMCache's chunk size (256)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--no-kl", action="store_true", help="skip the model-level KL (no model run)")
    ap.add_argument("--text", type=Path, help="the text the cache was captured from [default: the metadata's "
                    "text_file next to the cache]")
    ap.add_argument("--model", type=Path, help="the model the cache was captured with [default: SmolLM2-135M-Instruct]")
    ap.add_argument("--continuation", type=int, default=128, help="tokens scored for the KL (128, as cachegen eval)")
    ap.add_argument("--serdes", help="only the rows whose label contains one of these comma-separated words "
                    "(e.g. turboquant)")
    ap.add_argument("--triton-interpret", action="store_true",
                    help="run LMCache's TurboQuant (Triton kernels) in Triton's interpreter on the CPU: its "
                    "serializer otherwise needs CUDA; minutes a chunk, for bytes and quality, never for speed")
    args = ap.parse_args()
    if args.serdes:
        words = [w.strip() for w in args.serdes.split(",") if w.strip()]
        METHODS[:] = [m for m in METHODS if any(w in m[0] for w in words)]
    if args.triton_interpret:
        triton_interpreter_on_cpu()
    result = compare(args.cache, args.chunk_tokens, log=lambda m: print(m, file=sys.stderr), kl=not args.no_kl,
                     text=args.text, model=args.model, continuation=args.continuation)
    print(f"date {datetime.date.today().isoformat()}; {platform.machine()}, {os.cpu_count()} cores, "
          f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; {_versions()}")
    if args.markdown:
        print(markdown(result))
        return
    for r in result["rows"]:
        print(r)


if __name__ == "__main__":
    main()
