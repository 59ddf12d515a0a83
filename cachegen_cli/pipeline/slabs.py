"""Slabs: the runs of whole chunks that the host and the device encode and decode at a time,
sized so that a slab's float32 copy stays bounded whatever the cache's size."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..format.container import FileHeader

#: Target size of one slab's float32 copy: big enough to keep every core busy,
#: small enough that a multi-GB cache never needs a full float32 copy.
SLAB_BYTES = 256 << 20
#: On a GPU a slab should fill the device with streams: 4 GiB of float32 is a
#: 2 GiB bf16 cache (2M streams of 1024 symbols for Llama-sized layers).
GPU_SLAB_BYTES = 4 << 30


@dataclass
class Slab:
    first_chunk: int
    num_chunks: int
    t0: int
    t1: int


def iter_slabs(h: FileHeader, slab_bytes: int = SLAB_BYTES) -> Iterator[Slab]:
    """Consecutive runs of whole chunks whose float32 copy is about ``slab_bytes``."""
    per_chunk = h.chunk_tokens * h.num_layers * 2 * h.num_channels * 4
    step = max(1, slab_bytes // max(per_chunk, 1))
    for first in range(0, h.num_chunks, step):
        n = min(step, h.num_chunks - first)
        t0 = first * h.chunk_tokens
        yield Slab(first, n, t0, min(h.num_tokens, (first + n) * h.chunk_tokens))
