"""Table selection (format version 2), as device functions shared by the CPU and CUDA
kernels: which mode and range each channel's table gets, and which channels send a
one-byte "same table" entry instead of their own.

Every decision is integer arithmetic (symbol costs come from ``SYMBOL_COST``, a table of
fixed-point code lengths), so the CPU and a GPU make the same decisions and write the
same bytes whatever order their threads add things up in.
"""

import numpy as np
from numba.extending import register_jitable

from .coding_params import PROB_BITS, PROB_TOTAL
from .transform import MODE_DELTA, MODE_DIRECT, TRANSFORM_QMAX

#: Fixed-point unit of SYMBOL_COST: 1 bit = 2**16.
COST_ONE = 1 << 16
#: SYMBOL_COST[f]: the code length of a symbol of frequency f (out of PROB_TOTAL), in
#: units of 2**-16 bits, rounded.  f = 0 never codes; it gets the largest cost.
SYMBOL_COST = np.empty(PROB_TOTAL + 1, np.int64)
SYMBOL_COST[1:] = np.rint((PROB_BITS - np.log2(np.arange(1, PROB_TOTAL + 1, dtype=np.float64))) * COST_ONE)
SYMBOL_COST[0] = SYMBOL_COST[1]

#: Table sharing restarts every SHARE_SPAN channels (the first channel of a span keeps its own
#: table): spans are independent, so a GPU walks them in parallel; the cost is at most one
#: extra table per span.
SHARE_SPAN = 64

#: Per-channel level statistics (kernels' ``stats[..., i]``): min, max and sum of |value| of
#: the direct values, then the same of the token deltas (a chunk's first token: its value).
STAT_MIN, STAT_MAX, STAT_ABS, STAT_DMIN, STAT_DMAX, STAT_DABS = range(6)
#: Initial min / max of an empty set of levels.
STAT_EMPTY = 1 << 40


@register_jitable
def choose_table(mn, mx, ab, dmn, dmx, dab, allow_delta, num_tokens):
    """(mode, lo, alphabet) of one channel's table from its level statistics: token delta when
    it shrinks the symbols' total magnitude (a cheap integer proxy for their entropy) and its
    range fits the table's int8 lo; a cache of no tokens gets the one-symbol table."""
    if num_tokens == 0:
        return MODE_DIRECT, 0, 1
    if allow_delta and dab < ab and dmn >= -TRANSFORM_QMAX and dmx <= TRANSFORM_QMAX:
        return MODE_DELTA, dmn, dmx - dmn + 1
    return MODE_DIRECT, mn, mx - mn + 1


@register_jitable
def table_bytes(alphabet):
    """Bytes of an own table entry in the Params block: mode, lo, alphabet - 1, the nibbles."""
    return 3 + (alphabet + 1) // 2


@register_jitable
def share_cost(counts_row, cum_row, ref_cum_row, shift, alphabet, cost):
    """(own, other): the cost in COST_ONE units of coding a channel's symbols (counts_row) with
    its own table (plus sending it) and with the table of a previous channel whose symbols sit
    ``shift`` higher (plus the one-byte reference)."""
    own = np.int64(8 * COST_ONE) * table_bytes(alphabet)
    other = np.int64(8 * COST_ONE)
    for s in range(alphabet):
        n = np.int64(counts_row[s])
        if n > 0:
            own += n * cost[cum_row[s + 1] - cum_row[s]]
            other += n * cost[ref_cum_row[s + shift + 1] - ref_cum_row[s + shift]]
    return own, other


@register_jitable
def share_plane(counts_p, lo_p, alphabet_p, modes_p, cum_p, cost, shared_p, ref_p):
    """Walk one (layer, K/V) plane's channels in order: shared_p[c] = True when channel c codes
    more cheaply with the table of ref (the last channel of its SHARE_SPAN span that kept its
    own: same mode, a range that covers c's symbols) than with its own; ref_p[c] = the channel
    whose table c uses."""
    C = alphabet_p.shape[0]
    ref = -1
    for c in range(C):
        if c % SHARE_SPAN == 0:
            ref = -1
        shared_p[c] = False
        ref_p[c] = c
        a = alphabet_p[c]
        if ref >= 0 and modes_p[c] == modes_p[ref]:
            shift = lo_p[c] - lo_p[ref]
            if shift >= 0 and shift + a <= alphabet_p[ref]:
                own, other = share_cost(counts_p[c], cum_p[c], cum_p[ref], shift, a, cost)
                if other < own:
                    shared_p[c] = True
                    ref_p[c] = ref
                    continue
        ref = c
