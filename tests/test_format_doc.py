"""docs/format.md is the spec: read its tables, build struct formats from them, parse a real file."""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import cachegen_cli as cg

from conftest import realistic_kv

DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
TYPES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}


def table(heading: str) -> tuple[struct.Struct, list[str]]:
    """The struct format and field names of the table under ``heading`` in docs/format.md."""
    text = DOC.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows.append(cells)
        elif rows and not line.strip().startswith("|"):
            break
    fmt, names, expected_offset = "<", [], 0
    for offset, size, typ, field, _ in rows:
        assert int(offset) == expected_offset, f"{heading}: {field} at {offset}, expected {expected_offset}"
        match = re.fullmatch(r"bytes\[(\d+)\]", typ)
        fmt += f"{match.group(1)}s" if match else TYPES[typ]
        names.append(field)
        expected_offset += int(size)
    s = struct.Struct(fmt)
    assert s.size == expected_offset
    return s, names


def test_file_parsed_with_struct_from_the_doc_tables():
    kv = realistic_kv(layers=3, tokens=21, heads=2, head_dim=4)
    blob = cg.encode(kv, preset="lmcache", chunk_tokens=8, metadata={"who": "doc test"})

    header, names = table("## FileHeader (64 bytes)")
    assert header.size == 64
    h = dict(zip(names, header.unpack_from(blob, 0)))
    assert h["magic"] == bytes.fromhex("89 43 47 45 4E 0D 0A 1A".replace(" ", ""))
    assert (h["format_version"], h["header_size"], h["num_tokens"], h["num_layers"], h["num_channels"]) == (1, 64, 21, 3, 8)
    assert (h["chunk_tokens"], h["num_chunks"], h["dtype"], h["layout"], h["prob_bits"]) == (8, 3, 2, 1, 15)
    bins = blob[64 : 64 + 2 * h["num_layers"]]
    desc_raw = blob[64 + len(bins) : 64 + len(bins) + h["descriptor_size"]]
    assert zlib.crc32(blob[:60] + bins + desc_raw) == h["header_crc32"]
    desc = json.loads(desc_raw)
    assert desc["layout"] == "stacked" and desc["tensors"][0]["shape"] == [3, 2, 21, 2, 4]
    assert desc["metadata"] == {"who": "doc test"}

    trailer, tnames = table("## Trailer (16 bytes)")
    t = dict(zip(tnames, trailer.unpack_from(blob, len(blob) - trailer.size)))
    assert t["magic"] == b"CGENDIDX"
    index, inames = table("## Index")
    i = dict(zip(inames, index.unpack_from(blob, t["index_offset"])))
    assert i["magic"] == b"CGIX" and i["num_chunks"] == 3
    offsets = struct.unpack_from(f"<{i['num_chunks']}Q", blob, t["index_offset"] + index.size)
    assert offsets[0] == 64 + len(bins) + len(desc_raw)

    chunk, cnames = table("### ChunkHeader (40 bytes)")
    G = h["channels_per_stream"]
    for k, off in enumerate(offsets):
        c = dict(zip(cnames, chunk.unpack_from(blob, off)))
        assert c["magic"] == b"CGCK" and c["chunk_index"] == k and c["first_token"] == 8 * k
        tk = c["token_count"]
        assert tk == (8 if k < 2 else 5)
        assert c["scales_size"] == 2 * 3 * 2 * tk
        alphabets = [2 * ((b - 1) // 2) + 1 for b in bins]
        assert c["cdf_size"] == 8 * sum((a + 1) // 2 for a in alphabets)
        groups = -(-8 // G)
        assert c["lengths_size"] == 2 * 3 * 2 * groups
        body = c["scales_size"] + c["cdf_size"] + c["lengths_size"] + c["payload_size"]
        assert zlib.crc32(blob[off : off + 36] + blob[off + 40 : off + 40 + body]) == c["chunk_crc32"]
        lengths_at = off + 40 + c["scales_size"] + c["cdf_size"]
        lengths = struct.unpack_from(f"<{3 * 2 * groups}H", blob, lengths_at)
        assert sum(lengths) == c["payload_size"]
        end = off + 40 + body
        assert end == (offsets[k + 1] if k + 1 < len(offsets) else t["index_offset"])


def test_header_snippet_in_the_doc_runs(tmp_path, monkeypatch):
    """The 10-line struct snippet in docs/format.md reads a header without cachegen."""
    text = DOC.read_text()
    snippet = text[text.index("## Reading a header without cachegen") :].split("```python")[1].split("```")[0]
    (tmp_path / "kv.cgen").write_bytes(cg.encode(realistic_kv(layers=2, tokens=5), preset="lmcache"))
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "format.md", "exec"), {})


def test_version_2_header_snippet_in_the_doc_runs(tmp_path, monkeypatch, capsys):
    """The struct snippet of "Reading a version 2 header without cachegen" reads a v2 header."""
    import torch

    text = DOC.read_text()
    snippet = text[text.index("### Reading a version 2 header without cachegen") :].split("```python")[1].split("```")[0]
    kv = realistic_kv(layers=2, tokens=5).to(torch.bfloat16)
    monkeypatch.chdir(tmp_path)
    for quality in ("balanced", "lossless"):
        (tmp_path / "kv.cgen").write_bytes(cg.encode(kv, quality=quality, device="cpu"))
        exec(compile(snippet, "format.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 5 stacked method 2 flags 2" and len(out) == 3  # --quality balanced refines the last tokens
    assert out[2] == "2 5 stacked method 3 flags 0"
    steps = json.loads(out[1])
    assert len(steps) == 4 and all(s > 0 for s in steps)
