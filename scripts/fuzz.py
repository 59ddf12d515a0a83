"""Fuzz the .cgen reader: mutated and generated files, CRCs recomputed so that a mutation
reaches past the checksums into the parsers and the decoders.

    python scripts/fuzz.py --cases 1000000 --workers 4 --seed 1      # a long run
    python scripts/fuzz.py --seconds 900 --workers 1                 # for a time

Each case is made from (seed, case number) alone, so a failure is reproduced with
``--only CASE``.  A case passes when decoding either succeeds or raises a CacheGenError,
finishes within the time bound, and (methods 1 and 2, outside the verbatim sink tokens)
decodes finite values only.  The fast seeded run of tests/test_fuzz.py uses the same code.
See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import multiprocessing as mp
import os
import random
import struct
import sys
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Seconds one case may take before it counts as a hang (the first decodes compile kernels).
CASE_SECONDS = 20.0

MAGIC = b"\x89CGEN\r\n\x1a"
INTERESTING_8 = [0, 1, 2, 3, 0x7F, 0x80, 0xFE, 0xFF]
INTERESTING_16 = [0, 1, 2, 0x7F7F, 0x7F80, 0x7FFF, 0x8000, 0xFF80, 0xFFFF]
INTERESTING_32 = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 255, 256, 4096, 65535, 65536, 1 << 24, (1 << 31) - 1,
                  1 << 31, (1 << 32) - 2, (1 << 32) - 1]


# ------------------------------------------------------------------ seeds


def seed_files() -> list[tuple[str, bytes]]:
    """Small valid files of every method, dtype and layout, version 1 and 2."""
    import torch

    import cachegen_cli as cg

    def kv(layers, tokens, heads, dim, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(layers, 2, tokens, heads, dim, generator=g)
        if tokens:
            x[:, :, 0] *= 6.0
            x[:, 0, :, :, 0] += 8.0
        return x.to(dtype).contiguous()

    def per_layer(x):
        return {f"layers.{i}.{n}": x[i, j].permute(1, 0, 2).unsqueeze(0).contiguous()
                for i in range(x.shape[0]) for j, n in enumerate(("key", "value"))}

    seeds = []
    for n, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32)):
        x = kv(2, 11, 1, 6, dtype, n)
        for name, kw in (("v1-lmcache", dict(preset="lmcache")), ("v1-bins17", dict(bins="17")),
                         ("v1-bins3", dict(bins="3")),
                         ("v2-high", dict(quality="high")), ("v2-balanced", dict(quality="balanced")),
                         ("v2-small", dict(quality="small")), ("v2-lossless", dict(quality="lossless"))):
            seeds.append((f"{name}-{dtype}".replace("torch.", ""), cg.encode(x, chunk_tokens=4, device="cpu", **kw)))
        seeds.append((f"v2-balanced-per-layer-{dtype}".replace("torch.", ""),
                      cg.encode(per_layer(x), quality="balanced", chunk_tokens=4, device="cpu")))
        seeds.append((f"v1-per-layer-{dtype}".replace("torch.", ""),
                      cg.encode(per_layer(x), preset="lmcache", chunk_tokens=4, device="cpu")))
    one = kv(1, 1, 1, 3, torch.bfloat16, 7)
    empty = kv(2, 0, 1, 4, torch.bfloat16, 8)
    for q in ("lossless", "balanced"):
        seeds.append((f"v2-{q}-1tok", cg.encode(one, quality=q, chunk_tokens=4, device="cpu")))
        seeds.append((f"v2-{q}-0tok", cg.encode(empty, quality=q, chunk_tokens=4, device="cpu")))
    seeds.append(("v1-1tok", cg.encode(one, preset="lmcache", chunk_tokens=4, device="cpu")))
    seeds.append(("v1-0tok", cg.encode(empty, preset="lmcache", chunk_tokens=4, device="cpu")))
    return seeds


# ------------------------------------------------------------------ CRC repair


def _u32(b, at):
    return struct.unpack_from("<I", b, at)[0] if 0 <= at and at + 4 <= len(b) else None


def fix_crcs(blob: bytearray) -> bytearray:
    """Recompute every CRC the (possibly mutated) file announces, reading its sizes leniently:
    each chunk found by its magic, the index through the trailer, then the header."""
    n = len(blob)
    if n < 64 or blob[:8] != MAGIC:
        return blob
    version = struct.unpack_from("<H", blob, 8)[0]
    desc_size = _u32(blob, 12)
    layers = _u32(blob, 24)
    if version == 2:
        params_size = _u32(blob, 48)
        header_end = 64 + desc_size + params_size
    else:
        header_end = 64 + 2 * layers + desc_size
    at = blob.find(b"CGCK", min(header_end, n))
    while 0 <= at and at + 40 <= n:
        sizes = struct.unpack_from("<IIII", blob, at + 16)
        end = at + 40 + sum(sizes)
        if end <= n:
            struct.pack_into("<I", blob, at + 36, zlib.crc32(bytes(blob[at : at + 36]) + bytes(blob[at + 40 : end])))
        at = blob.find(b"CGCK", at + 4)
    if n >= 16 and blob[-8:] == b"CGENDIDX":
        idx = struct.unpack_from("<Q", blob, n - 16)[0]
        count = _u32(blob, idx + 4) if idx < n else None
        if count is not None:
            crc_at = idx + 8 + 8 * count
            if crc_at + 4 <= n:
                struct.pack_into("<I", blob, crc_at, zlib.crc32(bytes(blob[idx:crc_at])))
    if version == 2:
        covered = bytes(blob[64 : 64 + desc_size + params_size])
    else:
        covered = bytes(blob[64 : 64 + 2 * layers + desc_size])
    struct.pack_into("<I", blob, 60, zlib.crc32(bytes(blob[:60]) + covered))
    return blob


def chunk_offsets(blob: bytes) -> list[int]:
    out, at = [], blob.find(b"CGCK", 64)
    while at >= 0:
        out.append(at)
        at = blob.find(b"CGCK", at + 4)
    return out


# ------------------------------------------------------------------ mutators


def _put(rng: random.Random, b: bytearray, at: int, width: int) -> None:
    if at < 0 or at + width > len(b):
        return
    pool = {1: INTERESTING_8, 2: INTERESTING_16, 4: INTERESTING_32, 8: INTERESTING_32}[width]
    v = rng.choice(pool) if rng.random() < 0.8 else rng.getrandbits(8 * width)
    if rng.random() < 0.3:
        v = (int.from_bytes(b[at : at + width], "little") + rng.choice((-2, -1, 1, 2))) % (1 << (8 * width))
    b[at : at + width] = v.to_bytes(width, "little")


HEADER_FIELDS = [(8, 2), (10, 2), (12, 4), (16, 8), (24, 4), (28, 4), (32, 4), (36, 4), (40, 2), (42, 1),
                 (43, 1), (44, 1), (45, 1), (46, 1), (47, 1), (48, 4), (52, 4), (56, 4)]
CHUNK_FIELDS = [(4, 4), (8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4), (32, 4)]


def mutate(rng: random.Random, seed: bytes) -> tuple[str, bytes]:
    b = bytearray(seed)
    kinds = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        k = rng.randrange(12)
        n = len(b)
        if n == 0:
            break
        if k == 0:  # bit flips anywhere
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(n)
                b[i] ^= 1 << rng.randrange(8)
            kinds.append("bitflip")
        elif k == 1:  # interesting bytes anywhere
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(n)] = rng.choice(INTERESTING_8)
            kinds.append("byte")
        elif k == 2:  # a header field
            at, w = rng.choice(HEADER_FIELDS)
            _put(rng, b, at, w)
            kinds.append(f"header@{at}")
        elif k == 3:  # a chunk header field
            offs = chunk_offsets(bytes(b))
            if offs:
                at, w = rng.choice(CHUNK_FIELDS)
                _put(rng, b, rng.choice(offs) + at, w)
            kinds.append("chunkfield")
        elif k == 4:  # u16 words in the body (scales, lengths, steps, offsets, sink)
            for _ in range(rng.randint(1, 4)):
                _put(rng, b, rng.randrange(64, max(65, n - 1)) & ~1, 2)
            kinds.append("word16")
        elif k == 5:  # truncate
            del b[rng.randrange(n) :]
            kinds.append("truncate")
        elif k == 6:  # delete a range
            i = rng.randrange(n)
            del b[i : i + rng.randint(1, 64)]
            kinds.append("delete")
        elif k == 7:  # insert bytes
            i = rng.randrange(n + 1)
            b[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 32)))
            kinds.append("insert")
        elif k == 8:  # the descriptor JSON: a value changed
            kinds.append("descriptor")
            b = bytearray(_mutate_descriptor(rng, bytes(b)))
        elif k == 9:  # an index offset or the trailer
            if n >= 16:
                idx = struct.unpack_from("<Q", b, n - 16)[0]
                if rng.random() < 0.5 and idx + 8 < n:
                    cnt = _u32(b, idx + 4) or 0
                    if cnt:
                        _put(rng, b, idx + 8 + 8 * rng.randrange(cnt), 4)
                    else:
                        _put(rng, b, idx + 4, 4)
                else:
                    _put(rng, b, n - 16, 4)
            kinds.append("index")
        elif k == 10:  # duplicate or drop a whole chunk
            offs = chunk_offsets(bytes(b))
            if len(offs) >= 2:
                j = rng.randrange(len(offs) - 1)
                piece = bytes(b[offs[j] : offs[j + 1]])
                if rng.random() < 0.5:
                    b[offs[j + 1] : offs[j + 1]] = piece
                else:
                    del b[offs[j] : offs[j + 1]]
            kinds.append("chunksplice")
        else:  # a run of random bytes
            i = rng.randrange(n)
            m = rng.randint(1, 16)
            b[i : i + m] = bytes(rng.getrandbits(8) for _ in range(len(b[i : i + m])))
            kinds.append("random")
    if rng.random() < 0.9:
        fix_crcs(b)
        kinds.append("crc")
    return "+".join(kinds), bytes(b)


def _mutate_descriptor(rng: random.Random, blob: bytes) -> bytes:
    """Replace one value of the Descriptor JSON (sizes, CRC fixed later; index shifted)."""
    if len(blob) < 64:
        return blob
    version = struct.unpack_from("<H", blob, 8)[0]
    size = _u32(blob, 12)
    layers = _u32(blob, 24)
    at = 64 + (2 * layers if version == 1 else 0)
    try:
        desc = json.loads(blob[at : at + size])
    except (ValueError, UnicodeDecodeError):
        return blob
    weird = [None, True, -1, 0, 1, 2 ** 40, 1.5, "x", "", [], {}, [1, 2], "float16", "bfloat16", "layers.0.key"]

    def walk(obj, depth=0):
        if isinstance(obj, dict) and obj:
            key = rng.choice(sorted(obj))
            if depth > 3 or rng.random() < 0.4:
                obj[key] = rng.choice(weird)
            else:
                walk(obj[key], depth + 1)
            if rng.random() < 0.1:
                obj.pop(key, None)
        elif isinstance(obj, list) and obj:
            i = rng.randrange(len(obj))
            if depth > 3 or rng.random() < 0.5:
                obj[i] = rng.choice(weird)
            else:
                walk(obj[i], depth + 1)

    walk(desc)
    new = json.dumps(desc, separators=(",", ":"), sort_keys=True).encode()
    shift = len(new) - size
    out = bytearray(blob[:at] + new + blob[at + size :])
    struct.pack_into("<I", out, 12, len(new))
    n = len(out)
    if n >= 16 and out[-8:] == b"CGENDIDX":  # keep the index pointing at the moved chunks
        idx = (struct.unpack_from("<Q", out, n - 16)[0] + shift) % (1 << 64)
        struct.pack_into("<Q", out, n - 16, idx)
        cnt = _u32(out, idx + 4)
        if cnt is not None and idx + 8 + 8 * cnt <= n:
            for j in range(cnt):
                o = struct.unpack_from("<Q", out, idx + 8 + 8 * j)[0]
                struct.pack_into("<Q", out, idx + 8 + 8 * j, (o + shift) % (1 << 64))
    return bytes(out)


def generate(rng: random.Random, seeds: list[tuple[str, bytes]]) -> tuple[str, bytes]:
    """A file built from scratch: a seed's header with random fields, random sections, CRCs fixed."""
    _, base = rng.choice(seeds)
    b = bytearray(base[:64])
    for at, w in rng.sample(HEADER_FIELDS, rng.randint(1, 4)):
        _put(rng, b, at, w)
    body = bytearray(base[64:])
    for _ in range(rng.randint(0, 8)):
        if body:
            i = rng.randrange(len(body))
            body[i : i + 4] = bytes(rng.getrandbits(8) for _ in range(len(body[i : i + 4])))
    if rng.random() < 0.2:
        body = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 300))) + bytearray(base[-16:])
    return "generated", bytes(fix_crcs(b + body))


def make_case(seed: int, case: int, seeds: list[tuple[str, bytes]]) -> tuple[str, bytes]:
    rng = random.Random(seed * 1_000_003 + case)
    if rng.random() < 0.15:
        return generate(rng, seeds)
    name, base = rng.choice(seeds)
    kind, blob = mutate(rng, base)
    return f"{name}:{kind}", blob


# ------------------------------------------------------------------ the check


class CaseFailure(Exception):
    pass


def check(blob: bytes) -> str:
    """Decode ``blob`` three ways (whole in memory, slab by slab from a stream, the API);
    returns "ok" or the error class name; raises CaseFailure on a crash or a non-finite value."""
    import torch

    from cachegen_cli.errors import CacheGenError
    from cachegen_cli.pipeline import codec
    from cachegen_cli.storage import kvio
    import cachegen_cli as cg

    outcome = None
    try:
        reader, _ = codec.open_input(blob)
        h, tensor = codec.decode_from_stream(reader, device="cpu")
        tensors = kvio.to_tensors(tensor, h.descriptor)
        if h.method in (1, 2):
            part = tensor[:, :, h.sink_tokens :] if h.method == 2 else tensor
            if part.numel() and not torch.isfinite(part).all():
                raise CaseFailure(f"method {h.method} decoded a non-finite value")
        del tensors
        outcome = "ok"
    except CacheGenError as exc:
        outcome = type(exc).__name__
    except CaseFailure:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CaseFailure(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc
    # the streaming reader (what `cachegen decode` and `cachegen test` use) must agree
    try:
        dec = codec.SlabDecoder(io.BytesIO(blob), "cpu")
        for _ in dec.blocks():
            pass
        second = "ok"
    except CacheGenError as exc:
        second = type(exc).__name__
    except Exception as exc:  # noqa: BLE001
        raise CaseFailure(f"streaming: {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc
    if (outcome == "ok") != (second == "ok"):
        raise CaseFailure(f"in-memory decode says {outcome}, streaming decode says {second}")
    if outcome == "ok" and not isinstance(cg.decode(blob, device="cpu"), dict):
        raise CaseFailure("decode() returned no dict")
    return outcome


def run_cases(seed: int, cases, seeds, time_bound: float = CASE_SECONDS, on_failure=None) -> dict:
    """Run the cases; returns counts by outcome.  A case over ``time_bound`` seconds is a failure."""
    counts: dict[str, int] = {}
    failures = []
    for case in cases:
        try:
            name, blob = make_case(seed, case, seeds)
        except Exception:  # noqa: BLE001 - a bug of the mutators, not of the reader
            counts["mutator-skipped"] = counts.get("mutator-skipped", 0) + 1
            continue
        t = time.perf_counter()
        try:
            outcome = check(blob)
        except CaseFailure as exc:
            failures.append((case, name, str(exc)))
            outcome = "FAILURE"
            if on_failure:
                on_failure(case, name, blob, str(exc))
        took = time.perf_counter() - t
        if took > time_bound:
            failures.append((case, name, f"took {took:.1f} s"))
            if on_failure:
                on_failure(case, name, blob, f"took {took:.1f} s")
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "failures": failures}


# ------------------------------------------------------------------ long runs


def _worker(args) -> dict:
    seed, worker, workers, cases, seconds, out_dir = args
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    seeds = seed_files()
    started = time.monotonic()
    counts: dict[str, int] = {}
    failures = []
    done = 0
    last = started

    def on_failure(case, name, blob, message):
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / f"case-{seed}-{case}.cgen").write_bytes(blob)
            (Path(out_dir) / f"case-{seed}-{case}.txt").write_text(f"{name}\n{message}\n")

    case = worker
    while (cases is None or case < cases) and (seconds is None or time.monotonic() - started < seconds):
        # a hang kills the worker with a traceback of where it was (the parent reports the case)
        faulthandler.dump_traceback_later(CASE_SECONDS * 3, exit=True)
        r = run_cases(seed, [case], seeds, on_failure=on_failure)
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
        failures += r["failures"]
        done += 1
        case += workers
        if worker == 0 and time.monotonic() - last > 60:
            last = time.monotonic()
            print(f"[worker 0] {done} cases, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    return {"counts": counts, "failures": failures, "done": done, "seconds": time.monotonic() - started}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=None, help="total cases (default: 1,000,000 unless --seconds)")
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", type=int, default=None, help="run one case and print its outcome")
    ap.add_argument("--failures", default="build/fuzz-failures", help="where failing inputs are written")
    ap.add_argument("--json", action="store_true", help="print the totals as JSON")
    a = ap.parse_args(argv)
    if a.only is not None:
        seeds = seed_files()
        name, blob = make_case(a.seed, a.only, seeds)
        print(name, len(blob), "bytes")
        print(check(blob))
        return 0
    cases = a.cases if a.cases is not None or a.seconds is not None else 1_000_000
    t = time.monotonic()
    jobs = [(a.seed, w, a.workers, cases, a.seconds, a.failures) for w in range(a.workers)]
    if a.workers == 1:
        results = [_worker(jobs[0])]
    else:
        with mp.get_context("spawn").Pool(a.workers) as pool:
            results = pool.map(_worker, jobs)
    counts: dict[str, int] = {}
    failures = []
    for r in results:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
        failures += r["failures"]
    total = sum(counts.values())
    summary = {"seed": a.seed, "cases": total, "seconds": round(time.monotonic() - t, 1), "workers": a.workers,
               "outcomes": dict(sorted(counts.items(), key=lambda kv: -kv[1])), "failures": len(failures)}
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{total:,} cases in {summary['seconds']} s on {a.workers} worker(s), seed {a.seed}: "
              f"{len(failures)} failure(s)")
        for k, v in summary["outcomes"].items():
            print(f"  {v:>10,}  {k}")
    for case, name, message in failures[:20]:
        print(f"FAILURE case {case} ({name}): {message.splitlines()[0]}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
