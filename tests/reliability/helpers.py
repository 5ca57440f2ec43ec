"""Shared by the reliability tests: a pair of ranks kept alive while a test
attacks them, resource snapshots, and canary-filled memory."""
from __future__ import annotations

import gc
import os
import queue
import subprocess
import threading
import time
from concurrent.futures import Future

import numpy as np

from rdmatensor import connect

from ..support.ranks import TOKEN, free_ports

CANARY = 0xA5


class LivePair:
    """Ranks 0 and 1 of `plan`, connected in two threads of this process and
    kept open until close(); run(fn0, fn1) executes on both ranks' threads.

    `start` lists the ranks to start now (start_rank() brings up the others
    later, e.g. to attack rank 1 while it waits for rank 0's Exchange)."""

    def __init__(self, plan, provider: str, timeout: float = 10.0, token: str = TOKEN,
                 start=(0, 1)):
        self.plan, self.provider, self.timeout, self.token = plan, provider, timeout, token
        self.peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(free_ports(2))}
        self.sessions: dict = {}
        self.errors: dict = {}
        self._jobs = {r: queue.Queue() for r in (0, 1)}
        self._ready = {r: threading.Event() for r in (0, 1)}
        self._threads: dict = {}
        for r in start:
            self.start_rank(r)
        if len(start) == 2:
            for r in start:
                self.wait_ready(r)

    def start_rank(self, r: int) -> None:
        t = threading.Thread(target=self._rank, args=(r,), daemon=True, name=f"livepair-rank{r}")
        self._threads[r] = t
        t.start()

    def wait_ready(self, r: int, timeout: float | None = None) -> None:
        if not self._ready[r].wait(timeout or self.timeout + 10):
            raise AssertionError(f"rank {r} did not connect")
        if r in self.errors:
            raise AssertionError(f"rank {r} failed to connect: {self.errors[r]!r}") from self.errors[r]

    def _rank(self, r: int) -> None:
        try:
            with connect(r, self.peers, self.plan, provider=self.provider, token=self.token,
                         timeout=self.timeout) as s:
                self.sessions[r] = s
                self._ready[r].set()
                while True:
                    job = self._jobs[r].get()
                    if job is None:
                        return
                    fn, fut = job
                    try:
                        fut.set_result(fn(s))
                    except BaseException as exc:  # noqa: BLE001 - handed to the test
                        fut.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001
            self.errors[r] = exc
        finally:
            self._ready[r].set()

    def submit(self, r: int, fn) -> Future:
        fut: Future = Future()
        self._jobs[r].put((fn, fut))
        return fut

    def run(self, fn0, fn1, timeout: float = 60.0):
        """fn0(session0) and fn1(session1) at once; returns both results."""
        f0, f1 = self.submit(0, fn0), self.submit(1, fn1)
        return f0.result(timeout), f1.result(timeout)

    def close(self) -> None:
        for r in self._threads:
            self._jobs[r].put(None)
        for t in self._threads.values():
            t.join(30)
            assert not t.is_alive(), "a rank did not close"


def rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# gRPC's event engine grows its worker pool when every worker is busy (a loaded
# machine) and reclaims an extra worker only after it idled 20 s
# (kIdleThreadLimit in its work_stealing_thread_pool.cc): a pool that grew is
# gRPC's to shrink, not a thread this project left behind.
GRPC_POOL = "event_engine"


def task_count() -> int:
    """This process's OS threads, gRPC's event-engine workers aside."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() != GRPC_POOL
        except OSError:                      # a thread that ended meanwhile
            pass
    return count


def shm_mappings() -> list[str]:
    """rdmatensor segments this process still has mapped."""
    from rdmatensor.memory import mapped_segments
    return mapped_segments()


def snapshot() -> dict:
    gc.collect()
    return {"fds": fd_count(), "threads": threading.active_count(), "tasks": task_count(),
            "shm_maps": len(shm_mappings())}


def rss_settled_kib(limit_kib: int, within: float = 5.0) -> int:
    """RSS once freed memory went back to the system (gc, malloc_trim), waiting up
    to `within` seconds for it to fall under `limit_kib`: a leak stays, a
    transient peak does not (a failed setup can hold one for under a second)."""
    import ctypes
    trim = ctypes.CDLL(None).malloc_trim
    deadline = time.monotonic() + within
    while True:
        gc.collect()
        trim(0)
        rss = rss_kib()
        if rss < limit_kib or time.monotonic() > deadline:
            return rss
        time.sleep(0.1)


def rdma_resources(kinds=("qp", "mr", "cq", "pd")) -> dict[str, int]:
    """Objects the kernel's RDMA devices hold per kind, as `rdma res show KIND` lists them."""
    out = {}
    for kind in kinds:
        res = subprocess.run(["rdma", "res", "show", kind], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        out[kind] = sum(1 for line in res.stdout.splitlines() if line.strip())
    return out


def settle(baseline: dict, within: float = 5.0) -> dict:
    """Wait (closing threads take a moment) until no count exceeds `baseline`; the last snapshot."""
    deadline = time.monotonic() + within
    while True:
        now = snapshot()
        if all(now[k] <= baseline[k] for k in baseline) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def canary_arena(arena) -> np.ndarray:
    """Fill an arena with canary bytes; returns the expected contents to update."""
    arena.buf[:] = CANARY
    return np.full(arena.size, CANARY, np.uint8)


def assert_untouched(arena, expected: np.ndarray, what: str = "arena") -> None:
    diff = np.flatnonzero(arena.buf != expected)
    assert diff.size == 0, (f"{what}: {diff.size} bytes changed that no accepted write covers, "
                            f"first at offset {diff[0]}")
