"""verbs: real one-sided RDMA (InfiniBand, RoCE, SoftRoCE) through pyverbs.

A data write is RDMA WRITE WITH IMM from registered staging memory straight
into the peer's registered receive arena: the receiver's CPU only sees the
immediate. Credits go back as one-byte SENDs with an immediate. One RC queue
pair per peer; a poller thread reaps completions.
"""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from ..errors import PeerLost, TransportError
from ..memory import Arena
from .base import Channel

try:
    from .rc_endpoint import (LOCAL_ONLY, REMOTE_WRITE, RcEndpoint, RcParams, RemoteRegion,
                              completion_error, is_receive)
    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - reported by viable()
    _IMPORT_ERROR = exc

RECV_DEPTH = 128


class VerbsChannel(Channel):
    name = "verbs"
    needs_registered_source = True

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        if _IMPORT_ERROR is not None:
            return False, str(_IMPORT_ERROR)
        from ..devices import active_port
        found = active_port()
        if not found:
            return False, ("no RDMA device with an ACTIVE port (use `rdmatensor softroce vm`, or "
                           "`rdmatensor softroce up` where the kernel has rdma_rxe)")
        return True, f"{found[0].name} port {found[1].number}"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if _IMPORT_ERROR is not None:
            raise TransportError(f"verbs provider unavailable: {_IMPORT_ERROR}")
        self.ep = RcEndpoint(depth=2 * RECV_DEPTH)
        self._mrs: dict[int, object] = {}         # exposed region id -> MR
        self._sources: list[tuple[int, int, object]] = []   # (start, end, MR) we write from
        self._wr_ids = itertools.count(1)
        self._waiting: dict[int, list] = {}       # wr_id -> [Event, error]
        self._post_lock = threading.Lock()
        self._stop = threading.Event()
        self._bye = False
        self._poller: threading.Thread | None = None

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
        for _ in range(RECV_DEPTH):
            self.ep.post_recv()
        self.ep.connect(RcParams(**{k: peer_params[k] for k in ("qpn", "psn", "gid", "mtu")}))
        self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                        name=f"rdmatensor-verbs-{self.rank}<->{self.peer}")
        self._poller.start()

    def _source_mr(self, src: np.ndarray):
        addr = src.ctypes.data
        for start, end, mr in self._sources:
            if start <= addr and addr + src.nbytes <= end:
                return mr
        raise TransportError("verbs writes only from registered staging memory")

    def _post_and_wait(self, post) -> None:
        if self._lost:
            raise PeerLost(f"verbs channel to peer {self.peer} is down")
        wr_id = next(self._wr_ids)
        waiter = [threading.Event(), None]
        self._waiting[wr_id] = waiter
        try:
            with self._post_lock:
                post(wr_id)
            while not waiter[0].wait(1.0):
                if self._lost or self._stop.is_set():
                    raise PeerLost(f"verbs channel to peer {self.peer} went down during a write")
        finally:
            self._waiting.pop(wr_id, None)
        if waiter[1]:
            raise waiter[1]

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        desc = self.check_remote(region_id, offset, src.nbytes)
        mr = self._source_mr(src)
        remote = RemoteRegion(int(desc["addr"]), int(desc["size"]), int(desc["key"]))
        self._post_and_wait(lambda wr_id: self.ep.post_write(
            mr, src.ctypes.data, src.nbytes, remote, offset, imm=imm, wr_id=wr_id))

    def notify(self, imm: int) -> None:
        self._post_and_wait(lambda wr_id: self.ep.post_send_imm(imm, wr_id=wr_id))

    def _poll_loop(self) -> None:
        idle = 0
        try:
            while not self._stop.is_set():
                wcs = self.ep.poll(32, check=False)
                if not wcs:
                    if self._bye:
                        self.lost(PeerLost(f"peer {self.peer} closed the session"))
                        return
                    idle += 1
                    # Spin briefly (yielding the GIL), then back off to spare the CPU.
                    time.sleep(0 if idle < 200 else min(0.001, 0.00002 * (idle - 199)))
                    continue
                idle = 0
                for wc in wcs:
                    err = completion_error(wc)
                    if is_receive(wc):
                        if err:
                            raise TransportError(f"receive from peer {self.peer}: {err}")
                        self.ep.post_recv()
                        self.on_imm(wc.imm_data)
                        continue
                    waiter = self._waiting.get(wc.wr_id)
                    if err:
                        exc = TransportError(f"write to peer {self.peer}: {err}")
                        if waiter:
                            waiter[1] = exc
                            waiter[0].set()
                        raise exc
                    if waiter:
                        waiter[0].set()
        except Exception as exc:  # noqa: BLE001 - becomes the channel's sticky error
            if not self._stop.is_set():
                self.lost(exc if isinstance(exc, (TransportError, PeerLost)) else TransportError(str(exc)))
            for waiter in list(self._waiting.values()):
                waiter[0].set()

    def peer_said_bye(self) -> None:
        self._bye = True   # the poller reports it once the CQ is drained

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        self._mrs.clear()
        self._sources.clear()
        self.ep.close()
