"""verbs: real one-sided RDMA (InfiniBand, RoCE, SoftRoCE).

A data write is RDMA WRITE WITH IMM from registered staging memory straight
into the peer's registered receive arena: the receiver's CPU only sees the
immediate. Credits go back as SENDs with an immediate, owed while this side
is busy polling, so that they lead the next write's chain: one doorbell (on
SoftRoCE one system call) for both. One RC queue pair per
peer, through an RC endpoint (rc.py): the compiled one (`_native_endpoint.c`)
when it is built, else pyverbs; `RDMATENSOR_VERBS_ENDPOINT` forces either.

Writes are posted, not waited for: write() returns the send's number, which
the session passes to wait() only before it reuses the staging memory the
write reads. Sends complete in order, so a number is done once the highest
completed one reaches it: nothing is allocated per write. Completions are
reaped by whichever thread gets there first: a thread waiting for a tensor
polls the CQ itself for a short spin (in C with the GIL released, on the
compiled endpoint; no hand-off between threads on the fast path), then
sleeps on an event; a background thread blocks on the CQ's completion
channel (no CPU while idle) and reaps everything else. While a waiter has
polled the CQ within the last DEFER_SECONDS, the background thread does not
arm the completion channel: every completion would otherwise wake it and make
it contend for the interpreter lock with the waiter that already reaped it
(perftest's polling mode likewise takes no events), nor reap: it parks
until a credit is owed (posted within DEFER_SECONDS), a waiter sleeps or the
peer says goodbye, and once nobody polls, it stops owing credits and takes
events again.
"""
from __future__ import annotations

import math
from bisect import bisect_right
import threading
import time

import numpy as np

from ... import environment
from ...errors import PeerLost, ProviderUnavailable, RdmaTensorError, TransportError
from ...memory import Arena
from ..contract import Capabilities, Channel, Pieces
from ...devices import MTU_ENUM
from .choose_endpoint import endpoint_class
from .rc import MAX_CHAIN, READ_ONLY, RECV_BATCH, REMOTE_WRITE, RcParams, RemoteRegion

SEND_DEPTH = 256
# A waiter polls the CQ itself this long before it sleeps (RDMATENSOR_VERBS_SPIN_US: 0 sleeps at once).
SPIN_SECONDS = float(environment.get("RDMATENSOR_VERBS_SPIN_US", "2000")) / 1e6
DEFER_SECONDS = 0.005      # after a waiter's last poll, the background thread takes no events this long,
                           # and credits are owed: it looks this often, and posts them
# After its spin, a compiled waiter sleeps on the completion channel itself up to this long, so the
# completion it waits for wakes it alone (RDMATENSOR_VERBS_SLEEP_MS; 0: the background thread hands it over).
SLEEP_SECONDS = float(environment.get("RDMATENSOR_VERBS_SLEEP_MS", "250")) / 1e3
PARK_SECONDS = 1.0         # while a waiter polls and nothing is owed, the background thread sleeps this long,
                           # woken sooner when a credit is owed, a waiter sleeps, the peer says goodbye or the
                           # channel closes: each wake takes the GIL from a streaming sender (the NIC's CPU)


class VerbsChannel(Channel):
    name = "verbs"
    capabilities = Capabilities(needs_registered_source=True, posted_writes=True)

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        try:
            endpoint_class()
        except ProviderUnavailable as exc:
            return False, str(exc)
        from ...devices import active_port, list_devices
        found = active_port()
        if found:
            dev, port = found
            return True, f"{dev.name} port {port.number} ACTIVE ({port.link_layer})"
        if list_devices(gids=False):
            return False, "RDMA devices present but no port is ACTIVE"
        return False, ("no RDMA device (run inside `rdmatensor softroce vm`, "
                       "or `rdmatensor softroce up` where the kernel has rdma_rxe)")

    over_rails: type | None = None    # the channel over several NICs (rails.py registers it)

    def __new__(cls, *args, **kwargs):
        if cls is VerbsChannel and kwargs.get("port") is None and cls.over_rails and cls.over_rails.wanted() > 1:
            cls = cls.over_rails          # RDMATENSOR_IB_RAILS: several NICs to each peer
        return super().__new__(cls)

    def __init__(self, *args, max_incoming: int = 128, port: tuple[str, int, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # Every slot has at most one DATA and one CREDIT immediate in flight,
        # and fewer than RECV_BATCH consumed receives wait to be given back, so
        # a write never finds no receive posted (no RNR). `port`: (device, port,
        # GID index) to open, else as choose_port decides.
        device, number, gid_index = port or (None, 1, None)
        self.ep = endpoint_class()(device, number, gid_index, depth=SEND_DEPTH,
                                   recv_depth=max_incoming + RECV_BATCH)
        self._mrs: dict[int, object] = {}                    # exposed region id -> MR
        # Memory writes may leave from: start address -> (end, MR, the array, alive while registered),
        # and its sorted (start, end) pairs, replaced whole so writes_from() reads them without a lock.
        self._sources: dict[int, tuple[int, object, np.ndarray]] = {}
        self._source_ranges: tuple[list[int], list[int]] = ([], [])
        self._sources_lock = threading.Lock()
        self._regions: dict[int, RemoteRegion] = {}          # the peer's region id -> where we write
        self._sent = 0                    # the highest send number completed (sends complete in order)
        self._failure: Exception | None = None    # why no later send will complete
        self._send_waiters = 0
        self._send_cv = threading.Condition(threading.Lock())
        self._poll_lock = threading.Lock()
        self._event_lock = threading.Lock()    # one thread at a time blocks on the completion channel
        self._stop = threading.Event()
        self._closing = False             # close() began (read on the data path, where Event.is_set() costs a call)
        self._bye = False
        self._poller: threading.Thread | None = None
        self._polled_at = -math.inf       # when a waiter last polled the CQ itself (-inf: it went to sleep)
        self._waiter_slept = threading.Event()    # ends the background thread's quiet at once
        self._owed_soon = False           # a credit was owed while the background thread parked

    # -- setup ------------------------------------------------------------
    def expose(self, region_id: int, arena: Arena) -> dict:
        mr = self.ep.register(arena.buf, REMOTE_WRITE)
        self._mrs[region_id] = mr
        self.local[region_id] = (arena, mr.rkey)
        return {"region_id": region_id, "size": arena.size, "key": mr.rkey, "addr": arena.address}

    def unexpose(self, region_id: int) -> None:
        super().unexpose(region_id)
        mr = self._mrs.pop(region_id, None)
        if mr is not None:
            self.ep.deregister(mr)

    def register_source(self, buf: np.ndarray) -> None:
        start = buf.ctypes.data
        with self._sources_lock:
            held = self._sources.get(start)
            if held is not None and held[0] >= start + buf.nbytes:
                return                                  # registered already
            mr = self.ep.register(buf, READ_ONLY)       # the NIC only reads what we send from
            if held is not None:
                self.ep.deregister(held[1])
            self._sources[start] = (start + buf.nbytes, mr, buf)
            self._index_sources()

    def deregister_source(self, buf: np.ndarray) -> None:
        with self._sources_lock:
            held = self._sources.pop(buf.ctypes.data, None)
            if held is not None:
                self._index_sources()
                if not self._closing:
                    self.ep.deregister(held[1])

    def _index_sources(self) -> None:
        starts = sorted(self._sources)
        self._source_ranges = (starts, [self._sources[s][0] for s in starts])

    def writes_from(self, src: np.ndarray) -> bool:
        starts, ends = self._source_ranges
        if not starts:
            return False
        addr = src.ctypes.data
        i = bisect_right(starts, addr) - 1
        return i >= 0 and addr + src.nbytes <= ends[i]

    def attach(self, descriptor: dict) -> None:
        try:
            region = RemoteRegion(int(descriptor["addr"]), int(descriptor["size"]), int(descriptor["key"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"peer {self.peer} described a region without address, size or key: {exc!r}",
                                 peer=self.peer) from exc
        super().attach(descriptor)
        self._regions[int(descriptor["region_id"])] = region

    def params(self) -> dict:
        return self.ep.params().to_dict()

    def connect(self, peer_params: dict, initiator: bool, timeout: float) -> None:
        self._post_receives()
        try:   # proto3 drops zero fields: a PSN of 0 is legal and simply absent
            remote = RcParams(int(peer_params.get("qpn", 0)), int(peer_params.get("psn", 0)),
                              str(peer_params["gid"]), int(peer_params["mtu"]), int(peer_params.get("lid", 0)),
                              str(peer_params.get("link_layer") or "Ethernet"), str(peer_params.get("fabric", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"peer {self.peer} sent unusable verbs parameters: {exc!r}") from exc
        if remote.mtu not in MTU_ENUM:
            raise TransportError(f"peer {self.peer} sent an invalid path MTU {remote.mtu}")
        self.ep.connect(remote)
        self._poller = threading.Thread(target=self._event_loop, daemon=True,
                                        name=f"rdmatensor-verbs-{self.rank}<->{self.peer}")
        self._poller.start()

    def _post_receives(self) -> None:
        self.ep.post_recv(self.ep.recv_depth)

    # -- data path --------------------------------------------------------
    def _take(self, spin: float) -> tuple:
        """Poll the CQ (spinning up to `spin` s): every receive given back and its
        immediate handed to on_imm, in C on the compiled endpoint; the endpoint's
        reap() result."""
        return self.ep.reap(self.on_imm, spin)

    def _post(self, post, *args) -> int:
        """post(*args) on the endpoint; its send number. While the send queue is full,
        waits for the oldest send to complete."""
        while True:
            if self._lost or self._closing:
                raise PeerLost(f"verbs channel to peer {self.peer} is down", peer=self.peer)
            number = post(*args)
            if number:
                return number
            self._until(lambda oldest=self._sent + 1: self._sent >= oldest or self._failure is not None,
                        self._sleep_sent, 0.1)

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> int:
        """Post the write and return its number: `src` stays in use until wait(number)."""
        if isinstance(src, Pieces):
            return self.write_many([(region_id, offset, src, imm)])[0]
        remote = self._regions.get(region_id)
        if remote is None:
            self.check_remote(region_id, offset, src.nbytes)     # raises, naming the region
        try:
            if not (self._lost or self._closing):
                number = self.ep.post_write(src, remote, offset, imm)    # room in the queue: the common case
                if number:
                    return number
            return self._post(self.ep.post_write, src, remote, offset, imm)
        except TransportError as exc:
            if exc.peer is None:      # the endpoint refused it (bounds, source): say to whom
                raise type(exc)(f"write to peer {self.peer}'s region {region_id}: {exc}", peer=self.peer) from exc
            raise

    def prepare_write(self, region_id: int, offset: int, src: np.ndarray, imm: int):
        """The endpoint's prepared write (None for no region): it posts nothing
        once this channel is lost or closing (the endpoint is halted)."""
        remote = self._regions.get(region_id)
        return None if remote is None else self.ep.prepare_write(src, remote, offset, imm)

    def write_many(self, writes: list) -> list[int]:
        """Post the writes as chains of up to MAX_CHAIN work requests (one
        doorbell each); their numbers. A chain is checked whole before it goes.
        A write from Pieces goes as one write per piece, laid end to end, the
        immediate on the last (one queue pair: they land in order)."""
        if any(isinstance(w[2], Pieces) for w in writes):
            return self._write_pieces(writes)
        numbers = []
        for i in range(0, len(writes), MAX_CHAIN):
            chain = []
            for region_id, offset, src, imm in writes[i:i + MAX_CHAIN]:
                remote = self._regions.get(region_id)
                if remote is None:
                    self.check_remote(region_id, offset, src.nbytes)     # raises, naming the region
                chain.append((src, remote, offset, imm))
            try:
                first = self._post(self.ep.post_writes, chain)
            except TransportError as exc:
                if exc.peer is None:
                    raise type(exc)(f"writes to peer {self.peer}: {exc}", peer=self.peer) from exc
                raise
            numbers += range(first, first + len(chain))
        return numbers

    def _write_pieces(self, writes: list) -> list[int]:
        flat, ends = [], []
        for region_id, offset, src, imm in writes:
            if isinstance(src, Pieces):
                self.check_remote(region_id, offset, src.nbytes)    # whole, before any piece goes
                for piece in src[:-1]:
                    flat.append((region_id, offset, piece, None))
                    offset += piece.nbytes
                src = src[-1]
            flat.append((region_id, offset, src, imm))
            ends.append(len(flat) - 1)
        numbers = self.write_many(flat)
        return [numbers[end] for end in ends]

    def notify(self, imm: int) -> None:
        self._post(self.ep.post_send_imm, imm)

    def notify_later(self, imm: int) -> None:
        """Owed while a waiter polls (the endpoint is deferring): the credit leads
        the next chain posted, or goes before this side next waits for the peer,
        or with the background thread's next look, within DEFER_SECONDS."""
        if not self.ep.owe(imm):
            self.notify(imm)

    def credit_sink(self):
        """The endpoint's owe(): a credit owed while a waiter polls leads the next chain."""
        return self.ep.owe

    sleeps_in_waiter = True       # a completion on this channel's own CQ is all a waiter waits for

    def waiter(self):
        """The endpoint's compiled spin of wait_for() (None on pyverbs): it polls under
        this channel's poll lock and keeps _sent and _polled_at as _reap() does, then
        sleeps on the completion channel under the event lock. waiter()(None) polls once."""
        return self.ep.waiter(self, self.on_imm, self._poll_lock, SPIN_SECONDS,
                              self._event_lock if self.sleeps_in_waiter else None, SLEEP_SECONDS)

    def wait(self, number: int, timeout: float | None = None) -> None:
        """Until send `number` completed: reap on this thread for a short spin, then
        sleep until the reaping thread says so."""
        if number <= self._sent:
            return
        def done():
            return number <= self._sent or self._failure is not None
        if not self._until(done, self._sleep_sent, 1e9 if timeout is None else timeout):
            raise TransportError(f"a write to peer {self.peer} did not complete in {timeout} s", peer=self.peer)
        if number > self._sent:
            raise self._failure

    def wait_for(self, event, timeout: float) -> bool:
        """Poll the CQ on this thread for up to SPIN_SECONDS, then sleep on `event`
        (set by whichever thread reaps the completion). Never sleep-polls."""
        if event.is_set():
            return True
        if self.ep.owed and not (self._lost or self._closing):    # the peer may be waiting for one of them
            try:
                self._post(self.ep.post_owed)
            except (TransportError, PeerLost) as exc:     # reported like any failed post: waiters wake
                self._fail_all(exc)
        return self._until(event.is_set, lambda left, ready: event.wait(left), timeout)

    def _until(self, ready, sleep, timeout: float) -> bool:
        if ready():
            return True
        now = time.monotonic()
        deadline = now + timeout
        spin_until = min(deadline, now + SPIN_SECONDS)
        while not ready():
            now = time.monotonic()
            self._polled_at = now
            left = spin_until - now
            if left <= 0:
                self._polled_at = -math.inf   # nobody polls now: the background thread takes events again
                self._waiter_slept.set()
                return sleep(max(0.0, deadline - now), ready)
            if not self._reap(left):
                time.sleep(0)         # another thread is reaping: let it run
        self._polled_at = time.monotonic()
        return True

    def _sleep_sent(self, timeout: float, ready) -> bool:
        with self._send_cv:
            self._send_waiters += 1
            try:
                return self._send_cv.wait_for(ready, timeout)
            finally:
                self._send_waiters -= 1

    def progress(self, block_for: float = 0.0) -> bool:
        """Reap completions if no other thread is; True if any were found. With
        `block_for`, first wait up to that long for the CQ to report work."""
        found = self._reap()
        if not found and block_for > 0:
            with self._event_lock:
                self.ep.wait_event(block_for)
            found = self._reap()
        return found

    def _reap(self, spin: float = 0.0, wait_turn: float = 0.0) -> bool:
        """Take in what the CQ holds (spinning up to `spin` s for something); True if any.
        Completions are handled in order by one thread at a time: while another takes
        them, wait up to `wait_turn` s for it, else leave them to it. Any failure
        becomes the channel's sticky error."""
        if not (self._poll_lock.acquire(timeout=wait_turn) if wait_turn > 0 else self._poll_lock.acquire(False)):
            return False
        sent = self._sent
        try:
            if self._closing:
                return False
            found, last, failed = self._take(spin)
            if last:
                self._sent = last
            if failed:
                self._reap_failed(failed)
            return bool(found)
        except Exception as exc:  # noqa: BLE001 - becomes the channel's sticky error
            self._reap_failed(exc)
            return False
        finally:
            self._poll_lock.release()
            if self._sent != sent and self._send_waiters:
                self._wake_sends()

    def _reap_failed(self, failure) -> None:
        """What reaping found wrong, a failed completion (wr_id, status, is_receive)
        or an exception, made the channel's sticky error (from _reap() and the
        compiled waiter)."""
        if isinstance(failure, tuple):
            wr_id, status, is_receive = failure
            what = "receive from" if is_receive else "write to"
            failure = TransportError(f"{what} peer {self.peer}: work request {wr_id} failed: "
                                     f"{self.ep.status_name(status)} (status {status})", peer=self.peer)
        self._fail_all(failure if isinstance(failure, (TransportError, PeerLost)) else TransportError(str(failure)))

    def _wake_sends(self) -> None:
        with self._send_cv:
            self._send_cv.notify_all()

    def _fail_all(self, exc: Exception) -> None:
        if not self._stop.is_set():
            self.lost(exc)
        self._release_sends(exc)

    def _release_sends(self, exc: Exception) -> None:
        """No send beyond those completed will complete: wake whoever waits for one."""
        if self._failure is None:
            self._failure = exc
        with self._send_cv:
            self._send_cv.notify_all()

    def lost(self, error: Exception) -> None:
        """Once the peer is lost (also when the session's heartbeat says so) no
        thread reaps any more: a writer waiting for a completion gets the error."""
        self.ep.halted = True             # prepared writes go through write(), which raises
        super().lost(error)
        self._release_sends(error)

    def _event_loop(self) -> None:
        """Background progress: reap what the CQ holds, then block on its
        completion channel until it reports more; while a waiter polls, only
        look every DEFER_SECONDS, posting the credits owed."""
        ep = self.ep
        while not self._stop.is_set() and not self._lost:
            quiet = self._polled_at + DEFER_SECONDS - time.monotonic()
            if quiet <= 0 and self._reap():       # else the waiter that polls takes in what completes
                continue
            if self._bye:
                # the peer flushed its writes before its goodbye, but their completions may still be
                # in the CQ while a waiter polls it: take them in before reporting the peer gone, or
                # a recv of its last value finds the peer lost and the value not yet arrived. A
                # waiter holds the poll lock at most SLEEP_SECONDS at a time, taking them in itself
                if self._reap(wait_turn=SLEEP_SECONDS + 0.05):
                    continue
                if not ep.in_flight:
                    self.lost(PeerLost(f"peer {self.peer} closed the session", peer=self.peer))
                    return
            ep.deferring = quiet > 0
            try:
                ep.post_owed()            # no room: the completions that make some wake this thread
            except TransportError as exc:
                self._fail_all(exc)
                return
            if quiet > 0:                 # a waiter polls the CQ itself: no events, no wake-ups
                if not ep.owed:           # nothing owed: park until a credit is, or a waiter sleeps
                    self._owed_soon = False
                    ep.on_owed = self._credit_owed
                    if not ep.owed:
                        self._waiter_slept.wait(PARK_SECONDS)
                    ep.on_owed = None
                    if not self._owed_soon and not ep.owed:
                        self._waiter_slept.clear()
                        continue
                self._waiter_slept.clear()
                self._waiter_slept.wait(DEFER_SECONDS)    # a credit owed waits this long for a write to carry it
                self._waiter_slept.clear()
                continue
            with self._event_lock:        # a waiter may have slept on the channel meanwhile: look again
                if self._polled_at + DEFER_SECONDS <= time.monotonic():
                    self.ep.wait_event(0.1)

    def _credit_owed(self) -> None:
        """The endpoint's on_owed: a credit is owed while the background thread parks."""
        self._owed_soon = True
        self._waiter_slept.set()

    def arrivals(self) -> int:
        """Receives completed: immediates (writes' and credits') the peer posted."""
        return self.ep.arrivals

    def peer_said_bye(self) -> None:
        self._bye = True   # the poller reports it once the CQ is drained
        self._waiter_slept.set()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.ep.halted = True
        try:
            self.ep.deferring = False
            self.ep.post_owed()           # what the peer may still wait for
        except RdmaTensorError:           # already failed or closed: nobody waits for them
            pass
        self._stop.set()
        self._waiter_slept.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        with self._poll_lock:
            self._release_sends(PeerLost("channel closed", peer=self.peer))
            self._mrs.clear()
            self._regions.clear()
            with self._sources_lock:
                self._sources.clear()
                self._index_sources()
            self.ep.close()
