"""What users call: connect with a plan, send and receive tensors, close.

Setup (once, before the first step): every rank allocates its receive arenas
(the slots of every tensor it will receive) and its staging arenas (the same
layout, for what it sends), registers them with the provider, and starts its
control server. Then, for each peer pair, the lower rank makes one Exchange
call: token and plan digest checked, arena descriptors and channel parameters
swapped. A barrier ends setup. From then on a static tensor costs one
one-sided write: no control call, no serialization, no handshake.

Flow control is by credits, one per slot: a sender writes a slot only while it
holds that slot's credit; the receiver returns it (a zero-length write with an
immediate) when the user releases the view it got from recv().

Dynamic tensors (a None dimension) carry their actual shape in a header at the
start of their slot. When one outgrows its slot the sender asks the receiver
(Grow, on the control plane) for room; the receiver allocates and registers a
larger region and answers with its descriptor before the data goes.
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import Mapping, Sequence

import grpc
import numpy as np

from .control.service import ControlClient, TlsConfig, pb, pb_grpc, start_server
from .errors import (IntegrityError, PeerLost, PlanMismatch, RdmaTensorError, RecvTimeout, TensorMismatch,
                     TransportError, UnknownTensor, UsageError)
from .memory import Arena
from .plan import Plan, Slot, TensorSpec
from .providers import choose
from .providers.base import IMM_CREDIT, IMM_DATA, Channel, make_imm, split_imm

log = logging.getLogger("rdmatensor")
GROWN_REGION_BASE = 1 << 20      # region ids of grown dynamic slots start here
MAX_OPEN_BARRIERS = 256


@dataclass
class _SendSlot:
    slot: Slot
    peer: int
    credit: threading.Event = field(default_factory=threading.Event)
    region: int = 0
    offset: int = 0
    capacity: int = 0            # bytes the receiver has room for (header + payload)
    staging: np.ndarray | None = None
    staging_arena: Arena | None = None   # own arena once grown
    pending: object = None               # the last write's handle while it may still read staging


@dataclass
class _RecvSlot:
    slot: Slot
    peer: int
    arrived: threading.Event = field(default_factory=threading.Event)   # wakes waiters
    data: bool = False           # a DATA immediate came: the slot holds a new value
    held: bool = False
    memory: np.ndarray | None = None     # the bytes of this slot in the receive arena
    grown: tuple | None = None            # (region id, Arena) once grown


class Received:
    """A received tensor: a read-only view of the receive arena itself.

    Use as a context manager (`with session.recv(name) as array:`); leaving
    the block (or `release()`) hands the slot back to the sender."""

    def __init__(self, session: "Session", state: _RecvSlot, array: np.ndarray):
        self._session, self._state, self.array = session, state, array
        self.name = state.slot.spec.name

    def release(self) -> None:
        if self._state is None:
            return
        state, self._state = self._state, None
        self.array = None
        self._session._release(state)

    @property
    def released(self) -> bool:
        return self._state is None

    def __enter__(self) -> np.ndarray:
        if self._state is None:
            raise UsageError(f"tensor {self.name!r} was already released")
        return self.array

    def __exit__(self, *exc) -> None:
        self.release()


class _ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, session: "Session"):
        self.s = session

    def Exchange(self, request, context):
        return self.s._on_exchange(request, context)

    def Grow(self, request, context):
        return self.s._on_grow(request, context)

    def Barrier(self, request, context):
        return self.s._on_barrier(request, context)

    def Bye(self, request, context):
        self.s._authorize(request.rank, request.pair_secret, context)
        self.s._on_bye(request.rank, request.reason)
        return pb.ByeReply()

    def Ping(self, request, context):
        return pb.PingReply(rank=self.s.rank)


class _BaselineServicer(pb_grpc.BaselineServicer):
    def __init__(self, session: "Session"):
        self.s = session

    def Push(self, request, context):
        channel = self.s._channels.get(request.rank)
        if channel is None or not hasattr(channel, "deliver"):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"no grpc channel for rank {request.rank}")
        try:
            channel.deliver(request)
        except TransportError as exc:
            channel.lost(exc)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.PushReply()


def _region_msg(desc: dict) -> pb.Region:
    return pb.Region(region_id=desc["region_id"], size=desc["size"], key=desc["key"],
                     addr=desc.get("addr", 0), shm_name=desc.get("shm_name", ""))


def _region_dict(msg: pb.Region) -> dict:
    return {"region_id": msg.region_id, "size": msg.size, "key": msg.key, "addr": msg.addr,
            "shm_name": msg.shm_name}


def _params_msg(provider: str, params: dict) -> pb.ChannelParams:
    return pb.ChannelParams(provider=provider, **{k: v for k, v in params.items()})


def _params_dict(msg: pb.ChannelParams) -> dict:
    return {f.name: v for f, v in msg.ListFields()}


class Session:
    """One rank's end of an rdmatensor job. Create it with `connect()`."""

    def __init__(self, rank: int, peers: Mapping[int, str], plan: Plan, provider: str = "auto",
                 token: str | None = None, tls: TlsConfig | None = None, timeout: float = 60.0,
                 heartbeat: float = 1.0, peer_timeout: float = 10.0):
        if not isinstance(plan, Plan):
            raise UsageError(f"plan must be a Plan, not {type(plan).__name__}")
        if isinstance(peers, Sequence) and not isinstance(peers, str):
            peers = dict(enumerate(peers))
        self.rank, self.plan, self.timeout = rank, plan, timeout
        self.peers = {int(r): str(a) for r, a in peers.items()}
        if rank not in self.peers:
            raise UsageError(f"rank {rank} has no address in peers {sorted(self.peers)}")
        missing = plan.ranks() - set(self.peers)
        if missing:
            raise UsageError(f"the plan names ranks {sorted(missing)} that have no address in peers")
        if not token:
            raise UsageError("a token is required: peers authenticate with it")
        self._token, self._tls = token, tls
        self._lock = threading.Lock()
        self._error: RdmaTensorError | None = None          # sticky, session-wide
        self._peer_errors: dict[int, RdmaTensorError] = {}   # sticky, per peer
        self._stats = dict(bytes_sent=0, bytes_received=0, writes=0, recvs=0, copies=0,
                           dynamic=0, fallbacks=0, grows=0, waits=0, corrupt=0)
        self._channels: dict[int, Channel] = {}
        self._arenas: list[Arena] = []
        self._send: dict[str, _SendSlot] = {}
        self._recv: dict[str, _RecvSlot] = {}
        self._send_by_index: dict[int, list[_SendSlot]] = {}
        self._recv_by_index: dict[int, list[_RecvSlot]] = {}
        self._exchanged: dict[int, dict] = {}
        self._pair_secrets: dict[int, str] = {}
        self._said_bye: set[int] = set()
        self._exchange_events = {p: threading.Event() for p in plan.peers_of(rank) if p < rank}
        self._barriers: dict[str, list] = {}
        self._barrier_cv = threading.Condition()
        self._barrier_count: dict[str, int] = {}
        self._grow_lock = threading.Lock()
        self._next_region = GROWN_REGION_BASE
        self._clients: dict[int, ControlClient] = {}
        self._server = None
        self._closed = False
        if heartbeat <= 0 or peer_timeout < heartbeat:
            raise UsageError("heartbeat must be > 0 and peer_timeout >= heartbeat")
        self.heartbeat, self.peer_timeout = heartbeat, peer_timeout
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        peer_ranks = sorted(plan.peers_of(rank))
        self.provider_class = choose(provider, [self._host(p) for p in peer_ranks] or ["127.0.0.1"])
        self.provider = self.provider_class.name
        try:
            self._prepare(peer_ranks)
            self._start_server()
            self._exchange_all(peer_ranks)
            self.barrier("rdmatensor-setup")
            if peer_ranks:
                self._heartbeat_thread = threading.Thread(target=self._heartbeats, args=(peer_ranks,),
                                                          daemon=True, name=f"rdmatensor-heartbeat-{rank}")
                self._heartbeat_thread.start()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- setup
    def _host(self, rank: int) -> str:
        return self.peers[rank].rsplit(":", 1)[0].strip("[]")

    def _prepare(self, peer_ranks: list[int]) -> None:
        shared = getattr(self.provider_class, "shared_arenas", False)
        for peer in peer_ranks:
            n_in = len(getattr(self.plan.pairs.get((peer, self.rank)), "slots", ()))
            n_out = len(getattr(self.plan.pairs.get((self.rank, peer)), "slots", ()))
            ch = self.provider_class(self.rank, peer, self._host(self.rank),
                                     on_imm=partial(self._on_imm, peer), on_lost=partial(self._on_lost, peer),
                                     max_incoming=n_in + n_out)
            if self.provider == "grpc":
                ch.address, ch.token, ch.tls = self.peers[self.rank], self._token, self._tls
            self._channels[peer] = ch
            incoming = self.plan.pairs.get((peer, self.rank))
            if incoming:
                arenas = [self._arena(size, shared) for size in incoming.arena_sizes]
                for i, arena in enumerate(arenas):
                    ch.expose(i, arena)
                states = []
                for slot in incoming.slots:
                    st = _RecvSlot(slot, peer, memory=arenas[slot.arena].view(slot.offset, slot.size))
                    self._recv[slot.spec.name] = st
                    states.append(st)
                self._recv_by_index[peer] = states
            outgoing = self.plan.pairs.get((self.rank, peer))
            if outgoing:
                arenas = [self._arena(size, False) for size in outgoing.arena_sizes]
                for arena in arenas:
                    ch.register_source(arena)
                states = []
                for slot in outgoing.slots:
                    st = _SendSlot(slot, peer, region=slot.arena, offset=slot.offset, capacity=slot.size,
                                   staging=arenas[slot.arena].view(slot.offset, slot.size))
                    st.credit.set()
                    self._send[slot.spec.name] = st
                    states.append(st)
                self._send_by_index[peer] = states

    def _arena(self, size: int, shared: bool) -> Arena:
        arena = Arena(size, shared=shared)
        self._arenas.append(arena)
        return arena

    def _start_server(self) -> None:
        host, port = self.peers[self.rank].rsplit(":", 1)
        self._server, bound = start_server(f"{host}:{port}", self._token, _ControlServicer(self),
                                           _BaselineServicer(self), self._tls)
        if int(port) == 0:
            self.peers[self.rank] = f"{host}:{bound}"

    def _client(self, peer: int) -> ControlClient:
        if peer not in self._clients:
            self._clients[peer] = ControlClient(self.peers[peer], self._token, self._tls)
        return self._clients[peer]

    def _local_regions(self, peer: int) -> list[pb.Region]:
        ch = self._channels[peer]
        return [_region_msg({"region_id": rid, "size": arena.size, "key": key,
                             **({"addr": arena.address} if self.provider == "verbs" else {}),
                             **({"shm_name": arena.name} if arena.name else {})})
                for rid, (arena, key) in ch.local.items()]

    def _exchange_all(self, peer_ranks: list[int]) -> None:
        specs_json = self.plan.to_json()
        deadline = time.monotonic() + self.timeout
        for peer in (p for p in peer_ranks if p > self.rank):
            ch = self._channels[peer]
            self._pair_secrets[peer] = secrets.token_hex(16)
            req = pb.ExchangeRequest(rank=self.rank, peer=peer, plan_digest=self.plan.digest,
                                     plan_specs=specs_json, channel=_params_msg(self.provider, ch.params()),
                                     regions=self._local_regions(peer), pair_secret=self._pair_secrets[peer])
            client = self._client(peer)
            reply = client.call(client.control.Exchange, req, timeout=max(1.0, deadline - time.monotonic()),
                                wait_for_ready=True)
            for region in reply.regions:
                ch.attach(_region_dict(region))
            ch.connect(_params_dict(reply.channel), initiator=True,
                       timeout=max(1.0, deadline - time.monotonic()))
        for peer in (p for p in peer_ranks if p < self.rank):
            if not self._exchange_events[peer].wait(max(0.0, deadline - time.monotonic())):
                raise PeerLost(f"rank {peer} never set up its side with rank {self.rank} "
                               f"within {self.timeout:.0f} s")
            self._check()
            self._channels[peer].connect(self._exchanged[peer], initiator=False,
                                         timeout=max(1.0, deadline - time.monotonic()))

    def _on_exchange(self, request, context):
        peer = request.rank
        if request.peer != self.rank:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"this is rank {self.rank}, not {request.peer}")
        if peer not in self._exchange_events:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"rank {peer} is not a lower-ranked peer of rank {self.rank} in this plan")
        if len(request.pair_secret) < 32:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a pair secret of at least 32 characters is required")
        with self._lock:                     # claim the rank: one Exchange per peer, ever
            claimed = peer in self._pair_secrets
            if not claimed:
                self._pair_secrets[peer] = request.pair_secret
        if claimed:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"rank {peer} already exchanged")
        if request.plan_digest != self.plan.digest:
            try:
                theirs = json.loads(request.plan_specs)["specs"]
            except (ValueError, KeyError, TypeError):
                theirs = []
            msg = (f"plan mismatch between rank {peer} and rank {self.rank}: "
                   f"{self.plan.first_difference(theirs)}")
            self._fail(PlanMismatch(msg))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
        if request.channel.provider != self.provider:
            msg = (f"provider mismatch: rank {peer} uses {request.channel.provider!r}, "
                   f"rank {self.rank} uses {self.provider!r}")
            self._fail(PlanMismatch(msg))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
        ch = self._channels[peer]
        try:
            for region in request.regions:
                ch.attach(_region_dict(region))
        except RdmaTensorError as exc:
            self._fail(exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {peer}'s regions are unusable: {exc}")
        self._exchanged[peer] = _params_dict(request.channel)
        reply = pb.ExchangeReply(channel=_params_msg(self.provider, ch.params()),
                                 regions=self._local_regions(peer))
        self._exchange_events[peer].set()
        return reply

    # -------------------------------------------------------------- barrier
    def barrier(self, name: str = "barrier", timeout: float | None = None) -> None:
        """Wait until every rank of the plan reached the barrier of this name."""
        self._check()
        timeout = self.timeout if timeout is None else timeout
        with self._barrier_cv:
            generation = self._barrier_count.get(name, 0)
            self._barrier_count[name] = generation + 1
        key = f"{name}#{generation}"
        coordinator = min(self.plan.ranks() | {self.rank})
        if coordinator == self.rank:
            self._arrive(key, self.rank, timeout)
        else:
            client = self._client(coordinator)
            client.call(client.control.Barrier, pb.BarrierRequest(rank=self.rank, name=key),
                        timeout=timeout, wait_for_ready=True)

    def _arrive(self, key: str, rank: int, timeout: float, active=lambda: True) -> None:
        """Wait at barrier `key` until every rank arrived. A waiter that gives
        up takes its arrival back; the last one out forgets the key."""
        everyone = self.plan.ranks() | {self.rank}
        deadline = time.monotonic() + timeout
        with self._barrier_cv:
            if key not in self._barriers and len(self._barriers) >= MAX_OPEN_BARRIERS:
                raise UsageError(f"more than {MAX_OPEN_BARRIERS} barriers open at once")
            entry = self._barriers.setdefault(key, [set(), 0])   # arrived, departed
            entry[0].add(rank)
            self._barrier_cv.notify_all()
            try:
                while not everyone <= entry[0]:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._error or not active():
                        entry[0].discard(rank)
                        raise self._error or PeerLost(
                            f"barrier {key!r}: ranks {sorted(everyone - entry[0])} "
                            f"did not arrive within {timeout:.0f} s")
                    self._barrier_cv.wait(min(remaining, 0.5))
            finally:
                entry[1] += 1
                if entry[1] >= len(everyone) or not entry[0]:
                    self._barriers.pop(key, None)

    def _on_barrier(self, request, context):
        if request.rank not in self.plan.ranks() or request.rank == self.rank:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rank {request.rank} is not another rank of this plan")
        try:
            self._arrive(request.name, request.rank, self.timeout, active=context.is_active)
        except UsageError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RdmaTensorError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return pb.BarrierReply()

    # ---------------------------------------------------------- data events
    def _on_imm(self, peer: int, imm: int) -> None:
        kind, index = split_imm(imm)
        try:
            if kind == IMM_DATA:
                st = self._recv_by_index[peer][index]
                if st.data or st.held:
                    raise TransportError(f"rank {peer} wrote {st.slot.spec.name!r} without a credit")
                st.data = True
                st.arrived.set()
            elif kind == IMM_CREDIT:
                self._send_by_index[peer][index].credit.set()
            else:
                raise TransportError(f"rank {peer} sent an unknown immediate {imm:#x}")
        except (KeyError, IndexError):
            self._channels[peer].lost(TransportError(f"rank {peer} sent immediate {imm:#x} for no slot"))
        except TransportError as exc:
            self._channels[peer].lost(exc)

    def _on_lost(self, peer: int, error: Exception) -> None:
        if not isinstance(error, RdmaTensorError):
            error = TransportError(str(error))
        with self._lock:
            self._peer_errors.setdefault(peer, error)
        if not self._closed:
            # After the peer's orderly goodbye this is the expected end, not a fault.
            level = logging.INFO if peer in self._said_bye else logging.WARNING
            log.log(level, "rank %d: channel to rank %d lost: %s", self.rank, peer, error)
        # Wake everyone waiting on this peer so they see the error.
        for st in self._send_by_index.get(peer, []):
            st.credit.set()
        for st in self._recv_by_index.get(peer, []):
            st.arrived.set()

    def _heartbeats(self, peer_ranks: list[int]) -> None:
        """Ping every peer; one that fails twice in a row, or answers nothing for
        peer_timeout, is lost. This is how a killed or cut-off peer is noticed
        on providers that have no connection to break (verbs, grpc)."""
        clients = {p: ControlClient(self.peers[p], self._token, self._tls) for p in peer_ranks}
        last_ok = {p: time.monotonic() for p in peer_ranks}
        failures = dict.fromkeys(peer_ranks, 0)
        try:
            while not self._stop_heartbeat.wait(self.heartbeat):
                for peer, client in clients.items():
                    if peer in self._peer_errors or self._stop_heartbeat.is_set():
                        continue
                    try:
                        client.call(client.control.Ping, pb.PingRequest(rank=self.rank),
                                    timeout=min(self.peer_timeout, max(self.heartbeat, 2.0)))
                        last_ok[peer], failures[peer] = time.monotonic(), 0
                    except RdmaTensorError as exc:
                        failures[peer] += 1
                        silent = time.monotonic() - last_ok[peer]
                        if (failures[peer] >= 2 or silent >= self.peer_timeout) and not self._stop_heartbeat.is_set():
                            self._channels[peer].lost(PeerLost(
                                f"rank {peer} stopped answering ({silent:.1f} s): {exc}"))
        finally:
            for client in clients.values():
                client.close()

    def _on_bye(self, peer: int, reason: str) -> None:
        self._said_bye.add(peer)
        ch = self._channels.get(peer)
        if ch is not None:
            ch.peer_said_bye()

    def _fail(self, error: RdmaTensorError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        for ev in self._exchange_events.values():
            ev.set()
        with self._barrier_cv:
            self._barrier_cv.notify_all()

    def _check(self, peer: int | None = None) -> None:
        if self._error is not None:
            raise self._error
        if peer is not None and peer in self._peer_errors:
            raise self._peer_errors[peer]

    # ----------------------------------------------------------------- send
    def _spec(self, name: str) -> TensorSpec:
        spec = self.plan.specs.get(name)
        if spec is None:
            raise UnknownTensor(f"tensor {name!r} is not in the plan")
        return spec

    def buffer(self, name: str) -> np.ndarray:
        """The registered staging array of a static tensor this rank sends.
        Fill it and pass it to send(): it goes with no copy at all."""
        self._check()
        spec = self._spec(name)
        st = self._send.get(name)
        if st is None:
            raise UnknownTensor(f"rank {self.rank} does not send {name!r} (rank {spec.src} does)")
        if not spec.is_static:
            raise UsageError(f"{name!r} has a dynamic shape: it has no fixed staging buffer")
        self._source_free(st)
        return st.staging[:spec.nbytes].view(spec.dtype).reshape(spec.shape)

    def _source_free(self, st: _SendSlot) -> None:
        """Wait until the previous write no longer reads this slot's staging memory."""
        if st.pending is not None:
            self._channels[st.peer].wait(st.pending, self.timeout)
            st.pending = None

    def send(self, name: str, array, timeout: float | None = None) -> None:
        """Write `array` into the receiver's slot for `name` (one one-sided write).

        Waits while the receiver still holds the previous value of this tensor."""
        self._check()
        spec = self._spec(name)
        st = self._send.get(name)
        if st is None:
            raise UnknownTensor(f"rank {self.rank} does not send {name!r} (rank {spec.src} does)")
        if not isinstance(array, np.ndarray):
            raise TensorMismatch(f"{name!r}: expected a numpy array, got {type(array).__name__}")
        if not spec.matches(array):
            raise TensorMismatch(f"{name!r}: expected {spec.dtype} {_shape_str(spec.shape)}, "
                                 f"got {array.dtype} {_shape_str(array.shape)}")
        self._check(st.peer)
        self._take_credit(st, timeout)
        try:
            self._write(st, spec, array)
        except BaseException:
            if st.peer not in self._peer_errors:
                st.credit.set()   # nothing was written: the slot is still ours
            raise

    def _wait(self, event: threading.Event, peer: int, timeout: float) -> bool:
        """Wait for `event` the way this provider waits best (see Channel.wait_for)."""
        return event.is_set() or self._channels[peer].wait_for(event, timeout)

    def _take_credit(self, st: _SendSlot, timeout: float | None) -> None:
        if not st.credit.is_set():
            self._count("waits")
            timeout = self.timeout if timeout is None else timeout
            if not self._wait(st.credit, st.peer, timeout):
                raise RecvTimeout(f"{st.slot.spec.name!r}: rank {st.peer} held the previous value "
                                  f"for more than {timeout:.1f} s")
        self._check()
        self._check(st.peer)
        st.credit.clear()

    def _write(self, st: _SendSlot, spec: TensorSpec, array: np.ndarray) -> None:
        ch = self._channels[st.peer]
        imm = make_imm(IMM_DATA, st.slot.index)
        checksum = self.plan.checksum
        if spec.is_static and not checksum:
            nbytes = spec.nbytes
            if nbytes == 0:
                ch.notify(imm)
            else:
                src = self._source(st, ch, array, nbytes)
                st.pending = ch.write(st.region, st.offset, src, imm)
        else:
            # Header (dynamic), payload and trailer (checksum) go in one write
            # from staging.
            nbytes = array.nbytes
            header = spec.header_bytes()
            end = header + nbytes
            need = self.plan.trailer_offset(end) + self.plan.trailer_bytes
            if need > st.capacity:
                self._grow(st, need)
            self._source_free(st)
            staging = st.staging
            if header:
                hdr = staging[:header].view(np.int64)
                hdr[0] = array.ndim
                hdr[1:1 + array.ndim] = array.shape
            if nbytes and not (array.ctypes.data == staging[header:].ctypes.data and spec.is_static):
                np.copyto(staging[header:end].view(array.dtype).reshape(array.shape), array)
                self._count("copies")
            if checksum:
                trailer = self.plan.trailer_offset(end)
                staging[trailer:need].view(np.uint64)[0] = zlib.crc32(staging[header:end])
            st.pending = ch.write(st.region, st.offset, staging[:need], imm)
            if not spec.is_static:
                self._count("dynamic", "fallbacks")
        self._count("writes", bytes_sent=nbytes)

    def _source(self, st: _SendSlot, ch: Channel, array: np.ndarray, nbytes: int) -> np.ndarray:
        staging = st.staging[:nbytes]
        if array.ctypes.data == staging.ctypes.data:
            return staging                           # filled in place: no copy
        if not ch.needs_registered_source and array.flags.c_contiguous:
            return array.reshape(-1).view(np.uint8)  # written straight from the user's array
        self._source_free(st)
        np.copyto(staging.view(array.dtype).reshape(array.shape), array)
        self._count("copies")
        return staging

    def _grow(self, st: _SendSlot, need: int) -> None:
        """Ask the receiver for a region that holds `need` bytes (dynamic fallback)."""
        client = self._client(st.peer)
        reply = client.call(client.control.Grow, pb.GrowRequest(
            rank=self.rank, slot=st.slot.index, nbytes=need, pair_secret=self._pair_secrets[st.peer]),
            timeout=self.timeout)
        desc = _region_dict(reply.region)
        ch = self._channels[st.peer]
        ch.attach(desc)
        arena = Arena(desc["size"])
        ch.register_source(arena)
        self._arenas.append(arena)
        st.region, st.offset, st.capacity = desc["region_id"], 0, desc["size"]
        st.staging, st.staging_arena = arena.buf, arena
        self._count("grows")

    def _authorize(self, peer: int, secret: str, context) -> None:
        """Only the rank that exchanged with us may act as that rank."""
        want = self._pair_secrets.get(peer)
        if not want or not hmac.compare_digest(want.encode(), secret.encode()):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"not rank {peer}'s pair credential")

    def _on_grow(self, request, context):
        peer = request.rank
        self._authorize(peer, request.pair_secret, context)
        states = self._recv_by_index.get(peer, [])
        if not 0 <= request.slot < len(states) or states[request.slot].slot.spec.is_static:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"slot {request.slot} from rank {peer} "
                          f"is not a dynamic tensor")
        if request.nbytes > self.plan.max_arena_bytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{request.nbytes} bytes exceed one region ({self.plan.max_arena_bytes})")
        st = states[request.slot]
        if st.held or st.data:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{st.slot.spec.name!r} is still held: rank {peer} has no credit to grow it")
        size = 1 << max(12, (int(request.nbytes) - 1).bit_length())
        ch = self._channels[peer]
        with self._grow_lock:
            region_id = self._next_region
            self._next_region += 1
        arena = Arena(size, shared=getattr(self.provider_class, "shared_arenas", False))
        desc = ch.expose(region_id, arena)
        if self.provider == "verbs":
            desc["addr"] = arena.address
        if arena.name:
            desc["shm_name"] = arena.name
        old = st.grown
        st.grown, st.memory = (region_id, arena), arena.buf
        if old:
            ch.unexpose(old[0])
            old[1].close()
        return pb.GrowReply(region=_region_msg(desc))

    # ----------------------------------------------------------------- recv
    def recv(self, name: str, timeout: float | None = None) -> Received:
        """Wait for `name` and return it as a read-only view of the receive arena.

        Use `with session.recv(name) as array:`; the slot goes back to the
        sender when the block ends (or on `release()`)."""
        self._check()
        spec = self._spec(name)
        st = self._recv.get(name)
        if st is None:
            raise UnknownTensor(f"rank {self.rank} does not receive {name!r} (rank {spec.dst} does)")
        if st.held:
            raise UsageError(f"{name!r} is still held: release the previous view first")
        if not st.data:
            self._check(st.peer)     # lost while a previous value was held: nothing more will come
        timeout = self.timeout if timeout is None else timeout
        if not self._wait(st.arrived, st.peer, timeout):
            self._check(st.peer)
            raise RecvTimeout(f"{name!r} from rank {st.peer} did not arrive within {timeout:.1f} s")
        if not st.data:              # woken by a failure, not by data
            self._check()
            self._check(st.peer)
            raise TransportError(f"{name!r}: woken without data")
        st.held = True
        try:
            array = self._view(spec, st.memory)
        except TransportError:
            self._count("corrupt")
            self._release(st)
            raise
        array.flags.writeable = False
        self._count("recvs", bytes_received=array.nbytes)
        return Received(self, st, array)

    def _view(self, spec: TensorSpec, mem: np.ndarray) -> np.ndarray:
        """The tensor in a slot's memory; the peer's header and checksum are checked, never trusted."""
        if spec.is_static:
            header, shape, nbytes = 0, spec.shape, spec.nbytes
        else:
            header = spec.header_bytes()
            hdr = mem[:header].view(np.int64)
            shape = tuple(int(d) for d in hdr[1:1 + len(spec.shape)])
            if (int(hdr[0]) != len(spec.shape) or any(d < 0 for d in shape)
                    or any(w is not None and w != d for w, d in zip(spec.shape, shape))):
                raise TransportError(f"{spec.name!r}: malformed shape header {hdr[:1 + len(spec.shape)].tolist()}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize if shape else spec.dtype.itemsize
            if nbytes < 0 or header + nbytes > len(mem):
                raise TransportError(f"{spec.name!r}: header claims {nbytes} bytes, the slot holds "
                                     f"{len(mem) - header}")
        payload = mem[header:header + nbytes]
        if self.plan.checksum:
            trailer = self.plan.trailer_offset(header + nbytes)
            want = int(mem[trailer:trailer + 8].view(np.uint64)[0])
            got = zlib.crc32(payload)
            if want != got:
                raise IntegrityError(f"{spec.name!r}: checksum mismatch (crc32 {got:#010x}, "
                                     f"sender said {want:#010x})")
        return payload.view(spec.dtype).reshape(shape)

    def _release(self, st: _RecvSlot) -> None:
        st.held = False
        st.data = False
        if st.peer not in self._peer_errors:    # a loss must keep waking later waiters
            st.arrived.clear()
        if self._closed or st.peer in self._peer_errors:
            return
        try:
            self._channels[st.peer].notify(make_imm(IMM_CREDIT, st.slot.index))
        except RdmaTensorError as exc:
            # The sender is gone; it needs no credit. Its loss is reported by
            # the channel once everything it sent has been taken in.
            log.debug("rank %d: credit for %r not delivered: %s", self.rank, st.slot.spec.name, exc)

    # ---------------------------------------------------------------- misc
    def _count(self, *names: str, **amounts: int) -> None:
        with self._lock:
            for n in names:
                self._stats[n] += 1
            for n, v in amounts.items():
                self._stats[n] += v

    def stats(self) -> dict:
        """Counters: bytes_sent/received, writes, recvs, copies (user array ->
        staging, plus the grpc baseline's serialization copies on both sides), dynamic (dynamic-shape sends), fallbacks, grows, waits (sends
        that had to wait for a credit), control_calls (made by this rank: setup,
        barriers, grows; never one per static tensor)."""
        with self._lock:
            calls = sum(c.calls for c in self._clients.values())
            # Copies a provider makes itself (grpc serializes every tensor).
            provider_copies = sum(getattr(ch, "copies", 0) for ch in self._channels.values())
            return dict(self._stats, copies=self._stats["copies"] + provider_copies,
                        control_calls=calls, provider=self.provider)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Say goodbye to peers, then release channels (QPs, MRs, CQs, PDs,
        sockets, threads), arenas (and shared memory) and the control server.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail(UsageError(f"session of rank {self.rank} is closed"))
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
        for peer, secret in list(self._pair_secrets.items()):   # only peers we ever reached
            if peer in self._peer_errors:
                continue
            try:
                client = self._client(peer)
                client.call(client.control.Bye, pb.ByeRequest(rank=self.rank, reason="close",
                                                              pair_secret=secret), timeout=2.0)
            except RdmaTensorError:
                pass
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
        for ch in self._channels.values():
            try:
                ch.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("closing channel to rank %d: %s", ch.peer, exc)
        for st in self._send.values():
            st.credit.set()
            st.staging = None
        for st in self._recv.values():
            st.arrived.set()
            st.memory = None
            if st.grown:
                st.grown[1].close()
        for arena in self._arenas:
            arena.close()
        self._arenas.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session(rank={self.rank}, provider={self.provider}, {self.plan!r})"


def _shape_str(shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def connect(rank: int, peers: Mapping[int, str] | Sequence[str], plan: Plan, provider: str = "auto",
            token: str | None = None, tls: TlsConfig | None = None, timeout: float = 60.0,
            heartbeat: float = 1.0, peer_timeout: float = 10.0) -> Session:
    """Set up this rank's end: arenas registered, descriptors exchanged, barrier passed.

    `peers` maps every rank of the plan to its control address "host:port"
    (a list works too, indexed by rank). `provider` is auto, verbs, shm, tcp
    or grpc. `token` is the shared secret every peer must present; `tls`
    adds mutual TLS to the control plane. `timeout` bounds setup and is the
    default for send/recv waits. Every `heartbeat` seconds each peer is pinged;
    one that misses two pings, or `peer_timeout` seconds of them, is reported
    as PeerLost to every call that involves it."""
    return Session(rank, peers, plan, provider=provider, token=token, tls=tls, timeout=timeout,
                   heartbeat=heartbeat, peer_timeout=peer_timeout)
