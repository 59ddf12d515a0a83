"""Constants shared by every kernel and by the container.

They are part of the `.cgen` format (docs/format.md): changing any of them
changes the bytes a file holds, so they only change with the format version.
"""

import numpy as np

#: Probabilities are integers out of 2**PROB_BITS.
PROB_BITS = 15
PROB_TOTAL = 1 << PROB_BITS

#: The range coder renormalises (emits a byte) whenever its range drops below this.
RANGE_TOP = 1 << 24
RANGE_INIT = 0xFFFFFFFF
MASK32 = 0xFFFFFFFF

#: A stream holds at most this many symbols.  With PROB_BITS = 15 a symbol costs
#: at most 15.003 bits, so a stream's coded size is below 2 * n + 8 bytes, which
#: stays under 65535: stream lengths fit in a u16.
MAX_STREAM_SYMBOLS = 16384

#: Largest quantization alphabet: symbols are stored in a uint8.
MAX_ALPHABET = 255

#: CDF tables are sent as one 4-bit code per symbol.  Code 0 means "never seen"
#: (the symbol still gets the smallest probability, 1/PROB_TOTAL); codes 1..15
#: are steps of 2**0.6 in relative frequency, code 15 being the most frequent
#: symbol.  CODE_WEIGHT[k] is the integer weight code k stands for.
CODE_LEVELS = 15
CODE_STEP_LOG2 = 0.6
CODE_WEIGHT = np.array(
    [0] + [int(round(2.0 ** (CODE_STEP_LOG2 * (k - 1)) * 16)) for k in range(1, CODE_LEVELS + 1)],
    dtype=np.int64,
)
#: A count c (out of a maximum count m) gets code k + 1 where k is the number of
#: thresholds j with c * 2**20 >= m * CODE_THRESHOLD[j]; the thresholds sit at the
#: geometric midpoints between neighbouring levels, so integer comparisons pick the
#: nearest level in log space, identically on every device.
CODE_THRESHOLD = np.array(
    [int(round(2.0 ** (CODE_STEP_LOG2 * (j + 0.5 - (CODE_LEVELS - 1))) * (1 << 20))) for j in range(CODE_LEVELS - 1)],
    dtype=np.int64,
)


def max_stream_bytes(num_symbols: int) -> int:
    """Upper bound on the coded size of one stream of ``num_symbols`` symbols.

    Each symbol narrows the range by at most 2**-15.003, so the coder emits at
    most 15.003 / 8 < 2 bytes per symbol, plus at most 4 flush bytes.
    """
    return 2 * int(num_symbols) + 8


def alphabet_size(bins: int) -> int:
    """Number of symbols for ``bins`` quantization bins: levels -m..m with m = (bins-1)//2."""
    return 2 * ((int(bins) - 1) // 2) + 1
