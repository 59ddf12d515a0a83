"""scripts/context_entropy.py's bookkeeping: a table's entropy and stored cost, and the context
classes its tally gives each symbol (the previous token's within a chunk, the previous channel's)."""

import math

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def ce():
    return load_script("scripts/context_entropy.py", "context_entropy")


def test_static_bits_entropy_and_table_cost(ce):
    counts = np.array([[2, 2, 0, 0], [0, 0, 0, 0], [0, 3, 0, 1]])
    entropy, tables = ce.static_bits(counts)
    assert entropy == pytest.approx(4 * 1.0 + 4 * (-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))))
    assert tables == (24 + 4 * 2) + (24 + 4 * 3)  # the used range: symbols 0-1, then 1-3; the empty row free


def test_tally_classes(ce):
    # one layer, keys and values, 4 tokens, 2 channels; chunk of 2 tokens; channel 1 codes deltas
    q = np.zeros((1, 2, 4, 2), np.int16)
    q[0, 0, :, 0] = [0, 2, -1, 1]
    q[0, 0, :, 1] = [1, 2, 2, 5]
    modes = np.zeros((1, 2, 2), np.int64)
    modes[0, 0, 1] = 1
    lo = np.full((1, 2, 2), -3, np.int64)
    out = np.zeros((1, 2, 2, ce.SLOTS, 12), np.int64)
    ce.tally(q, modes, lo, 1, 2, out)
    k0, k1 = out[0, 0, 0], out[0, 0, 1]
    assert k0[0].sum() == 3 and k1[0].sum() == 3  # tokens 1-3 (token 0 is the sink)
    # channel 0, token 1 (value 2): chunk's second token, the previous token (0) is the sink -> class 0
    assert k0[1 + 0, 2 + 3] == 1
    # channel 0, token 3 (value 1): the previous token's value -1 -> class 1
    assert k0[1 + 1, 1 + 3] == 1
    # channel 1 codes deltas: token 1 -> 2 - 1 = 1; token 3 -> 5 - 2 = 3; token 2 (a chunk's first) -> 2
    assert k1[0, 1 + 3] == 1 and k1[0, 3 + 3] == 1 and k1[0, 2 + 3] == 1
    # channel 1, token 3: the previous channel's value at token 3 is 1 -> class 1; the previous
    # token's delta (token 2, a chunk's first: its level 2) -> class 2
    assert k1[1 + 3 + 1, 3 + 3] == 1
    assert k1[1 + 2, 3 + 3] == 1
    assert k1[1 + 6 + 2 * 3 + 1, 3 + 3] == 1
