"""Input checks as CPU kernels: finding NaN / Inf by their exponent bits.

torch.isfinite on a CPU bf16 tensor converts every value to float first and
runs at a few hundred MB/s; an all-ones exponent is NaN or Inf in every IEEE
format, so testing the raw bits in parallel costs one read of the data.
"""

from . import jit_cache  # noqa: F401

import numpy as np
from numba import njit, prange


#: Words a step of first_nonfinite_row tests without a branch (the loop vectorizes; a test and
#: exit per word kept it scalar: ~1.2 ns a value on one core of the development machine).
STEP_WORDS = 4096


def first_nonfinite_row(bits, exponent_mask):
    """bits: unsigned ints [rows, n] (the raw words of a float array).  Returns the first
    row holding a word whose exponent bits are all set (NaN or Inf), or -1."""
    bits = np.ascontiguousarray(bits)
    return _first_nonfinite_row(bits.reshape(-1), bits.shape[0], np.array([exponent_mask], bits.dtype))


@njit(cache=True, nogil=True)
def _all_ones_in(words, m):
    """True when a word of ``words`` has every bit of m set (its largest field under m is m)."""
    top = m ^ m
    for i in range(words.shape[0]):
        x = words[i] & m
        if x > top:
            top = x
    return top == m


@njit(parallel=True, cache=True, nogil=True)
def _first_nonfinite_row(flat, rows, mask_word):
    """first_nonfinite_row over the rows of ``flat`` (contiguous words, ``rows`` rows of them),
    mask_word[0] the exponent mask in the words' own type (so that the loop runs on words of
    that width: an int64 mask widened every word, 3x slower).  One job per STEP_WORDS words of
    a row."""
    n = flat.shape[0] // max(rows, 1)
    steps = max(1, (n + STEP_WORDS - 1) // STEP_WORDS)
    found = np.zeros(rows * steps, np.int32)
    m = mask_word[0]
    for job in prange(rows * steps):
        r = job // steps
        i0 = r * n + (job % steps) * STEP_WORDS
        i1 = min(i0 + STEP_WORDS, (r + 1) * n)
        found[job] = _all_ones_in(flat[i0:i1], m)
    for job in range(rows * steps):
        if found[job]:
            return job // steps
    return -1
