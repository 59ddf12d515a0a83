"""Format version 3 on the host: a cache of any shape (storage/kvparts.py) encoded group by
group with the existing codecs, and decoded back to its exact tensors.

Each group is a regular cache [layers, 2, tokens, channels]; it is coded by
codec.encode_to_stream exactly as a regular file (any --quality, preset or bins, chosen for
the group's own layers: per-layer steps and bins follow the layer numbers), and the file is the
multi-part container of format/parts.py around those group files and the extra tensors' bytes.
A group is held in memory while it is coded, so memory is about the cache plus one group's
file, not the slab of the regular path.
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
        return dataclasses.replace(quant, key_step=k, value_step=v)
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
    import json

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
    manifest = json.dumps(fmt.manifest_of(pc), separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return fmt.PARTS_HEADER.size + len(manifest.encode("utf-8")) + fmt.PART_ENTRY.size * (len(pc.groups) + len(extras)) + total


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

