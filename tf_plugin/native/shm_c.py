"""The C executor (shm_allreduce.c) behind the contract (contract.ShmGroup), through
ctypes: either the framework-free library (build.library("c")) or the TensorFlow
op library, which holds the same executor (ops.py registers its groups for the
ops). A blocking all-reduce releases the GIL while the executor thread runs it.
No TensorFlow.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading

import numpy as np

from . import contract
from .contract import DTYPES, OPS, ShmGroup, check_args, error_for

MESSAGE = 320
_P, _U32, _U64, _INT, _DBL, _STR = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_double,
                                    ctypes.c_char_p)
_binding = threading.Lock()


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the executor's functions on `lib` (once)."""
    with _binding:
        if getattr(lib, "_rdt_shm_bound", False):
            return lib
        lib.rdt_shm_segment_bytes.argtypes = [_U32, ctypes.POINTER(_U64)]
        lib.rdt_shm_segment_bytes.restype = _U64
        lib.rdt_shm_group_create.argtypes = [ctypes.POINTER(_INT), _INT, _INT, _U32, ctypes.POINTER(_U64), _DBL,
                                             ctypes.c_char_p, ctypes.c_size_t]
        lib.rdt_shm_group_create.restype = _P
        lib.rdt_shm_group_retain.argtypes = [_P]
        lib.rdt_shm_group_retain.restype = None
        lib.rdt_shm_group_release.argtypes = [_P]
        lib.rdt_shm_group_release.restype = None
        lib.rdt_shm_group_allreduce.argtypes = [_P, _U32, _P, _P, _U64, _INT, _INT, _DBL, _STR, ctypes.c_char_p,
                                                ctypes.c_size_t]
        lib.rdt_shm_group_allreduce.restype = _INT
        lib.rdt_shm_group_allreduce_parts.argtypes = [_P, _U32, _INT, ctypes.POINTER(_P), ctypes.POINTER(_P),
                                                      ctypes.POINTER(_U64), _INT, _INT, _DBL, _STR, ctypes.c_char_p,
                                                      ctypes.c_size_t]
        lib.rdt_shm_group_allreduce_parts.restype = _INT
        lib.rdt_shm_group_allreduce_many.argtypes = [_P, _INT, ctypes.POINTER(_U32), ctypes.POINTER(_P),
                                                     ctypes.POINTER(_P), ctypes.POINTER(_U64), ctypes.POINTER(_INT),
                                                     _INT, _DBL, ctypes.POINTER(_STR), ctypes.POINTER(_INT),
                                                     ctypes.c_char_p, ctypes.c_size_t]
        lib.rdt_shm_group_allreduce_many.restype = _INT
        lib.rdt_shm_group_abort.argtypes = [_P, _INT, _STR]
        lib.rdt_shm_group_abort.restype = None
        lib.rdt_shm_group_status.argtypes = [_P]
        lib.rdt_shm_group_status.restype = _INT
        lib.rdt_shm_group_peer_ahead.argtypes = [_P, ctypes.POINTER(_U32), ctypes.POINTER(_U64)]
        lib.rdt_shm_group_peer_ahead.restype = _INT
        lib.rdt_shm_group_counters.argtypes = [_P, ctypes.POINTER(_U64), ctypes.POINTER(_U64)]
        lib.rdt_shm_group_counters.restype = None
        lib.rdt_shm_group_busy.argtypes = [_P, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]
        lib.rdt_shm_group_busy.restype = None
        lib.rdt_shm_group_set_nice.argtypes = [_P, _INT]
        lib.rdt_shm_group_set_nice.restype = _INT
        lib._rdt_shm_bound = True
    return lib


def _u64s(values):
    values = list(values)
    return (_U64 * max(1, len(values)))(*values)


class CGroup(ShmGroup):
    """One rank's side of a group, run by the C executor of `lib`."""

    def __init__(self, lib: ctypes.CDLL, fds, rank: int, ranks: int, bucket_bytes, timeout: float):
        self.lib = bind(lib)
        self.rank, self.ranks, self.timeout = rank, ranks, float(timeout)
        self.bucket_bytes = tuple(int(b) for b in bucket_bytes)
        if len(fds) != ranks:
            raise contract.ShmInvalid(f"{len(fds)} segments for {ranks} ranks")
        err = ctypes.create_string_buffer(MESSAGE)
        fd_array = (_INT * max(1, ranks))(*fds)
        handle = self.lib.rdt_shm_group_create(fd_array, rank, ranks, len(self.bucket_bytes),
                                               _u64s(self.bucket_bytes), self.timeout, err, MESSAGE)
        if not handle:
            raise contract.ShmInvalid(err.value.decode(errors="replace"))
        self.handle = handle
        self._busy = threading.Condition()
        self._calls = 0
        self._closed = False
        self._final = (0, 0)
        self._final_busy = (0.0, 0.0)

    def allreduce(self, bucket: int, array, op: str = "sum", scale: float = 1.0, label: str | None = None
                  ) -> np.ndarray:
        array = np.ascontiguousarray(array)
        label = label or "a tensor"
        check_args(self.bucket_bytes, bucket, array, op, label)
        out = np.empty_like(array)
        err = ctypes.create_string_buffer(MESSAGE)
        with self._call(f"rdmatensor shm all-reduce of {label} (bucket {bucket})"):
            status = self.lib.rdt_shm_group_allreduce(self.handle, bucket, array.ctypes.data, out.ctypes.data,
                                                      array.size, DTYPES[array.dtype], OPS[op], float(scale),
                                                      label.encode(), err, MESSAGE)
        if status:
            raise error_for(status, err.value.decode(errors="replace"))
        return out

    def allreduce_many(self, buckets, arrays, op: str = "sum", scale: float = 1.0, labels=None) -> list:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        buckets = [int(b) for b in buckets]
        m = len(arrays)
        labels = [lab or "a tensor" for lab in (labels if labels is not None else [None] * m)]
        if len(buckets) != m or len(labels) != m:
            raise contract.ShmInvalid(f"{m} arrays, {len(buckets)} buckets, {len(labels)} labels")
        for b, a, lab in zip(buckets, arrays, labels, strict=True):
            check_args(self.bucket_bytes, b, a, op, lab)
        outs = [np.empty_like(a) for a in arrays]
        err = ctypes.create_string_buffer(MESSAGE)
        size = max(1, m)
        args = ((_U32 * size)(*buckets), (_P * size)(*[a.ctypes.data for a in arrays]),
                (_P * size)(*[o.ctypes.data for o in outs]), (_U64 * size)(*[a.size for a in arrays]),
                (_INT * size)(*[DTYPES[a.dtype] for a in arrays]))
        names = (_STR * size)(*[lab.encode() for lab in labels])
        statuses = (_INT * size)()
        with self._call("rdmatensor shm all-reduce"):
            status = self.lib.rdt_shm_group_allreduce_many(self.handle, m, *args, OPS[op], float(scale), names,
                                                           statuses, err, MESSAGE)
        if status:
            raise error_for(status, err.value.decode(errors="replace"))
        return outs

    def allreduce_parts(self, bucket: int, arrays, op: str = "sum", scale: float = 1.0, label: str | None = None
                        ) -> list:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        label = label or "a tensor"
        if not arrays or len({a.dtype for a in arrays}) > 1:
            raise contract.ShmInvalid(f"all-reduce of {label}: parts of one dtype, not "
                                      f"{sorted({a.dtype.name for a in arrays})}")
        whole = np.empty(sum(a.size for a in arrays), arrays[0].dtype)     # checked as one request
        check_args(self.bucket_bytes, bucket, whole, op, label)
        outs = [np.empty_like(a) for a in arrays]
        m = len(arrays)
        err = ctypes.create_string_buffer(MESSAGE)
        with self._call(f"rdmatensor shm all-reduce of {label} (bucket {bucket})"):
            status = self.lib.rdt_shm_group_allreduce_parts(
                self.handle, bucket, m, (_P * m)(*[a.ctypes.data for a in arrays]),
                (_P * m)(*[o.ctypes.data for o in outs]), (_U64 * m)(*[a.size for a in arrays]),
                DTYPES[arrays[0].dtype], OPS[op], float(scale), label.encode(), err, MESSAGE)
        if status:
            raise error_for(status, err.value.decode(errors="replace"))
        return outs

    def counters(self) -> tuple[int, int]:
        with self._busy:
            if self.handle is None:               # closed: as they were then
                return self._final
            calls, moved = _U64(), _U64()
            self.lib.rdt_shm_group_counters(self.handle, ctypes.byref(calls), ctypes.byref(moved))
            return calls.value, moved.value

    def busy(self) -> tuple[float, float]:
        with self._busy:
            if self.handle is None:
                return self._final_busy
            busy, overlapped = ctypes.c_double(), ctypes.c_double()
            self.lib.rdt_shm_group_busy(self.handle, ctypes.byref(busy), ctypes.byref(overlapped))
            return busy.value, overlapped.value

    def set_nice(self, nice: int) -> bool:
        """Give the executor thread this nice value; False where that is not permitted
        (raising a priority needs CAP_SYS_NICE or RLIMIT_NICE)."""
        with self._busy:
            if self.handle is None:
                raise contract.ShmClosed("the group was closed")
            code = self.lib.rdt_shm_group_set_nice(self.handle, int(nice))
        if code in (errno.EACCES, errno.EPERM):
            return False
        if code:
            raise OSError(code, f"setting the executor thread's nice to {nice}: {os.strerror(code)}")
        self.executor_nice = int(nice)
        return True

    @contextlib.contextmanager
    def _call(self, what: str):
        """One call into the executor, counted so close() waits for it; refused once closed."""
        with self._busy:
            if self._closed:
                raise contract.ShmClosed(f"{what}: the group was closed")
            self._calls += 1
        try:
            yield
        finally:
            with self._busy:
                self._calls -= 1
                self._busy.notify_all()

    def abort(self, why: str = "aborted by the caller", status: int = contract.ABORTED) -> None:
        with self._busy:
            if self.handle is not None:
                self.lib.rdt_shm_group_abort(self.handle, status, why.encode())

    def status(self) -> int:
        with self._busy:
            return self.lib.rdt_shm_group_status(self.handle) if self.handle is not None else contract.CLOSED

    def peer_ahead(self) -> tuple[int, int, int] | None:
        with self._busy:
            if self.handle is None:
                return None
            bucket, call = _U32(), _U64()
            peer = self.lib.rdt_shm_group_peer_ahead(self.handle, ctypes.byref(bucket), ctypes.byref(call))
        return (peer, bucket.value, call.value) if peer >= 0 else None

    def close(self) -> None:
        with self._busy:
            if self._closed:
                return
            self._closed = True
            self.lib.rdt_shm_group_abort(self.handle, contract.CLOSED, b"the group was closed")
            while self._calls:
                self._busy.wait()
        self._final, self._final_busy = self.counters(), self.busy()
        with self._busy:
            handle, self.handle = self.handle, None
        self.lib.rdt_shm_group_release(handle)
