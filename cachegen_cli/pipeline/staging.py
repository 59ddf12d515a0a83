"""Small host arrays to the device without stalling the host: the GPU-resident pipelines'
steps, offsets, chunk positions and header bytes (kilobytes, a few per call).

Why not the obvious ways: a copy from pageable memory makes the host wait for all the work
queued on the stream (CUDA's rule for pageable transfers), and ``tensor.pin_memory()`` costs
0.4-1 ms per call on the H200 host (benchmarks/profile_host.py at 108299e, docs/results/
2026-12-02b_profile_host_108299e.txt: six per balanced decode, ~6 ms of a profiled ~20 ms).
So every array goes through one page-locked ring buffer allocated once: its bytes are written
at the ring's head, the copy is queued like a kernel, and a CUDA event recorded after it says
when that stretch of the ring may be written again (the host waits on an event only when the
ring has wrapped onto a copy not yet run).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

_ALIGN = 256  # each array's stretch starts on a 256-byte boundary (any dtype's view is aligned)
_MIN_RING = 4 << 20


class UploadRing:
    """A page-locked ring buffer that stages host arrays for asynchronous device copies."""

    def __init__(self, min_bytes: int = _MIN_RING) -> None:
        self._min = min_bytes
        self._buf: torch.Tensor | None = None
        self._head = 0
        self._pending: deque = deque()  # (start, end, event): stretches whose copy may not have run
        self._lock = threading.Lock()

    def _wait_overlapping(self, a0: int, a1: int) -> None:
        keep = deque()
        for s, e, ev in self._pending:
            if s < a1 and a0 < e:
                ev.synchronize()
            elif not ev.query():
                keep.append((s, e, ev))
        self._pending = keep

    def _reserve(self, nbytes: int) -> int:
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if self._buf is None or need > self._buf.numel():
            for _, _, ev in self._pending:  # the old ring stays alive until its copies have run
                ev.synchronize()
            self._pending.clear()
            self._buf = torch.empty(max(2 * need, self._min), dtype=torch.uint8, pin_memory=True)
            self._head = 0
        if self._head + need > self._buf.numel():
            self._head = 0
        a0 = self._head
        self._wait_overlapping(a0, a0 + need)
        self._head = a0 + need
        return a0

    def upload_arrays(self, arrays: list[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
        """Host arrays of any shapes and dtypes on ``dev`` in one copy (each on a 256-byte
        boundary of one device buffer), as views of their shapes and dtypes."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        dtypes = [torch.from_numpy(np.empty(0, a.dtype)).dtype for a in arrays]
        if dev.type != "cuda":
            return [torch.from_numpy(a.copy()) for a in arrays]
        at, total = [], 0
        for a in arrays:
            at.append(total)
            total += -(-max(a.nbytes, 1) // _ALIGN) * _ALIGN
        out = torch.empty(total, dtype=torch.uint8, device=dev)
        with self._lock:
            a0 = self._reserve(total)
            host = self._buf[a0 : a0 + total].numpy()
            for a, o in zip(arrays, at):
                host[o : o + a.nbytes] = a.reshape(-1).view(np.uint8)
            out.copy_(self._buf[a0 : a0 + total], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self._pending.append((a0, a0 + total, ev))
        return [out[o : o + a.nbytes].view(dt).reshape(a.shape) for a, o, dt in zip(arrays, at, dtypes)]

    def upload(self, a: np.ndarray, dev: torch.device) -> torch.Tensor:
        """``a`` (any shape and dtype numpy has a torch twin for) as a tensor on ``dev``; the copy
        is queued on dev's current stream.  A CPU ``dev`` (numba's simulator) gets a copy."""
        return self.upload_arrays([a], dev)[0]


_RING = UploadRing()


def to_device(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A host array on ``dev``, the copy queued (the shared ring of this module)."""
    return _RING.upload(a, dev)


def upload_arrays(arrays: list[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    """Host arrays (any shapes and dtypes) on ``dev`` in one queued copy; returns views."""
    return _RING.upload_arrays(arrays, dev)


def upload_int64(parts: list[np.ndarray], dev: torch.device) -> list[torch.Tensor]:
    """Several small host integer arrays on ``dev`` as int64, in one copy; returns views."""
    flat = (np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts]) if parts
            else np.zeros(0, np.int64))
    d = to_device(flat, dev)
    out, o = [], 0
    for p in parts:
        n = int(np.asarray(p).size)
        out.append(d[o : o + n])
        o += n
    return out


# ---------------------------------------------------------------- whole caches and files


#: The largest page-locked buffer kept for a file's bytes (per thread and role); a larger cache
#: or file goes through pageable memory (slower copies, but no gigabytes pinned for good).
HOST_BUFFER_MAX = 4 << 30


class HostBuffers:
    """Page-locked host buffers, one per role ("input", "output"), each grown to the largest
    size asked for and kept: a file read into one, or a result copied out into one, moves
    across the link at its full speed, and touches no fresh pages.

    Why: a fresh host array of a cache's size costs a page fault per 4 KiB on its first write
    (on the H200 host a pageable copy of a 134 MB decoded cache to the host took ~88 ms, the
    read of a 134 MB input ~44 ms, against ~6 ms for the copy into page-locked memory that a
    batch worker reuses: benchmarks/bench_batch.py --profile).  Per thread: what a buffer
    returned holds is valid until the same thread asks for that role again."""

    def __init__(self, limit: int = HOST_BUFFER_MAX) -> None:
        self.limit = limit
        self._local = threading.local()

    def get(self, role: str, nbytes: int) -> torch.Tensor | None:
        """A page-locked uint8 tensor of ``nbytes`` for ``role``, or None when CUDA is not in
        use here or ``nbytes`` exceeds the limit."""
        if nbytes > self.limit or not self.available():
            return None
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        buf = bufs.get(role)
        if buf is None or buf.numel() < nbytes:
            bufs.pop(role, None)  # the old one is released before the larger one is taken
            buf = bufs[role] = self.allocate(max(nbytes, 1 << 20))
        return buf[:nbytes]

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def allocate(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release(self) -> None:
        """Free this thread's buffers (a process done with the GPU's file paths gets its
        page-locked memory back; the next call allocates again)."""
        self._local.bufs = {}


HOST_BUFFERS = HostBuffers()


class PinnedSlabBuffers:
    """kvio.SlabBuffers' interface over HOST_BUFFERS' ``role`` buffer: a reader that fills the
    array it gets (SafetensorsSource.read) fills page-locked memory; pageable memory when
    there is no page-locked buffer to give (no CUDA, or too large)."""

    def __init__(self, role: str = "input") -> None:
        self.role = role

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = HOST_BUFFERS.get(f"{self.role}:{name}", n)
        if buf is None:
            return np.empty(shape, dtype)
        return buf.numpy().view(dtype).reshape(shape)


def to_host(t: torch.Tensor, role: str = "output") -> np.ndarray:
    """A device tensor's bytes on the host (uint8, its C order), through HOST_BUFFERS' ``role``
    buffer: valid until this thread asks for that role again.  Waits for the work that writes
    ``t``."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    flat = t.view(-1).view(torch.uint8) if n else t.new_empty(0, dtype=torch.uint8)
    buf = HOST_BUFFERS.get(role, n) if t.is_cuda else None
    if buf is None:
        return flat.cpu().numpy()
    buf.copy_(flat)
    return buf.numpy()
