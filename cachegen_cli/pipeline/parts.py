"""Format version 3 on the host: a cache of any shape (storage/kvparts.py) encoded group by
group with the existing codecs, and decoded back to its exact tensors.

Each group is a regular cache [layers, 2, tokens, channels]; it is coded by
codec.encode_to_stream exactly as a regular file (any --quality, preset or bins, chosen for
the group's own layers: per-layer steps and bins follow the layer numbers), and the file is the
multi-part container of format/parts.py around those group files and the extra tensors' bytes.
In memory (encode_parts / decode_parts) a group is held while it is coded; file to file
(encode_parts_file / decode_parts_file) the groups are read and written a plane slab at a
time (storage/kvparts_files.py) and coded straight into the output, with the same bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, SizeError
from ..format import parts as fmt
from ..format.container import BufferReader
from ..methods.config import QuantizationConfig, QuantizationSpec, TransformConfig
from ..methods.parts_calibration import PartsCalibration, group_calibration, member_slots, slots_of_group
from ..storage import kvio, kvparts
from ..storage import kvparts_files  # noqa: F401  (the file-to-file coders' plane reader and writer)
from . import codec


@dataclass(repr=False)
class PartsSummary:
    """What encode_parts wrote: the file's bytes, and each group's EncodeSummary."""

    file_bytes: int
    payload_bytes: int
    side_bytes: int
    original_bytes: int  # every tensor's bytes (K / V / latent and extras)
    kv_bytes: int
    num_values: int  # K / V / latent values
    groups: list = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    version: int = fmt.FORMAT_VERSION_3

    @property
    def num_chunks(self) -> int:
        return sum(s.header.num_chunks for s in self.groups)

    @property
    def num_tokens(self) -> int:
        return max((s.header.num_tokens for s in self.groups), default=0)

    @property
    def chunk_tokens(self) -> int:
        return self.groups[0].header.chunk_tokens if self.groups else 0

    def __repr__(self) -> str:
        return (f"PartsSummary(format_version=3, groups={len(self.groups)}, extras={len(self.extras)}, "
                f"file_bytes={self.file_bytes}, payload_bytes={self.payload_bytes}, side_bytes={self.side_bytes})")


def group_quantization(quant, g: "kvparts.Group", model_layers: int):
    """The settings of one group from those of the whole cache: per-layer bins or steps are
    taken at the group's layer numbers; a "planes" group's two halves of a plane both get the
    plane's K (key, latent) or V (value) setting."""
    layers = g.layers()
    cols = [0 if k in ("kv", "key", "latent") else 1 for k in g.plane_kinds()]
    if isinstance(quant, TransformConfig):
        table = quant.steps_table(model_layers)
        if g.kind == "kv":
            k, v = tuple(float(table[l, 0]) for l in layers), tuple(float(table[l, 1]) for l in layers)
        else:
            k = v = tuple(float(table[l, c]) for l, c in zip(layers, cols))
        # Keys without RoPE are not applied inside a multi-part file yet: a group's layers may hold
        # windows of different positions (the format would need a RoPE block per group).
        return dataclasses.replace(quant, key_step=k, value_step=v, rope_keys=False)
    table = quant.bins_table(model_layers)
    if g.kind == "kv":
        kb, vb = [int(table[l, 0]) for l in layers], [int(table[l, 1]) for l in layers]
    else:
        kb = vb = [int(table[l, c]) for l, c in zip(layers, cols)]
    spec = lambda bins: tuple(QuantizationSpec(j, j + 1, b) for j, b in enumerate(bins))  # noqa: E731
    return QuantizationConfig(spec(kb), spec(vb), name=quant.name)


def _group_cache(pc: "kvparts.PartsCache", g: "kvparts.Group") -> kvio.KVCache:
    data = pc.group_data(g)
    C2 = g.coded_channels
    return kvio.KVCache(data, "stacked", 1, C2, [{"name": "group", "shape": [g.num_layers, 2, g.tokens, 1, C2]}], {})


def encode_parts(pc: "kvparts.PartsCache", out, quant, chunk_tokens: int, progress=None, device: str = "cpu",
                 calibration=None) -> PartsSummary:
    """Write the version-3 file of ``pc`` to ``out`` (anything with write).  ``calibration``: a
    version-3 calibration (methods/parts_calibration.py): each group's file is rotated with its
    members' rotations, as a regular file with a calibration."""
    if calibration is not None and not isinstance(calibration, PartsCalibration):
        raise ConfigError("a calibration applies to a cache of one shape; this cache is coded in "
                          f"{len(pc.groups)} group(s) of different shapes",
                          cli="--calibration applies to a cache of one shape (not to a multi-part file)")
    model_layers = pc.model_layers
    total_chunks = sum(-(-g.tokens // max(chunk_tokens, 1)) for g in pc.groups)
    done = [0]
    summaries, bodies = [], []
    for g in pc.groups:
        gq = group_quantization(quant, g, model_layers)
        sink = codec.ByteCollector()
        base = done[0]
        report = (lambda d, t, base=base: progress(base + d, total_chunks)) if progress else None
        gcal = None if calibration is None else group_calibration(calibration, g.kind, g.channels, slots_of_group(g))
        s = codec.encode_to_stream(_group_cache(pc, g), sink, gq, chunk_tokens, report, device, gcal)
        done[0] += s.header.num_chunks
        summaries.append(s)
        bodies.append((fmt.PART_GROUP, sink.getvalue()))
    extras = [(fmt.PART_RAW, kvparts.raw_bytes(t)) for e, t in zip(pc.entries, pc.tensors) if e["role"] == "extra"]
    pieces = fmt.pack(fmt.manifest_of(pc), bodies + extras, pc.decoded_bytes())
    size = 0
    for p in pieces:
        out.write(p)
        size += len(p)
    payload = sum(s.payload_bytes for s in summaries)
    return PartsSummary(size, payload, size - payload, pc.decoded_bytes(), pc.kv_bytes(), pc.num_values(), summaries,
                        pc.extras, pc.dropped)


def max_encoded_size_parts(pc: "kvparts.PartsCache", quant, chunk_tokens: int) -> int:
    """The most bytes encode_parts can write for ``pc``'s shapes, dtypes and names with ``quant``,
    whatever its values: each group's bound (pipeline/bounds.py, at the group's own settings),
    the extras' bytes and the container around them (the manifest depends on shapes only)."""
    from . import bounds

    total = 0
    for g in pc.groups:
        C2 = g.coded_channels
        shape = (g.num_layers, 2, g.tokens, C2)
        cache = kvio.KVCache(torch.empty(shape, dtype=kvparts.KV_DTYPE_BY_NAME[g.dtype], device="meta"), "stacked", 1,
                             C2, [{"name": "group", "shape": [g.num_layers, 2, g.tokens, 1, C2]}], {})
        total += bounds.max_encoded_size(cache, group_quantization(quant, g, pc.model_layers), chunk_tokens)
    extras = [e for e in pc.entries if e["role"] == "extra"]
    total += sum(kvparts._numel(e["shape"]) * kvparts._itemsize(e["dtype"]) for e in extras)
    return fmt.head_size(fmt.manifest_of(pc), len(pc.groups) + len(extras)) + total


# ---------------------------------------------------------------- file to file, a slab at a time


class GroupSource:
    """A group of a file read a run of tokens at a time (storage/kvparts_files.PlanesFile), as a
    source for codec.encode_to_stream (the interface of kvio.SafetensorsSource): the group's
    regular cache [layers, 2, tokens, coded channels] is never whole in memory."""

    def __init__(self, planes: "kvparts_files.PlanesFile", g: "kvparts.Group") -> None:
        self.planes, self.g = planes, g
        C2 = g.coded_channels
        dtype = kvparts.KV_DTYPE_BY_NAME[g.dtype]
        self.cache = kvio.KVCache(torch.empty((g.num_layers, 2, g.tokens, C2), dtype=dtype, device="meta"), "stacked",
                                  1, C2, [{"name": "group", "shape": [g.num_layers, 2, g.tokens, 1, C2]}], {})

    def read(self, t0: int, t1: int, buffers=None) -> torch.Tensor:
        g, C2 = self.g, self.g.coded_channels
        out = torch.empty((g.num_layers, 2, t1 - t0, C2), dtype=kvparts.KV_DTYPE_BY_NAME[g.dtype])
        for j, m in enumerate(g.members):
            if g.kind == "kv":
                out[j, 0].copy_(self.planes.plane(m[0], t0, t1))
                out[j, 1].copy_(self.planes.plane(m[1], t0, t1))
            else:  # the two halves of the plane; an odd count's padding channel is zero (format.md)
                x = self.planes.plane(m, t0, t1)
                out[j, 0].copy_(x[:, :C2])
                out[j, 1, :, : g.channels - C2].copy_(x[:, C2:])
                out[j, 1, :, g.channels - C2:].zero_()
        return out

    def finite_check(self):
        return None  # PlanesFile.check_finite ran before any group was coded, naming the tensor

    def load(self) -> kvio.KVCache:
        c = self.cache
        return kvio.KVCache(self.read(0, c.num_tokens), "stacked", 1, c.num_channels, c.tensors, {})


class _PartSink:
    """Writes a part straight into the output, counting its bytes and their CRC-32."""

    def __init__(self, out) -> None:
        self.out, self.size, self.crc = out, 0, 0

    def write(self, data) -> int:
        import zlib

        view = memoryview(data).cast("B")
        self.out.write(view)
        self.size += len(view)
        self.crc = zlib.crc32(view, self.crc)
        return len(view)


def encode_parts_file(planes: "kvparts_files.PlanesFile", out, quant, chunk_tokens: int, progress=None,
                      device: str = "cpu", calibration=None, checked: bool = False) -> PartsSummary:
    """encode_parts for a file read plane slab by plane slab, written to ``out`` (a seekable file):
    a gap for the PartsHeader, Manifest and Part table (whose size the shapes fix), each group's
    file coded slab by slab straight into its place, the extras copied, then the head written
    into the gap.  The bytes are encode_parts' (tests/test_streaming.py).  ``checked``: the
    caller ran ``planes.check_finite()`` already."""
    pc = planes.pc
    if calibration is not None and not isinstance(calibration, PartsCalibration):
        raise ConfigError("a calibration applies to a cache of one shape; this cache is coded in "
                          f"{len(pc.groups)} group(s) of different shapes",
                          cli="--calibration applies to a cache of one shape (not to a multi-part file)")
    if not checked:
        planes.check_finite()  # every value, before any work (as kvparts.analyse in memory)
    manifest = fmt.manifest_of(pc)
    extras = [(i, e) for i, e in enumerate(pc.entries) if e["role"] == "extra"]
    start = out.tell()
    out.write(bytes(fmt.head_size(manifest, len(pc.groups) + len(extras))))
    total_chunks = sum(-(-g.tokens // max(chunk_tokens, 1)) for g in pc.groups)
    done = 0
    table, summaries = [], []
    for g in pc.groups:
        gq = group_quantization(quant, g, pc.model_layers)
        gcal = None if calibration is None else group_calibration(calibration, g.kind, g.channels, slots_of_group(g))
        sink = _PartSink(out)
        report = (lambda d, t, base=done: progress(base + d, total_chunks)) if progress else None
        s = codec.encode_to_stream(GroupSource(planes, g), sink, gq, chunk_tokens, report, device, gcal)
        done += s.header.num_chunks
        summaries.append(s)
        table.append((fmt.PART_GROUP, sink.size, sink.crc))
    for _, e in extras:
        sink = _PartSink(out)
        for block in planes.raw(e):
            sink.write(block)
        table.append((fmt.PART_RAW, sink.size, sink.crc))
    end = out.tell()
    out.seek(start)
    out.write(fmt.pack_head(manifest, table, pc.decoded_bytes()))
    out.seek(end)
    size = end - start
    payload = sum(s.payload_bytes for s in summaries)
    return PartsSummary(size, payload, size - payload, pc.decoded_bytes(), pc.kv_bytes(), pc.num_values(), summaries,
                        pc.extras, pc.dropped)


def decode_parts_file(pf: "fmt.PartsFile", path, device: str = "cpu", calibration=None, progress=None,
                      release=None) -> None:
    """A version-3 file decoded into the safetensors file at ``path`` (a temporary path the caller
    renames) group by group and slab by slab (kvparts_files.PlanesWriter): the bytes
    decode_parts' tensors give (kvparts.safetensors_parts).  ``release(offset, size)``: called
    when a part's bytes are no longer needed (the caller drops a mapping's pages)."""
    from ..storage.kvparts_files import PlanesWriter

    m = pf.manifest
    groups = m["groups"]
    with PlanesWriter(path, m) as writer:
        for gi, g in enumerate(groups):
            part = pf.part(gi)
            reader = BufferReader(part)
            dec = codec.SlabDecoder(reader, device, group_rotation(pf, gi, part, calibration))
            _check_group_header(gi, g, dec.header)
            C = g["channels"]
            for t0, _, block in dec.blocks():
                block = block.cpu()
                C2 = block.shape[3]
                for j, member in enumerate(g["members"]):
                    if g["kind"] == "kv":
                        for kv, (ti, *sel) in enumerate(member):
                            writer.write_plane(ti, tuple(sel), t0, block[j, kv])
                    else:
                        ti, *sel = member[0]
                        writer.write_plane(ti, tuple(sel), t0, torch.cat([block[j, 0], block[j, 1, :, : C - C2]], 1))
            del dec, reader, part
            if release is not None:
                release(*pf.parts[gi][:2])
            if progress:
                progress(gi + 1, len(groups))
        for k, (i, e) in enumerate((i, e) for i, e in enumerate(m["tensors"]) if e["role"] == "extra"):
            writer.write_raw(i, pf.part(e["part"]))


def _check_group_header(gi: int, g: dict, h) -> None:
    coded = g["channels"] if g["kind"] == "kv" else -(-g["channels"] // 2)
    if (h.num_layers, h.num_tokens, h.num_channels, h.dtype) != (len(g["members"]), g["tokens"], coded, g["dtype"]):
        raise SizeError(f"group {gi}'s file holds {h.num_layers} layers x {h.num_tokens} tokens x "
                        f"{h.num_channels} channels of {h.dtype}, the manifest says otherwise")


def group_rotation(pf: "fmt.PartsFile", gi: int, part, calibration):
    """The calibration group ``gi``'s file is decoded with: a version-3 calibration gives the
    group's own rotation (only a rotated group needs one: a group written unrotated, e.g. by
    the small-cache rule, decodes without); any other is used as given (version 2's rules)."""
    if not isinstance(calibration, PartsCalibration):
        return calibration
    head = bytes(part[:64])
    if not (len(head) == 64 and head[8:10] == b"\x02\x00" and head[47] & 1):  # not a rotated v2 file
        return None
    g = pf.manifest["groups"][gi]
    return group_calibration(calibration, g["kind"], g["channels"], member_slots(g, pf.manifest["tensors"]))


def decode_group(pf: "fmt.PartsFile", gi: int, device: str = "cpu", calibration=None) -> torch.Tensor:
    """Group ``gi``'s regular cache [layers, 2, tokens, coded channels], checked against the manifest."""
    part = pf.part(gi)
    calibration = group_rotation(pf, gi, part, calibration)
    reader = BufferReader(part)
    dec = codec.SlabDecoder(reader, device, calibration)
    _check_group_header(gi, pf.manifest["groups"][gi], dec.header)
    reader.seek(0)
    _, data = codec.decode_from_stream(reader, device=device, calibration=calibration)
    return data


def decode_parts(buffer, device: str = "cpu", calibration=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest and the original named tensors (in file order, on the CPU) of a version-3 file."""
    pf = fmt.PartsFile(buffer)
    m = pf.manifest
    data = [decode_group(pf, i, device, calibration) for i in range(len(m["groups"]))]
    extras = [bytes(pf.part(i)) for i in range(len(m["groups"]), len(pf.parts))]
    return m, kvparts.tensors_from_groups(m, data, extras)


def test_parts(buffer, device: str = "cpu", calibration=None, progress=None) -> dict:
    """Check a version-3 file as a decode does (every part's CRC, every group decoded), keeping nothing."""
    pf = fmt.PartsFile(buffer)
    m = pf.manifest
    tokens = chunks = 0
    for i in range(len(m["groups"])):
        part = pf.part(i)
        reader = BufferReader(part)
        dec = codec.SlabDecoder(reader, device, group_rotation(pf, i, part, calibration))
        _check_group_header(i, m["groups"][i], dec.header)
        for _ in dec.blocks(progress):
            pass
        tokens = max(tokens, dec.header.num_tokens)
        chunks += dec.header.num_chunks
    for i in range(len(m["groups"]), len(pf.parts)):
        pf.part(i)
    return {"format_version": fmt.FORMAT_VERSION_3, "num_tokens": tokens, "num_chunks": chunks,
            "num_groups": len(m["groups"]), "num_tensors": len(m["tensors"])}


def group_versions(pf: "fmt.PartsFile") -> list[int]:
    """The format version (1 or 2) of each group's file, from its header bytes."""
    import struct

    return [struct.unpack_from("<H", bytes(pf.view[o + 8:o + 10]))[0] for o, _, k, _ in pf.parts if k == fmt.PART_GROUP]

