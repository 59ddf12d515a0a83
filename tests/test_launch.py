"""kernels/launch.py: a kernel launched through the lean launcher computes what numba's own
launch computes, for arrays of several dtypes, views and scalars of each kind it packs; the
first launch of a signature goes through numba and leaves a plan, a signature it does not
pack keeps numba's launch.  Needs a GPU (under the simulator ``jit_kernel`` is cuda.jit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _kernels():
    from cachegen_cli.kernels import launch
    from cachegen_cli.kernels.cuda import cuda

    def body(a, b, out, n, scale, flag, small):
        i = cuda.grid(1)
        if i < n:
            v = a[i] * scale + b[i % b.shape[0], 1] + small
            out[i] = v if flag else -v

    return launch.jit_kernel(body), cuda.jit(body), launch


def test_lean_launches_compute_what_numba_launches_compute():
    lean, plain, launch = _kernels()
    from cachegen_cli.kernels.cuda import cuda

    n = 1000
    a = torch.arange(n, dtype=torch.float64, device="cuda") * 0.5
    base = torch.randn(40, 6, dtype=torch.float64, device="cuda")
    b = base[::2, 1:4]  # a strided view: its strides must reach the kernel in bytes
    views = [cuda.as_cuda_array(t, sync=False) for t in (a, b)]
    for scale, flag, small in ((2.0, True, np.int32(3)), (-1.5, False, np.int32(-7)), (0.25, True, np.int32(11))):
        want = torch.zeros(n, dtype=torch.float64, device="cuda")
        got = torch.full((n,), 9.0, dtype=torch.float64, device="cuda")
        wv, gv = cuda.as_cuda_array(want, sync=False), cuda.as_cuda_array(got, sync=False)
        plain[(n + 127) // 128, 128](views[0], views[1], wv, np.int64(n), scale, flag, small)
        lean[(n + 127) // 128, 128](views[0], views[1], gv, np.int64(n), scale, flag, small)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    plans = [p for p in lean.plans.values()]
    assert plans and all(p is not False for p in plans), "the signature got a plan after its first launch"


def test_a_torch_tensor_argument_keeps_numbas_launch():
    lean, plain, launch = _kernels()
    n = 64
    a = torch.ones(n, dtype=torch.float64, device="cuda")
    b = torch.ones(4, 3, dtype=torch.float64, device="cuda")
    out = torch.zeros(n, dtype=torch.float64, device="cuda")
    for _ in range(2):
        lean[1, 64](a, b, out, np.int64(n), 2.0, True, np.int32(0))
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3.0))
    assert list(lean.plans.values()) == [False]
