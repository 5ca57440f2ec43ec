"""Liveness: where a peer is declared lost, and the errors that stick.

A peer is lost when its channel breaks (tcp, shm: at once), when it stops
answering heartbeats (verbs, grpc: two missed pings in a row, one per 5 s of
a peer timeout over 10 s, or `peer_timeout` seconds of silence), or after its goodbye once everything it sent is in.
A heartbeat pings only a peer from which nothing arrived since the last one
(verbs counts arrivals): while tensors flow, no RPC runs beside them.
Errors stick: a peer's error fails every later call involving that peer, a
session-wide one (setup failure, close) every later call.

A rank that closes after losing another says which in its goodbye, and its
peers report *that* rank as lost: in a chain of ranks waiting on each other,
every one names the rank that failed first, not the neighbour that left
because of it. Failures (every loss but an orderly goodbye) are reported to
watchers (`when_peer_failed`), which is how a training job fails as a whole.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .. import environment
from ..control.service import ControlClient, pb
from ..errors import PeerLost, RdmaTensorError, TransportError, UsageError
from .context import SessionContext

log = logging.getLogger("rdmatensor")
PEER_TIMEOUT = 10.0      # seconds of silence before a peer is lost, unless RDMATENSOR_PEER_TIMEOUT says


def peer_timeout_from_env() -> float:
    """RDMATENSOR_PEER_TIMEOUT in seconds, else PEER_TIMEOUT: raised where ranks may
    not be scheduled for seconds (an emulated VM, an oversubscribed host)."""
    text = environment.get("RDMATENSOR_PEER_TIMEOUT", None)
    if text is None:
        return PEER_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1.0:
        raise UsageError(f"RDMATENSOR_PEER_TIMEOUT={text!r}: give seconds, 1 or more")
    return value


def misses_to_lose(peer_timeout: float) -> int:
    """Pings missed in a row that lose a peer before its peer timeout: 2 at the
    default 10 s, one per 5 s of a longer one (a starved host's gRPC may refuse
    or time out a connection within a second, so a count of 2 would ignore it)."""
    return max(2, round(peer_timeout / 5))


def ping_timeout(heartbeat: float, peer_timeout: float) -> float:
    """How long one ping waits for its answer: two missed pings lose a peer, so
    with a longer peer timeout a ping waits longer too (10 s: 2 s, as always)."""
    return min(peer_timeout, max(heartbeat, 2.0, peer_timeout / 5))


class Liveness:
    def __init__(self, ctx: SessionContext, heartbeat: float, peer_timeout: float):
        self.ctx = ctx
        self.heartbeat, self.peer_timeout = heartbeat, peer_timeout
        self._lock = threading.Lock()
        self.error: RdmaTensorError | None = None           # sticky, session-wide
        self.peer_errors: dict[int, RdmaTensorError] = {}   # sticky, per peer
        self._said_bye: set[int] = set()
        self._byes = threading.Condition(self._lock)
        self._bye_causes: dict[int, PeerLost] = {}           # peer -> the loss it left because of
        self.first_failure: PeerLost | None = None           # the first rank lost other than in order
        self._on_peer_lost: list[Callable[[int], None]] = []
        self._on_peer_failed: list[Callable[[PeerLost], None]] = []
        self._on_fail: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status: Callable[[], str] | None = None       # what this rank says of itself (Session.serve_status)

    def describe(self) -> str:
        """This rank's answer to a peer that asks how it is: '' where nothing says."""
        status = self.status
        try:
            return status() if status is not None else ""
        except Exception:  # noqa: BLE001 - a broken describer must not fail the heartbeat that carries it
            return ""

    def when_peer_lost(self, wake: Callable[[int], None]) -> None:
        """Call `wake(peer)` when a peer is lost (to wake whoever waits on it)."""
        self._on_peer_lost.append(wake)

    def when_failed(self, wake: Callable[[], None]) -> None:
        """Call `wake()` when the session fails."""
        self._on_fail.append(wake)

    def when_peer_failed(self, callback: Callable[[PeerLost], None]) -> None:
        """Call `callback(error)` when a peer is lost other than by an orderly
        goodbye; `error.peer` is the rank lost (for a peer that left because it
        lost another rank, that other rank)."""
        self._on_peer_failed.append(callback)

    # -- sticky errors ----------------------------------------------------
    def check(self, peer: int | None = None) -> None:
        """Raise the session's error, or `peer`'s, if there is one."""
        if self.error is not None:
            raise self.error
        if peer is not None and peer in self.peer_errors:
            raise self.peer_errors[peer]

    def is_lost(self, peer: int) -> bool:
        return peer in self.peer_errors

    def fail(self, error: RdmaTensorError) -> None:
        """The whole session failed (or closed): every later call raises `error`."""
        with self._lock:
            if self.error is None:
                self.error = error
            if isinstance(error, PeerLost) and error.peer is not None and self.first_failure is None:
                self.first_failure = error
        for wake in self._on_fail:
            wake()

    def lost(self, peer: int, error: Exception) -> None:
        """A channel reports its peer gone (called at most once per channel)."""
        if not isinstance(error, RdmaTensorError):
            error = TransportError(str(error), peer=peer)
        if error.peer is None:
            error.peer = peer
        error = self._bye_causes.get(peer, error)
        orderly = peer in self._said_bye and peer not in self._bye_causes
        failure = None
        with self._lock:
            self.peer_errors.setdefault(peer, error)
            if not orderly and not self.ctx.closed:
                failure = error if isinstance(error, PeerLost) else PeerLost(str(error), peer=error.peer)
                if self.first_failure is None:
                    self.first_failure = failure
        if not self.ctx.closed:
            # After the peer's orderly goodbye this is the expected end, not a fault.
            log.log(logging.INFO if orderly else logging.WARNING, "rank %d: channel to rank %d lost: %s",
                    self.ctx.rank, peer, error)
        if failure is not None:            # before waking: a watcher may fail the whole session
            for callback in self._on_peer_failed:
                callback(failure)
        for wake in self._on_peer_lost:
            wake(peer)

    # -- heartbeats -------------------------------------------------------
    def start(self, peer_ranks: list[int]) -> None:
        if peer_ranks:
            self._thread = threading.Thread(target=self._heartbeats, args=(peer_ranks,), daemon=True,
                                            name=f"rdmatensor-heartbeat-{self.ctx.rank}")
            self._thread.start()

    def _heartbeats(self, peer_ranks: list[int]) -> None:
        """Ping every peer from which nothing arrived since the last look; one
        that fails twice in a row, or answers nothing for peer_timeout, is
        lost. This is how a killed or cut-off peer is noticed on providers
        that have no connection to break (verbs, grpc)."""
        ctx = self.ctx
        clients = {p: ControlClient(ctx.peers[p], ctx.token, ctx.tls, peer=p) for p in peer_ranks}
        last_ok = {p: time.monotonic() for p in peer_ranks}
        failures = dict.fromkeys(peer_ranks, 0)
        heard = {p: self._arrivals(p) for p in peer_ranks}
        try:
            while not self._stop.wait(self.heartbeat):
                for peer, client in clients.items():
                    if self.is_lost(peer) or self._stop.is_set():
                        continue
                    # A peer whose messages kept arriving is alive: no ping, so a streaming
                    # rank's CPU (on SoftRoCE, the NIC's too) is not spent on RPCs.
                    arrived = self._arrivals(peer)
                    if arrived is not None and arrived != heard[peer]:
                        heard[peer], last_ok[peer], failures[peer] = arrived, time.monotonic(), 0
                        continue
                    ctx.counters.add("pings")
                    try:
                        reply = client.call(client.control.Ping,
                                            pb.PingRequest(rank=ctx.rank, pair_secret=ctx.credentials.secret(peer)),
                                            timeout=ping_timeout(self.heartbeat, self.peer_timeout))
                        if reply.rank != peer:
                            raise TransportError(f"rank {reply.rank} answered at rank {peer}'s address", peer=peer)
                        last_ok[peer], failures[peer] = time.monotonic(), 0
                    except RdmaTensorError as exc:
                        failures[peer] += 1
                        silent = time.monotonic() - last_ok[peer]
                        if ((failures[peer] >= misses_to_lose(self.peer_timeout) or silent >= self.peer_timeout)
                                and not self._stop.is_set()):
                            ctx.channels[peer].lost(PeerLost(
                                f"rank {peer} stopped answering ({silent:.1f} s): {exc}", peer=peer))
        finally:
            for client in clients.values():
                client.close()

    def _arrivals(self, peer: int) -> int | None:
        channel = self.ctx.channels.get(peer)
        try:
            return channel.arrivals() if channel is not None else None
        except RdmaTensorError:               # a closed endpoint: ping, and let that decide
            return None

    # -- goodbye ----------------------------------------------------------
    def on_bye(self, peer: int, lost_rank: int | None = None, reason: str = "") -> None:
        """`peer` closed: its channel reports the loss once everything it sent is in,
        as that of `lost_rank` when the peer closed because it lost that rank."""
        if lost_rank is not None and lost_rank not in (peer, self.ctx.rank):
            self._bye_causes[peer] = PeerLost(f"rank {lost_rank} was lost (rank {peer} left because of it: "
                                              f"{reason})", peer=lost_rank)
        with self._lock:
            self._said_bye.add(peer)
            self._byes.notify_all()
        ch = self.ctx.channels.get(peer)
        if ch is not None:
            ch.peer_said_bye()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_goodbyes(self, timeout: float) -> None:
        """Until every peer still here said goodbye too (or `timeout`): a control
        server stopped under a peer's open connection makes gRPC log a GOAWAY
        there, on every rank of a job that ends cleanly."""
        deadline = time.monotonic() + timeout
        with self._byes:
            while any(p not in self._said_bye and p not in self.peer_errors for p in self.ctx.credentials.peers()
                      if p in self.ctx.channels):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._byes.wait(min(remaining, 0.05))

    def say_goodbye(self) -> None:
        """Tell every peer this rank reached, and has not lost, that it closes
        (and which rank it lost first, if any)."""
        ctx = self.ctx
        cause = self.first_failure
        extra = {"lost_rank": cause.peer, "reason": str(cause)[:500]} if cause is not None else {"reason": "close"}
        for peer in ctx.credentials.peers():
            # a peer that said goodbye first waits for ours (wait_goodbyes) before its server stops
            if (self.is_lost(peer) and peer not in self._said_bye) or peer not in ctx.channels:
                continue
            try:
                ctx.call(peer, "Bye", pb.ByeRequest(rank=ctx.rank, pair_secret=ctx.credentials.secret(peer),
                                                    **extra), timeout=2.0)
            except RdmaTensorError:
                pass
