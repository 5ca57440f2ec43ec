"""The communication thread: one per rank, it runs every bucket's ring while
TensorFlow goes on with backprop. The executor's Python twin of contract.Rounds.

TensorFlow hands a bucket over as soon as its gradients exist (launch), and
later asks for its result (collect). The thread takes the *rounds* (one
all-reduce of one tensor set: a step's gradients) in the order they were
opened, and a round's buckets in the plan's order, whatever order TensorFlow
hands them over in. Every rank opens the same rounds in the same order (the
collectives run in program order), so every rank runs the same rings in the
same sequence: no two ranks ever wait on each other in different rings.

Nothing here is left to hang: a bucket not handed over within the timeout
(the step that launched its round died half-way) fails the round with
`Timeout`, and a ring's error fails its round: every bucket of it, including
those handed over later, raises that error. Later rounds run as usual. This
module does not import TensorFlow: what a ring is, it learns from `run`.
"""
from __future__ import annotations

import collections
import threading
import time

from rdmatensor import Timeout, UsageError

from ..core.meter import Meter
from ..core.timeline import COMMUNICATION, TENSORFLOW, Timeline
from .contract import Rounds


class Round:
    """One all-reduce: buckets as they are handed over, results as their rings end."""

    def __init__(self, key, number: int, buckets: int, run, describe):
        self.key, self.number, self.run, self.describe = key, number, run, describe
        self.inputs: list = [None] * buckets          # each bucket's arrays, until its ring has run
        self.ready: list = [None] * buckets           # when it was handed over (perf_counter)
        self.results: list = [None] * buckets
        self.done = [threading.Event() for _ in range(buckets)]
        self.collected = [False] * buckets
        self.error: BaseException | None = None

    @property
    def handed(self) -> int:
        return sum(t is not None for t in self.ready)

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error
        for event in self.done:
            event.set()


class CommThread(Rounds):
    """Rings on a background thread, in the order rounds are opened.

    launch(key, j, arrays, buckets, run, describe) hands bucket j of the round of
    `key` over (opening a round when the last one of `key` already has bucket j) and returns the round's number;
    `run(j, arrays)` is bucket j's ring, returning its outputs, and
    `describe(j)` says what the bucket holds (for errors and the time line).
    collect(key, j, number) waits for bucket j of that round and returns its
    outputs: a result only ever reaches the call that launched it, even when
    an earlier call of the same key failed before collecting all its buckets
    (without a number: the oldest round of `key` with bucket j uncollected)."""

    def __init__(self, rank: int, timeout: float, meter: Meter | None = None, timeline: Timeline | None = None):
        self.rank, self.timeout = rank, timeout
        self.meter = meter or Meter()
        self.timeline = timeline
        self._cond = threading.Condition()
        self._queue: collections.deque[Round] = collections.deque()   # rounds not finished, in order
        self._open: dict = {}                                          # key -> its round still being handed over
        self._uncollected: dict = {}                                   # key -> its rounds with results to collect
        self._rounds = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------ TensorFlow's side
    def launch(self, key, j: int, arrays: list, buckets: int, run, describe) -> int:
        with self._cond:
            self._check()
            rnd = self._open.get(key)
            if rnd is None or rnd.ready[j] is not None:
                rnd = Round(key, self._rounds, buckets, run, describe)
                self._rounds += 1
                self._open[key] = rnd
                self._queue.append(rnd)
                rounds = self._uncollected.setdefault(key, collections.deque())
                for old in [r for r in rounds if r.error is not None]:
                    rounds.remove(old)      # a failed round whose step gave up on it: its error was raised
                rounds.append(rnd)
            rnd.inputs[j], rnd.ready[j] = arrays, time.perf_counter()
            if rnd.handed == len(rnd.ready):
                del self._open[key]
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"rdmatensor-comm-r{self.rank}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if self.timeline is not None:
            self.timeline.instant(f"ready {j}", TENSORFLOW, rnd.ready[j], round=rnd.number, bucket=j,
                                  **describe(j))
        return rnd.number

    def collect(self, key, j: int, number: int | None = None) -> list:
        with self._cond:
            rounds = self._uncollected.get(key, ())
            rnd = next((r for r in rounds if not r.collected[j] and number in (None, r.number)), None)
            if rnd is None:
                which = "" if number is None else f" of round {number}"
                raise UsageError(f"rank {self.rank}: bucket {j}{which} of {key!r} is collected but was never "
                                 f"launched, or was collected already")
            rnd.collected[j] = True
            if all(rnd.collected):
                rounds.remove(rnd)
        t0 = time.perf_counter()
        rnd.done[j].wait()
        if self.timeline is not None:
            self.timeline.span(f"wait {j}", TENSORFLOW, t0, time.perf_counter(), round=rnd.number, bucket=j)
        if rnd.error is not None:
            raise rnd.error
        out, rnd.results[j] = rnd.results[j], None
        return out

    def drain(self) -> None:
        """Wait until every round opened so far has finished (before the session
        under the rings is replaced)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._queue:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise Timeout(f"rank {self.rank}: all-reduces still running after {self.timeout:.0f} s: "
                                  f"{[r.key for r in self._queue]}")
            self._check()

    def idle(self) -> bool:
        """No round waiting for its buckets or running (core/checked_collectives.py's divergence watchdog)."""
        with self._cond:
            return not self._queue

    def close(self) -> None:
        """Stop the thread; rounds not finished fail (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(self.timeout)
        with self._cond:
            for rnd in self._queue:
                rnd.fail(UsageError(f"rank {self.rank}: the all-reduce of {rnd.key!r} was cut off by shutdown"))
            self._queue.clear()
            self._open.clear()
        if self.timeline is not None:
            self.timeline.close()

    def _check(self) -> None:
        if self._closed:
            raise UsageError(f"rank {self.rank}: the communication thread is closed")

    # ------------------------------------------------------ the thread's side
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                rnd = self._queue[0]
            self._run(rnd)
            with self._cond:
                if self._queue and self._queue[0] is rnd:
                    self._queue.popleft()
                # A failed round fails alone: its run() already reset the generation with
                # every rank (core/collectives.py), so later rounds meet their peers as usual.
                self._cond.notify_all()

    def _run(self, rnd: Round) -> None:
        spans, cpu = [], 0.0
        try:
            for j in range(len(rnd.inputs)):
                arrays = self._handed_over(rnd, j)
                t0, c0 = time.perf_counter(), time.thread_time()
                rnd.results[j] = rnd.run(j, arrays)
                t1 = time.perf_counter()
                cpu += time.thread_time() - c0
                rnd.inputs[j] = None               # TensorFlow may reuse those buffers now
                rnd.done[j].set()
                spans.append((t0, t1))
                if self.timeline is not None:
                    self.timeline.span(f"ring {j}", COMMUNICATION, t0, t1, round=rnd.number, bucket=j,
                                       **rnd.describe(j))
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter of the round
            rnd.fail(exc)
        finally:
            for j in range(len(rnd.inputs)):
                rnd.inputs[j] = None
        if spans and rnd.error is None:
            backprop_end = max(rnd.ready)          # the last bucket handed over: every gradient exists
            self.meter.add_round(sum(t1 - t0 for t0, t1 in spans),
                                 sum(max(0.0, min(t1, backprop_end) - t0) for t0, t1 in spans), cpu)
        if self.timeline is not None:
            self.timeline.flush()

    def _handed_over(self, rnd: Round, j: int) -> list:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while rnd.ready[j] is None:
                if self._closed:
                    raise UsageError(f"rank {self.rank}: shut down while waiting for bucket {j} of {rnd.key!r}")
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise Timeout(f"rank {self.rank}: bucket {j} of {rnd.key!r} ({rnd.describe(j)}) was not "
                                  f"handed over within {self.timeout:.0f} s of the previous one: the step that "
                                  f"launched this all-reduce did not finish its backward pass")
            return rnd.inputs[j]
