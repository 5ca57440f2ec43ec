"""Memory TensorFlow can take with no copy: 64-byte aligned arrays, and output
buffers reused once TensorFlow let go of the last tensor over them. No
TensorFlow here: graph/ingest.py hands these to it."""
from __future__ import annotations

import collections
import ctypes
import weakref

import numpy as np

TF_ALIGN = 64    # Allocator::kAllocatorAlignment / EIGEN_MAX_ALIGN_BYTES


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized ndarray whose data is 64-byte aligned (fit for from_dlpack)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + TF_ALIGN, np.uint8)
    start = -raw.ctypes.data % TF_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class Reused:
    """Flat 64-byte aligned output buffers of one size, handed to TensorFlow with
    no copy step after step, never overwritten while TensorFlow still holds them.

    lease() returns a fresh ndarray over a free buffer. Its base is a ctypes
    array, not an ndarray, so numpy stops collapsing view chains at the lease:
    every view cut from it (the tensors' outputs) keeps it alive, and a
    finalizer on it puts the buffer back once the last one is gone (TensorFlow
    drops its reference when it frees the tensor). A buffer is allocated only
    while every existing one is still held: one or two in steady training,
    without the page faults of a fresh allocation per step."""

    def __init__(self, size: int, dtype, tally: dict | None = None, on_new=None):
        # on_new(buffer): called with each buffer allocated (the ring registers it for writes)
        self.size, self.dtype, self.tally, self.on_new = size, np.dtype(dtype), tally, on_new
        self._free = collections.deque()       # thread-safe append/pop: finalizers run on TF's threads
        self.allocated = 0

    def lease(self) -> np.ndarray:
        try:
            raw = self._free.pop()
        except IndexError:
            raw = aligned_empty((self.size,), self.dtype)
            self.allocated += 1
            if self.on_new is not None and raw.nbytes:
                self.on_new(raw)
            if self.tally is not None:
                self.tally["allocated"] = self.tally.get("allocated", 0) + 1
        if not raw.nbytes:
            return raw
        lease = np.frombuffer((ctypes.c_char * raw.nbytes).from_address(raw.ctypes.data), self.dtype)
        weakref.finalize(lease, self._free.append, raw)
        return lease
