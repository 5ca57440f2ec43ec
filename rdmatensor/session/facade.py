"""What users call: connect() and the Session it returns.

Session is a thin facade: it builds the parts of one rank's session (see the
package's docstring), runs setup in order, and delegates every call.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ..control.service import TlsConfig, pb, start_server
from ..control.servicers import BaselineServicer, ControlServicer
from ..errors import PeerLost, RdmaTensorError, UsageError
from ..plan import Plan
from ..providers import choose
from . import slots
from .barrier import Barriers
from .context import SessionContext
from .credits import Credits
from .exchange import Exchange
from .growth import Growth
from .liveness import Liveness, log, peer_timeout_from_env
from .recv import Received, Receiver
from .send import Sender

SETUP_BARRIER = "rdmatensor-setup"
GOODBYE_WAIT = 0.5          # seconds a closing session waits for its peers' goodbyes before its server stops


class Session:
    """One rank's end of an rdmatensor job. Create it with `connect()`."""

    def __init__(self, rank: int, peers: Mapping[int, str], plan: Plan, provider: str = "auto",
                 token: str | None = None, tls: TlsConfig | None = None, timeout: float = 60.0,
                 heartbeat: float = 1.0, peer_timeout: float | None = None, abort: Callable[[], None] | None = None):
        if not isinstance(plan, Plan):
            raise UsageError(f"plan must be a Plan, not {type(plan).__name__}")
        if isinstance(peers, Sequence) and not isinstance(peers, str):
            peers = dict(enumerate(peers))
        peers = {int(r): str(a) for r, a in peers.items()}
        if rank not in peers:
            raise UsageError(f"rank {rank} has no address in peers {sorted(peers)}")
        missing = plan.ranks() - set(peers)
        if missing:
            raise UsageError(f"the plan names ranks {sorted(missing)} that have no address in peers")
        if not token:
            raise UsageError("a token is required: peers authenticate with it")
        if peer_timeout is None:
            peer_timeout = peer_timeout_from_env()
        if heartbeat <= 0 or peer_timeout < heartbeat:
            raise UsageError("heartbeat must be > 0 and peer_timeout >= heartbeat")
        self.rank, self.plan, self.timeout = rank, plan, timeout
        self.heartbeat, self.peer_timeout = heartbeat, peer_timeout
        peer_ranks = sorted(plan.peers_of(rank))
        hosts = {p: peers[p].rsplit(":", 1)[0].strip("[]") for p in peer_ranks}
        classes = choose(provider, hosts or {rank: "127.0.0.1"}, rank)
        self.providers = {p: classes[p].name for p in peer_ranks}    # the provider of each pair
        self.provider = "+".join(sorted({c.name for c in classes.values()}))
        ctx = self._ctx = SessionContext(rank, peers, plan, {p: classes[p] for p in peer_ranks},
                                         token, tls, timeout)
        self.peers = ctx.peers
        ctx.abort = abort
        self._live = Liveness(ctx, heartbeat, peer_timeout)
        self._credits = Credits(ctx, self._live)
        self._exchange = Exchange(ctx, self._credits, self._live)
        self._growth = Growth(ctx, self._credits)
        self._barriers = Barriers(ctx, self._live)
        self._sender = Sender(ctx, self._credits, self._growth, self._live)
        self._receiver = Receiver(ctx, self._credits, self._live)
        # The data path's two calls go straight to their parts (the methods
        # below document them), through the compiled hop where it is built.
        self.send, self.recv = self._sender.send, self._receiver.recv
        if slots.compiled is not None:
            hop = slots.compiled.Hop(self._credits.send, self._credits.recv, self._live, ctx, self.send,
                                     self.recv, self._receiver.timed_out, self._credits.return_credit)
            self.send, self.recv = hop.send, hop.recv
        self._server = None
        self._ready = False                  # set up: every peer reached, the setup barrier passed
        try:
            self._exchange.prepare(peer_ranks)
            self._start_server()
            self._exchange.run(peer_ranks)
            self.barrier(SETUP_BARRIER)
            ctx.abort = None
            self._live.start(peer_ranks)
            self._ready = True
        except BaseException:
            self.close()
            raise

    def _start_server(self) -> None:
        ctx = self._ctx
        host, port = ctx.peers[ctx.rank].rsplit(":", 1)
        control = ControlServicer(ctx.rank, ctx.credentials, self._exchange, self._growth, self._barriers,
                                  self._live)
        baseline = BaselineServicer(ctx.channels, ctx.credentials)
        self._server, bound = start_server(f"{host}:{port}", ctx.token, control, baseline, ctx.tls)
        if int(port) == 0:
            ctx.peers[ctx.rank] = f"{host}:{bound}"

    # -- the API ----------------------------------------------------------
    def buffer(self, name: str) -> np.ndarray:
        """The registered staging array of a static tensor this rank sends.
        Fill it and pass it to send(): it goes with no copy at all. It is
        handed out only once the previous write from it completed. Call it
        again before each refill: after send() returns, the write may still
        read the array (on verbs the NIC does), so send() makes it read-only
        (numpy's ValueError on a refill) until this hands it out again.
        Sending it again unchanged is safe."""
        return self._sender.buffer(name)

    def send(self, name: str, array, timeout: float | None = None, tag: int = 0) -> None:
        """Write `array` into the receiver's slot for `name` (one one-sided write).

        Waits while the receiver still holds the previous value of this tensor
        (SendTimeout after `timeout`, default the session's). `tag` (0..4095)
        travels in the write's immediate: the receiver sees it on the value
        (Received.tag) and recv(tag=) hands over only a value that carries it."""
        self._sender.send(name, array, timeout, tag)

    def send_many(self, items, timeout: float | None = None, tag: int = 0) -> None:
        """send() each (name, array) of `items`, in order; a bad item (unknown
        name, wrong dtype or shape) refuses the call before anything is sent.
        Static tensors go out together: on verbs, up to 32 writes per doorbell
        (one chain of work requests), on tcp in one sendmsg. A batch is posted
        before waiting for a credit, so a tensor may appear more than once.
        Every write carries `tag`, as in send()."""
        self._sender.send_many(items, timeout, tag)

    def register_source(self, array: np.ndarray) -> None:
        """Let writes leave straight from `array` (writable, C-contiguous), with no copy
        into staging: verbs registers it, for the NIC to read alone, with every peer, and
        keeps it alive until deregister_source(). A write from it may still read it
        after send() returns: wait_sent() before changing it."""
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.flags.writeable):
            raise UsageError("register_source takes a writable C-contiguous numpy array")
        if array.nbytes:
            for ch in self._ctx.channels.values():
                ch.register_source(array)

    def deregister_source(self, array: np.ndarray) -> None:
        """Undo register_source(), once every posted write completed."""
        self._sender.flush()
        for ch in self._ctx.channels.values():
            ch.deregister_source(array)

    def wait_sent(self, names) -> None:
        """Wait until no write of these tensors (this rank sends them) still reads
        its source: the array given to send() may change after this."""
        self._sender.wait_sent(names)

    def recv(self, name: str, timeout: float | None = None, tag: int | None = None) -> Received:
        """Wait for `name` and return it as a read-only view of the receive arena.

        Use `with session.recv(name) as array:`; the slot goes back to the
        sender when the block ends (or on `release()`). With `tag`, a value
        the sender wrote with another tag is discarded (its slot given back)
        and CallMismatch raised: one call never takes another call's value."""
        return self._receiver.recv(name, timeout, tag)

    def wait_released(self, names, timeout: float | None = None) -> None:
        """Wait until the receiver of each tensor this rank sends in `names` has
        released its last value (its credit is back): the value was taken.
        SendTimeout after `timeout` (default the session's)."""
        self._sender.wait_released(names, timeout)

    def barrier(self, name: str = "barrier", timeout: float | None = None) -> None:
        """Wait until every rank of the plan reached the barrier of this name."""
        self._barriers.wait(name, timeout)

    def on_peer_failure(self, callback: Callable[[PeerLost], None]) -> None:
        """Call `callback(error)` (from a session thread) when a peer is lost
        other than by an orderly close: it died, was cut off, or closed because
        it lost another rank, which `error.peer` then names."""
        self._live.when_peer_failed(callback)

    def serve_status(self, describe: Callable[[], str]) -> None:
        """What this rank answers a peer's peer_status(): `describe()`, a short text."""
        self._live.status = describe

    def peer_status(self, peer: int, timeout: float = 5.0) -> str:
        """Ask `peer` how it is (one control call): what its serve_status() says, or ''."""
        ctx = self._ctx
        request = pb.PingRequest(rank=ctx.rank, pair_secret=ctx.credentials.secret(peer))
        return ctx.call(peer, "Ping", request, timeout=timeout).status

    def unread(self) -> list[str]:
        """Names of the tensors whose value arrived here and has not been taken
        by recv() (what peers already sent: a watchdog's view of the session).
        Completions a provider keeps until asked (shm's ring) are taken in first."""
        return [name for name, _ in self.arrived()]

    def arrived(self) -> list[tuple[str, int]]:
        """(name, tag) of every value that arrived here and was not taken yet, as unread()."""
        for ch in list(self._ctx.channels.values()):
            ch.progress()
        return [(name, st.tag) for name, st in list(self._credits.recv.items()) if st.state == st.FULL]

    def abort(self, error: RdmaTensorError) -> None:
        """Fail the whole session with `error`: every waiting call and every
        later one raises it (a job that cannot go on without a lost rank). The
        peers hear which rank was lost when this session closes."""
        self._live.fail(error)

    def stats(self) -> dict:
        """Counters: bytes_sent/received, bytes_sent_to {peer: bytes}, writes, recvs, copies (into staging,
        plus the grpc baseline's serialization copies on both sides; those into
        staging by purpose as copies_gather (Pieces), copies_array (an array
        the provider cannot write from) and copies_frame (a dynamic or
        checksummed value's framing), with bytes_copied),
        dynamic (dynamic-shape sends), fallbacks, grows, waits (sends that had
        to wait for a credit), corrupt (values refused on receipt),
        control_calls (made by this rank: setup, barriers, grows; never one
        per static tensor), pings (heartbeats this rank sent: none to a peer
        whose messages keep arriving, where the provider counts them), and the
        provider's name."""
        ctx = self._ctx
        counts = {**self._credits.traffic(), **ctx.counters.snapshot()}
        counts["copies"] += sum(ch.copies for ch in ctx.channels.values())
        return dict(counts, control_calls=ctx.control_calls(), provider=self.provider)

    def debug_state(self) -> dict:
        """A look inside, for tests and debugging (it holds live objects and the
        pair credentials: never log it). Keys: error (session-wide, or None),
        peer_errors {peer: error}, channels {peer: Channel}, send_slots and
        recv_slots {name: SendSlot / RecvSlot}, exchanged {lower-ranked peer:
        its channel parameters}, pair_secrets {peer: secret}, open_barriers."""
        ctx = self._ctx
        return {"error": self._live.error, "peer_errors": dict(self._live.peer_errors),
                "channels": dict(ctx.channels), "send_slots": dict(self._credits.send),
                "recv_slots": dict(self._credits.recv), "exchanged": dict(self._exchange.exchanged),
                "pair_secrets": {p: ctx.credentials.secret(p) for p in ctx.credentials.peers()},
                "open_barriers": len(self._barriers.open)}

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def close(self) -> None:
        """Let posted writes complete, say goodbye to peers, then release channels (QPs, MRs, CQs, PDs,
        sockets, threads), arenas (and shared memory) and the control server.
        Idempotent."""
        ctx = self._ctx
        if ctx.closed:
            return
        self._sender.flush()         # posted writes land before the goodbye
        ctx.closed = True
        self._live.fail(UsageError(f"session of rank {self.rank} is closed"))
        self._live.stop()
        self._live.say_goodbye()
        ctx.close_clients()                  # ours, before a peer's server stops under them
        if self._ready:                      # theirs, before ours stops (a failed setup: no peer to wait for)
            self._live.wait_goodbyes(GOODBYE_WAIT)
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
        for ch in ctx.channels.values():
            try:
                ch.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("closing channel to rank %d: %s", ch.peer, exc)
        self._credits.wake_all()
        for st in self._credits.send.values():
            st.staging = st.post = None
        for st in self._credits.recv.values():
            st.memory = None
        for arena in ctx.arenas:
            arena.close()
        ctx.arenas.clear()
        ctx.close_clients()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session(rank={self.rank}, provider={self.provider}, {self.plan!r})"


def connect(rank: int, peers: Mapping[int, str] | Sequence[str], plan: Plan, provider: str = "auto",
            token: str | None = None, tls: TlsConfig | None = None, timeout: float = 60.0,
            heartbeat: float = 1.0, peer_timeout: float | None = None, abort: Callable[[], None] | None = None
            ) -> Session:
    """Set up this rank's end: arenas registered, descriptors exchanged, barrier passed.

    `peers` maps every rank of the plan to its control address "host:port"
    (a list works too, indexed by rank). `provider` is auto or a name from
    rdmatensor.providers.REGISTRY (verbs, shm, tcp, grpc). `token` is the
    shared secret every peer must present; `tls` adds mutual TLS to the
    control plane. `timeout` bounds setup and is the default for send/recv
    waits. Every `heartbeat` seconds each peer is pinged; one that misses two
    pings, or `peer_timeout` seconds of them, is reported as PeerLost to
    every call that involves it (peer_timeout: RDMATENSOR_PEER_TIMEOUT, else
    10 s; a ping waits a fifth of it, at least 2 s, for its answer, and a
    longer timeout needs one missed ping per 5 s of it). `abort`, if given, is called a few times a
    second while setup waits for peers; what it raises ends the setup (a job
    that learns from elsewhere that a peer is gone need not wait `timeout`)."""
    return Session(rank, peers, plan, provider=provider, token=token, tls=tls, timeout=timeout,
                   heartbeat=heartbeat, peer_timeout=peer_timeout, abort=abort)
