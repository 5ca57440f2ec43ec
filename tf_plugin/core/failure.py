"""A training job fails as a whole: once any rank is lost, every collective of
this rank fails with PeerLost naming the rank lost first.

Synchronous training cannot go on without one of its ranks. A session fails
only the calls that involve the lost peer, so a rank blocked on a neighbour
that is still alive (a ring of four, a worker waiting on its parameter
server) would wait until that neighbour gave up in turn. JobFailure watches
every session of this rank (the bootstrap channel reaches every rank, so
each rank sees each loss itself) and, at the first loss other than an
orderly close, aborts them all with one PeerLost naming that rank: every
blocked allreduce, broadcast or recv returns at once, on every rank, with
the same error. This module does not import TensorFlow.
"""
from __future__ import annotations

import threading

from rdmatensor import PeerLost


class JobFailure:
    def __init__(self, rank: int):
        self.rank = rank
        self.first: PeerLost | None = None        # what every collective of this rank raises from now on
        self._sessions: list = []
        self._hooks: list = []                    # fn(first): what else fails with the job (a native group)
        self._lock = threading.Lock()

    def watch(self, session, ranks=None) -> None:
        """Fail `session` with the job when a rank is lost (at once if one already was).
        `ranks`: the job's rank of each of the session's (a process set's session)."""
        with self._lock:
            self._sessions = [s for s in self._sessions if not s.closed] + [session]
            first = self.first
        if ranks is None:
            session.on_peer_failure(self._failed)
        else:
            session.on_peer_failure(lambda e: self._failed(PeerLost(str(e), peer=ranks[e.peer])
                                                           if e.peer is not None else e))
        if first is not None:
            session.abort(first)

    def on_failure(self, fn) -> None:
        """Call fn(PeerLost) when the job fails (at once if it did): something
        that is no session but must stop waiting too, as a native all-reduce group."""
        with self._lock:
            first = self.first
            if first is None:
                self._hooks.append(fn)
        if first is not None:
            fn(first)

    def _failed(self, error: PeerLost) -> None:
        with self._lock:
            if self.first is None:
                self.first = PeerLost(f"rank {error.peer} was lost, so rank {self.rank} cannot go on: {error}",
                                      peer=error.peer)
            first, sessions = self.first, list(self._sessions)
            hooks, self._hooks = self._hooks, []
        for s in sessions:
            s.abort(first)
        for fn in hooks:
            fn(first)
