"""File -> file encode and decode a slab at a time: the same bytes as the whole-cache paths,
the same errors, and memory that stays a slab rather than the cache."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import cachegen_cli as cg
from cachegen_cli.methods import calibration as calib
from cachegen_cli.pipeline import codec
from cachegen_cli.storage import kvio
from cachegen_cli.methods import transform
from cachegen_cli.errors import LayoutError, NonFiniteError, NotSafetensorsError
from cachegen_cli.kernels import cpu_transform as k2
from cachegen_cli.format.params import pack_refinement, unpack_refinement

from conftest import per_layer, realistic_kv

ROOT = Path(__file__).resolve().parent.parent
METHODS = [{"preset": "lmcache"}, {"quality": "lossless"}, {"quality": "balanced"}, {"quality": "small"}]


@pytest.fixture
def small_slabs(monkeypatch):
    """Slabs of one chunk (format v1) and of two 8-token chunks (v2) for 3-layer, 16-channel caches."""
    monkeypatch.setattr(codec, "SLAB_BYTES", 1)
    monkeypatch.setattr(transform, "V2_SLAB_BYTES", 2 * 8 * 3 * 2 * 16 * 4)


def _old_decoded_file(blob: bytes, path: Path, calibration=None) -> bytes:
    """What decode_file wrote before it streamed: the whole tensors through safetensors."""
    reader, _ = codec.open_input(blob)
    h, data = codec.decode_from_stream(reader, device="cpu", calibration=calibration)
    kvio.write_safetensors_atomic(kvio.to_tensors(data, h.descriptor), h.descriptor.get("metadata", {}), path)
    return path.read_bytes()


# ---------------------------------------------------------------- the safetensors writer and reader


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["stacked", "per-layer-4d", "per-layer-3d"])
@pytest.mark.parametrize("metadata", [None, {"model": 'quote " newline \n tab \t ctl \x01 é 漢 🙂'}])
def test_writer_gives_safetensors_bytes_slab_by_slab(tmp_path, dtype, layout, metadata):
    kv = realistic_kv(layers=3, tokens=23, dtype=dtype)
    tensors = {"kv é": kv} if layout == "stacked" else per_layer(kv, batch=layout.endswith("4d"))
    cache = kvio.from_tensors(tensors, metadata=metadata)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata=metadata)
    for cuts in ([0, 23], [0, 1, 9, 22, 23], list(range(24))):
        out = tmp_path / f"out{len(cuts)}.safetensors"
        with kvio.SafetensorsWriter(out, cache.descriptor(), cache.dtype_name) as w:
            for t0, t1 in reversed(list(zip(cuts, cuts[1:]))):  # any order: positioned writes
                w.write(t0, cache.data[:, :, t0:t1])
        assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_writer_sorts_metadata_keys(tmp_path):
    """safetensors writes several metadata keys in hash order (a different file each run);
    the streaming writer sorts them; everything else is safetensors' layout."""
    kv = realistic_kv(layers=2, tokens=5)
    cache = kvio.from_tensors(kv, metadata={"zeta": "1", "alpha": "2", "mid": "3"})
    out = tmp_path / "o.safetensors"
    with kvio.SafetensorsWriter(out, cache.descriptor(), cache.dtype_name) as w:
        w.write(0, cache.data)
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    assert list(json.loads(raw[8 : 8 + n])["__metadata__"]) == ["alpha", "mid", "zeta"]
    assert torch.equal(load_file(str(out))["kv"], kv)


@pytest.mark.parametrize("layout", ["stacked", "per-layer-4d", "per-layer-3d"])
def test_source_reads_token_ranges(tmp_path, layout):
    kv = realistic_kv(layers=3, tokens=31)
    tensors = {"kv": kv} if layout == "stacked" else per_layer(kv, batch=layout.endswith("4d"))
    path = tmp_path / "kv.safetensors"
    save_file(tensors, str(path), metadata={"m": "x"})
    whole = kvio.read_safetensors(path)
    with kvio.SafetensorsSource(path) as src:
        assert src.cache.descriptor() == whole.descriptor()
        assert src.cache.data.device.type == "meta"
        for t0, t1 in ((0, 31), (0, 1), (5, 17), (30, 31), (31, 31)):
            assert torch.equal(src.read(t0, t1), whole.data[:, :, t0:t1])


def test_source_rejects_what_read_safetensors_rejects(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(NotSafetensorsError, match="not a readable safetensors file"):
        kvio.SafetensorsSource(bad)
    odd = tmp_path / "odd.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(2)}, str(odd))
    with pytest.raises(LayoutError) as streamed:
        kvio.SafetensorsSource(odd)
    with pytest.raises(LayoutError) as whole:
        kvio.read_safetensors(odd)
    assert str(streamed.value) == str(whole.value)
    ints = tmp_path / "ints.safetensors"
    save_file({"kv": torch.zeros(2, 2, 3, 1, 4, dtype=torch.int32)}, str(ints))
    with pytest.raises(cg.CacheGenError, match="int32"):
        kvio.SafetensorsSource(ints)


# ---------------------------------------------------------------- files: same bytes, any slab size


def _roundtrip_files(tmp_path: Path, src: Path, name: str, **kw) -> tuple[bytes, bytes]:
    cgen, back = tmp_path / f"{name}.cgen", tmp_path / f"{name}.back.safetensors"
    cg.encode_file(src, cgen, device="cpu", chunk_tokens=8, force=True, **kw)
    cg.decode_file(cgen, back, device="cpu", force=True, calibration=kw.get("calibration"))
    return cgen.read_bytes(), back.read_bytes()


@pytest.mark.parametrize("method", METHODS, ids=lambda m: next(iter(m.values())))
@pytest.mark.parametrize("layout", ["stacked", "per-layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_files_in_slabs_match_the_whole_cache_paths(tmp_path, monkeypatch, method, layout, dtype):
    # 77 tokens in chunks of 8: ten chunks, the last short; the 64 refined tokens of the
    # --quality methods start inside a slab and span several.
    kv = realistic_kv(layers=3, tokens=77, dtype=dtype)
    tensors = {"kv": kv} if layout == "stacked" else per_layer(kv)
    src = tmp_path / "kv.safetensors"
    save_file(tensors, str(src), metadata={"model": "synthetic"})
    one_slab = _roundtrip_files(tmp_path, src, "one", **method)
    monkeypatch.setattr(codec, "SLAB_BYTES", 1)
    monkeypatch.setattr(transform, "V2_SLAB_BYTES", 2 * 8 * 3 * 2 * 16 * 4)
    slabs = _roundtrip_files(tmp_path, src, "slabs", **method)
    assert slabs == one_slab
    blob = cg.encode(tensors, device="cpu", chunk_tokens=8, metadata={"model": "synthetic"}, **method)
    assert slabs[0] == blob  # the in-memory API writes the same file
    assert slabs[1] == _old_decoded_file(blob, tmp_path / "old.safetensors")
    if method.get("quality") == "lossless":
        assert slabs[1] == src.read_bytes()  # bit-exact, down to the file


def test_rotated_file_in_slabs(tmp_path, small_slabs):
    kv = realistic_kv(layers=3, tokens=77)
    cal = calib.fit([kv.reshape(3, 2, 77, 16)])
    src = tmp_path / "kv.safetensors"
    save_file({"kv": kv}, str(src))
    cgen, back = _roundtrip_files(tmp_path, src, "rot", quality="balanced", calibration=cal)
    assert cgen == cg.encode(kv, quality="balanced", calibration=cal, chunk_tokens=8, device="cpu")
    assert back == _old_decoded_file(cgen, tmp_path / "old.safetensors", cal)


def test_decode_file_checks_the_calibration_before_writing(tmp_path):
    kv = realistic_kv(layers=3, tokens=20)
    cal = calib.fit([kv.reshape(3, 2, 20, 16)])
    (tmp_path / "kv.cgen").write_bytes(cg.encode(kv, quality="balanced", calibration=cal, device="cpu"))
    before = set(os.listdir(tmp_path))
    with pytest.raises(calib.CalibrationError):
        cg.decode_file(tmp_path / "kv.cgen", tmp_path / "out.safetensors", device="cpu")
    assert set(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("method", METHODS, ids=lambda m: next(iter(m.values())))
def test_nonfinite_error_names_the_first_layer_of_the_whole_cache(tmp_path, small_slabs, method):
    kv = realistic_kv(layers=3, tokens=40)
    kv[2, 1, 3, 0, 0] = float("nan")  # first slab, last layer
    kv[1, 0, 37, 1, 2] = float("inf")  # last slab, an earlier layer
    kv[1, 1, 20, 0, 5] = float("nan")
    src = tmp_path / "kv.safetensors"
    save_file({"kv": kv}, str(src))
    with pytest.raises(NonFiniteError) as whole:
        kvio.read_safetensors(src)
    assert "layer 1 holds NaN and Inf" in str(whole.value)
    before = set(os.listdir(tmp_path))
    with pytest.raises(NonFiniteError) as streamed:
        cg.encode_file(src, tmp_path / "kv.cgen", device="cpu", chunk_tokens=8, **method)
    assert str(streamed.value) == str(whole.value)
    assert set(os.listdir(tmp_path)) == before  # no output, no temporary file


def test_empty_cache_files(tmp_path):
    src = tmp_path / "kv.safetensors"
    save_file({"kv": torch.zeros(2, 2, 0, 2, 8, dtype=torch.bfloat16)}, str(src))
    for method in METHODS:
        cgen, back = _roundtrip_files(tmp_path, src, "e", **method)
        assert back == src.read_bytes()


# ---------------------------------------------------------------- kernels the slab paths use


def test_stats_carried_across_slabs_equal_the_whole_cache_sums():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 700, 5)).astype(np.float32)
    rot = np.zeros((0, 0, 0, 0, 0), np.float32)
    sums, sumsq = np.empty((2, 2, 5)), np.empty((2, 2, 5))
    k2.transform_stats(x, rot, 3, sums, sumsq)
    for cuts in ([0, 700], [0, 1, 255, 256, 257, 600, 700], [0, 2, 3, 512, 700]):
        s1, s2, b1, b2 = (np.zeros((2, 2, 5)) for _ in range(4))
        for t0, t1 in zip(cuts, cuts[1:]):
            k2.transform_stats_carry(np.ascontiguousarray(x[:, :, t0:t1]), rot, 3, t0, 700, s1, s2, b1, b2)
        # the same additions in the same order: identical on any machine
        assert np.array_equal(s1, sums) and np.array_equal(s2, sumsq)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
def test_refinement_bits_kernels_match_params(bits):
    rng = np.random.default_rng(bits)
    v = rng.integers(0, 1 << bits, 1001).astype(np.uint8)
    packed = transform.pack_refinement_bits(v, bits)
    assert packed.tobytes() == pack_refinement(v, bits)
    assert np.array_equal(transform.unpack_refinement_bits(packed, v.size, bits), unpack_refinement(packed, v.size, bits))
    if (v.size * bits) % 8:
        bad = packed.copy()
        bad[-1] |= 0x80
        with pytest.raises(cg.CacheGenError, match="padding"):
            transform.unpack_refinement_bits(bad, v.size, bits)


# ---------------------------------------------------------------- memory


_PEAK = textwrap.dedent("""
    import resource, sys
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, {tests!r})
    import cachegen_cli as cg
    from cachegen_cli.pipeline import codec
    from cachegen_cli.methods import transform
    from conftest import realistic_kv
    src, step, method = sys.argv[1], sys.argv[2], sys.argv[3]
    kw = {{"preset": "lmcache"}} if method == "lmcache" else {{"quality": method}}
    # compile / load the kernels and warm up on a small file first: the measurement is the growth
    small = src + ".small.safetensors"
    save_file({{"kv": realistic_kv(layers=4, tokens=64, heads=8, head_dim=32)}}, small)
    cg.encode_file(small, small + ".cgen", device="cpu", force=True, **kw)
    cg.decode_file(small + ".cgen", small + ".back", device="cpu", force=True)
    codec.SLAB_BYTES = transform.V2_SLAB_BYTES = 4 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if step == "encode":
        cg.encode_file(src, src + ".cgen", device="cpu", force=True, **kw)
    else:
        cg.decode_file(src + ".cgen", src + ".back", device="cpu", force=True)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
""")


@pytest.mark.parametrize("method", ["lmcache", "lossless", "balanced"])
def test_file_paths_hold_a_slab_not_the_cache(tmp_path, method):
    """The cache is 64 MiB in slabs of 4 MiB of float32: encode and decode grow the process by
    far less than the cache (the whole-cache paths grew it by several times its size)."""
    src = tmp_path / "kv.safetensors"
    kv = realistic_kv(layers=4, tokens=4096, heads=8, head_dim=256)  # 4 x 2 x 4096 x 2048 bf16 = 64 MiB
    save_file({"kv": kv}, str(src))
    N = kv.numel() * kv.element_size()
    del kv
    script = _PEAK.format(tests=str(Path(__file__).parent))
    for step in ("encode", "decode"):
        r = subprocess.run([sys.executable, "-c", script, str(src), step, method], capture_output=True, text=True,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        growth = int(r.stdout.split()[-1])
        assert growth < N // 2, f"{step} grew the process by {growth / 2**20:.0f} MiB for a {N / 2**20:.0f} MiB cache"


# ---------------------------------------------------------------- multi-part files (format v3), plane slab by slab


def _v3_cases():
    from test_shapes import CASES

    return {k: CASES[k] for k in ("sliding window + extras", "MLA K/V of different sizes",
                                  "batch of 3, past_key_values names, fp16", "key_cache / value_cache names, fp32",
                                  "latents layers.i.latent, odd channels", "stacked tensor + input_ids",
                                  "zero tokens in a layer")}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: next(iter(m.values())))
@pytest.mark.parametrize("case", list(_v3_cases()))
def test_multi_part_files_in_slabs_match_the_in_memory_path(tmp_path, small_slabs, case, method):
    """encode_file reads a multi-part cache a plane slab at a time and codes each group straight
    into the output; decode_file writes the planes slab by slab: the bytes of encode() of the
    file's tensors and of the decoded tensors' safetensors file."""
    from cachegen_cli.format import parts as fmt
    from cachegen_cli.storage import kvparts

    src = tmp_path / "kv.safetensors"
    save_file(_v3_cases()[case](), str(src), metadata={"model": "synthetic"})
    cgen, back = _roundtrip_files(tmp_path, src, "v3", **method)
    assert cgen[8] == 3
    tensors, metadata = kvio.read_tensors(src)  # the tensors in the order the file path reads them
    blob = cg.encode(tensors, device="cpu", chunk_tokens=8, metadata=metadata, **method)
    assert cgen == blob
    decoded = cg.decode(blob, device="cpu")
    assert back == b"".join(bytes(p) for p in kvparts.safetensors_parts(decoded, fmt.PartsFile(blob).manifest["metadata"]))
    if method.get("quality") == "lossless":  # bit-exact, every tensor
        got = load_file(str(tmp_path / "v3.back.safetensors"))
        assert got.keys() == tensors.keys()
        bits = lambda t: t.contiguous().view(torch.uint8) if t.numel() else t  # noqa: E731
        assert all(torch.equal(bits(got[n]), bits(t)) for n, t in tensors.items())


def test_rotated_multi_part_file_in_slabs(tmp_path, small_slabs):
    from test_shapes import mla

    from cachegen_cli.methods import parts_calibration
    from cachegen_cli.storage import kvparts

    kv = mla(layers=2, tokens=77)
    cal = parts_calibration.fit_parts([kvparts.analyse(kv)])
    src = tmp_path / "kv.safetensors"
    save_file(kv, str(src))
    cgen, back = _roundtrip_files(tmp_path, src, "rot", quality="balanced", calibration=cal)
    tensors, _ = kvio.read_tensors(src)
    blob = cg.encode(tensors, quality="balanced", calibration=cal, chunk_tokens=8, device="cpu")
    assert cgen == blob
    decoded = cg.decode(blob, device="cpu", calibration=cal)
    assert back == b"".join(bytes(p) for p in kvparts.safetensors_parts(decoded, {}))


def test_multi_part_nonfinite_error_names_the_tensor_before_any_output(tmp_path, small_slabs):
    from test_shapes import sliding

    kv = sliding(full=40, window=12)
    kv["layers.3.value"][0, 1, 30, 2] = float("inf")  # a late token of a later tensor
    kv["layers.1.key"][0, 0, 37, 0] = float("nan")
    src = tmp_path / "kv.safetensors"
    save_file(kv, str(src))
    with pytest.raises(NonFiniteError) as whole:
        cg.encode(kvio.read_tensors(src)[0], device="cpu")
    (tmp_path / "kv.cgen").write_bytes(b"exists")
    before = set(os.listdir(tmp_path))
    with pytest.raises(NonFiniteError) as streamed:  # the input's error, not the existing output's
        cg.encode_file(src, tmp_path / "kv.cgen", device="cpu", chunk_tokens=8)
    assert str(streamed.value) == str(whole.value) and "'layers.1.key' holds NaN" in str(whole.value)
    assert set(os.listdir(tmp_path)) == before and (tmp_path / "kv.cgen").read_bytes() == b"exists"


_PEAK_PARTS = textwrap.dedent("""
    import resource, sys
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, {tests!r})
    import cachegen_cli as cg
    from cachegen_cli.pipeline import codec
    from cachegen_cli.methods import transform
    from test_shapes import sliding
    src, step, method = sys.argv[1], sys.argv[2], sys.argv[3]
    kw = {{"quality": method}}
    small = src + ".small.safetensors"  # compile / load the kernels and the v3 paths first
    save_file(sliding(full=80, window=20, heads=8, head_dim=32), small)
    cg.encode_file(small, small + ".cgen", device="cpu", force=True, **kw)
    cg.decode_file(small + ".cgen", small + ".back", device="cpu", force=True)
    codec.SLAB_BYTES = transform.V2_SLAB_BYTES = 4 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if step == "encode":
        cg.encode_file(src, src + ".cgen", device="cpu", force=True, **kw)
    else:
        cg.decode_file(src + ".cgen", src + ".back", device="cpu", force=True)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
""")


@pytest.mark.parametrize("method", ["lossless", "balanced"])
def test_multi_part_file_paths_hold_a_slab_not_the_cache(tmp_path, method):
    """A sliding-window cache of 84 MB (two full layers of 4096 tokens, two windowed of 1024,
    8 heads x 256, bf16, plus input_ids) in 4 MiB slabs: encode and decode grow the process by
    far less than the cache (before they read and decoded it whole: 1.58 GB and 1.12 GB of peak
    RSS for a 336 MB cache, docs/shapes.md)."""
    g = torch.Generator().manual_seed(0)
    kv = {}
    for i in range(4):
        T = 1024 if i % 2 == 0 else 4096
        for k in ("key", "value"):
            kv[f"layers.{i}.{k}"] = (torch.randn(1, 8, T, 256, generator=g) * 0.5).to(torch.bfloat16)
    kv["input_ids"] = torch.arange(4096).unsqueeze(0)
    N = sum(t.numel() * t.element_size() for t in kv.values())
    src = tmp_path / "kv.safetensors"
    save_file(kv, str(src))
    del kv
    script = _PEAK_PARTS.format(tests=str(Path(__file__).parent))
    for step in ("encode", "decode"):
        r = subprocess.run([sys.executable, "-c", script, str(src), step, method], capture_output=True, text=True,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        growth = int(r.stdout.split()[-1])
        assert growth < N // 2, f"{step} grew the process by {growth / 2**20:.0f} MiB for a {N / 2**20:.0f} MiB cache"
