"""Input checks as CPU kernels: finding NaN / Inf by their exponent bits.

torch.isfinite on a CPU bf16 tensor converts every value to float first and
runs at a few hundred MB/s; an all-ones exponent is NaN or Inf in every IEEE
format, so testing the raw bits in parallel costs one read of the data.
"""

from . import jit_cache  # noqa: F401

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, nogil=True)
def first_nonfinite_row(bits, exponent_mask):
    """bits: unsigned ints [rows, n] (the raw words of a float array).  Returns the first
    row holding a word whose exponent bits are all set (NaN or Inf), or -1."""
    rows = bits.shape[0]
    found = np.full(rows, False)
    for r in prange(rows):
        row = bits[r]
        for i in range(row.shape[0]):
            if (row[i] & exponent_mask) == exponent_mask:
                found[r] = True
                break
    for r in range(rows):
        if found[r]:
            return r
    return -1
