"""The calibrated step allocation (methods/transform.allocate) as device functions that give the
same bits on the CPU and on a GPU, so that a calibrated encode's steps can be made on the device
(kernels/cuda_pipeline.plane_steps) and still match the CPU's file byte for byte.

Why not np.log / np.exp: libm's and CUDA's libdevice's logarithms and exponentials are each
within an ulp or so of the truth, but not the same ulp, and a step is rounded to bfloat16 after
them: a rare plane would get a different step on each device.  Here both come from the same
IEEE operations in the same order: range reductions by powers of two (exact), an atanh series
for the logarithm and a Taylor series for the exponential, every product rounded on its own
(``mul``: a plain product on the CPU, libdevice's dmul_rn on a GPU, where the compiler would
otherwise fuse a product into the next addition), every division correctly rounded.  Accuracy:
a few ulps, far finer than a step's bfloat16 (the allocation is an estimate: docs/quality.md).

``make(mul)`` returns (log, exp, allocate) compiled for whichever target calls them
(numba's register_jitable): the CPU's kernels pass a plain product, the GPU's dmul_rn.
"""

import math

from numba.extending import register_jitable

from .transform import pairwise_sum

#: ln 2 split for the reductions (fdlibm's): k x LN2_HI is exact for |k| < 2^11
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
SQRT2 = 1.4142135623730951
#: terms of the series: |s| <= 0.1716 (s^2 <= 0.0295) and |r| <= 0.347 leave < 1e-19 out
LOG_TERMS = 14
EXP_TERMS = 20
_TWO64 = 18446744073709551616.0
_TWO_M64 = 1.0 / _TWO64
_TWO60 = 1152921504606846976.0
_TWO_M60 = 1.0 / _TWO60


def make(mul):
    """(log, exp, allocate) over the product ``mul`` (see the module's docstring)."""

    @register_jitable
    def log(x):
        """Natural logarithm of a float64; log(0) = -inf, log(inf) = inf, NaN for x < 0 or NaN."""
        if x != x or x < 0.0:
            return math.nan
        if x == 0.0:
            return -math.inf
        if x == math.inf:
            return math.inf
        f = x
        k = 0
        while f >= _TWO64:  # powers of two: exact
            f = f * _TWO_M64
            k += 64
        while f < _TWO_M64:
            f = f * _TWO64
            k -= 64
        while f >= SQRT2:
            f = f * 0.5
            k += 1
        while f < 0.5 * SQRT2:
            f = f * 2.0
            k -= 1
        # log f = 2 atanh(s) = 2 (s + s^3 / 3 + s^5 / 5 + ...), s = (f - 1) / (f + 1)
        s = (f - 1.0) / (f + 1.0)
        z = mul(s, s)
        p = 1.0 / (2 * LOG_TERMS + 1)
        for j in range(LOG_TERMS - 1, -1, -1):
            p = mul(p, z) + 1.0 / (2 * j + 1)
        logf = mul(2.0 * s, p)
        fk = float(k)
        return mul(fk, LN2_HI) + (mul(fk, LN2_LO) + logf)

    @register_jitable
    def exp(x):
        """e^x of a float64; exp(NaN) = NaN, 0 below the smallest subnormal, inf past the largest."""
        if x != x:
            return math.nan
        if x > 709.8:
            return math.inf
        if x < -745.2:
            return 0.0
        fk = math.floor(mul(x, INV_LN2) + 0.5) * 1.0
        r = (x - mul(fk, LN2_HI)) - mul(fk, LN2_LO)
        # e^r = 1 + r (1 + r / 2 (1 + r / 3 (...)))
        p = 1.0
        for j in range(EXP_TERMS, 0, -1):
            p = 1.0 + mul(r, p) / j
        ki = int(fk)
        while ki > 60:  # times 2^k by powers of two (exact while the value stays normal)
            p = p * _TWO60
            ki -= 60
        while ki < -60:
            p = p * _TWO_M60
            ki += 60
        scale = 1.0  # 2^ki, |ki| <= 60, by exact doublings or halvings
        while ki > 0:
            scale = scale * 2.0
            ki -= 1
        while ki < 0:
            scale = scale * 0.5
            ki += 1
        return p * scale

    @register_jitable
    def allocate(rel, rms, sensitivity, strength, min_step, max_step, out, logw, live_logs, los, ns, stage, left):
        """methods/transform.allocate over P planes (flat float64 arrays [P]): out[i] = rel[i] x
        factor[i] clipped to [min_step, max(max_step, rel[i])], factor = exp(-strength / 2 x
        (log w - mean log w)) for the planes with any spread (rms > 1e-30; w = rms^2 x
        sensitivity), 1 for the rest.  logw, live_logs: float64 [P] scratch; los, ns, stage
        (int64) and left (float64): pairwise_sum's, 64 entries each."""
        P = rel.shape[0]
        nlive = 0
        for i in range(P):
            logw[i] = 0.0
            if rms[i] > 1e-30:
                logw[i] = log(mul(mul(rms[i], rms[i]), sensitivity[i]))
                live_logs[nlive] = logw[i]
                nlive += 1
        mean = pairwise_sum(live_logs, 0, nlive, los, ns, stage, left) / nlive if nlive else 0.0
        half = -0.5 * strength
        for i in range(P):
            factor = exp(mul(half, logw[i] - mean)) if rms[i] > 1e-30 else 1.0
            v = mul(rel[i], factor)
            top = max(max_step, rel[i])
            # np.clip(v, lo, hi): min(max(v, lo), hi), a NaN staying NaN
            if v < min_step:
                v = min_step
            if v > top:
                v = top
            out[i] = v

    return log, exp, allocate
