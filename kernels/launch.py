"""A leaner launcher for the numba-cuda kernels: ``jit_kernel`` is ``cuda.jit`` for a kernel whose
launches, after the first of each argument-type signature,, skip numba's per-call dispatch.

Why: numba's launch types every argument, looks the overload up, and turns each array into
ctypes fields on every call: ~60 us of host time for ten arrays on the H200's host (numba
arrays made once) and ~320 us when torch tensors are wrapped per call
(docs/results/2026-12-02d_launch_cost_2c02488.txt), against ~18 us for the same launch with the
fields packed by hand.  A GPU-resident call makes 6-20 launches between synchronisations, and
while the host spends that the GPU can run dry.

How: the first launch of a signature goes through numba (compiling, checking), then the plan
for that signature is kept: the compiled function and, per argument, how to pack it exactly as
numba's _Kernel._prepare_args does (an array: meminfo 0, parent 0, item count, item size, data
pointer, shape, strides in bytes; an integer: its ctypes type; float32 / float64: c_float /
c_double; a boolean as it is).  A signature with anything else (records, tuples, dynamic shared
memory, a debug or cooperative kernel) keeps numba's own launch.  An array's fields are packed
once per numba array object (the pipelines keep their views: transform_resident._nb).  Under
numba's simulator ``jit_kernel`` is plain ``cuda.jit``.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

if not hasattr(np, "row_stack"):  # numba-cuda 0.30.4 with numpy 2.5: see kernels/cuda.py
    np.row_stack = np.vstack

from numba import config as _numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from . import jit_cache  # noqa: E402  (numba's cache folder, before any kernel is made)

jit_cache.configure_cuda()

SIM = bool(_numba_config.ENABLE_CUDASIM)

#: False: every kernel launched through numba (CACHEGEN_LEAN_LAUNCH=0; benchmarks compare the two).
ENABLED = os.environ.get("CACHEGEN_LEAN_LAUNCH", "1") != "0"


#: Compiled CUDA kernels kept on disk (numba's cache, in jit_cache's folder, keyed on every
#: kernel source file): without it every process compiles each kernel it launches on first use,
#: seconds per process, paid again by each `cachegen` call and by each worker of a batch.
#: Off (compile in every process) with CACHEGEN_CUDA_CACHE=0, and while a tuning variable
#: changes the kernels' compile options (CACHEGEN_MAXREG, CACHEGEN_CUDA_CODER_REGISTERS): numba's
#: cache key holds the source and the closure's values, not the options.
TUNING_VARIABLES = ("CACHEGEN_MAXREG", "CACHEGEN_CUDA_CODER_REGISTERS")
DISK_CACHE = (os.environ.get("CACHEGEN_CUDA_CACHE", "1") != "0"
              and not any(os.environ.get(v) for v in TUNING_VARIABLES))


def jit_kernel(fn=None, **options):
    """``cuda.jit(fn)`` / ``cuda.jit(**options)(fn)`` for a kernel, launched through
    LeanKernel (on a GPU) and cached on disk (DISK_CACHE)."""

    def wrap(f):
        if SIM:
            return cuda.jit(**options)(f) if options else cuda.jit(f)
        return LeanKernel(cuda.jit(cache=DISK_CACHE, **options)(f))

    return wrap(fn) if fn is not None else wrap


class LeanKernel:
    """A numba CUDA dispatcher whose ``[grid, block, stream](*args)`` launches skip numba's
    dispatch once a signature has been launched; every other attribute is the dispatcher's."""

    def __init__(self, dispatcher) -> None:
        self.dispatcher = dispatcher
        self.plans: dict = {}

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)

    def __getitem__(self, config):
        if not ENABLED or len(config) > 3 and config[3]:
            return self.dispatcher[config]
        return _Launch(self, config[0], config[1], config[2] if len(config) > 2 else 0)


class _Launch:
    __slots__ = ("owner", "grid", "block", "stream")

    def __init__(self, owner: LeanKernel, grid, block, stream) -> None:
        self.owner, self.grid, self.block, self.stream = owner, grid, block, stream

    def __call__(self, *args):
        owner = self.owner
        key = tuple(map(_arg_key, args))
        plan = owner.plans.get(key)
        if plan is None:  # the first launch of this signature: numba's own, then the plan
            owner.dispatcher[self.grid, self.block, self.stream](*args)
            owner.plans[key] = _make_plan(owner.dispatcher, args)
            return
        if plan is False:
            owner.dispatcher[self.grid, self.block, self.stream](*args)
            return
        func, packers = plan
        fields = []
        for pack, a in zip(packers, args):
            pack(a, fields)
        _core_launch(_stream(self.stream), _config(self.grid, self.block), func, *fields)


def _arg_key(a):
    """What decides an argument's numba type: an array's cached numba type, a scalar's class."""
    t = getattr(a, "_cg_type", None)
    if t is not None:
        return t
    if hasattr(a, "device_ctypes_pointer"):
        t = a._numba_type_
        try:
            a._cg_type = t
        except AttributeError:  # pragma: no cover - a class with slots: typed each call
            pass
        return t
    return type(a)


def _pack_array(a, out):
    f = getattr(a, "_cg_fields", None)
    if f is None:
        ptr = a.__cuda_array_interface__["data"][0] or 0
        f = (0, 0, int(a.size), int(a.dtype.itemsize), ptr, *a.shape, *a.strides)
        try:
            a._cg_fields = f
        except AttributeError:  # pragma: no cover
            pass
    out.extend(f)


def _scalar_packer(ty):
    from numba.core import types

    if isinstance(ty, types.Integer):
        c = getattr(ctypes, f"c_{ty}")
        return lambda a, out: out.append(c(a))
    if ty == types.float64:
        return lambda a, out: out.append(ctypes.c_double(a))
    if ty == types.float32:
        return lambda a, out: out.append(ctypes.c_float(a))
    if ty == types.boolean:
        return lambda a, out: out.append(a)
    return None


def _make_plan(dispatcher, args):
    """(compiled function, packers) for launches with these arguments' types, or False when
    numba's own launch must stay (a type this launcher does not pack, a special kernel)."""
    from numba.core import types

    try:
        argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
        overload = dispatcher.overloads.get(argtypes)
        if overload is None or getattr(overload, "debug", False) or getattr(overload, "cooperative", False):
            return False
        if getattr(dispatcher, "extensions", None) or getattr(overload, "extensions", None):
            return False
        packers = []
        for ty, a in zip(overload.argument_types, args):
            if isinstance(ty, types.Array):
                if not hasattr(a, "device_ctypes_pointer"):
                    return False  # wrapped per call by numba (a torch tensor, a host array)
                packers.append(_pack_array)
            else:
                p = _scalar_packer(ty)
                if p is None:
                    return False
                packers.append(p)
        return overload._codelibrary.get_cufunc().kernel, packers
    except Exception:  # noqa: BLE001 - anything unexpected in numba's internals: its own launch
        return False


_STREAMS: dict = {}
_CONFIGS: dict = {}


def _stream(stream):
    s = _STREAMS.get(stream) if isinstance(stream, int) else None
    if s is None:
        from numba.cuda.cudadrv import driver

        s = driver._to_core_stream(stream)
        if isinstance(stream, int):
            _STREAMS[stream] = s
    return s


def _config(grid, block):
    key = (grid, block)
    c = _CONFIGS.get(key)
    if c is None:
        from cuda.core import LaunchConfig

        c = LaunchConfig(grid=grid, block=block)
        if len(_CONFIGS) > 4096:
            _CONFIGS.clear()
        _CONFIGS[key] = c
    return c


_LAUNCH = []


def _core_launch(stream, config, func, *fields):
    """cuda.core's launch (imported on the first launch, not on every one)."""
    if not _LAUNCH:
        from cuda.core import launch

        _LAUNCH.append(launch)
    _LAUNCH[0](stream, config, func, *fields)
