"""The entropy stage alone: exactness, bitrate against the entropy, bounds, pinned bytes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from cachegen_cli.kernels import cpu
from cachegen_cli.kernels.coding_params import PROB_TOTAL, max_stream_bytes


def _tables(counts: np.ndarray, maxq: np.ndarray):
    """counts [K, L, 2, C, S] -> (codes, cum) through the CPU kernels."""
    codes = np.empty(counts.shape, np.uint8)
    cum = np.empty(counts.shape[:-1] + (counts.shape[-1] + 1,), np.int32)
    cpu.build_cdf(counts, maxq, codes, cum)
    return codes, cum


def _roundtrip(symbols: np.ndarray, maxq: np.ndarray, chunk_tokens: int, group: int):
    L, _, T, C = symbols.shape
    K = -(-T // chunk_tokens)
    S = int(2 * maxq.max() + 1)
    counts = np.empty((K, L, 2, C, S), np.int32)
    cpu.histogram(symbols, chunk_tokens, counts)
    codes, cum = _tables(counts, maxq)
    groups = -(-C // group)
    n = K * L * 2 * groups
    slots = np.empty((n, max_stream_bytes(chunk_tokens * group)), np.uint8)
    lengths = np.empty(n, np.int32)
    cpu.encode_streams(symbols, cum, chunk_tokens, group, slots, lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = np.empty(int(offsets[-1]), np.uint8)
    cpu.pack_streams(slots, lengths, offsets, payload)
    cum2 = np.empty_like(cum)
    cpu.cum_from_codes(codes, maxq, cum2)
    decoded = np.empty_like(symbols)
    cpu.decode_streams(payload, offsets, lengths, cum2, maxq, chunk_tokens, group, decoded)
    return payload, lengths, cum, decoded


def _ideal_bytes(symbols, cum, chunk_tokens):
    """Code length in bytes of the symbols under the CDFs used: sum of -log2 p / 8."""
    L, _, T, C = symbols.shape
    freq = np.diff(cum, axis=-1).astype(np.float64) / PROB_TOTAL
    bits = 0.0
    for k in range(cum.shape[0]):
        t0, t1 = k * chunk_tokens, min(T, (k + 1) * chunk_tokens)
        s = symbols[:, :, t0:t1, :].astype(np.int64)
        p = np.take_along_axis(np.broadcast_to(freq[k][:, :, None], (L, 2, t1 - t0, C, freq.shape[-1])), s[..., None], -1)
        bits += -np.log2(p).sum()
    return bits / 8


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("maxq", [1, 7, 15, 127])
def test_random_distributions_roundtrip_exactly(seed, maxq):
    rng = np.random.default_rng(seed)
    L, T, C = 2, 97, 11
    # Skewed distributions of random shape per channel, so tables differ everywhere.
    probs = rng.dirichlet(np.full(2 * maxq + 1, 0.3), size=C)
    symbols = np.empty((L, 2, T, C), np.uint8)
    for c in range(C):
        symbols[..., c] = rng.choice(2 * maxq + 1, size=(L, 2, T), p=probs[c])
    mq = np.full((L, 2), maxq, np.int32)
    for chunk_tokens, group in ((32, 1), (97, 3), (7, 11)):
        _, _, _, decoded = _roundtrip(symbols, mq, chunk_tokens, group)
        np.testing.assert_array_equal(decoded, symbols)


def test_constant_channel_needs_no_bytes():
    symbols = np.full((1, 2, 300, 4), 7, np.uint8)
    payload, lengths, _, decoded = _roundtrip(symbols, np.full((1, 2), 7, np.int32), 256, 1)
    np.testing.assert_array_equal(decoded, symbols)
    assert payload.size <= 2 * lengths.size  # a stream of a certain symbol costs ~nothing
    assert lengths.max() <= 1


def test_worst_case_stays_within_the_bound():
    # Every symbol is one the table gives the smallest probability: the longest streams possible.
    maxq = 15
    T = 512
    symbols = np.zeros((1, 2, T, 1), np.uint8)
    symbols[:, :, :5, 0] = 30  # seen rarely -> low code; then code those rare symbols a lot
    counts = np.zeros((1, 1, 2, 1, 31), np.int32)
    counts[..., 0] = 1 << 14
    counts[..., 30] = 1
    codes, cum = _tables(counts, np.full((1, 2), maxq, np.int32))
    rare = np.full((1, 2, T, 1), 1, np.uint8)  # symbol 1 was never seen: frequency 1/32768
    slots = np.empty((2, max_stream_bytes(T)), np.uint8)
    lengths = np.empty(2, np.int32)
    cpu.encode_streams(rare, cum, T, 1, slots, lengths)
    assert (lengths <= max_stream_bytes(T)).all()
    assert lengths.min() >= T * 15 // 8  # ~15 bits per symbol, as expected
    offsets = np.array([0, lengths[0], lengths.sum()], np.int64)
    payload = np.concatenate([slots[0, : lengths[0]], slots[1, : lengths[1]]])
    out = np.empty_like(rare)
    cpu.decode_streams(payload, offsets, lengths, cum, np.full((1, 2), maxq, np.int32), T, 1, out)
    np.testing.assert_array_equal(out, rare)


def test_cdf_tables_are_valid():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 300, size=(2, 3, 2, 5, 31)).astype(np.int32)
    counts[0, 0, 0, 0] = 0
    counts[0, 0, 0, 0, 3] = 256
    counts[1, 1, 1, 1, ::2] = 0
    maxq = np.array([[15, 7], [15, 15], [3, 1]], np.int32)
    codes, cum = _tables(counts, maxq)
    for l in range(3):
        for kv in range(2):
            a = 2 * maxq[l, kv] + 1
            table = cum[:, l, kv, :, : a + 1]
            freq = np.diff(table, axis=-1)
            assert (table[..., 0] == 0).all() and (table[..., a] == PROB_TOTAL).all()
            assert (freq >= 1).all()
            seen = counts[:, l, kv, :, :a] > 0
            assert ((codes[:, l, kv, :, :a] > 0) == seen).all()
            assert (codes[:, l, kv, :, a:] == 0).all()


def test_payload_within_one_percent_of_entropy_on_real_kv(sample_stacked):
    """Coded size vs. the ideal code length under the stored CDFs, on the real sample."""
    from safetensors.torch import load_file

    from cachegen_cli.methods.config import lmcache_rule

    kv = next(iter(load_file(str(sample_stacked)).values()))
    L, _, T, H, D = kv.shape
    x = kv.reshape(L, 2, T, H * D).float().numpy()
    maxq = ((lmcache_rule(L).bins_table(L) - 1) // 2).astype(np.int32)
    scales = np.empty((L, 2, T), np.uint16)
    symbols = np.empty((L, 2, T, H * D), np.uint8)
    cpu.quantize(np.ascontiguousarray(x), maxq, scales, symbols)
    payload, lengths, cum, decoded = _roundtrip(symbols, maxq, 256, 4)
    np.testing.assert_array_equal(decoded, symbols)
    ideal = _ideal_bytes(symbols, cum, 256)
    assert payload.size <= 1.01 * ideal, (payload.size, ideal)
    assert payload.size >= ideal - 1  # no coder beats the code length of its own model


def test_pinned_bytes():
    """A tiny fixed input must code to exactly these bytes (format stability)."""
    rng = np.random.default_rng(1234)
    symbols = rng.integers(0, 15, size=(1, 2, 20, 3)).astype(np.uint8)
    symbols[0, 1] = np.clip(symbols[0, 1], 6, 8)
    payload, lengths, _, decoded = _roundtrip(symbols, np.full((1, 2), 7, np.int32), 8, 2)
    np.testing.assert_array_equal(decoded, symbols)
    assert lengths.tolist() == PINNED_LENGTHS
    assert payload.tobytes().hex() == PINNED_PAYLOAD_HEX
    assert hashlib.sha256(payload.tobytes()).hexdigest() == PINNED_SHA256


PINNED_LENGTHS = [5, 3, 3, 1, 5, 3, 2, 2, 2, 1, 1, 1]
PINNED_PAYLOAD_HEX = "fa5e41e2c5e4efc0a8182e78daabcbd848b7ed50f8a2d8968d6373df18"
PINNED_SHA256 = "cf3b2092d3ebbe782f16097848e37a67646d4e02be1c03f391c28413b64f8dbe"
