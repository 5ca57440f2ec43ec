"""The contract of the shared-memory all-reduce on one host: what the C executor
(shm_allreduce.c, through shm_c.CGroup) and its Python twin (shm_twin.TwinGroup)
both do, so that callers never tell them apart and the tests hold both to it.

A group is made from every rank's segment (segment.py), this rank, the number
of ranks, the bucket sizes in bytes and a timeout in seconds. Its buckets are
all-reduced one call at a time, in the order the ranks call them: every rank
must call the same all-reduces, with the same element count, dtype, op and
scale, in the same order (a difference raises ShmMismatch on every rank).

- `allreduce(bucket, array, op, scale, label)`: a new array, the ranks' arrays
  combined by `op` (sum, average, min, max, product), folded in rank order in
  the array's dtype (numpy's np.add / np.minimum / np.maximum / np.multiply,
  integers wrapping), then multiplied by the factor: `scale`, divided by the
  number of ranks for an average, as tf_plugin/core/scaling.py multiplies
  (float32 by the factor rounded to float32, integers in double truncated).
  Nothing is multiplied when the factor is 1.
- `allreduce_many(buckets, arrays, op, scale, labels)`: several, in order (the
  C executor queues them all, then runs them in waves).
- `abort(why)`: every wait wakes; the running and later all-reduces raise
  ShmAborted, and the peers see this rank aborted (ShmPeerAborted) at once.
- `close()`: abort, then let go of the memory. Arrays already returned stay
  valid (they are the caller's, never views of a segment).

A failed all-reduce (timeout, mismatch, a peer's abort) leaves the ranks out of
step, so it breaks the group: every later call raises ShmAborted. No TensorFlow.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from rdmatensor.errors import PlanMismatch, RdmaTensorError, Timeout

DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2, np.dtype(np.int32): 3, np.dtype(np.int64): 4,
          np.dtype(np.float16): 5}
OPS = {"sum": 1, "average": 2, "min": 3, "max": 4, "product": 5}

OK, INVALID, TIMEOUT, ABORTED, PEER_ABORTED, CANCELLED, MISMATCH, CLOSED, SYSTEM = range(9)


class ShmError(RdmaTensorError):
    """An all-reduce over shared memory failed; `status` is its code (shm_allreduce.h)."""
    status = SYSTEM


class ShmInvalid(ShmError, ValueError):
    """A bad argument (bucket, dtype, op, too many elements): nothing was started."""
    status = INVALID


class ShmTimeout(ShmError, Timeout):
    """A peer did not arrive within the group's timeout; the message names it."""
    status = TIMEOUT


class ShmAborted(ShmError):
    """This rank aborted the group, or an earlier failure broke it."""
    status = ABORTED


class ShmPeerAborted(ShmError):
    """A peer aborted its group while this rank waited for it."""
    status = PEER_ABORTED


class ShmCancelled(ShmAborted):
    """A pending all-reduce was cancelled (which breaks the group)."""
    status = CANCELLED


class ShmMismatch(ShmError, PlanMismatch):
    """The ranks all-reduce different things (count, dtype, op, scale) on one bucket."""
    status = MISMATCH


class ShmClosed(ShmAborted):
    """The group was closed."""
    status = CLOSED


ERRORS = {c.status: c for c in (ShmInvalid, ShmTimeout, ShmAborted, ShmPeerAborted, ShmCancelled, ShmMismatch,
                                ShmClosed)}


def error_for(status: int, message: str) -> ShmError:
    return ERRORS.get(status, ShmError)(message)


def factor(op: str, scale: float, ranks: int) -> float:
    """What the combined values are multiplied by (in double; 1.0: nothing)."""
    return scale / ranks if op == "average" else scale


def check_args(bucket_bytes, bucket: int, array: np.ndarray, op: str, label: str) -> None:
    """Raise ShmInvalid as the C side refuses a request (the same words)."""
    if array.dtype not in DTYPES:
        raise ShmInvalid(f"all-reduce of {label}: dtype {array.dtype} is not one of float32, float64, int32, int64, "
                         "float16")
    if op not in OPS:
        raise ShmInvalid(f"all-reduce of {label}: op {op!r} is not one of sum, average, min, max, product")
    if not 0 <= bucket < len(bucket_bytes):
        raise ShmInvalid(f"all-reduce of {label}: bucket {bucket} does not exist (the group has {len(bucket_bytes)})")
    if array.size > bucket_bytes[bucket] // array.dtype.itemsize:
        raise ShmInvalid(f"all-reduce of {label}: {array.size} elements of {array.dtype} ({array.nbytes} bytes) do "
                         f"not fit in bucket {bucket} ({bucket_bytes[bucket]} bytes)")


class ShmGroup(ABC):
    """One rank's side of a group (see the module's docstring)."""
    rank: int
    ranks: int
    bucket_bytes: tuple
    timeout: float
    # the nice value given to the group's own executor thread; None: the process's
    # (not set, or not permitted), or no thread of its own (the twin runs each call
    # on its caller's thread)
    executor_nice: int | None = None

    @abstractmethod
    def allreduce(self, bucket: int, array, op: str = "sum", scale: float = 1.0, label: str | None = None
                  ) -> np.ndarray:
        """The ranks' `array`s combined (a new array of its shape and dtype)."""

    def allreduce_many(self, buckets, arrays, op: str = "sum", scale: float = 1.0, labels=None) -> list:
        """Several all-reduces in this order, as allreduce would run them one by one
        (the C executor queues them all first and runs them in waves)."""
        labels = list(labels) if labels is not None else [None] * len(arrays)
        return [self.allreduce(b, a, op, scale, lab) for b, a, lab in zip(buckets, arrays, labels, strict=True)]

    def allreduce_parts(self, bucket: int, arrays, op: str = "sum", scale: float = 1.0, label: str | None = None
                        ) -> list:
        """`arrays` (one dtype) all-reduced back to back as ONE request of `bucket`, as a
        fusion bucket's members: a new array per array, of its shape. Here by a
        concatenation and a split; the C executor copies the parts into its segment and
        the results out of it, with no concatenation."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not arrays or len({a.dtype for a in arrays}) > 1:
            raise ShmInvalid(f"all-reduce of {label or 'a tensor'}: parts of one dtype, not "
                             f"{sorted({a.dtype.name for a in arrays})}")
        flat = self.allreduce(bucket, np.concatenate([a.reshape(-1) for a in arrays]), op, scale, label)
        ends = np.cumsum([a.size for a in arrays])[:-1]
        return [part.reshape(a.shape) for part, a in zip(np.split(flat, ends), arrays, strict=True)]

    @abstractmethod
    def counters(self) -> tuple[int, int]:
        """(calls this rank completed, bytes they moved across its boundary each way):
        a call of n bytes moves (r-1)*s + n - s, s this rank's slice, 2(r-1)/r*n for
        even slices, as many as a ring all-reduce sends and receives."""

    @abstractmethod
    def busy(self) -> tuple[float, float]:
        """(seconds spent running this rank's calls, of them the seconds before the
        last bucket of their round was submitted). A round is one call of every
        bucket; launched as backprop makes its gradients, the second over the first
        is the share of the all-reduce that overlapped backprop. The C executor
        counts a wave of calls from taking it to its last completion (counted before
        that call returns); the twin
        runs each call when it is made, so only a call of an earlier bucket than
        the last overlaps."""

    @abstractmethod
    def abort(self, why: str = "aborted by the caller", status: int = ABORTED) -> None:
        """Break the group: waits end, this and later all-reduces raise. A peer
        waiting on it fails with PEER_ABORTED, or with MISMATCH when `status` is
        MISMATCH (this rank found that the ranks called different collectives)."""

    @abstractmethod
    def status(self) -> int:
        """0 while live, else the status this rank's side was aborted with (CLOSED once closed)."""

    @abstractmethod
    def peer_ahead(self) -> tuple[int, int, int] | None:
        """(peer, bucket, the peer's call number there) for a peer that has begun a
        call this rank has not begun, nor queued; None when there is none."""

    @abstractmethod
    def close(self) -> None:
        """Abort and let go of the segments' memory (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
