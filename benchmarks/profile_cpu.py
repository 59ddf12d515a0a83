"""Per-stage CPU profile of the codec on the real sample tiled along tokens.

    python benchmarks/profile_cpu.py                 # numba's default thread count
    NUMBA_NUM_THREADS=1 python benchmarks/profile_cpu.py
    python benchmarks/profile_cpu.py --tile 4 --repeat 5

Two parts, each stage timed alone (the best of --repeat runs after one warm-up run;
ms, MB/s of the bf16 input, and CPU nanoseconds per value):

* reference: the stage-by-stage kernels (cpu.quantize, histogram, build_cdf,
  encode_streams, pack_streams; cum_from_codes, decode_streams, dequantize) over the
  whole slab, with the float32 conversions around them: the pipeline the CUDA kernels
  mirror, and what the CPU path ran before the fused kernels;
* fused: what codec.encode_to_stream / decode_from_stream run on the CPU now
  (cpu.encode_planes / decode_planes and the host work around them), then the whole
  API calls cachegen_cli.encode / decode.

"cpu ms" is process CPU time: with several threads it adds up their time, so
cpu ms / wall ms is the parallel speed-up the stage got.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data" / "smollm2_pydoc_520.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tile", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import numba
    from safetensors.torch import load_file

    import cachegen_cli as cg
    from cachegen_cli.pipeline import codec
    from cachegen_cli.format import container
    from cachegen_cli.storage import kvio
    from cachegen_cli.methods.config import lmcache_rule
    from cachegen_cli.kernels import cpu
    from cachegen_cli.kernels.coding_params import max_stream_bytes

    kv = load_file(str(SAMPLE))["kv"].repeat(1, 1, args.tile, 1, 1).contiguous()
    nbytes = kv.numel() * 2
    nvalues = kv.numel()
    print(f"{SAMPLE.name} x{args.tile}: {list(kv.shape)} bf16, {nbytes / 1e6:.1f} MB; numba threads {numba.get_num_threads()}")
    print(f"{'stage':44s} {'wall ms':>9s} {'MB/s':>8s} {'cpu ms':>9s} {'ns/value':>9s}")

    def tm(name, fn, *a):
        fn(*a)  # warm-up (and compilation)
        best = None
        for _ in range(args.repeat):
            w, c = time.perf_counter(), time.process_time()
            r = fn(*a)
            w, c = time.perf_counter() - w, time.process_time() - c
            if best is None or w < best[0]:
                best = (w, c)
        w, c = best
        print(f"{name:44s} {w * 1e3:9.1f} {nbytes / w / 1e6:8.0f} {c * 1e3:9.1f} {c * 1e9 / nvalues:9.2f}", flush=True)
        return r

    cache = kvio.from_tensors(kv)
    h = codec.make_header(cache, lmcache_rule(cache.num_layers), 256)
    L, C, ct, G, T = h.num_layers, h.num_channels, h.chunk_tokens, h.group, h.num_tokens
    K, S = h.num_chunks, int(h.alphabets.max())
    maxq = h.maxq
    assert len(list(codec.iter_slabs(h))) == 1, "profile assumes one slab"

    print("-- reference: stage-by-stage kernels")
    x = tm("to float32 (torch)", lambda: cache.data.to(torch.float32).contiguous().numpy())
    scales = np.empty((L, 2, T), np.uint16)
    sym = np.empty((L, 2, T, C), np.uint8)
    tm("quantize", cpu.quantize, x, maxq, scales, sym)
    counts = np.empty((K, L, 2, C, S), np.int32)
    tm("histogram", cpu.histogram, sym, ct, counts)
    codes = np.empty((K, L, 2, C, S), np.uint8)
    cum = np.empty((K, L, 2, C, S + 1), np.int32)
    tm("build_cdf", cpu.build_cdf, counts, maxq, codes, cum)
    n = K * h.streams_per_chunk
    slots = np.empty((n, max_stream_bytes(ct * G)), np.uint8)
    lengths = np.empty(n, np.int32)
    tm("encode_streams", cpu.encode_streams, sym, cum, ct, G, slots, lengths)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=off[1:])
    payload = np.empty(int(off[-1]), np.uint8)
    tm("pack_streams", cpu.pack_streams, slots, lengths, off, payload)
    cum2 = np.empty_like(cum)
    tm("cum_from_codes", cpu.cum_from_codes, codes, maxq, cum2)
    sym2 = np.empty_like(sym)
    tm("decode_streams", cpu.decode_streams, payload, off, lengths, cum2, maxq, ct, G, sym2)
    assert np.array_equal(sym, sym2)
    out = np.empty_like(x)
    tm("dequantize", cpu.dequantize, sym, scales, maxq, out)
    tm("from float32 (torch, to bf16)", lambda: torch.from_numpy(out).to(torch.bfloat16))

    print("-- fused: what the codec runs on the CPU")
    words, shift = codec._cpu_source_words(cache.data)
    f_scales = np.empty((L, 2, T), np.uint16)
    f_codes = np.empty((K, L, 2, C, S), np.uint8)
    f_lengths = np.empty((K, L, 2, h.groups), np.int32)
    plane_bytes = np.empty(K * L * 2, np.int64)
    planes = np.empty((K * L * 2, h.groups * max_stream_bytes(ct * G)), np.uint8)
    tm("encode_planes", cpu.encode_planes, words, shift, 0, T, maxq, ct, G, f_scales, f_codes, f_lengths,
       plane_bytes, planes)
    p_off = np.zeros(K * L * 2 + 1, np.int64)
    np.cumsum(plane_bytes, out=p_off[1:])
    f_payload = np.empty(int(p_off[-1]), np.uint8)
    tm("pack_streams (planes)", cpu.pack_streams, planes, plane_bytes, p_off, f_payload)
    assert np.array_equal(f_payload, payload) and np.array_equal(f_codes, codes) and np.array_equal(f_scales, scales)
    tm("pack_codes", container.pack_codes, codes, h)
    chunks = tm("encode_slab (all of the above)", codec._encode_slab_cpu, h, words, shift, 0, T, 0)
    tm("chunk records (CRC-32)", lambda: list(codec._pool().map(container.chunk_parts, chunks)))
    blob = tm("cachegen_cli.encode (whole API)", lambda: cg.encode(kv, device="cpu"))

    def read_all():
        f = container.BufferReader(blob)
        hh, _, offs, size = codec.read_header_and_index(f)
        return list(codec.iter_chunks(f, hh, offs, size))

    batch = tm("read chunks (CRC-32, checks)", read_all)
    tm("unpack_codes", lambda: container.unpack_codes(np.stack([c.codes for c in batch]), h, S))
    bf = np.empty((L, 2, T, C), np.uint16)
    tm("decode_planes -> bf16", cpu.decode_planes, payload, off, lengths, codes, maxq, ct, G, scales, bf, 0, True)
    f32 = np.empty((L, 2, T, C), np.float32)
    tm("decode_planes -> float32", cpu.decode_planes, payload, off, lengths, codes, maxq, ct, G, scales, f32, 0, False)
    assert np.array_equal(f32.view(np.uint32), out.view(np.uint32))
    dst = torch.empty((L, 2, T, C), dtype=torch.bfloat16)
    tm("decode slab into the tensor (all above)", codec._decode_slab_cpu, h, batch,
       dst.view(torch.int16).numpy().view(np.uint16), 0, True)
    back = tm("cachegen_cli.decode (whole API)", lambda: cg.decode(blob, device="cpu"))
    assert torch.equal(back["kv"].view(torch.int16), torch.from_numpy(out).to(torch.bfloat16).reshape(kv.shape).view(torch.int16))


if __name__ == "__main__":
    main()
