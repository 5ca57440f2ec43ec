"""Checks on what the ranks call: a broken or hostile script gets a typed error
naming the tensor and the rank, never a hang or a wrong result.

CheckedCollectives is the Collectives of every Horovod-API rank:

- Errors name the call. Whatever a collective raises is raised again, as the
  same class, saying which collective, which tensor and which rank: a
  RecvTimeout on the bootstrap's 'boot/r1/r0' becomes "allreduce of 'lonely'
  on rank 0: rank 1 did not take part within the timeout (...)".
- Divergence. Ranks that call different collectives (a tensor whose shape or
  dtype changed on one rank only; a collective one rank skips) would each
  wait for the other: one moves the tensors of a set already planned while
  the other proposes a new set over the bootstrap channel. Each side can see
  it: the proposal lies unread in the first one's bootstrap slot, the first
  one's data lies unread in the proposer's slots. Ranks in step never leave
  either there for long (a rank proposes only after it finished every
  collective before, and everything it sent for those arrives within network
  latency), so a watchdog that sees either for a grace period (5 s, at most
  half the timeout) fails the rank with PlanMismatch naming both calls.
- Non-finite values (optional: RDMATENSOR_CHECK_FINITE=1, or
  init(check_finite=True)). Each rank notes which of its floating inputs
  hold a NaN or Inf, and checks the reduced outputs. A NaN or Inf in any
  rank's input reaches every rank's output, so every rank finds it in the
  same call; one exchange of the notes then lets every rank raise the same
  NonFiniteValue, naming the tensor and the rank(s) it came from. The
  sessions stay usable: a script may skip that step.

This module does not import TensorFlow.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from rdmatensor import PeerLost, PlanMismatch, RdmaTensorError, Timeout

from .collectives import Collectives, entries_of

MAX_GRACE = 5.0             # seconds something may lie unread before the ranks are declared diverged
WATCH_EVERY = 0.25


class NonFiniteValue(RdmaTensorError):
    """A NaN or Inf in a tensor given to allreduce (RDMATENSOR_CHECK_FINITE): `tensor`
    names it, `peer` the (first) rank whose value held it."""


def finite_check_from_env() -> bool:
    return os.environ.get("RDMATENSOR_CHECK_FINITE", "").strip().lower() in ("1", "true", "yes", "on")


def describe(entries: list[dict]) -> str:
    """A collective as a message shows it: its op and first tensors with dtype and shape."""
    if not entries:
        return "an empty collective"
    kind, _, arg = entries[0]["op"].partition(":")
    op = {"allreduce": f"allreduce ({arg})", "broadcast": f"broadcast from rank {arg}"}.get(kind, kind)
    shown = ", ".join(f"{e['name']!r} {e['dtype']} {list(e['shape'])}" for e in entries[:3])
    more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
    return f"{op} of {shown}{more}"


@dataclass
class Activity:
    """The collective this rank is in (described only when a message needs it)."""
    kind: str
    op: str
    names: list
    arrays: list
    phase: str = "data"          # plan: agreeing on a new tensor set over the bootstrap; data: moving tensors
    since: float = field(default_factory=time.monotonic)

    @property
    def entries(self) -> list[dict]:
        return entries_of(self.kind, self.op, self.names, self.arrays)


class CheckedCollectives(Collectives):
    def __init__(self, *args, check_finite: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.check_finite = check_finite
        self.grace = min(MAX_GRACE, self.timeout / 2)
        self._activity: Activity | None = None
        self._stop = threading.Event()
        self._watchdog = None
        if self.size > 1:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"rdmatensor-divergence-{self.rank}")
            self._watchdog.start()

    # ----------------------------------------------------------- the calls
    def ensure(self, requests):
        act = self._activity
        if act is None:
            return super().ensure(requests)
        act.phase, act.since = "plan", time.monotonic()
        sets = super().ensure(requests)
        act.phase, act.since = "data", time.monotonic()      # not on failure: _doing needs the phase
        return sets

    def allreduce(self, names, arrays, average: bool = True):
        with self._doing("allreduce", "average" if average else "sum", names, arrays) as act:
            local_bad = self._non_finite(names, arrays) if self.check_finite else []
            out = super().allreduce(names, arrays, average)
            if self.check_finite:
                self._check_outputs(act, names, out, local_bad)
            return out

    def broadcast(self, names, arrays, root: int):
        with self._doing("broadcast", str(root), names, arrays):
            return super().broadcast(names, arrays, root)

    def allgather(self, names, arrays):
        with self._doing("allgather", "", names, arrays):
            return super().allgather(names, arrays)

    def close(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=2)
        super().close()

    # ------------------------------------------------------- naming errors
    @contextlib.contextmanager
    def _doing(self, kind: str, op: str, names, arrays):
        if self.size == 1:
            yield None
            return
        act = Activity(kind, op, list(names), list(arrays))
        self._activity = act
        try:
            yield act
        except RdmaTensorError as exc:
            if exc.tensor is not None and exc.tensor in names:
                raise                                   # named already (divergence, non-finite)
            if isinstance(exc, PeerLost) and exc.peer in self._suspects(act):
                # The rank that left had diverged from this one: say that, not only that it left.
                try:
                    diverged = self._divergence(act, exc.peer)
                except RdmaTensorError:
                    diverged = None
                if diverged is not None:
                    raise diverged from exc
            what = f"{kind} of {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            if isinstance(exc, Timeout) and exc.peer is not None:
                message = f"{what} on rank {self.rank}: rank {exc.peer} did not take part within the timeout ({exc})"
            else:
                message = f"{what} on rank {self.rank}: {exc}"
            raise type(exc)(message, peer=exc.peer, tensor=names[0]) from exc
        finally:
            self._activity = None

    # ---------------------------------------------------------- non-finite
    @staticmethod
    def _non_finite(names, arrays) -> list[str]:
        return [n for n, a in zip(names, arrays, strict=True)
                if np.asarray(a).dtype.kind in "fc" and not np.isfinite(a).all()]

    def _check_outputs(self, act: Activity, names, outputs, local_bad: list[str]) -> None:
        bad = self._non_finite(names, outputs)
        if not bad:
            return
        act.phase = "plan"                              # in the bootstrap now, on every rank
        notes = [json.loads(raw) for raw in self.bootstrap.allgather("finite", json.dumps(local_bad).encode())]
        tensor = bad[0]
        ranks = [r for r, theirs in enumerate(notes) if tensor in theirs]
        if ranks:
            where = f"rank {ranks[0]}'s value" if len(ranks) == 1 else f"the values of ranks {ranks}"
            message = f"allreduce of {tensor!r}: {where} held NaN or Inf (seen on rank {self.rank})"
        else:
            message = (f"allreduce of {tensor!r}: every rank's value was finite, the reduced one is not "
                       f"(overflow; seen on rank {self.rank})")
        raise NonFiniteValue(message, peer=ranks[0] if ranks else None, tensor=tensor)

    # ---------------------------------------------------------- divergence
    def _watch(self) -> None:
        seen, since = None, 0.0
        while not self._stop.wait(WATCH_EVERY):
            act = self._activity
            suspect = next(iter(self._suspects(act)), None) if act is not None else None
            key = None if suspect is None else (id(act), act.phase, suspect)
            if key != seen:
                seen, since = key, time.monotonic()
                continue
            if key is None or time.monotonic() - since < self.grace:
                continue
            try:
                error = self._divergence(act, suspect)
            except RdmaTensorError:
                continue                                # it was read after all: not stuck
            for session in (self.session, self.bootstrap.session):
                if session is not None:
                    session.abort(error)
            return

    def _suspects(self, act: Activity) -> list[int]:
        """The ranks that left something unread here that they would not have, had
        they called the same collective: a bootstrap message (a proposal) while this
        rank moves tensors (data phase), or tensors of the current generation while
        this rank proposes a new set (plan phase)."""
        if act.phase == "data":
            return self.bootstrap.unread()
        session = self.session
        if session is None:
            return []
        return sorted({session.plan.specs[name].src for name in session.unread()})

    def _divergence(self, act: Activity, peer: int) -> PlanMismatch:
        """The error both ranks get: what `peer` calls, what this rank calls."""
        mine = describe(act.entries)
        why = ("the ranks diverged: a tensor whose shape or dtype changed on some ranks only, or a "
               "collective called on some ranks only")
        if act.phase == "data":
            tag, data = self.bootstrap.take(peer, timeout=0)
            theirs = (describe([e for s in json.loads(data)["sets"] for e in s]) + ", new to the plan,"
                      if tag == "plan" else f"the exchange {tag!r}")
            return PlanMismatch(f"rank {peer} calls {theirs} while rank {self.rank} is in {mine}: {why}",
                                peer=peer, tensor=act.names[0])
        session = self.session
        name = next(n for n in session.unread() if session.plan.specs[n].src == peer)
        index = int(re.search(r"(?:^|/)s(\d+)/", name).group(1))     # set i's tensors: s{i}/..., ring/s{i}/...
        theirs = describe(self._order[index].entries)
        return PlanMismatch(f"rank {peer} is in {theirs} while rank {self.rank} calls {mine}, new to the plan: "
                            f"{why}", peer=peer, tensor=act.names[0])
