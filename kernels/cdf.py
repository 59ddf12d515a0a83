"""Symbol statistics: counts -> 4-bit codes -> integer CDF.

A chunk sends, for every (layer, K/V, channel), one 4-bit code per symbol of
the alphabet instead of a full CDF (docs/format.md, "CDF codes").  The encoder
turns the symbol counts into codes (`counts_to_codes`) and both encoder and
decoder turn the codes into the same integer CDF (`codes_to_cum`), so the
coder never needs the exact counts.  Every symbol gets a frequency of at least
1 out of PROB_TOTAL, so any symbol can be coded, seen or not.

All arithmetic is integer: the CPU and the GPU build identical tables.
"""

import numpy as np
from numba.extending import register_jitable

from .coding_params import CODE_LEVELS, CODE_THRESHOLD, CODE_WEIGHT, PROB_TOTAL


@register_jitable
def counts_to_codes(counts_row, alphabet, codes_row):
    """Fill codes_row[:alphabet] with the 4-bit code of each count; zero the rest."""
    top = np.int64(0)
    for s in range(alphabet):
        if counts_row[s] > top:
            top = np.int64(counts_row[s])
    for s in range(codes_row.shape[0]):
        code = 0
        if s < alphabet:
            c = np.int64(counts_row[s])
            if c > 0:
                code = 1
                scaled = c << 20
                for j in range(CODE_LEVELS - 1):
                    if scaled >= top * CODE_THRESHOLD[j]:
                        code += 1
        codes_row[s] = code


@register_jitable
def codes_to_cum(codes_row, alphabet, cum_row):
    """Integer CDF from 4-bit codes: cum_row[0] = 0, cum_row[alphabet] = PROB_TOTAL.

    Frequencies are 1 + weight * spare // total_weight; the rounding remainder
    goes to the first symbol with the highest code.  Entries past the alphabet
    are set to PROB_TOTAL.
    """
    total_weight = np.int64(0)
    best = 0
    best_code = -1
    for s in range(alphabet):
        code = np.int64(codes_row[s])
        total_weight += CODE_WEIGHT[code]
        if code > best_code:
            best_code = code
            best = s
    spare = np.int64(PROB_TOTAL - alphabet)
    assigned = np.int64(0)
    for s in range(alphabet):
        if total_weight > 0:
            assigned += 1 + (CODE_WEIGHT[np.int64(codes_row[s])] * spare) // total_weight
        else:
            assigned += 1
    remainder = np.int64(PROB_TOTAL) - assigned
    if total_weight == 0:
        # No information at all (cannot happen for a non-empty chunk): flat table.
        remainder = np.int64(PROB_TOTAL) - alphabet
    acc = np.int64(0)
    cum_row[0] = 0
    for s in range(alphabet):
        if total_weight > 0:
            freq = 1 + (CODE_WEIGHT[np.int64(codes_row[s])] * spare) // total_weight
        else:
            freq = np.int64(1)
        if s == best:
            freq += remainder
        acc += freq
        cum_row[s + 1] = acc
    for s in range(alphabet + 1, cum_row.shape[0]):
        cum_row[s] = PROB_TOTAL
