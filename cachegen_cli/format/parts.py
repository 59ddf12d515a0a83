"""Format version 3, the multi-part container, byte for byte as docs/format.md ("Format
version 3") specifies it.

    PartsHeader (48 B) | Manifest (JSON) | Part table (24 B per part) | Part 0 | Part 1 | ...

A part is either a group (a complete version 1 or 2 .cgen file of one uniform group of
planes, storage/kvparts.py) or an extra tensor's raw bytes.  The manifest names every tensor
of the original file and says which planes of which tensor each group holds.  The reader
trusts nothing it reads: every length, count, index and shape is range-checked against the
format's caps, the header and the bytes actually in the file before anything is allocated.
"""

from __future__ import annotations

import json
import struct
import zlib

from ..errors import BadMagicError, ChecksumError, SizeError, TruncatedError, UnsupportedVersionError
from ..storage import kvparts
from .container import MAGIC, load_capped_json

FORMAT_VERSION_3 = 3
PARTS_HEADER = struct.Struct("<8sHHIIIQQII")
PART_ENTRY = struct.Struct("<QQB3sI")
assert PARTS_HEADER.size == 48 and PART_ENTRY.size == 24

PART_GROUP = 1  # a complete version 1 / 2 .cgen file
PART_RAW = 2  # an extra tensor's bytes

MAX_MANIFEST_BYTES = 64 << 20
MAX_PARTS = 1 << 17
MAX_GROUPS = 1 << 16
MAX_RANK = 8
MAX_NAME_CHARS = 1 << 16
MAX_GROUP_LAYERS = 4096  # container.MAX_LAYERS: a group is coded as one regular cache
MAX_TENSOR_BYTES = 1 << 50
#: Leading selector axes of each form (form_dims: one plane per index of them).
SELECT_AXES = {"HTD": 0, "TC": 0, "BHTD": 1, "BTC": 1, "L2THD": 2}
KIND_FORMS = {"key": ("HTD", "BHTD"), "value": ("HTD", "BHTD"), "latent": ("TC", "BTC", "BHTD")}


def _crc(*parts) -> int:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc & 0xFFFFFFFF


# ---------------------------------------------------------------- writing


def manifest_of(pc: "kvparts.PartsCache") -> dict:
    """The manifest of a cache: its tensors in file order and its groups (group g in part g, the
    extras in the parts after them, in tensor order)."""
    tensors = []
    part = len(pc.groups)
    for e in pc.entries:
        entry = dict(e)
        if e["role"] == "extra":
            entry["part"] = part
            part += 1
        tensors.append(entry)
    groups = []
    for i, g in enumerate(pc.groups):
        ref = lambda p: [p.tensor, *p.select]  # noqa: E731
        members = [[ref(m[0]), ref(m[1])] if g.kind == "kv" else [ref(m)] for m in g.members]
        groups.append({"kind": g.kind, "seq": g.seq, "tokens": g.tokens, "channels": g.channels, "dtype": g.dtype,
                       "part": i, "members": members, "first_positions": list(g.first_positions)})
    return {"tensors": tensors, "groups": groups, "metadata": dict(pc.metadata)}


def pack(manifest: dict, parts: list[tuple[int, object]], decoded_bytes: int) -> list:
    """The file as a list of byte buffers: header + manifest + part table, then the parts.
    ``parts``: (PART_GROUP or PART_RAW, bytes-like) in part order."""
    views = [memoryview(p).cast("B") if not isinstance(p, bytes) else p for _, p in parts]
    return [pack_head(manifest, [(kind, len(view), _crc(view)) for (kind, _), view in zip(parts, views)],
                      decoded_bytes)] + views


def head_size(manifest: dict, part_count: int) -> int:
    """Bytes of the PartsHeader, Manifest and Part table: where part 0 starts."""
    return PARTS_HEADER.size + len(_manifest_bytes(manifest)) + PART_ENTRY.size * part_count


def _manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode("utf-8")


def pack_head(manifest: dict, parts: list[tuple[int, int, int]], decoded_bytes: int) -> bytes:
    """The PartsHeader, Manifest and Part table of parts (kind, size, CRC-32) lying back to back
    after them (a writer that streams the parts writes this last, at the start of the file)."""
    desc = _manifest_bytes(manifest)
    offset = PARTS_HEADER.size + len(desc) + PART_ENTRY.size * len(parts)
    table = []
    for kind, size, crc in parts:
        table.append(PART_ENTRY.pack(offset, size, kind, bytes(3), crc))
        offset += size
    table_raw = b"".join(table)
    head = PARTS_HEADER.pack(MAGIC, FORMAT_VERSION_3, PARTS_HEADER.size, 0, len(desc), len(parts), decoded_bytes,
                             offset, 0, 0)[:-4]
    head += struct.pack("<I", _crc(head, desc, table_raw))
    return head + desc + table_raw


# ---------------------------------------------------------------- reading


def is_parts_file(head: bytes) -> bool:
    head = bytes(head[:10])
    return len(head) == 10 and head[:8] == MAGIC and struct.unpack_from("<H", head, 8)[0] == FORMAT_VERSION_3


def decoded_size(head: bytes) -> int | None:
    """The decoded tensors' bytes the 48-byte header announces (for --max-output-size)."""
    head = bytes(head[:PARTS_HEADER.size])
    if len(head) < PARTS_HEADER.size or not is_parts_file(head):
        return None
    return struct.unpack_from("<Q", head, 24)[0]


class PartsFile:
    """A version-3 file opened over a buffer (bytes or a memory map): the header, manifest and
    part table read and checked; ``part(i)`` is a zero-copy view of part i, CRC-checked."""

    def __init__(self, buffer) -> None:
        view = memoryview(buffer).cast("B")
        if len(view) < len(MAGIC) or bytes(view[:8]) != MAGIC:
            raise BadMagicError("not a .cgen file (bad magic)")
        if len(view) < PARTS_HEADER.size:
            raise TruncatedError(f"file ends inside the file header ({len(view)} of {PARTS_HEADER.size} bytes)")
        (_, version, header_size, flags, manifest_size, part_count, decoded_bytes, file_size, reserved,
         crc) = PARTS_HEADER.unpack(bytes(view[:PARTS_HEADER.size]))
        if version != FORMAT_VERSION_3:
            raise UnsupportedVersionError(f"format version {version} is not a multi-part file")
        if header_size != PARTS_HEADER.size:
            raise SizeError(f"file header size {header_size}, expected {PARTS_HEADER.size}")
        if flags or reserved:
            raise UnsupportedVersionError("reserved header bits are set (written by a newer cachegen?)")
        if not 0 < manifest_size <= MAX_MANIFEST_BYTES:
            raise SizeError(f"manifest size {manifest_size} out of range 1..{MAX_MANIFEST_BYTES}")
        if part_count > MAX_PARTS:
            raise SizeError(f"part count {part_count} out of range 0..{MAX_PARTS}")
        table_at = PARTS_HEADER.size + manifest_size
        data_at = table_at + PART_ENTRY.size * part_count
        if file_size != len(view):
            if len(view) < file_size:
                raise TruncatedError(f"the file holds {len(view)} bytes, its header says {file_size} (truncated)")
            raise SizeError(f"the file holds {len(view)} bytes, its header says {file_size}")
        if data_at > file_size:
            raise TruncatedError("file ends inside the manifest or the part table")
        desc = bytes(view[PARTS_HEADER.size:table_at])
        table_raw = bytes(view[table_at:data_at])
        if _crc(bytes(view[:PARTS_HEADER.size - 4]), desc, table_raw) != crc:
            raise ChecksumError("file header CRC mismatch: the file is corrupted")
        self.parts: list[tuple[int, int, int, int]] = []  # (offset, size, kind, crc)
        at = data_at
        for i in range(part_count):
            offset, size, kind, pad, part_crc = PART_ENTRY.unpack_from(table_raw, i * PART_ENTRY.size)
            if kind not in (PART_GROUP, PART_RAW) or any(pad):
                raise UnsupportedVersionError(f"part {i} has unknown kind {kind} or reserved bytes set")
            if offset != at or size > file_size - offset:
                raise SizeError(f"part {i} at [{offset}, +{size}) is not where the part table implies")
            self.parts.append((offset, size, kind, part_crc))
            at = offset + size
        if at != file_size:
            raise SizeError(f"the parts end at byte {at}, the file at {file_size}")
        self.view = view
        self.decoded_bytes = decoded_bytes
        self.manifest = parse_manifest(desc, self.parts, decoded_bytes)

    def part(self, i: int) -> memoryview:
        offset, size, _, crc = self.parts[i]
        data = self.view[offset:offset + size]
        if _crc(data) != crc:
            raise ChecksumError(f"part {i} CRC mismatch: the file is corrupted")
        return data


def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def parse_manifest(raw: bytes, parts: list[tuple[int, int, int, int]], decoded_bytes: int) -> dict:
    """The manifest's JSON, checked against the caps, the part table and itself; SizeError
    when anything does not fit."""
    m = load_capped_json(raw, "manifest")
    try:
        _check_manifest(m, parts, decoded_bytes)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise SizeError(f"manifest: {exc}") from None
    return m


def _check_manifest(m, parts, decoded_bytes: int) -> None:
    if not isinstance(m, dict) or set(m) != {"tensors", "groups", "metadata"}:
        raise ValueError("not an object of tensors, groups and metadata")
    meta = m["metadata"]
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("metadata must map strings to strings")
    tensors, groups = m["tensors"], m["groups"]
    if not isinstance(tensors, list) or not 1 <= len(tensors) <= kvparts.MAX_TENSORS:
        raise ValueError("no tensors listed, or too many")
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise ValueError("groups is not a list, or too long")
    names = set()
    total = 0
    planes_needed = 0
    extra_parts = []
    for i, e in enumerate(tensors):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or len(e["name"]) > MAX_NAME_CHARS:
            raise ValueError(f"tensor {i}: bad entry")
        if e["name"] in names:
            raise ValueError(f"tensor {e['name'][:60]!r} listed twice")
        names.add(e["name"])
        shape = e.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_int(s, 0, 1 << 40) for s in shape):
            raise ValueError(f"tensor {i}: bad shape")
        role = e.get("role")
        if role == "extra":
            if set(e) != {"name", "role", "dtype", "shape", "part"} or e["dtype"] not in kvparts.EXTRA_DTYPES:
                raise ValueError(f"tensor {i}: bad extra entry")
            size = kvparts._numel(shape) * kvparts._itemsize(e["dtype"])
            extra_parts.append((i, e["part"], size))
        elif role == "kv":
            form = e.get("form")
            if form not in kvparts.FORMS or len(shape) != kvparts.FORMS[form] or e.get("dtype") not in kvparts.KV_DTYPES.values():
                raise ValueError(f"tensor {i}: bad form, rank or dtype")
            allowed = {"name", "role", "form", "dtype", "shape", "sliding_window"}
            if form == "L2THD":
                if shape[1] != 2 or not 1 <= shape[0] <= MAX_GROUP_LAYERS:
                    raise ValueError(f"tensor {i}: a stacked tensor is [layers, 2, tokens, heads, head_dim]")
            else:
                allowed |= {"layer", "kind", "seq"}
                if not (_int(e.get("layer"), 0, kvparts.MAX_LAYER_INDEX) and e.get("kind") in KIND_FORMS
                        and _int(e.get("seq"), 0, kvparts.MAX_BATCH - 1) and form in KIND_FORMS[e["kind"]]):
                    raise ValueError(f"tensor {i}: bad layer, kind or sequence")
                if form in ("BHTD", "BTC") and not 1 <= shape[0] <= kvparts.MAX_BATCH:
                    raise ValueError(f"tensor {i}: batch size out of range")
            if not set(e) <= allowed or ("sliding_window" in e and not _int(e["sliding_window"], 1, 1 << 32)):
                raise ValueError(f"tensor {i}: unknown fields")
            lead = shape[:SELECT_AXES[form]]
            planes_needed += kvparts._numel(lead)
            size = kvparts._numel(shape) * kvparts._itemsize(e["dtype"])
        else:
            raise ValueError(f"tensor {i}: unknown role {role!r}")
        if size > MAX_TENSOR_BYTES:
            raise ValueError(f"tensor {i} is too large")
        total += size
    if total != decoded_bytes:
        raise ValueError(f"the tensors take {total} bytes, the header says {decoded_bytes}")
    if len(parts) != len(groups) + len(extra_parts):
        raise ValueError(f"{len(parts)} parts for {len(groups)} groups and {len(extra_parts)} extra tensors")
    for k, (i, part, size) in enumerate(extra_parts):
        if part != len(groups) + k or parts[part][2] != PART_RAW or parts[part][1] != size:
            raise ValueError(f"tensor {i}: its part does not hold its {size} bytes")
    seen: set[tuple] = set()
    for gi, g in enumerate(groups):
        _check_group(gi, g, tensors, parts, seen)
    if len(seen) != planes_needed:
        raise ValueError(f"the groups hold {len(seen)} planes, the tensors {planes_needed}")


def _plane_of(ref, tensors) -> tuple[dict, tuple, int, int, str]:
    """(entry, key, tokens, channels, kind) of a plane reference [tensor, *selector]."""
    if not isinstance(ref, list) or not ref or not _int(ref[0], 0, len(tensors) - 1):
        raise ValueError("bad plane reference")
    e = tensors[ref[0]]
    if e["role"] != "kv":
        raise ValueError("a plane reference names an extra tensor")
    form, shape = e["form"], e["shape"]
    sel = ref[1:]
    n = SELECT_AXES[form]
    if len(sel) != n or not all(_int(s, 0, shape[a] - 1) for a, s in enumerate(sel)):
        raise ValueError("plane selector out of range")
    if form == "HTD":
        T, C = shape[1], shape[0] * shape[2]
    elif form == "BHTD":
        T, C = shape[2], shape[1] * shape[3]
    elif form == "TC":
        T, C = shape[0], shape[1]
    elif form == "BTC":
        T, C = shape[1], shape[2]
    else:
        T, C = shape[2], shape[3] * shape[4]
    kind = ("key", "value")[sel[1]] if form == "L2THD" else e["kind"]
    return e, tuple(ref), T, C, kind


def _check_group(gi: int, g, tensors, parts, seen: set) -> None:
    if not isinstance(g, dict) or set(g) != {"kind", "seq", "tokens", "channels", "dtype", "part", "members",
                                             "first_positions"}:
        raise ValueError(f"group {gi}: bad entry")
    if g["kind"] not in ("kv", "planes") or g["dtype"] not in kvparts.KV_DTYPES.values():
        raise ValueError(f"group {gi}: bad kind or dtype")
    if not (_int(g["seq"], 0, kvparts.MAX_BATCH - 1) and _int(g["tokens"], 0, kvparts.MAX_TOKENS)
            and _int(g["channels"], 1, kvparts.MAX_CHANNELS) and g["part"] == gi and parts[gi][2] == PART_GROUP):
        raise ValueError(f"group {gi}: bad sequence, tokens, channels or part")
    members, firsts = g["members"], g["first_positions"]
    if not isinstance(members, list) or not 1 <= len(members) <= MAX_GROUP_LAYERS:
        raise ValueError(f"group {gi}: 1 to {MAX_GROUP_LAYERS} members")
    if not isinstance(firsts, list) or len(firsts) != len(members) or not all(_int(p, 0, kvparts.MAX_TOKENS) for p in firsts):
        raise ValueError(f"group {gi}: bad first positions")
    width = 2 if g["kind"] == "kv" else 1
    for member in members:
        if not isinstance(member, list) or len(member) != width:
            raise ValueError(f"group {gi}: a member is not {width} plane(s)")
        kinds = []
        for ref in member:
            e, key, T, C, kind = _plane_of(ref, tensors)
            if (T, C, e["dtype"]) != (g["tokens"], g["channels"], g["dtype"]):
                raise ValueError(f"group {gi}: a plane of {e['name'][:60]!r} does not have the group's tokens, "
                                 "channels and dtype")
            if key in seen:
                raise ValueError(f"group {gi}: a plane of {e['name'][:60]!r} is listed twice")
            seen.add(key)
            kinds.append(kind)
        if width == 2 and kinds != ["key", "value"]:
            raise ValueError(f"group {gi}: a kv member is not a key and a value")
