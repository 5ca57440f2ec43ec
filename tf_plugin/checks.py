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
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from rdmatensor import PeerLost, PlanMismatch, RdmaTensorError, Timeout

from .collectives import Collectives, entries_of

GRACE = 2.0                 # seconds a peer's tensors may lie unread before the ranks are declared diverged
WATCH_EVERY = 0.25
WHY = ("the ranks diverged: a tensor whose shape or dtype changed on some ranks only, or a collective "
       "called on some ranks only")


class NonFiniteValue(RdmaTensorError):
    """A NaN or Inf in an all-reduce (RDMATENSOR_CHECK_FINITE): `tensor` names it,
    `peer` is this rank when its own value held it, else None."""


def finite_check_from_env() -> bool:
    return os.environ.get("RDMATENSOR_CHECK_FINITE", "").strip().lower() in ("1", "true", "yes", "on")


def describe(entries: list[dict]) -> str:
    """A collective as a message shows it: its op and first tensors with dtype and shape."""
    if not entries:
        return "an empty collective"
    kind, _, arg = entries[0]["op"].partition(":")
    op = {"allreduce": f"allreduce ({arg.split(':')[0]})", "broadcast": f"broadcast from rank {arg}"}.get(kind, kind)
    shown = ", ".join(f"{e['name']!r} {e['dtype']} {list(e['shape'])}" for e in entries[:3])
    more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
    return f"{op} of {shown}{more}"


@dataclass
class Planning:
    """This rank proposing tensor sets (the requests given to ensure)."""
    requests: list
    since: float = field(default_factory=time.monotonic)

    @property
    def entries(self) -> list[dict]:
        return [e for kind, op, names, arrays in self.requests for e in entries_of(kind, op, names, arrays)]


class CheckedCollectives(Collectives):
    def __init__(self, *args, check_finite: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.check_finite = check_finite
        self.grace = min(GRACE, self.timeout / 2)
        self._planning: Planning | None = None
        self._local_bad: dict = {}          # (set key, bucket) -> this rank's inputs holding NaN or Inf
        self._stop = threading.Event()
        self._watchdog = None
        if self.size > 1:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"rdmatensor-divergence-{self.rank}")
            self._watchdog.start()

    # ----------------------------------------------------------- the calls
    def ensure(self, requests):
        self._planning = Planning(list(requests))
        try:
            return super().ensure(requests)
        finally:
            self._planning = None

    def launch(self, group, j: int, arrays: list) -> None:
        kind, op, names, described = group.request
        if self.check_finite:
            self._local_bad[(group.key, j)] = self._non_finite(self._members(group, j), arrays)
        with self._naming(kind, op, names, described):
            super().launch(group, j, arrays)

    def collect(self, group, j: int) -> list[np.ndarray]:
        kind, op, names, described = group.request
        with self._naming(kind, op, names, described):
            out = super().collect(group, j)
        if self.check_finite:
            self._check_outputs(group, j, out)
        return out

    def allreduce(self, names, arrays, average: bool = True):
        with self._naming("allreduce", "average" if average else "sum", names, arrays):
            return super().allreduce(names, arrays, average)

    def broadcast(self, names, arrays, root: int):
        with self._naming("broadcast", str(root), names, arrays):
            return super().broadcast(names, arrays, root)

    def allgather(self, names, arrays):
        with self._naming("allgather", "", names, arrays):
            return super().allgather(names, arrays)

    def close(self) -> None:
        self._stop.set()
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
            if isinstance(exc, PeerLost) and exc.peer is not None:
                diverged = self._diverged_peer(exc.peer, entries_of(kind, op, names, arrays))
                if diverged is not None:                # the peer left because the ranks diverged
                    raise diverged from exc
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
        seen, since = None, 0.0
        while not self._stop.wait(WATCH_EVERY):
            planning = self._planning
            stale = self._stale(planning) if planning is not None else None
            key = None if stale is None else (id(planning), stale)
            if key != seen:
                seen, since = key, time.monotonic()
                continue
            if key is None or time.monotonic() - since < self.grace:
                continue
            error = self._proposer_error(planning, stale)
            for session in (self.session, self.bootstrap.session):
                if session is not None:
                    session.abort(error)
                    session.close()         # the peer's wait ends now, and it learns why (_naming)
            return

    def _stale(self, planning: Planning) -> str | None:
        """A tensor of a planned set that a peer wrote here while this rank, with no
        all-reduce left to run, proposes new sets: one it will never read."""
        session = self.session
        if session is None or not self.comm.idle():
            return None
        unread = session.unread()
        return unread[0] if unread else None

    def _proposer_error(self, planning: Planning, tensor: str) -> PlanMismatch:
        peer = self.session.plan.specs[tensor].src
        index = int(re.search(r"(?:^|/)s(\d+)/", tensor).group(1))      # set i's tensors: s{i}/..., ring/s{i}/...
        mine = planning.entries
        return PlanMismatch(f"rank {peer} is in {describe(self._order[index].entries)} while rank {self.rank} "
                            f"calls {describe(mine)}, new to the plan: {WHY}", peer=peer, tensor=mine[0]["name"])

    def _diverged_peer(self, peer: int, mine: list[dict]) -> PlanMismatch | None:
        """The error to raise when `peer` left while its proposal lies unread here."""
        if peer not in self.bootstrap.unread():
            return None
        try:
            tag, data = self.bootstrap.take(peer, timeout=0)
        except RdmaTensorError:
            return None
        theirs = (describe([e for s in json.loads(data)["sets"] for e in s]) + ", new to the plan,"
                  if tag == "plan" else f"the exchange {tag!r}")
        return PlanMismatch(f"rank {peer} calls {theirs} while rank {self.rank} is in {describe(mine)}: {WHY}",
                            peer=peer, tensor=mine[0]["name"])
