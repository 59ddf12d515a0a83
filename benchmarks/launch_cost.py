"""What one step of a GPU-resident call costs the host: a numba kernel launch with n array
arguments (numba device arrays, or torch tensors wrapped per call as the pipelines do), the
wrapping itself, a small torch op, and a small copy to the host (a synchronisation).  The
GPU idles while the host spends this between a synchronisation and the next long kernel.

One more row tries what a leaner launcher could do: the compiled kernel launched through
cuda.core with each torch tensor's fields packed by hand in numba's argument layout (meminfo,
parent, item count, item size, data pointer, shape, strides in bytes), checked against the
values numba's own launch writes.

    python benchmarks/launch_cost.py --calls 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from cachegen_cli.kernels.cuda import cuda  # numba's, after numpy 2.5's np.row_stack is restored


@cuda.jit
def _k2(a, b):
    i = cuda.grid(1)
    if i < a.shape[0]:
        b[i] = a[i]


@cuda.jit
def _k10(a, b, c, d, e, f, g, h, p, q):
    i = cuda.grid(1)
    if i < a.shape[0]:
        b[i] = a[i] + c[i] + d[i] + e[i] + f[i] + g[i] + h[i] + p[i] + q[i]


@cuda.jit
def _k10s(a, b, c, d, e, f, g, h, p, q):
    # ten scalars: what an int64 argument costs
    i = cuda.grid(1)
    if i < 1:
        pass


def per_call_us(fn, calls: int) -> tuple[float, float, float]:
    """Median, min and max over 5 runs of the mean microseconds per fn() over ``calls``."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs), min(runs), max(runs)


def packed_launcher(dispatcher, griddim, blockdim):
    """A launch of ``dispatcher``'s one compiled overload with torch tensors packed by hand
    (numba-cuda 0.30's layout, see dispatcher._Kernel._prepare_args), on the default stream."""
    from cuda.core import LaunchConfig, launch
    from numba.cuda.cudadrv import driver

    kernel = next(iter(dispatcher.overloads.values()))._codelibrary.get_cufunc().kernel
    stream = driver._to_core_stream(0)
    config = LaunchConfig(grid=griddim, block=blockdim)

    def run(*tensors):
        args = []
        for t in tensors:
            size = t.element_size()
            args += [0, 0, t.numel(), size, t.data_ptr(), *t.shape, *(st * size for st in t.stride())]
        launch(stream, config, kernel, *args)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    ts = [torch.zeros(256, dtype=torch.int64, device="cuda") for _ in range(10)]
    nbs = [cuda.as_cuda_array(t, sync=False) for t in ts]
    one = lambda t: cuda.as_cuda_array(t, sync=False)  # noqa: E731
    small = torch.arange(16, device="cuda")
    rows = {
        "as_cuda_array(torch tensor), one": lambda: one(ts[0]),
        "launch, 2 numba arrays": lambda: _k2[1, 256](nbs[0], nbs[1]),
        "launch, 10 numba arrays": lambda: _k10[1, 256](*nbs),
        "launch, 10 torch tensors wrapped per call": lambda: _k10[1, 256](*[one(t) for t in ts]),
        "launch, 10 torch tensors passed as they are": lambda: _k10[1, 256](*ts),
        "launch, 10 int64 scalars": lambda: _k10s[1, 32](*[np.int64(i) for i in range(10)]),
        "torch add of 16 values": lambda: small + 1,
        "torch index of 16 values": lambda: small[small],
        "copy of 16 values to the host (sync)": lambda: small.cpu(),
    }
    for name, fn in rows.items():
        med, lo, hi = per_call_us(fn, a.calls if "sync" not in name else a.calls // 4)
        print(f"{name:45s} {med:8.1f} us  ({lo:.1f}-{hi:.1f})")
    try:
        ins = [torch.arange(256, dtype=torch.int64, device="cuda") * (i + 1) for i in range(10)]
        want = torch.zeros(256, dtype=torch.int64, device="cuda")
        got = torch.zeros(256, dtype=torch.int64, device="cuda")
        args = [ins[0], want, *ins[2:]]
        _k10[1, 256](*[one(t) for t in args])  # numba's launch: what the packed one must match
        run = packed_launcher(_k10, 1, 256)
        run(ins[0], got, *ins[2:])
        torch.cuda.synchronize()
        same = torch.equal(got, want) and bool(want.any())
        med, lo, hi = per_call_us(lambda: run(ins[0], got, *ins[2:]), a.calls)
        print(f"{'launch, 10 torch tensors packed by hand':45s} {med:8.1f} us  ({lo:.1f}-{hi:.1f})  "
              f"same values as numba's launch: {same}")
    except Exception as e:  # noqa: BLE001 - a measurement: say why the row is missing
        print(f"launch, 10 torch tensors packed by hand: failed ({type(e).__name__}: {e})")


if __name__ == "__main__":
    main()
