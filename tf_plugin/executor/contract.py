"""The executor's contract: what the collective engine and TensorFlow's ops ask
of whatever runs the ring all-reduce, and what they may count on.

Python plans, the executor executes. The planner (tf_plugin.core) turns what
the job calls into an analyzed plan and a session; the executor runs that
plan, step after step: the writes, the waits, the sums, the copies, the
communication thread's rounds. Today the executor is Python (ring.py,
comm_thread.py); a compiled one, driven by a schedule compiled once from the
same plan and running without the GIL, is to implement these same two
classes, so that callers never tell the two apart, and a build without it
keeps the Python twin (chosen as rdmatensor.native chooses its compiled parts).

Two parts:

- `Ring`: one all-reduce program over one session and one analyzed plan (a
  tensor set's buckets). It runs a bucket's ring on the calling thread, or
  every bucket in lockstep, and can hand buckets to its own communication
  thread (the in-graph path of graph/ring_tape.py).
- `Rounds`: the communication thread. It runs rounds (one all-reduce of one
  tensor set: a step's gradients) in the order they are opened, a round's
  buckets in the plan's order, whatever order TensorFlow hands them over in.
  The engine (core/collectives.py) keeps one for every tensor set of the job,
  with the rings as what it runs.

Threads: "TensorFlow's thread" is whichever thread runs the op that calls
(a launch or wait op inside tf.function, or the eager caller); "the
communication thread" is the one `Rounds` starts. Errors raised are
rdmatensor's (rdmatensor.errors): Timeout, UsageError, and whatever the
session raises (PeerLost, a closed session's error...), handed unchanged to
the caller that waits for the result.

The plan the executor reads is the planner's Analysis (core/layout.py); the
protocols below say which of its fields it reads, so that the executor does
not import the planner.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, Sequence

import numpy as np


# ------------------------------------------------------- what it reads of the plan
class PlannedVariable(Protocol):
    key: str                         # its name in the plan's tensor names
    shape: tuple                     # its gradient's shape


class PlannedBucket(Protocol):
    """One all-reduce's payload: `members` (variable key, offset, elements) laid
    end to end, 64-byte aligned, in `size` elements of `dtype`."""
    key: str                         # the ring's chunks are named after it (schedule.ring_name)
    dtype: np.dtype
    members: tuple
    size: int

    def split(self, flat: np.ndarray, shapes: dict) -> list[np.ndarray]:
        """Each member's view of the bucket's flat array, in its shape."""


class PlannedHierarchy(Protocol):
    """Ranks grouped by host: a host's ring, the ring across hosts, the host's ring again."""

    def local(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s host, in ring order."""

    def cross(self, rank: int) -> tuple[int, ...]:
        """The ranks at `rank`'s local position on every host, in ring order."""


class AnalyzedPlan(Protocol):
    """What the executor reads of an analyzed plan (core/layout.Analysis). The
    session was connected over the plan's tensors, which name every chunk of
    every ring (schedule.py)."""
    workers: int                           # the ranks of the ring
    variables: Sequence[PlannedVariable]
    buckets: Sequence[PlannedBucket]       # in the order backprop completes them
    hierarchy: PlannedHierarchy | None     # None: one flat ring over every rank


# ------------------------------------------------------------------- the ring
class Ring(ABC):
    """The all-reduce of one analyzed plan's buckets over one session.

    Made with (session, analysis, meter=None, average=True, combine=np.add,
    scale=None): `session` is rdmatensor's, connected over the plan; `meter`
    (core/meter.Meter) is where it counts its time and copies; `combine` is
    how two ranks' values make one (np.add, np.minimum, np.maximum,
    np.multiply); the combined values are multiplied by `scale` (Horovod's
    postscale, as core/scaling.py computes it), by default 1/N when
    `average`. A ring belongs to its session: the engine makes a new one
    when it replaces the session.

    Attributes callers read: session, analysis, meter, rank (this rank),
    size (the ring's ranks), shapes (variable key -> gradient shape).

    Results are flat, 64-byte aligned output buffers that TensorFlow takes
    with no copy; the ring leases one again only once TensorFlow let go of
    every view of it and no write still reads it. Inputs are read where they
    are, never copied together, and are free for the caller to reuse once the
    call that took them returned (or, handed to the communication thread,
    once that bucket's result is ready)."""

    session: Any
    analysis: AnalyzedPlan
    meter: Any
    rank: int
    size: int
    shapes: dict

    @abstractmethod
    def allreduce_arrays(self, keys: Sequence[str], arrays: Sequence[np.ndarray],
                         average: bool = True) -> list[np.ndarray]:
        """Every bucket at once, in lockstep, on the calling thread (eager
        training: TensorFlow's thread): the arrays (named by `keys` as in the
        plan) averaged (or summed, average=False) over the ranks, one result per
        array in order, each a view of its bucket's output. An array the plan
        does not all-reduce comes back as zeros. Raises what the session
        raises (a lost peer, a timeout); the ring is then of no further use."""

    @abstractmethod
    def reduce_bucket(self, j: int, arrays: Sequence[np.ndarray], tag: int = 0) -> np.ndarray:
        """Bucket j's ring alone, from its members' arrays in order, on the
        calling thread (the communication thread runs it as a round's `run`):
        its flat output (Bucket.split gives the members), combined and scaled
        as the ring was made. Every write carries `tag` and only values with
        it are taken (the engine's call number). Raises what the session
        raises."""

    @abstractmethod
    def describe(self, j: int) -> dict:
        """What bucket j holds, for the time line and errors: bucket_key,
        tensors, bytes. Called on either thread; raises nothing."""

    @abstractmethod
    def launch(self, j: int, arrays: Sequence[np.ndarray]) -> int:
        """Hand bucket j's arrays to the ring's own communication thread
        (started on first use, with the time line RDMATENSOR_TIMELINE asks
        for), on TensorFlow's thread (the launch op), and return at once: the
        round's number, for collect. Raises UsageError once closed."""

    @abstractmethod
    def collect(self, j: int, number: int | None = None) -> np.ndarray:
        """Bucket j's result of round `number` (launch's; None: the oldest one
        not yet collected), on TensorFlow's thread (the wait op): blocks until
        its ring is done. Raises the ring's error (or the round's Timeout), or
        UsageError for a bucket not launched or already collected (the Python
        twin raises AttributeError before its first launch)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the communication thread, if one was started; idempotent, from
        any thread. Rounds not finished fail with UsageError."""


# ------------------------------------------------------- the communication thread
class Rounds(ABC):
    """The communication thread: rounds in the order they are opened, a round's
    buckets in the plan's order. Every rank opens the same rounds in the same
    order (collectives run in program order), so every rank runs the same
    rings in the same sequence.

    Made with (rank, timeout, meter=None, timeline=None): `timeout` bounds
    every wait for a bucket to be handed over and every drain; `meter` gets
    each finished round's time (Meter.add_round); `timeline` (core/timeline,
    or None) gets its events. `timeline` is an attribute the engine may
    replace or clear between rounds (start_timeline, stop_timeline).

    A bucket not handed over within the timeout fails its round with Timeout;
    a ring's error fails its round (every bucket of it, even those handed
    over later, raises it); later rounds run as usual."""

    timeline: Any

    @abstractmethod
    def launch(self, key: Any, j: int, arrays: Sequence[np.ndarray], buckets: int,
               run: Callable[[int, Sequence[np.ndarray]], Any], describe: Callable[[int], dict]) -> int:
        """Hand bucket j of a round of `key` (of `buckets` buckets) over, on
        TensorFlow's thread, and return at once: the round's number. A round
        is opened when the last one of `key` already has bucket j. Later, on
        the communication thread, `run(j, arrays)` is the bucket's ring and
        its return value the result; `describe(j)` says what the bucket holds.
        The arrays are not touched once run returned. Raises UsageError once
        closed."""

    @abstractmethod
    def collect(self, key: Any, j: int, number: int | None = None) -> Any:
        """Bucket j's result of round `number` of `key` (None: the oldest round
        with bucket j uncollected), on TensorFlow's thread: blocks until its
        ring ran. A result only ever reaches the call that launched it. Raises
        the round's error, or UsageError for a bucket never launched or
        already collected."""

    @abstractmethod
    def drain(self) -> None:
        """Block until every round opened so far finished (before the engine
        replaces the session under the rings). Raises Timeout after the
        timeout, UsageError once closed."""

    @abstractmethod
    def idle(self) -> bool:
        """Whether no round waits for its buckets or runs (the engine's
        divergence watchdog asks, from its own thread). Never blocks long."""

    @abstractmethod
    def close(self) -> None:
        """Stop the thread and close the time line; rounds not finished fail
        with UsageError. Idempotent, from any thread but the communication
        thread itself."""
