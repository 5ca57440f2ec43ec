"""One reliable-connected (RC) queue pair with its protection domain, completion
queue and memory regions, through pyverbs: the fallback for the compiled
endpoint (native_endpoint.py), with the same contract (rc.py).

Resources close children first (QP, MRs, CQ, PD, context), and `close()` is
idempotent. The hot path builds nothing: the work requests for writes,
immediates and receives are built once and reused (building one costs
microseconds, and Debian's pyverbs 44 never frees them: `__dealloc` in its
`wr.pyx`), receives are given back in batches with one doorbell, and the
completion queue has a completion channel whose file descriptor a thread can
block on with the GIL released (`wait_event`).
"""
from __future__ import annotations

import itertools
import os
import random
import select
import threading
import time

from ...devices import CONTEXT_LOCK, MTU_BYTES, MTU_ENUM
from ...errors import DeviceError, TransportError, UsageError, VerbsError
from ..contract import pair_imm
from .addressing import Fabric, port_identity, route
from .rc import (LOCAL_ONLY, MAX_CHAIN, MAX_REGION, RECV_BATCH, REMOTE_WRITE, EndpointHelpers, RcParams,
                 RemoteRegion, check_locked_memory, find_port)

try:
    import pyverbs.enums as ev
    from pyverbs.addr import AHAttr, GID, GlobalRoute
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR
except ImportError as exc:  # pragma: no cover - depends on the distribution
    raise DeviceError("pyverbs is not importable: install python3-pyverbs and use a virtualenv "
                      "made with --system-site-packages") from exc

__all__ = ["LOCAL_ONLY", "RECV_BATCH", "REMOTE_WRITE", "RcEndpoint", "RcParams", "RemoteRegion"]
RECV_TAG = 1 << 63         # marks a receive's wr_id: a flushed completion's opcode is undefined


class RcEndpoint(EndpointHelpers):
    def __init__(self, device: str | None = None, port: int = 1, gid_index: int | None = None,
                 depth: int = 256, recv_depth: int | None = None, fabric: Fabric | None = None):
        device, port, gid_index = find_port(device, port, gid_index)
        self.device, self.port, self.gid_index = device, port, gid_index
        self.fabric = fabric or Fabric.from_env()
        self.lid, self.link_layer = port_identity(device, port)
        self._mrs: list[MR] = []
        self._sources: list[tuple[int, int, MR]] = []     # local-only regions: (start, end, mr)
        self._post_lock = threading.Lock()               # posts mutate the shared work requests
        self._sends_posted = self._sends_completed = 0
        self.arrivals = 0                 # receives completed well: each one posted by the peer
        self._owed: list[int] = []       # immediates owed (credits): posted before the next send
        self.deferring = False           # while set, owe() takes immediates
        self.on_owed = None              # None, or called once (then None again) when owe() next takes one
        self._woken = 0                  # CQ events taken by wait_event()
        self.halted = False              # while set, prepared writes post nothing
        self._closed = False
        try:
            with CONTEXT_LOCK:
                self.ctx = Context(name=device)
            port_attr = self.ctx.query_port(port)
            if port_attr.state != ev.IBV_PORT_ACTIVE:
                raise DeviceError(f"{device} port {port} is not ACTIVE")
            self.active_mtu = port_attr.active_mtu
            self.gid = self.ctx.query_gid(port, self.gid_index)
            attr = self.ctx.query_device()
            self.depth = min(depth, attr.max_qp_wr)
            self.recv_depth = min(recv_depth or depth, attr.max_qp_wr)
            self.pd = PD(self.ctx)
            self.channel, self.event_fd = _completion_channel(self.ctx)
            self.cq = CQ(self.ctx, min(self.depth + self.recv_depth, attr.max_cqe), None, self.channel, 0)
            self.cq.req_notify()
            self._events = select.poll()
            if self.event_fd is not None:
                self._events.register(self.event_fd, select.POLLIN)
            cap = QPCap(max_send_wr=self.depth, max_recv_wr=self.recv_depth, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=ev.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
            self.qp = QP(self.pd, init)
            # INIT now, so receives can be posted before the peer is known.
            init_attr = QPAttr(port_num=port)
            init_attr.qp_access_flags = REMOTE_WRITE
            init_attr.pkey_index = self.fabric.pkey_index
            self.qp.to_init(init_attr)
            # pyverbs wants an SGE on every receive, though a write's immediate
            # never lands in it: all receives share this scratch region.
            self._recv_scratch = MR(self.pd, 64, ev.IBV_ACCESS_LOCAL_WRITE)
            self._send_scratch = MR(self.pd, 64, ev.IBV_ACCESS_LOCAL_WRITE)
            self._mrs += [self._recv_scratch, self._send_scratch]
            self._prepare_work_requests()
        except (PyverbsError, PyverbsRDMAError) as exc:
            self.close()
            raise VerbsError(f"cannot set up a queue pair on {device} port {port}: {exc}") from exc
        self.psn = random.getrandbits(24)

    # -- memory -----------------------------------------------------------
    def register(self, array, access: int = REMOTE_WRITE) -> MR:
        """Register a C-contiguous array's memory (kept alive by the caller), writable
        unless the NIC only reads it (no access flag)."""
        writes = access & (ev.IBV_ACCESS_LOCAL_WRITE | ev.IBV_ACCESS_REMOTE_WRITE)
        if not array.flags.c_contiguous or (writes and not array.flags.writeable):
            raise UsageError("only writable C-contiguous memory can be registered for writes" if writes
                             else "only C-contiguous memory can be registered")
        if array.nbytes == 0 or array.nbytes > MAX_REGION:
            raise UsageError(f"a region must hold 1 byte to 4 GiB, not {array.nbytes}")
        check_locked_memory(array)
        try:
            mr = MR(self.pd, array.nbytes, access, address=array.ctypes.data)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"registering {array.nbytes} bytes failed: {exc}") from exc
        self._mrs.append(mr)
        if not access & ev.IBV_ACCESS_REMOTE_WRITE:
            self._sources.append((array.ctypes.data, array.ctypes.data + array.nbytes, mr))
        return mr

    def deregister(self, mr: MR) -> None:
        if mr in self._mrs:
            self._mrs.remove(mr)
            self._sources = [s for s in self._sources if s[2] is not mr]
            start = mr.buf
            self._recv_into_wrs = {k: wr for k, wr in self._recv_into_wrs.items()
                                   if not start <= k[0] < start + mr.length}     # they carry its lkey
            mr.close()

    def _source_lkey(self, addr: int, length: int) -> int:
        for start, end, mr in self._sources:
            if start <= addr and addr + length <= end:
                return mr.lkey
        raise TransportError(f"verbs sends only from registered staging memory: [{addr:#x}, +{length}) is in "
                             f"no local-only region of this endpoint")

    # -- connection -------------------------------------------------------
    def params(self) -> RcParams:
        return RcParams(self.qp.qp_num, self.psn, str(self.gid), MTU_BYTES[self.active_mtu], self.lid,
                        self.link_layer, self.fabric.agreed())

    def connect(self, remote: RcParams) -> None:
        r = route(self.link_layer, str(self.gid), MTU_BYTES[self.active_mtu], self.gid_index, remote, self.fabric)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = REMOTE_WRITE
        if r.is_global:
            gr = GlobalRoute(dgid=GID(r.dgid), sgid_index=r.sgid_index, hop_limit=r.hop_limit,
                             traffic_class=r.traffic_class)
            attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self.port, sl=r.service_level)
        else:
            attr.ah_attr = AHAttr(is_global=0, dlid=r.dlid, port_num=self.port, sl=r.service_level)
        attr.path_mtu = MTU_ENUM[r.path_mtu]
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = r.timeout            # 4.096 us * 2^timeout per try
        attr.retry_cnt = r.retry_count
        attr.rnr_retry = 7     # infinite: the receiver re-posts receives as it consumes them
        try:
            self.qp.to_rtr(attr)
            self.qp.to_rts(attr)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"connecting QP {self.qp.qp_num} to remote QP {remote.qpn} "
                             f"(gid {remote.gid}) failed: {exc}") from exc

    # -- data path --------------------------------------------------------
    def _prepare_work_requests(self) -> None:
        scratch = self._recv_scratch
        self._recv_wrs = [RecvWR(wr_id=RECV_TAG, num_sge=1, sg=[SGE(scratch.buf, 64, scratch.lkey)])
                          for _ in range(RECV_BATCH)]
        for wr, nxt in itertools.pairwise(self._recv_wrs):
            wr.next_wr = nxt
        self._recv_owed = 0
        self._recv_into_wrs: dict[tuple[int, int, int], RecvWR] = {}
        self._write_sge = SGE(scratch.buf, 0, scratch.lkey)
        self._write_wr = SendWR(opcode=ev.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[self._write_sge],
                                send_flags=ev.IBV_SEND_SIGNALED)
        self._send_sge = SGE(scratch.buf, 0, scratch.lkey)
        self._send_wr = SendWR(opcode=ev.IBV_WR_SEND, num_sge=1, sg=[self._send_sge],
                               send_flags=ev.IBV_SEND_SIGNALED)
        self._imm_wr = SendWR(opcode=ev.IBV_WR_SEND_WITH_IMM, num_sge=1,
                              sg=[SGE(self._send_scratch.buf, 1, self._send_scratch.lkey)],
                              send_flags=ev.IBV_SEND_SIGNALED)

    def _post_numbered(self, wr, what: str) -> int:
        """Post the owed immediates, then a send with the next number; its number.
        0 (nothing posted) when the send queue lacks room for them all."""
        if not self._has_room(1):
            return 0
        self._post_owed()
        self._post_one(wr, what)
        return self._sends_posted

    def _has_room(self, sends: int) -> bool:
        return self._sends_posted - self._sends_completed + len(self._owed) + sends <= self.depth

    def _post_one(self, wr, what: str) -> None:
        wr.wr_id = self._sends_posted + 1
        try:
            self.qp.post_send(wr)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"{what} failed: {exc}") from exc
        self._sends_posted += 1

    def _post_owed(self) -> None:
        """Post what is owed (under _post_lock, room checked)."""
        owed, self._owed = self._owed, []
        for imm in owed:
            self._imm_wr.imm_data = imm
            self._post_one(self._imm_wr, "posting an owed immediate")

    def owe(self, imm: int) -> bool:
        """While `deferring`, the immediate goes before the next send instead of
        a post of its own (pyverbs has no chains: it saves nothing here but
        keeps the contract); False: not taken, post it yourself."""
        with self._post_lock:
            if not self.deferring:
                return False
            if len(self._owed) == MAX_CHAIN:
                if not self._has_room(0):
                    return False
                self._post_owed()
            self._owed.append(imm)
            wake, self.on_owed = self.on_owed, None
        if wake is not None:             # the background thread parked until a credit is owed
            wake()
        return True

    def post_owed(self) -> bool:
        """Post what is owed now; False if the send queue lacks room for it."""
        with self._post_lock:
            if not self._has_room(0):
                return False
            self._post_owed()
            return True

    @property
    def wakeups(self) -> dict:
        """CQ events taken by wait_event() (no waiter sleeps on the channel here)."""
        return {"wait_event": self._woken, "slept": 0, "handed_over": 0}

    @property
    def owed(self) -> int:
        return len(self._owed)

    def post_recv(self, count: int = 1) -> None:
        """Give back `count` receives for the immediates of incoming writes (no
        payload lands in them), in batches of RECV_BATCH, each one doorbell: up
        to RECV_BATCH - 1 are owed at any time, so size `recv_depth` for that."""
        self._recv_owed += count
        try:
            while self._recv_owed >= RECV_BATCH:
                self.qp.post_recv(self._recv_wrs[0])
                self._recv_owed -= RECV_BATCH
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"posting receives failed: {exc}") from exc

    def post_recv_into(self, dst, recv_id: int) -> None:
        """One receive into `dst` (registered local-only); its completion carries
        `recv_id`. pyverbs cannot re-point a receive's SGE, so each (buffer, id)
        gets its work request built once and reused."""
        key = dst.ctypes.data, dst.nbytes, recv_id
        wr = self._recv_into_wrs.get(key)
        if wr is None:
            sge = SGE(dst.ctypes.data, dst.nbytes, self._source_lkey(dst.ctypes.data, dst.nbytes))
            wr = self._recv_into_wrs[key] = RecvWR(wr_id=RECV_TAG | recv_id, num_sge=1, sg=[sge])
        try:
            self.qp.post_recv(wr)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"posting a receive failed: {exc}") from exc

    def post_write(self, src, remote: RemoteRegion, remote_offset: int, imm: int | None = None) -> int:
        """RDMA WRITE (WITH IMM) of `src` into the remote region; the send's number."""
        self._check_bounds(src, remote, remote_offset)
        with self._post_lock:
            return self._post_write(src, remote, remote_offset, imm)

    def prepare_write(self, src, remote: RemoteRegion, remote_offset: int, imm: int | None = None):
        """post_write() of these arguments, checked now: calling it posts it (its
        number, 0 if it did not: halted, closed or no room). The compiled
        endpoint builds the work request once; pyverbs reuses one anyway."""
        self._check_bounds(src, remote, remote_offset)
        self._source_lkey(src.ctypes.data, src.nbytes)

        def post() -> int:
            if self.halted or self._closed:
                return 0
            with self._post_lock:
                return self._post_write(src, remote, remote_offset, imm)
        return post

    def post_writes(self, writes) -> int:
        """Several (src, remote, offset, imm) writes, every one checked before any
        is posted; the first's number (the others follow), 0 if the queue lacks
        room. pyverbs posts them one by one: the chain is the compiled endpoint's."""
        if not 1 <= len(writes) <= MAX_CHAIN:
            raise UsageError(f"post_writes takes 1 to {MAX_CHAIN} writes, not {len(writes)}")
        for src, remote, offset, _ in writes:
            self._check_bounds(src, remote, offset)
            self._source_lkey(src.ctypes.data, src.nbytes)
        with self._post_lock:
            if not self._has_room(len(writes)):
                return 0
            writes, owed = [list(w) for w in writes], len(self._owed)
            for w in writes:                  # the last credits owed ride in the first writes they pair with
                both = pair_imm(w[3], self._owed[owed - 1]) if owed and w[3] is not None else None
                if both is not None:
                    w[3], owed = both, owed - 1
            del self._owed[owed:]
            self._post_owed()
            first = self._sends_posted + 1
            for w in writes:
                self._post_write(*w)
            return first

    @staticmethod
    def _check_bounds(src, remote: RemoteRegion, remote_offset: int) -> None:
        length = src.nbytes
        if remote_offset < 0 or remote_offset + length > remote.length:
            raise TransportError(f"write of {length} bytes at offset {remote_offset} is outside "
                                 f"the {remote.length}-byte remote region")

    def _post_write(self, src, remote: RemoteRegion, remote_offset: int, imm: int | None) -> int:
        length = src.nbytes
        sge, wr = self._write_sge, self._write_wr
        addr = src.ctypes.data
        sge.addr, sge.length, sge.lkey = addr, length, self._source_lkey(addr, length)
        wr.sg_list = sge
        wr.opcode = ev.IBV_WR_RDMA_WRITE if imm is None else ev.IBV_WR_RDMA_WRITE_WITH_IMM
        both = pair_imm(imm, self._owed[-1]) if imm is not None and self._owed else None
        wr.imm_data = (imm or 0) if both is None else both
        wr.set_wr_rdma(remote.rkey, remote.addr + remote_offset)
        if both is None:
            return self._post_numbered(wr, f"posting a {length}-byte write")
        credit = self._owed.pop()           # the last credit owed rides in this write
        number = self._post_numbered(wr, f"posting a {length}-byte write")
        if not number:
            self._owed.append(credit)
        return number

    def post_send_imm(self, imm: int) -> int:
        """A one-byte SEND carrying only an immediate (consumes one posted receive)."""
        with self._post_lock:
            if not self._has_room(1):
                return 0
            self._owed.append(imm)            # the owed ones first, then this one, through the same request
            self._post_owed()
            return self._sends_posted

    def post_send(self, src) -> int:
        """A SEND of `src` (registered local-only) into the peer's next posted receive."""
        with self._post_lock:
            sge, wr = self._send_sge, self._send_wr
            sge.addr, sge.length = src.ctypes.data, src.nbytes
            sge.lkey = self._source_lkey(sge.addr, src.nbytes)
            wr.sg_list = sge
            return self._post_numbered(wr, "posting a send")

    def wait_event(self, timeout: float) -> bool:
        """Block until the completion queue reports new work, at most `timeout`
        seconds, with the GIL released; True if it did. Re-arms the queue, so
        the caller polls once more afterwards. One thread at a time. Without a
        completion channel (see _completion_channel) this only sleeps briefly."""
        if self.event_fd is None:
            threading.Event().wait(min(timeout, 0.001))
            return False
        if not self._events.poll(timeout * 1000):
            return False
        self.channel.get_cq_event(self.cq)
        self.cq.ack_events(1)
        self._woken += 1
        self.cq.req_notify()
        return True

    def poll(self, max_entries: int = 32, spin: float = 0.0) -> list[tuple]:
        """Completed work as (wr_id, status, is_receive, imm, byte_len): a receive's
        own id, a send's number. With `spin`, polls up to that long until something
        completes (holding the GIL between polls: the compiled endpoint does not)."""
        n, wcs = self.cq.poll(num_entries=max_entries)
        if not n and spin > 0:
            end = time.monotonic() + spin
            while not n and time.monotonic() < end:
                time.sleep(0)
                n, wcs = self.cq.poll(num_entries=max_entries)
        out = []
        for wc in wcs[:n]:
            wr_id = wc.wr_id
            is_recv = wr_id >= RECV_TAG
            if not is_recv:
                self._sends_completed += 1
            elif wc.status == 0:
                self.arrivals += 1
            out.append((wr_id & ~RECV_TAG, wc.status, is_recv, wc.imm_data, wc.byte_len))
        return out

    def reap(self, on_imm, spin: float = 0.0) -> tuple:
        """poll(), then every receive given back and its immediate passed to
        on_imm(imm), in order, up to the first failed completion: (found, the
        last send number completed well, None or (wr_id, status, is_receive))."""
        done, last = self.poll(32, spin), 0
        for wr_id, status, is_receive, imm, _ in done:
            if status:
                return len(done), last, (wr_id, status, is_receive)
            if is_receive:
                self.post_recv()
                on_imm(imm)
            else:
                last = wr_id
        return len(done), last, None

    def waiter(self, channel, on_imm, poll_lock, spin: float, event_lock=None, sleep: float = 0.0) -> None:
        """None: no compiled spin here; the channel's wait_for() waits."""
        return None

    @staticmethod
    def status_name(status: int) -> str:
        try:
            return ev.ibv_wc_status(status).name
        except ValueError:
            return "unknown"

    @property
    def in_flight(self) -> int:
        return self._sends_posted - self._sends_completed

    # -- lifetime ---------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "qp", None) is not None:
            self.qp.close()
        for mr in self._mrs:
            mr.close()
        self._mrs.clear()
        self._sources.clear()
        with CONTEXT_LOCK:      # a descriptor closed here must not confuse _completion_channel
            for name in ("cq", "channel", "pd", "ctx"):
                obj = getattr(self, name, None)
                if obj is not None:
                    obj.close()


def _completion_channel(context) -> tuple:
    """A completion channel and its file descriptor. pyverbs 44 does not expose
    the descriptor, so it is found as the one event descriptor the channel's
    creation added to this process (this package opens contexts and channels
    under CONTEXT_LOCK). If that is ambiguous (another library opened a device
    meanwhile), None: the background thread then polls every millisecond
    instead of blocking, which costs CPU but is still correct."""
    with CONTEXT_LOCK:
        before = _event_fds()
        channel = CompChannel(context)
        new = set(_event_fds()) - set(before)
    return channel, (new.pop() if len(new) == 1 else None)


def _event_fds() -> dict[int, str]:
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue                      # closed meanwhile (listdir's own descriptor, for one)
        if "infinibandevent" in link:
            found[int(name)] = link
    return found
