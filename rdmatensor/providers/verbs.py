"""verbs: real one-sided RDMA (InfiniBand, RoCE, SoftRoCE) through pyverbs.

A data write is RDMA WRITE WITH IMM from registered staging memory straight
into the peer's registered receive arena: the receiver's CPU only sees the
immediate. Credits go back as one-byte SENDs with an immediate. One RC queue
pair per peer.

Writes are posted, not waited for: write() returns a completion handle that
the session waits for only before it reuses the staging memory the write
reads, and the send queue is bounded by a semaphore. Completions are reaped
by whichever thread gets there first: a thread waiting for a tensor polls the
CQ itself for a short spin (no hand-off between threads on the fast path),
then sleeps on an event; a background thread blocks on the CQ's completion
channel (no CPU while idle) and reaps everything else.
"""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from ..errors import PeerLost, TransportError
from ..memory import Arena
from .base import Capabilities, Channel

try:
    from .rc_endpoint import (LOCAL_ONLY, RECV_BATCH, REMOTE_WRITE, RcEndpoint, RcParams, RemoteRegion,
                              completion_error, is_receive)
    from ..devices import MTU_ENUM
    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - reported by viable()
    _IMPORT_ERROR = exc

SEND_DEPTH = 256
SPIN_SECONDS = 0.002       # a waiter polls the CQ itself this long before it sleeps


class Completion:
    """Set when a posted work request completed (or failed: `error`)."""
    __slots__ = ("event", "error")

    def __init__(self):
        self.event = threading.Event()
        self.error: Exception | None = None


class VerbsChannel(Channel):
    name = "verbs"
    capabilities = Capabilities(needs_registered_source=True, posted_writes=True)

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        if _IMPORT_ERROR is not None:
            return False, str(_IMPORT_ERROR)
        from ..devices import active_port, list_devices
        found = active_port()
        if found:
            dev, port = found
            return True, f"{dev.name} port {port.number} ACTIVE ({port.link_layer})"
        if list_devices(gids=False):
            return False, "RDMA devices present but no port is ACTIVE"
        return False, ("no RDMA device (run inside `rdmatensor softroce vm`, "
                       "or `rdmatensor softroce up` where the kernel has rdma_rxe)")

    def __init__(self, *args, max_incoming: int = 128, **kwargs):
        super().__init__(*args, **kwargs)
        if _IMPORT_ERROR is not None:
            raise TransportError(f"verbs provider unavailable: {_IMPORT_ERROR}")
        # Every slot has at most one DATA and one CREDIT immediate in flight,
        # and fewer than RECV_BATCH consumed receives wait to be given back, so
        # a write never finds no receive posted (no RNR).
        self.ep = RcEndpoint(depth=SEND_DEPTH, recv_depth=max_incoming + RECV_BATCH)
        self._mrs: dict[int, object] = {}                    # exposed region id -> MR
        self._sources: list[tuple[int, int, object]] = []   # (start, end, MR) we write from
        self._wr_ids = itertools.count(1)
        self._pending: dict[int, Completion] = {}
        self._sq = threading.BoundedSemaphore(self.ep.depth)
        self._post_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._event_lock = threading.Lock()    # one thread at a time blocks on the completion channel
        self._stop = threading.Event()
        self._bye = False
        self._poller: threading.Thread | None = None

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

    def register_source(self, arena: Arena) -> None:
        mr = self.ep.register(arena.buf, LOCAL_ONLY)
        self._sources.append((arena.address, arena.address + arena.size, mr))

    def params(self) -> dict:
        return self.ep.params().to_dict()

    def connect(self, peer_params: dict, initiator: bool, timeout: float) -> None:
        self._post_receives()
        try:   # proto3 drops zero fields: a PSN of 0 is legal and simply absent
            remote = RcParams(int(peer_params.get("qpn", 0)), int(peer_params.get("psn", 0)),
                              str(peer_params["gid"]), int(peer_params["mtu"]))
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
    def _received(self, wc) -> None:
        """A receive completed: an immediate arrived (its payload, if any, is in place)."""
        self.ep.post_recv()
        self.on_imm(wc.imm_data)

    def _source_mr(self, src: np.ndarray):
        addr = src.ctypes.data
        for start, end, mr in self._sources:
            if start <= addr and addr + src.nbytes <= end:
                return mr
        raise TransportError("verbs writes only from registered staging memory")

    def _post(self, post) -> Completion:
        if self._lost:
            raise PeerLost(f"verbs channel to peer {self.peer} is down")
        while not self._sq.acquire(timeout=0.01):   # the send queue is full: completions free it
            self._reap()
            if self._lost or self._stop.is_set():
                raise PeerLost(f"verbs channel to peer {self.peer} is down")
        done = Completion()
        with self._post_lock:
            wr_id = next(self._wr_ids)
            self._pending[wr_id] = done
            try:
                post(wr_id)
            except BaseException:
                self._pending.pop(wr_id, None)
                self._sq.release()
                raise
        return done

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> Completion:
        """Post the write and return its handle: `src` stays in use until wait(handle)."""
        desc = self.check_remote(region_id, offset, src.nbytes)
        mr = self._source_mr(src)
        remote = RemoteRegion(int(desc["addr"]), int(desc["size"]), int(desc["key"]))
        return self._post(lambda wr_id: self.ep.post_write(
            mr, src.ctypes.data, src.nbytes, remote, offset, imm=imm, wr_id=wr_id))

    def notify(self, imm: int) -> None:
        self._post(lambda wr_id: self.ep.post_send_imm(imm, wr_id=wr_id))

    def wait(self, done: Completion, timeout: float | None = None) -> None:
        """Until `done` completes: reap on this thread for a short spin, then sleep
        until the reaping thread sets it."""
        if not self.wait_for(done.event, 1e9 if timeout is None else timeout):
            raise TransportError(f"a write to peer {self.peer} did not complete in {timeout} s", peer=self.peer)
        if done.error:
            raise done.error

    def wait_for(self, event, timeout: float) -> bool:
        """Poll the CQ on this thread for up to SPIN_SECONDS, then sleep on `event`
        (set by whichever thread reaps the completion). Never sleep-polls."""
        deadline = time.monotonic() + timeout
        spin_until = min(deadline, time.monotonic() + SPIN_SECONDS)
        while not event.is_set():
            if time.monotonic() >= spin_until:
                return event.wait(max(0.0, deadline - time.monotonic()))
            if not self._reap():
                time.sleep(0)         # let the thread we wait for run
        return True

    def progress(self, block_for: float = 0.0) -> bool:
        """Reap completions if no other thread is; True if any were found. With
        `block_for`, first wait up to that long for the CQ to report work."""
        found = self._reap()
        if not found and block_for > 0:
            with self._event_lock:
                self.ep.wait_event(block_for)
            found = self._reap()
        return found

    def _reap(self) -> bool:
        if not self._poll_lock.acquire(blocking=False):
            return False
        try:
            if self._stop.is_set():
                return False
            wcs = self.ep.poll(32, check=False)
            for wc in wcs:
                err = completion_error(wc)
                if is_receive(wc):
                    if err:
                        raise TransportError(f"receive from peer {self.peer}: {err}")
                    self._received(wc)
                    continue
                done = self._pending.pop(wc.wr_id, None)
                self._sq.release()
                if err:
                    exc = TransportError(f"write to peer {self.peer}: {err}")
                    if done:
                        done.error = exc
                        done.event.set()
                    raise exc
                if done:
                    done.event.set()
            return bool(wcs)
        except Exception as exc:  # noqa: BLE001 - becomes the channel's sticky error
            self._fail_all(exc if isinstance(exc, (TransportError, PeerLost)) else TransportError(str(exc)))
            return False
        finally:
            self._poll_lock.release()

    def _fail_all(self, exc: Exception) -> None:
        if not self._stop.is_set():
            self.lost(exc)
        self._release_pending(exc)

    def _release_pending(self, exc: Exception) -> None:
        for done in list(self._pending.values()):
            done.error = done.error or exc
            done.event.set()

    def lost(self, error: Exception) -> None:
        """Once the peer is lost (also when the session's heartbeat says so) no
        thread reaps any more: a writer waiting for a completion gets the error."""
        super().lost(error)
        self._release_pending(error)

    def _event_loop(self) -> None:
        """Background progress: reap what the CQ holds, then block on its
        completion channel until it reports more."""
        while not self._stop.is_set() and not self._lost:
            if self._reap():
                continue
            if self._bye and not self._pending:
                self.lost(PeerLost(f"peer {self.peer} closed the session", peer=self.peer))
                return
            with self._event_lock:
                self.ep.wait_event(0.1)

    def peer_said_bye(self) -> None:
        self._bye = True   # the poller reports it once the CQ is drained

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        with self._poll_lock:
            for done in self._pending.values():
                done.error = done.error or PeerLost("channel closed")
                done.event.set()
            self._mrs.clear()
            self._sources.clear()
            self.ep.close()
