"""Checks on what the ranks call: a broken or hostile script gets a typed error
naming the tensor and the rank, never a hang or a wrong result.

CheckedCollectives is the Collectives of every Horovod-API rank:

- Errors name the call. Whatever a collective raises is raised again, as the
  same class, saying which collective, which tensor and which rank: a
  RecvTimeout on the bootstrap's 'boot/r1/r0' becomes "allreduce of 'lonely'
  on rank 0: rank 1 did not take part within the timeout (...)".
- Divergence. Ranks that call different collectives (a tensor whose shape or
  dtype changed on one rank only; a collective one rank skips) would each
  wait for the other: one proposes a new tensor set over the bootstrap
  channel while the other moves the tensors of a set already planned, and
  writes some of them to the proposer. The proposer sees it exactly: it has
  no all-reduce left to run (the communication thread is idle) and yet a
  peer's tensors of a planned set lie unread in its slots, which never
  happens to ranks in step (a rank proposes only after every collective
  before it, in program order, has taken in what it needed). After a short
  grace the proposer fails and closes its sessions with PlanMismatch naming
  both calls; the other rank, whose wait then ends with that peer gone,
  finds the peer's proposal unread in its own bootstrap slot and raises the
  same PlanMismatch instead of a bare PeerLost.
- Non-finite values (optional: RDMATENSOR_CHECK_FINITE=1, or
  init(check_finite=True)). Each rank notes which of its floating inputs of
  an all-reduce hold a NaN or Inf and checks the reduced outputs. A NaN or
  Inf in any rank's input reaches every rank's output, so every rank raises
  NonFiniteValue in the same call, naming the tensor; the rank whose value
  held it says so (`peer` is itself), the others that their own was finite.
  The sessions stay usable: a script may skip that step.

This module does not import TensorFlow.
"""
from __future__ import annotations

import contextlib
import logging
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from rdmatensor import PlanMismatch, RdmaTensorError, Timeout

from ..errors import NonFiniteValue
from . import settings
from .collectives import TAGS, Collectives
from .tensor_sets import describe, entries_of

GRACE = 2.0                 # seconds a peer's tensors may lie unread before the ranks are declared diverged
WATCH_EVERY = 0.25
log = logging.getLogger("rdmatensor")
STATUS_TIMEOUT = 5.0        # seconds a stalled rank waits for a peer to say how far it got


@dataclass
class Stall:
    """Horovod's stall check, as the environment sets it (settings.py)."""
    check_time: float | None        # None: off
    shutdown_time: float            # 0: a stalled call waits until the timeout
    warned: int | None = None       # the call last warned about
    missing: list = field(default_factory=list)

    @classmethod
    def from_env(cls) -> "Stall":
        off = settings.flag(settings.STALL_CHECK_DISABLE)
        return cls(None if off else settings.seconds(settings.STALL_CHECK_TIME),
                   settings.seconds(settings.STALL_SHUTDOWN_TIME))
WHY = ("the ranks diverged: a tensor whose shape or dtype changed on some ranks only, or a collective "
       "called on some ranks only")


def finite_check_from_env() -> bool:
    return os.environ.get("RDMATENSOR_CHECK_FINITE", "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Planning:
    """This rank proposing new tensor sets for call `number` (kind, op, names, arrays each)."""
    requests: list
    number: int
    generation: int
    since: float = field(default_factory=time.monotonic)

    @property
    def entries(self) -> list[dict]:
        return [e for kind, op, names, arrays in self.requests for e in entries_of(kind, op, names, arrays)]


class CheckedCollectives(Collectives):
    def __init__(self, *args, check_finite: bool = False, ranks: list[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.check_finite = check_finite
        self.ranks = ranks or list(range(self.size))      # each member's rank in the job, for messages
        self.stall = Stall.from_env()
        if self.bootstrap.session is not None:
            self.bootstrap.session.serve_status(lambda: json.dumps({"calls": self.calls}))
        self.grace = min(GRACE, self.timeout / 2)
        self._planning: Planning | None = None
        self._local_bad: dict = {}          # (set key, bucket) -> this rank's inputs holding NaN or Inf
        self._stop = threading.Event()
        self._wake = threading.Event()      # set as a call of the Python path begins (or on close)
        self._in_flight = 0                 # calls of the Python path under way on this rank
        self._flight = threading.Lock()
        self._watchdog = None
        if self.size > 1:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"rdmatensor-divergence-{self.rank}")
            self._watchdog.start()

    # ----------------------------------------------------------- the calls
    def _next_generation(self, number, missing, failed=None, cause=False):
        # Marked only while this rank proposes, never while it looks up a planned set: a
        # faster peer's values of that call may already lie in its slots.
        if failed is not None:
            return super()._next_generation(number, missing, failed, cause)
        self._planning = Planning([request for _, request in missing], number, self.generations)
        self._wake.set()
        try:
            return super()._next_generation(number, missing, failed, cause)
        finally:
            self._planning = None

    def attempt(self, number: int, body, entries: list):
        with self._flight:
            self._in_flight += 1
        self._wake.set()
        try:
            return super().attempt(number, body, entries)
        finally:
            with self._flight:
                self._in_flight -= 1

    def launch(self, group, j: int, arrays: list) -> int:
        kind, op, names, described = group.request
        if self.check_finite:
            self._local_bad[(group.key, j)] = self._non_finite(self._members(group, j), arrays)
        with self._naming(kind, op, names, described):
            return super().launch(group, j, arrays)

    def collect(self, group, j: int, number: int | None = None) -> np.ndarray:
        kind, op, names, described = group.request
        with self._naming(kind, op, names, described):
            out = super().collect(group, j, number)
        if self.check_finite:
            self._check_outputs(group, j, group.members(j, out))
        return out

    def allreduce(self, names, arrays, op: str = "average", prescale: float = 1.0, postscale: float = 1.0,
                  scatter: bool = False):
        with self._naming("reducescatter" if scatter else "allreduce", op, names, arrays):
            return super().allreduce(names, arrays, op, prescale, postscale, scatter)

    def broadcast(self, names, arrays, root: int):
        with self._naming("broadcast", str(root), names, arrays):
            return super().broadcast(names, arrays, root)

    def allgather(self, names, arrays):
        with self._naming("allgather", "", names, arrays):
            return super().allgather(names, arrays)

    def alltoall(self, name, array, splits):
        with self._naming("alltoall", "", [name], [array]):
            return super().alltoall(name, array, splits)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=2)
        super().close()

    # ------------------------------------------------------- naming errors
    @contextlib.contextmanager
    def _naming(self, kind: str, op: str, names, arrays):
        """Raise whatever the collective raises again, saying which call it was."""
        try:
            yield
        except RdmaTensorError as exc:
            if exc.tensor is not None and exc.tensor in names:
                raise                                   # named already
            what = f"{kind} of {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            if isinstance(exc, Timeout) and exc.peer is not None:
                message = f"{what} on rank {self.rank}: rank {exc.peer} did not take part within the timeout ({exc})"
            else:
                message = f"{what} on rank {self.rank}: {exc}"
            raise type(exc)(message, peer=exc.peer, tensor=names[0]) from exc

    # ---------------------------------------------------------- non-finite
    @staticmethod
    def _members(group, j: int) -> list[str]:
        names = group.request[2]
        return [names[int(key)] for key, _, _ in group.buckets[j].members]

    @staticmethod
    def _non_finite(names, arrays) -> list[str]:
        return [n for n, a in zip(names, arrays, strict=True)
                if np.asarray(a).dtype.kind in "fc" and not np.isfinite(a).all()]

    def _check_outputs(self, group, j: int, outputs) -> None:
        bad = self._non_finite(self._members(group, j), outputs)
        if not bad:
            return
        tensor = bad[0]
        if tensor in self._local_bad.get((group.key, j), ()):
            raise NonFiniteValue(f"allreduce of {tensor!r}: rank {self.rank}'s value holds NaN or Inf",
                                 peer=self.rank, tensor=tensor)
        raise NonFiniteValue(f"allreduce of {tensor!r}: the reduced value holds NaN or Inf from another rank "
                             f"(rank {self.rank}'s own value is finite)", tensor=tensor)

    # ---------------------------------------------------------- divergence
    def _watch(self) -> None:
        seen: dict = {}                      # a peer's exchange message -> when it was first seen unread
        while not self._stop.is_set():
            self._wake.clear()
            if not self._in_flight and self._planning is None:
                self._wake.wait()            # nothing to judge: no Python while only native steps run
                continue
            if self._stop.wait(WATCH_EVERY):
                break
            if not self._in_flight and self._planning is None:     # the call ended meanwhile
                continue
            try:
                error = self._divergence(seen)
                stalled = None if error else self._stalled()
            except RdmaTensorError:          # a session closing under the watchdog: nothing to judge
                continue
            if stalled is not None:          # as Horovod's stall shutdown: this rank's collectives end
                for session in (self.session, self.bootstrap.session):
                    if session is not None and not session.closed:
                        session.abort(stalled)
                continue
            session = self.session
            if error is not None and session is not None and not session.closed:
                self.seen = (self.generations, str(error))     # the reset's exchange tells every rank why
                session.abort(error)         # every call waiting on it raises `error` and resets
                session.close()              # and every peer's wait on this rank ends

    def _divergence(self, seen: dict) -> PlanMismatch | None:
        """Proof that the ranks called different collectives, or None:

        - a value tagged with the number of a call in progress here, in the
          slot of another tensor set (the peer's call of that number is another);
        - a value tagged with the number of the call this rank is planning (the
          peer runs a planned set while this rank proposes a new one);
        - a peer's proposal for the number of a call that moves values here
          (the peer plans while this rank runs a planned set);
        - a peer's object exchange unread for the grace period while a call
          moves values here;
        - a peer waiting for the grace period in a native all-reduce this rank
          has not begun, while this rank plans or moves values (_native_ahead)."""
        session, planning, active = self.session, self._planning, dict(self._active)
        if planning is not None or active:       # a native all-reduce's peer has no session to look at
            ahead = self._native_ahead(seen, planning.entries if planning is not None else
                                       next(iter(active.values()))[2])
            if ahead is not None:
                return ahead
        if session is None or session.closed or (planning is None and not active):
            return None
        if planning is not None and planning.generation != self.generations:
            planning = None           # its new generation is connected: values for its call are expected
        for name, tag in session.arrived():
            index = _set_index(name)
            mine = active.get(tag)
            if mine is not None and index != mine[1]:
                return self._mismatch(session.plan.specs[name].src, self._order[index].entries, mine[2], False)
            if planning is not None and tag == planning.number % TAGS and mine is None:
                return self._mismatch(session.plan.specs[name].src, self._order[index].entries,
                                      planning.entries, True)
        if planning is not None or not active:
            return None
        numbers = {number: entries for number, _, entries in active.values()}
        for src in self.bootstrap.unread():
            message = self.bootstrap.peek(src)
            if message is None:
                continue
            tag, data = message
            if tag == "plan":
                theirs = json.loads(data)
                if theirs.get("call") in numbers and not theirs.get("failed"):
                    return self._mismatch(src, [e for s in theirs["sets"] for e in s], numbers[theirs["call"]], True,
                                          mine_planned=True)
            else:
                first = seen.setdefault((src, tag, len(data)), time.monotonic())
                if time.monotonic() - first > self.grace:
                    return PlanMismatch(f"rank {src} is in the exchange {tag!r} while rank {self.rank} is in "
                                        f"{describe(next(iter(numbers.values())))}: {WHY}", peer=src)
        return None

    def _native_ahead(self, seen: dict, entries: list) -> PlanMismatch | None:
        """A peer that has waited the grace period in a native all-reduce (a traced
        step's, graph/native_allreduce.py) which this rank has not begun, while this
        rank makes a call of the Python path: the ranks diverged. Its group is aborted
        here, so that the peer's wait ends now rather than at its timeout, and both
        ranks reset at their next call (Collectives.mend)."""
        ahead = self.mender.ahead(self.attached) if self.mender is not None else []
        now, current = time.monotonic(), set()
        for group, (peer, bucket, call) in ahead:
            key = ("native", group.name, peer, bucket, call)
            current.add(key)
            if now - seen.setdefault(key, now) > self.grace:
                error = PlanMismatch(f"rank {self.ranks[peer]} has waited {self.grace:g} s in a native all-reduce "
                                     f"(bucket {bucket} of group {group.name}, its call {call}) while rank "
                                     f"{self.ranks[self.rank]} is in {describe(entries)}: {WHY}", peer=peer)
                self.mender.diverged(group, str(error))
                return error
        for key in [k for k in seen if k[0] == "native" and k not in current]:
            del seen[key]
        return None

    def _stalled(self) -> Timeout | None:
        """Horovod's stall check: once the oldest call waiting here has waited the stall
        time, ask every peer how many calls it began (one control call each, once per
        call) and warn, naming the ranks that have not called it; past the shutdown
        time, the error that ends the call."""
        stall, waiting = self.stall, dict(self.waiting)
        if stall.check_time is None or not waiting:
            return None
        number = min(waiting)
        since, entries, _ = waiting[number]
        waited = time.monotonic() - since
        if waited < stall.check_time:
            return None
        if stall.warned != number:
            stall.warned, stall.missing = number, self._not_called(number)
            who = (f"ranks {stall.missing} have not called it" if stall.missing else
                   "every rank has called it: the values are still on their way")
            log.warning(f"rank {self.ranks[self.rank]}: {describe(entries)} has waited {waited:.0f} s: {who} "
                        f"(stall check: RDMATENSOR_STALL_CHECK_TIME_SECONDS or HOROVOD_STALL_CHECK_TIME_SECONDS)")
        if stall.shutdown_time and waited >= stall.shutdown_time and stall.missing:
            return Timeout(f"{describe(entries)} on rank {self.ranks[self.rank]} waited {waited:.0f} s for ranks "
                           f"{stall.missing}, which have not called it (stall shutdown time: "
                           f"RDMATENSOR_STALL_SHUTDOWN_TIME_SECONDS or HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)",
                           peer=stall.missing[0], tensor=entries[0]["name"] if entries else None)
        return None

    def _not_called(self, number: int) -> list[int]:
        """The job ranks of the peers that have not begun call `number`, as they say."""
        session, missing = self.bootstrap.session, []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            try:
                calls = json.loads(session.peer_status(peer, timeout=STATUS_TIMEOUT) or "{}").get("calls")
            except (RdmaTensorError, ValueError):
                calls = None               # a peer that cannot say is not named
            if calls is not None and calls <= number:
                missing.append(self.ranks[peer])
        return missing

    def _mismatch(self, peer: int, theirs: list, mine: list, new: bool, mine_planned: bool = False) -> PlanMismatch:
        theirs_text, mine_text = describe(theirs), describe(mine)
        if new and mine_planned:
            theirs_text += ", new to the plan,"
        elif new:
            mine_text += ", new to the plan,"
        return PlanMismatch(f"rank {peer} is in {theirs_text} while rank {self.rank} calls {mine_text}: {WHY}",
                            peer=peer, tensor=mine[0]["name"] if mine else None)


def _set_index(name: str) -> int:
    """The tensor set a slot belongs to: set i's tensors are s{i}/..., ring/s{i}/..."""
    return int(re.search(r"(?:^|/)s(\d+)/", name).group(1))
