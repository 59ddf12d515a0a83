"""Fuzz the .cgen reader: mutated and generated files, CRCs recomputed so that a mutation
reaches past the checksums into the parsers and the decoders.

    python scripts/fuzz.py --cases 1000000 --workers 4 --seed 1      # a long run
    python scripts/fuzz.py --seconds 900 --workers 1                 # for a time

Each case is made from (seed, case number) alone, so a failure is reproduced with
``--only CASE``.  A case passes when decoding either succeeds or raises a CacheGenError,
finishes within the time bound, and (methods 1 and 2, outside the verbatim sink tokens)
decodes finite values only.  Decoders get the fuzz calibration (rotated seeds) and an output
limit of MAX_OUTPUT bytes; the report gives each worker's peak RSS and the most one case
raised the RSS.  The fast seeded run of tests/test_fuzz.py uses the same code.
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
import resource
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
#: The decoders' output limit (the API's max_output_size=, the CLI's --max-output-size): a case
#: announcing more must stop at OutputTooLargeError, before allocating; what a case may allocate
#: is bounded by it (tests/test_fuzz.py checks the peak RSS against it).
MAX_OUTPUT = 64 << 20

MAGIC = b"\x89CGEN\r\n\x1a"
INTERESTING_8 = [0, 1, 2, 3, 0x7F, 0x80, 0xFE, 0xFF]
INTERESTING_16 = [0, 1, 2, 0x7F7F, 0x7F80, 0x7FFF, 0x8000, 0xFF80, 0xFFFF]
INTERESTING_32 = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 255, 256, 4096, 65535, 65536, 1 << 24, (1 << 31) - 1,
                  1 << 31, (1 << 32) - 2, (1 << 32) - 1]


# ------------------------------------------------------------------ seeds


def _givens(n: int, pairs, c: float = 0.6, s: float = 0.8) -> list[list[float]]:
    """An n x n rotation: Givens rotations by (c, s) on the index pairs, multiplied in order, in
    plain Python floats (the same float32 bits on every machine, unlike a LAPACK fit)."""
    r = [[float(i == j) for j in range(n)] for i in range(n)]
    for a, b in pairs:
        g = [[float(i == j) for j in range(n)] for i in range(n)]
        g[a][a], g[a][b], g[b][a], g[b][b] = c, -s, s, c
        r = [[sum(r[i][k] * g[k][j] for k in range(n)) for j in range(n)] for i in range(n)]
    return r


def fuzz_calibration(layers: int = 2, channels: int = 6, blocks: int = 1):
    """The rotated seeds' calibration (methods/calibration.py), built in memory: the same
    rotation for every (layer, K/V), full (blocks=1) or block-diagonal."""
    import numpy as np

    from cachegen_cli.methods.calibration import Calibration

    d = channels // blocks
    pairs = [(i, i + 1) for i in range(0, d - 1, 2)] + [(i, i + 1) for i in range(1, d - 1, 2)]
    block = np.array(_givens(d, pairs), np.float32)
    rot = np.broadcast_to(block, (layers, 2, blocks, d, d)).copy()
    return Calibration(rot if blocks > 1 else rot[:, :, 0], {"format": "cachegen-calibration",
                                                              "version": "2" if blocks > 1 else "1"})


#: The rotated seeds' calibrations: [full, per-block] (built once).
_CALIBRATIONS = []


def default_calibration():
    if not _CALIBRATIONS:
        _CALIBRATIONS.extend((fuzz_calibration(), fuzz_calibration(blocks=2)))
    return _CALIBRATIONS[0]


def calibration_for(blob: bytes):
    """What a user would pass: the fuzz calibration whose SHA-256 the (possibly mutated) version-2
    file names in its Params block, else the full one (a digest or shape that matches neither
    stops at a CalibrationError)."""
    default = default_calibration()
    if len(blob) >= 64 and blob[8:10] == b"\x02\x00":
        at = 64 + struct.unpack_from("<I", blob, 12)[0]
        digest = blob[at : at + 32]
        for cal in _CALIBRATIONS:
            if cal.sha256 == digest:
                return cal
    return default


def seed_files() -> list[tuple[str, bytes]]:
    """Small valid files of every method, dtype and layout, version 1 and 2; rotated version-2
    files (the fuzz calibration); multi-part files (version 3) holding version 1 and 2 groups."""
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
    # rotated (flags bit 0): a full rotation and a per-block one (check() decodes each with its own)
    for n, dtype in enumerate((torch.bfloat16, torch.float32)):
        x = kv(2, 11, 1, 6, dtype, 20 + n)
        for q in ("balanced", "small"):
            seeds.append((f"v2-{q}-rotated-{dtype}".replace("torch.", ""),
                          cg.encode(x, quality=q, calibration=default_calibration(), chunk_tokens=4, device="cpu")))
    seeds.append(("v2-balanced-rotated-blocks", cg.encode(kv(2, 11, 1, 6, torch.bfloat16, 22), quality="balanced",
                                                          calibration=_CALIBRATIONS[1], chunk_tokens=4,
                                                          device="cpu")))
    # the rotated seeds above use the fixed-point rotation (flags 9, cachegen's writer since
    # 2026-12-02); these keep flags bit 0's float64 form (files written before), refined too
    from cachegen_cli.methods import transform as transform_methods

    old_form = transform_methods.FIXED_ROTATION
    transform_methods.FIXED_ROTATION = False
    try:
        for n, q in enumerate(("balanced", "high")):
            seeds.append((f"v2-{q}-rotated-float64-form", cg.encode(kv(2, 11, 1, 6, torch.bfloat16, 24 + n), quality=q,
                                                                    calibration=default_calibration(), chunk_tokens=4,
                                                                    device="cpu")))
    finally:
        transform_methods.FIXED_ROTATION = old_form
    # keys without their RoPE (flags bit 2): both pair styles, a partial rotary dim, a frequency row
    # per layer, positions far from 0; and with a rotation (flags 5)
    from cachegen_cli.format.params import Rope
    from cachegen_cli.methods import rope as rope_methods

    base = rope_methods.from_theta(10000.0, 6, 4)
    for n, (dtype, style) in enumerate(((torch.bfloat16, 0), (torch.float32, 1))):
        r = Rope(style, 6, 4, 1000 + n, (base.inv_freq * [[1.0], [0.5]][:1]).repeat(2, 0) if n else base.inv_freq)
        seeds.append((f"v2-balanced-rope-{dtype}".replace("torch.", ""),
                      cg.encode(kv(2, 11, 1, 6, dtype, 40 + n), quality="balanced", rope=r, chunk_tokens=4,
                                device="cpu")))
    seeds.append(("v2-small-rope-rotated", cg.encode(kv(2, 11, 1, 6, torch.bfloat16, 42), quality="small",
                                                     calibration=default_calibration(), rope=base, chunk_tokens=4,
                                                     device="cpu")))
    # format v3: windowed layers (two "kv" groups of method 2) and an int64 extra; K and V of
    # different sizes ("planes" groups of method 1) and a bool extra
    g = torch.Generator().manual_seed(30)

    def t(*shape):
        return (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)

    windowed = {"layers.0.key": t(1, 1, 11, 6), "layers.0.value": t(1, 1, 11, 6),
                "layers.1.key": t(1, 1, 5, 6), "layers.1.value": t(1, 1, 5, 6),
                "input_ids": torch.arange(11, dtype=torch.int64)}
    seeds.append(("v3-windowed-balanced", cg.encode(windowed, quality="balanced", chunk_tokens=4, device="cpu")))
    seeds.append(("v3-windowed-lossless", cg.encode(windowed, quality="lossless", chunk_tokens=4, device="cpu")))
    mla = {"layers.0.key": t(1, 1, 7, 6), "layers.0.value": t(1, 1, 7, 4),
           "layers.1.key": t(1, 1, 7, 6), "layers.1.value": t(1, 1, 7, 4),
           "attention_mask": torch.ones(7, dtype=torch.bool)}
    seeds.append(("v3-planes-lmcache", cg.encode(mla, preset="lmcache", chunk_tokens=4, device="cpu")))
    return seeds


# ------------------------------------------------------------------ CRC repair


def _u32(b, at):
    return struct.unpack_from("<I", b, at)[0] if 0 <= at and at + 4 <= len(b) else None


def _fix_parts_crcs(blob: bytearray) -> bytearray:
    """fix_crcs of a version-3 file: each part found through the part table (leniently: an entry
    out of the file is skipped), a group part's own CRCs first, then its entry's, then the header's."""
    n = len(blob)
    manifest_size, part_count = _u32(blob, 16), _u32(blob, 20)
    table = 48 + manifest_size
    for i in range(min(part_count, max(0, (n - table) // 24))):
        at = table + 24 * i
        offset, size, kind = struct.unpack_from("<QQB", blob, at)
        if offset + size > n:
            continue
        part = bytearray(blob[offset : offset + size])
        if kind == 1 and part[:8] == MAGIC and part[8:10] != b"\x03\x00":  # a group: its own file first
            part = fix_crcs(part)
            blob[offset : offset + size] = part
        struct.pack_into("<I", blob, at + 20, zlib.crc32(bytes(part)))
    end = min(n, table + 24 * part_count)
    struct.pack_into("<I", blob, 44, zlib.crc32(bytes(blob[:44]) + bytes(blob[48:end])))
    return blob


def fix_crcs(blob: bytearray) -> bytearray:
    """Recompute every CRC the (possibly mutated) file announces, reading its sizes leniently:
    each chunk found by its magic, the index through the trailer, then the header (version 3:
    each part through the part table, then the header)."""
    n = len(blob)
    if n < 64 or blob[:8] != MAGIC:
        return blob
    version = struct.unpack_from("<H", blob, 8)[0]
    if version == 3:
        return _fix_parts_crcs(blob)
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
    """Replace one value of the Descriptor JSON (sizes, CRC fixed later; index shifted); of a
    version-3 file, of the Manifest (the part table's offsets and the file size shifted)."""
    if len(blob) < 64:
        return blob
    version = struct.unpack_from("<H", blob, 8)[0]
    if version == 3:
        return _mutate_manifest(rng, blob)
    size = _u32(blob, 12)
    layers = _u32(blob, 24)
    at = 64 + (2 * layers if version == 1 else 0)
    try:
        desc = json.loads(blob[at : at + size])
    except (ValueError, UnicodeDecodeError):
        return blob
    _walk_json(rng, desc)
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


def _mutate_manifest(rng: random.Random, blob: bytes) -> bytes:
    """One value of a version-3 Manifest replaced (tensor entries, groups, members, positions)."""
    size, count = _u32(blob, 16), _u32(blob, 20)
    try:
        manifest = json.loads(blob[48 : 48 + size])
    except (ValueError, UnicodeDecodeError, TypeError):
        return blob
    _walk_json(rng, manifest, 5)  # down to a plane reference's selectors: groups, a group, members, a member, a reference
    new = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    shift = len(new) - size
    out = bytearray(blob[:48] + new + blob[48 + size :])
    struct.pack_into("<I", out, 16, len(new))
    struct.pack_into("<Q", out, 32, (struct.unpack_from("<Q", out, 32)[0] + shift) % (1 << 64))
    table = 48 + len(new)
    for i in range(min(count, max(0, (len(out) - table) // 24))):  # the parts moved with the manifest
        o = struct.unpack_from("<Q", out, table + 24 * i)[0]
        struct.pack_into("<Q", out, table + 24 * i, (o + shift) % (1 << 64))
    return bytes(out)


def _walk_json(rng: random.Random, desc, max_depth: int = 3) -> None:
    """Replace (or drop) one value somewhere in a parsed JSON object, in place, at most
    ``max_depth`` + 1 levels down."""
    weird = [None, True, -1, 0, 1, 2 ** 40, 1.5, "x", "", [], {}, [1, 2], "float16", "bfloat16", "layers.0.key",
             "kv", "extra", "planes", "HTD", "BHTD", "L2THD", "latent", [0], [0, 0, 0], 2 ** 32, 4096]

    def walk(obj, depth=0):
        if isinstance(obj, dict) and obj:
            key = rng.choice(sorted(obj))
            if depth > max_depth or rng.random() < 0.4:
                obj[key] = rng.choice(weird)
            else:
                walk(obj[key], depth + 1)
            if rng.random() < 0.1:
                obj.pop(key, None)
        elif isinstance(obj, list) and obj:
            i = rng.randrange(len(obj))
            if depth > max_depth or rng.random() < 0.5:
                obj[i] = rng.choice(weird)
            else:
                walk(obj[i], depth + 1)

    walk(desc)


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


def _finite_or_fail(tensor, method: int, sink: int, where: str = "") -> None:
    """Methods 1 and 2 decode finite values only (outside method 2's verbatim sink tokens;
    method 3 stores its words raw, so a mutated file may hold a NaN that was written there)."""
    import torch

    if method in (1, 2):
        part = tensor[:, :, sink:] if method == 2 else tensor
        if part.numel() and not torch.isfinite(part).all():
            raise CaseFailure(f"{where}method {method} decoded a non-finite value")


def _outcome(fn, what: str) -> str:
    """"ok" when fn() returns, the CacheGenError's class name when it raises one; anything else
    is a CaseFailure."""
    from cachegen_cli.errors import CacheGenError

    try:
        fn()
        return "ok"
    except CacheGenError as exc:
        return type(exc).__name__
    except CaseFailure:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CaseFailure(f"{what}{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc


def check(blob: bytes, calibration="default", max_output_size: int | None = MAX_OUTPUT) -> str:
    """Decode ``blob`` three ways (whole in memory, slab by slab from a stream, the API; a
    version-3 file: group by group as `cachegen decode` does, as `cachegen test` does, the API)
    with ``calibration`` (default: calibration_for's pick) and the output limit; returns "ok" or the
    error class name; raises CaseFailure on a crash, a non-finite value or a disagreement."""
    from cachegen_cli.format.container import check_decoded_size
    from cachegen_cli.pipeline import codec
    from cachegen_cli.storage import kvio
    import cachegen_cli as cg

    cal = calibration_for(blob) if calibration == "default" else calibration
    if blob[:8] == MAGIC and blob[8:10] == b"\x03\x00":
        return _check_parts(blob, cal, max_output_size)

    def in_memory():
        check_decoded_size(blob[:64], max_output_size)  # as cachegen_cli.decode, before anything is allocated
        reader, _ = codec.open_input(blob)
        h, tensor = codec.decode_from_stream(reader, device="cpu", calibration=cal)
        tensors = kvio.to_tensors(tensor, h.descriptor)
        _finite_or_fail(tensor, h.method, h.sink_tokens if h.method == 2 else 0)
        del tensors, tensor

    def streaming():  # what `cachegen decode` and `cachegen test` use
        dec = codec.SlabDecoder(io.BytesIO(blob), "cpu", cal)
        check_decoded_size(blob[:64], max_output_size)
        for _ in dec.blocks():
            pass

    outcome = _outcome(in_memory, "")
    second = _outcome(streaming, "streaming: ")
    if (outcome == "ok") != (second == "ok"):
        raise CaseFailure(f"in-memory decode says {outcome}, streaming decode says {second}")
    if outcome == "ok":
        out = cg.decode(blob, device="cpu", calibration=cal, max_output_size=max_output_size)
        if not isinstance(out, dict):
            raise CaseFailure("decode() returned no dict")
    return outcome


def _check_parts(blob: bytes, cal, max_output_size: int | None) -> str:
    """check() of a version-3 file: the package's decode path for it, three ways."""
    from cachegen_cli.format import parts as parts_format
    from cachegen_cli.format.container import check_decoded_size
    from cachegen_cli.pipeline import parts as parts_codec
    from cachegen_cli.storage import kvparts
    import cachegen_cli as cg

    def by_groups():  # api._decode_parts_file: the groups, then the tensors from the manifest
        pf = parts_format.PartsFile(blob)
        check_decoded_size(blob[:64], max_output_size)
        m = pf.manifest
        data = []
        for i in range(len(m["groups"])):
            group = parts_codec.decode_group(pf, i, "cpu", cal)
            head = bytes(pf.part(i)[:64])
            method, sink = head[44], struct.unpack_from("<I", head, 52)[0] if head[8] == 2 else 0
            _finite_or_fail(group, method, sink if method == 2 else 0, f"group {i}: ")
            data.append(group)
        extras = [bytes(pf.part(i)) for i in range(len(m["groups"]), len(pf.parts))]
        tensors = kvparts.tensors_from_groups(m, data, extras)
        del data, tensors

    def tested():  # `cachegen test`
        check_decoded_size(blob[:64], max_output_size)
        parts_codec.test_parts(blob, "cpu", cal)

    outcome = _outcome(by_groups, "v3: ")
    second = _outcome(tested, "v3 test: ")
    if (outcome == "ok") != (second == "ok"):
        raise CaseFailure(f"v3: the group decode says {outcome}, the test path says {second}")
    third = _outcome(lambda: cg.decode(blob, device="cpu", calibration=cal, max_output_size=max_output_size),
                     "v3 decode(): ")
    if (outcome == "ok") != (third == "ok"):
        raise CaseFailure(f"v3: the group decode says {outcome}, decode() says {third}")
    return outcome


def _peak_rss() -> int:
    """This process's peak resident set so far, in bytes (getrusage's ru_maxrss; Linux reports
    KiB).  It only grows, and the interpreter's start-up (imports, loading the kernels) sets a
    peak that one small decode never passes: a case's own peak needs _CasePeak."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(*keys: str) -> list[int]:
    out = dict.fromkeys(keys, 0)
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in out:
                out[k] = int(v.split()[0])
    return [out[k] * 1024 for k in keys]


class _CasePeak:
    """How far one case raises the resident set above where it started: on Linux the kernel's
    high-water mark is reset to the current RSS (/proc/self/clear_refs "5") and read back
    (VmHWM); elsewhere the growth of ru_maxrss (a lower bound: 0 under an earlier peak)."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start, = _status_kib("VmRSS")
            self.exact = True
        except OSError:
            self.start, self.exact = _peak_rss(), False

    def peak(self) -> int:
        """The case's peak RSS (bytes): the high-water mark since the reset."""
        return _status_kib("VmHWM")[0] if self.exact else _peak_rss()

    def growth(self) -> int:
        return max(0, self.peak() - self.start)


def run_cases(seed: int, cases, seeds, time_bound: float = CASE_SECONDS, on_failure=None) -> dict:
    """Run the cases; returns counts by outcome, the failures, and memory (bytes): ``start_rss``
    (the process's peak RSS, ru_maxrss, before the run), ``peak_rss`` (the largest of it and every
    case's peak), ``max_case_growth`` (the most one case raised the RSS above where it started,
    _CasePeak) and ``max_growth_case``.  A case over ``time_bound`` seconds is a failure."""
    counts: dict[str, int] = {}
    failures = []
    start = peak = _peak_rss()
    growth, growth_case = 0, None
    for case in cases:
        try:
            name, blob = make_case(seed, case, seeds)
        except Exception:  # noqa: BLE001 - a bug of the mutators, not of the reader
            counts["mutator-skipped"] = counts.get("mutator-skipped", 0) + 1
            continue
        t = time.perf_counter()
        mem = _CasePeak()
        try:
            outcome = check(blob)
        except CaseFailure as exc:
            failures.append((case, name, str(exc)))
            outcome = "FAILURE"
            if on_failure:
                on_failure(case, name, blob, str(exc))
        took = time.perf_counter() - t
        peak = max(peak, mem.peak())
        if mem.growth() > growth:
            growth, growth_case = mem.growth(), case
        if took > time_bound:
            failures.append((case, name, f"took {took:.1f} s"))
            if on_failure:
                on_failure(case, name, blob, f"took {took:.1f} s")
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "failures": failures, "start_rss": start, "peak_rss": peak,
            "max_case_growth": growth, "max_growth_case": growth_case}


# ------------------------------------------------------------------ long runs


def _worker(args) -> dict:
    seed, worker, workers, cases, seconds, out_dir = args
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    seeds = seed_files()
    for _, blob in seeds:  # load the kernels first: the peak RSS after this is the worker's baseline
        check(blob)
    base_rss = peak_rss = _peak_rss()
    growth, growth_case = 0, None
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
        peak_rss = max(peak_rss, r["peak_rss"])
        if r["max_case_growth"] > growth:
            growth, growth_case = r["max_case_growth"], case
        done += 1
        case += workers
        if worker == 0 and time.monotonic() - last > 60:
            last = time.monotonic()
            print(f"[worker 0] {done} cases, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    return {"counts": counts, "failures": failures, "done": done, "seconds": time.monotonic() - started,
            "base_rss": base_rss, "peak_rss": peak_rss, "max_case_growth": growth, "max_growth_case": growth_case}


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
    mib = 1 << 20
    memory = [{"worker": w, "base_rss_mib": round(r["base_rss"] / mib, 1), "peak_rss_mib": round(r["peak_rss"] / mib, 1),
               "max_case_growth_kib": r["max_case_growth"] // 1024, "max_growth_case": r["max_growth_case"]}
              for w, r in enumerate(results)]
    summary = {"seed": a.seed, "cases": total, "seconds": round(time.monotonic() - t, 1), "workers": a.workers,
               "outcomes": dict(sorted(counts.items(), key=lambda kv: -kv[1])), "failures": len(failures),
               "max_output_mib": MAX_OUTPUT / mib, "memory": memory}
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{total:,} cases in {summary['seconds']} s on {a.workers} worker(s), seed {a.seed}: "
              f"{len(failures)} failure(s)")
        for k, v in summary["outcomes"].items():
            print(f"  {v:>10,}  {k}")
        for m in memory:
            print(f"  worker {m['worker']}: peak RSS {m['peak_rss_mib']} MiB ({m['base_rss_mib']} MiB after the seeds); "
                  f"one case raised the RSS by at most {m['max_case_growth_kib']:,} KiB (case {m['max_growth_case']}); "
                  f"output limit {MAX_OUTPUT // mib} MiB")
    for case, name, message in failures[:20]:
        print(f"FAILURE case {case} ({name}): {message.splitlines()[0]}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
