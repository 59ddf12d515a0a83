"""The largest .cgen file a cache of a given shape can encode to, whatever its values.

A caller that must reserve the output before encoding (LMCache's serde asks for
``estimate_serialized_size`` before it serializes; a fixed-size slot in shared memory)
needs a bound that no input exceeds.  Every section of a file but the payload and the
Params tables has a size fixed by the header (docs/format.md); the payload and the tables
are bounded by the format's own caps, the ones the reader enforces:

* a stream of n symbols is at most ``max_stream_bytes(n) = 2 n + 8`` bytes (each symbol
  narrows the coder's range by at most 2**-15.003; kernels/coding_params.py);
* a version-2 table is at most 3 + ceil(256 / 2) = 131 bytes (alphabets of at most 256
  symbols; a shared table is 1 byte).

So the bound is exact for the fixed parts and the worst case for the rest: a real cache
compresses to a fraction of it (docs/lmcache.md measures how much).  It depends only on
the shape, the dtype, the tensor names (the Descriptor) and the quantization settings.
"""

from __future__ import annotations

import json

from ..format import container
from ..format.params import ITEMSIZE, MAX_TABLE_ALPHABET, REFINEMENT_BYTES
from ..kernels.coding_params import max_stream_bytes
from ..methods.config import QuantizationConfig, TransformConfig, validate_chunk_tokens
from ..methods.transform import refine_plan
from ..storage.kvio import KVCache
from .codec import make_header

#: Bytes of the largest own table of a version-2 file: mode, lo, alphabet - 1, 4-bit codes.
MAX_TABLE_BYTES = 3 + (MAX_TABLE_ALPHABET + 1) // 2
#: Index magic + count + CRC-32 (the 8-byte offsets come on top).
INDEX_FIXED_BYTES = 12


def _descriptor_size(cache: KVCache) -> int:
    # The same serialisation as container.pack_file_header's (sorted keys, no spaces, UTF-8).
    return len(json.dumps(cache.descriptor(), separators=(",", ":"), ensure_ascii=False,
                          sort_keys=True).encode("utf-8"))


def _refined_raw_bytes(L: int, C: int, T: int, ct: int, refined: int, bits: int) -> int:
    """Sum over chunks of each chunk's packed refinement section (docs/format.md, "Chunks,
    version 2"): only the chunks that hold some of the last ``refined`` tokens have one."""
    if not refined:
        return 0
    total = 0
    first = (T - refined) // ct
    for k in range(first, -(-T // ct)):  # at most refined / ct + 1 chunks
        t0, t1 = k * ct, min(T, (k + 1) * ct)
        n = t1 - max(t0, T - refined)
        total += -(-(L * 2 * n * C * bits) // 8)
    return total


def max_encoded_size(cache: KVCache, quant: QuantizationConfig | TransformConfig, chunk_tokens: int) -> int:
    """Bytes of the largest .cgen file ``cache``'s shape, dtype and names can encode to with
    ``quant`` and ``chunk_tokens`` tokens per chunk, on any device (they write the same bytes).

    ``cache`` may hold meta tensors: only its shape, dtype and descriptor are read."""
    ct = validate_chunk_tokens(chunk_tokens)
    L, T, C = cache.num_layers, cache.num_tokens, cache.num_channels
    K = -(-T // ct)
    if isinstance(quant, TransformConfig):
        G = container.choose_group_v2(ct, C)
        groups = -(-C // G)
        tables = L * 2 * C * MAX_TABLE_BYTES
        itemsize = ITEMSIZE[cache.dtype_name]
        if quant.method == "lossless":
            params = tables
            raw = L * 2 * T * C * (itemsize - 1)  # the low bytes of every word
        else:
            sink = min(quant.sink_tokens, T)
            refined, bits = refine_plan(quant, T, sink)
            params = (32 + 4 * L + 4 * L * C + 2 * L * sink * C * itemsize
                      + (REFINEMENT_BYTES if refined else 0) + tables)
            raw = _refined_raw_bytes(L, C, T, ct, refined, bits)
        head = container.FILE_HEADER_V2.size + _descriptor_size(cache) + params
    else:
        h = make_header(cache, quant, ct)
        G, groups = h.group, h.groups
        head = container.FILE_HEADER.size + 2 * L + _descriptor_size(cache)
        _, cdf, _ = h.section_sizes(ct)
        # u16 scales per (layer, K/V, token); the CDF codes have the same size in every chunk
        raw = L * 2 * T * 2 + K * cdf
    lengths = K * L * 2 * groups * 2
    # Every stream at its cap: per (layer, K/V), groups - 1 streams of G channels and a last
    # one of the channels left, over K - 1 full chunks and a last one of the tokens left.
    last_group = C - (groups - 1) * G
    payload = 0
    for count, tokens in ((K - 1, ct), (1, T - (K - 1) * ct)) if K else ():
        per_plane = (groups - 1) * max_stream_bytes(tokens * G) + max_stream_bytes(tokens * last_group)
        payload += count * L * 2 * per_plane
    index = INDEX_FIXED_BYTES + 8 * K
    return head + K * container.CHUNK_HEADER.size + raw + lengths + payload + index + container.TRAILER.size
