"""The Python twin of the shared-memory all-reduce (shm_allreduce.c): numpy over
the same segments, the same protocol, the same contract (contract.ShmGroup). It
runs where the C executor is not built or RDMATENSOR_TF_OPS=python, and a twin
rank and a C rank can be in one group.

It runs each all-reduce on the calling thread (one at a time per group). Its
waits poll with a backoff (50 us of spinning, then sleeps from 20 us up to 1 ms)
and never sleep in a futex, so a C peer never has to wake it; after each
publication it wakes the word it stored (a futex wake), since a C peer may sleep
on it. Ordering: numpy's 8-byte stores and loads of aligned words are single
instructions, and x86-64 keeps stores in order and loads in order, which is
the release/acquire the protocol needs (the compiled parts rely on x86-64 too).
No TensorFlow.
"""
from __future__ import annotations

import ctypes
import mmap
import platform
import struct
import threading
import time

import numpy as np

from ..core import scaling
from . import contract
from .contract import OPS, ShmGroup, check_args, error_for
from .segment import OFF_BUCKETS, OFF_STATE, PIPELINE_BYTES, PROGRESS_DONE, Layout, check_segment, \
    pipeline_chunks

DESCRIPTOR = struct.Struct("<QIId")     # count, dtype, op, scale (after in_seq)
_UFUNCS = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAKE = 1


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def bounds(count: int, ranks: int, r: int) -> tuple[int, int]:
    """[lo, hi) of slice r (as schedule.ring_bounds cuts)."""
    q, rem = divmod(count, ranks)
    lo = r * q + min(r, rem)
    return lo, lo + q + (1 if r < rem else 0)


class TwinGroup(ShmGroup):
    """One rank's side of a group, in Python (contract.py)."""

    def __init__(self, fds, rank: int, ranks: int, bucket_bytes, timeout: float):
        if not 0 <= rank < ranks or len(fds) != ranks:
            raise contract.ShmInvalid(f"rank {rank} of {ranks} ranks with {len(fds)} segments")
        if not timeout > 0:
            raise contract.ShmInvalid(f"timeout {timeout} s: give a positive number of seconds")
        self.rank, self.ranks, self.timeout = rank, ranks, float(timeout)
        self.layout = Layout(bucket_bytes)
        self.bucket_bytes = self.layout.bucket_bytes
        self._maps, self._words, self._states = [], [], []
        words = (OFF_BUCKETS + 128 * len(self.bucket_bytes)) // 8
        try:
            for r, fd in enumerate(fds):
                check_segment(fd, r, ranks, self.layout)
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if r == rank else 0)
                m = mmap.mmap(fd, self.layout.total, mmap.MAP_SHARED, prot)
                self._maps.append(m)
                self._words.append(np.frombuffer(m, "<u8", words))
                self._states.append(np.frombuffer(m, "<u4", 1, OFF_STATE))
        except ValueError as exc:
            self._unmap()
            raise contract.ShmInvalid(str(exc)) from exc
        self._base = self._words[rank].ctypes.data
        self._calls = [0] * len(self.bucket_bytes)
        self._lock = threading.Lock()
        self._aborted, self._why = 0, ""
        self._closed = False
        self._done, self._moved = 0, 0
        self._busy, self._overlapped = 0.0, 0.0

    # --------------------------------------------------------------- contract
    def allreduce(self, bucket: int, array, op: str = "sum", scale: float = 1.0, label: str | None = None
                  ) -> np.ndarray:
        array = np.ascontiguousarray(array)
        label = label or "a tensor"
        check_args(self.bucket_bytes, bucket, array, op, label)
        with self._lock:
            if self._aborted:
                raise error_for(self._aborted, self._failed(bucket, label))
            try:
                t0 = time.monotonic()
                result = self._run(bucket, array, op, float(scale), label)
                spent = time.monotonic() - t0
                self._busy += spent
                if bucket < len(self.bucket_bytes) - 1:      # its round's last bucket comes later
                    self._overlapped += spent
                lo, hi = bounds(array.size, self.ranks, self.rank)
                self._done += 1
                self._moved += ((self.ranks - 1) * (hi - lo) + array.size - (hi - lo)) * array.itemsize
                return result
            except contract.ShmError as exc:
                if not self._aborted:     # a call left half done puts the ranks out of step
                    self.abort(f"an earlier all-reduce failed ({str(exc)[:250]})")
                raise

    def counters(self) -> tuple[int, int]:
        with self._lock:
            return self._done, self._moved

    def busy(self) -> tuple[float, float]:
        with self._lock:
            return self._busy, self._overlapped

    def abort(self, why: str = "aborted by the caller", status: int = contract.ABORTED) -> None:
        if self._aborted or self._closed and not self._maps:
            return
        self._why, self._aborted = why, status
        try:
            self._states[self.rank][0] = status
            for b in range(len(self.bucket_bytes)):
                self._wake(self.layout.in_seq(b))
                self._wake(self.layout.out_seq(b))
        except IndexError:      # closed meanwhile (its segment unmapped): nothing left to tell
            pass

    def status(self) -> int:
        return self._aborted

    def peer_ahead(self) -> tuple[int, int, int] | None:
        if not self._lock.acquire(blocking=False):      # a call of mine under way (or a close)
            return None
        try:
            if self._aborted or self._closed:
                return None
            for b in range(len(self.bucket_bytes)):
                index = self.layout.in_seq(b) // 8
                mine = int(self._words[self.rank][index])
                for r in range(self.ranks):
                    theirs = int(self._words[r][index]) if r != self.rank else 0
                    if theirs > mine:
                        return r, b, theirs
            return None
        finally:
            self._lock.release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.abort("the group was closed", contract.CLOSED)
        with self._lock:
            self._unmap()

    # --------------------------------------------------------------- protocol
    def _run(self, b: int, array: np.ndarray, op: str, scale: float, label: str) -> np.ndarray:
        me, n, lay = self.rank, self.ranks, self.layout
        dtype, count = array.dtype, array.size
        k = self._calls[b] = self._calls[b] + 1
        chunks = pipeline_chunks(count, dtype.itemsize, n)
        if chunks:
            return self._run_pipelined(b, k, array, op, scale, label, chunks)
        in_idx, out_idx = lay.in_seq(b) // 8, lay.out_seq(b) // 8
        own = self._maps[me]
        # 1. my input, my descriptor, in_seq = k
        np.frombuffer(own, dtype, count, lay.in_off[b])[:] = array.reshape(-1)
        DESCRIPTOR.pack_into(own, lay.in_seq(b) + 8, count, contract.DTYPES[dtype], OPS[op], scale)
        self._publish(lay.in_seq(b), k)
        self._publish(lay.in_progress(b), (k << 24) | PROGRESS_DONE)      # what a pipelined peer waits on
        # 2. every peer's input; my slice of the result into my `out`
        deadline = time.monotonic() + self.timeout
        for p in range(n):
            if p != me:
                self._wait(p, in_idx, k, "input", deadline, b, label, k)
                self._same_call(p, b, k, count, dtype, op, scale, label)
        result = np.empty(count, dtype)
        self._reduce(b, count, dtype, op, scale, *bounds(count, n, me), result)
        self._publish(lay.out_seq(b), k)
        self._publish(lay.out_progress(b), (k << 24) | PROGRESS_DONE)
        # 3. every rank's slice of the result
        deadline = time.monotonic() + self.timeout
        for p in range(n):
            if p != me:
                self._wait(p, out_idx, k, "result", deadline, b, label, k)
                plo, phi = bounds(count, n, p)
                if phi > plo:
                    result[plo:phi] = np.frombuffer(self._maps[p], dtype, count, lay.out_off(b))[plo:phi]
        return result.reshape(array.shape)

    def _run_pipelined(self, b: int, k: int, array: np.ndarray, op: str, scale: float, label: str,
                       chunks: int) -> np.ndarray:
        """Steps 1-3 chunk by chunk, a stage apart, as the C executor runs a large call
        (shm_allreduce.h): copy in chunk t, reduce t - 1, copy out t - 2."""
        me, n, lay = self.rank, self.ranks, self.layout
        dtype, count, flat = array.dtype, array.size, array.reshape(-1)
        own = self._maps[me]
        mine = np.frombuffer(own, dtype, count, lay.in_off[b])
        DESCRIPTOR.pack_into(own, lay.in_seq(b) + 8, count, contract.DTYPES[dtype], OPS[op], scale)
        result = np.empty(count, dtype)
        per = PIPELINE_BYTES // dtype.itemsize
        slices = [bounds(count, n, p) for p in range(n)]

        def chunk(p: int, j: int) -> tuple[int, int]:
            lo, hi = slices[p]
            start = min(lo + j * per, hi)
            return start, min(start + per, hi)
        for t in range(chunks + 2):
            deadline = time.monotonic() + self.timeout
            if t < chunks:
                for p in range(n):
                    lo, hi = chunk(p, t)
                    mine[lo:hi] = flat[lo:hi]
                self._publish(lay.in_progress(b), (k << 24) | (t + 1))
                if t + 1 == chunks:
                    self._publish(lay.in_seq(b), k)
            if 1 <= t <= chunks:
                for p in range(n):
                    if p != me:
                        self._wait(p, lay.in_progress(b) // 8, (k << 24) | t, "input", deadline, b, label, k)
                        if t == 1:
                            self._same_call(p, b, k, count, dtype, op, scale, label)
                self._reduce(b, count, dtype, op, scale, *chunk(me, t - 1), result)
                self._publish(lay.out_progress(b), (k << 24) | t)
                if t == chunks:
                    self._publish(lay.out_seq(b), k)
            if t >= 2:
                for p in range(n):
                    if p != me:
                        self._wait(p, lay.out_progress(b) // 8, (k << 24) | (t - 1), "result", deadline, b, label,
                                   k)
                        lo, hi = chunk(p, t - 2)
                        result[lo:hi] = np.frombuffer(self._maps[p], dtype, count, lay.out_off(b))[lo:hi]
        return result.reshape(array.shape)

    def _same_call(self, p: int, b: int, k: int, count: int, dtype, op: str, scale: float, label: str) -> None:
        """Peer p's descriptor of call k is mine, else ShmMismatch."""
        theirs = DESCRIPTOR.unpack_from(self._maps[p], self.layout.in_seq(b) + 8)
        if theirs[:3] != (count, contract.DTYPES[dtype], OPS[op]) or \
                struct.pack("<d", theirs[3]) != struct.pack("<d", scale):
            raise contract.ShmMismatch(
                f"rdmatensor shm all-reduce of {label} (bucket {b}, call {k}): rank {p} all-reduces "
                f"{theirs[0]} elements of {_dtype_name(theirs[1])} ({_op_name(theirs[2])}, scale "
                f"{theirs[3]:g}), rank {self.rank} {count} elements of {dtype} ({op}, scale {scale:g}): every "
                "rank must call the same all-reduces in the same order")

    def _reduce(self, b: int, count: int, dtype, op: str, scale: float, lo: int, hi: int, result) -> None:
        """Elements [lo, hi) of the result, the ranks' inputs folded in rank order and
        scaled, into my `out` and into `result`."""
        if hi <= lo:
            return
        lay = self.layout
        acc = result[lo:hi]
        acc[:] = np.frombuffer(self._maps[0], dtype, count, lay.in_off[b])[lo:hi]
        combine = _UFUNCS[op]
        for p in range(1, self.ranks):
            combine(acc, np.frombuffer(self._maps[p], dtype, count, lay.in_off[b])[lo:hi], out=acc)
        f = contract.factor(op, scale, self.ranks)
        if f != 1.0:
            scaling.scale_into(acc, acc, f)
        np.frombuffer(self._maps[self.rank], dtype, count, lay.out_off(b))[lo:hi] = acc

    def _publish(self, offset: int, value: int) -> None:
        """My word at `offset` = value, then a wake for a C peer sleeping on it."""
        self._words[self.rank][offset // 8] = value
        self._wake(offset)

    def _wait(self, peer: int, index: int, k: int, what: str, deadline: float, b: int, label: str,
              call: int) -> None:
        """Until the peer's word `index` reaches k (a sequence number, or a progress word's
        value); errors name the call."""
        words = self._words[peer]
        if words[index] >= k:
            return
        start = time.perf_counter()
        while time.perf_counter() - start < 50e-6:
            if words[index] >= k:
                return
        delay = 20e-6
        while True:
            if words[index] >= k:
                return
            if self._aborted:
                raise error_for(self._aborted, self._failed(b, label))
            state = int(self._states[peer][0])
            if state == contract.MISMATCH:
                raise contract.ShmMismatch(
                    f"rdmatensor shm all-reduce of {label} (bucket {b}, call {call}): rank {peer} found that the ranks "
                    f"called different collectives while rank {self.rank} waited for its {what}")
            if state:
                raise contract.ShmPeerAborted(
                    f"rdmatensor shm all-reduce of {label} (bucket {b}, call {call}): rank {peer} aborted its group "
                    f"(status {state}) while rank {self.rank} waited for its {what}")
            if time.monotonic() > deadline:
                raise contract.ShmTimeout(
                    f"rdmatensor shm all-reduce of {label} (bucket {b}, call {call}): rank {peer} did not arrive "
                    f"within {self.timeout:g} s (rank {self.rank} waited for its {what})")
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def _wake(self, offset: int) -> None:
        """Wake whatever C peer sleeps on my word at `offset`."""
        if _LIBC is not None and _SYS_FUTEX is not None and self._maps:
            _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self._base + offset), ctypes.c_int(_FUTEX_WAKE),
                          ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))

    def _failed(self, b: int, label: str) -> str:
        return f"rdmatensor shm all-reduce of {label} (bucket {b}) not done: {self._why}"

    def _unmap(self) -> None:
        self._words, self._states = [], []
        for m in self._maps:
            try:
                m.close()
            except BufferError:     # a view still held (a traceback's frame): unmapped when it goes
                pass
        self._maps = []


def _dtype_name(code: int) -> str:
    return next((str(d) for d, c in contract.DTYPES.items() if c == code), "an unknown dtype")


def _op_name(code: int) -> str:
    return next((o for o, c in OPS.items() if c == code), "an unknown op")

