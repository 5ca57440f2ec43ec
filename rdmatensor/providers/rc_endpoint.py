"""One reliable-connected (RC) queue pair with its protection domain, completion
queue and memory regions, through pyverbs.

This is the verbs layer the `verbs` provider is built on: register memory
once, exchange `RcParams` out of band, then post one-sided writes. Resources
close children first (QP, MRs, CQ, PD, context), and `close()` is idempotent.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np

from ..devices import MTU_BYTES, MTU_ENUM, active_port, list_devices
from ..errors import DeviceError, TransportError, UsageError, VerbsError

try:
    import pyverbs.enums as ev
    from pyverbs.addr import AHAttr, GID, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR
except ImportError as exc:  # pragma: no cover - depends on the distribution
    raise DeviceError("pyverbs is not importable: install python3-pyverbs and use a virtualenv "
                      "made with --system-site-packages") from exc

# Receive arenas: the peer may write, nobody may read remotely.
REMOTE_WRITE = ev.IBV_ACCESS_LOCAL_WRITE | ev.IBV_ACCESS_REMOTE_WRITE
# Staging memory we send from: local access only.
LOCAL_ONLY = ev.IBV_ACCESS_LOCAL_WRITE
MAX_REGION = 4 << 30

@dataclass(frozen=True)
class RcParams:
    """What a peer needs to connect its QP to ours."""
    qpn: int
    psn: int
    gid: str
    mtu: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RemoteRegion:
    """Where a peer may write: address, length, key."""
    addr: int
    length: int
    rkey: int


class RcEndpoint:
    def __init__(self, device: str | None = None, port: int = 1, gid_index: int | None = None,
                 depth: int = 256, recv_depth: int | None = None):
        if device is None:
            found = active_port()
            if not found:
                names = [d.name for d in list_devices()]
                raise DeviceError("no RDMA device with an ACTIVE port" +
                                  (f" (found {', '.join(names)}, none ACTIVE)" if names else ""))
            device, port = found[0].name, found[1].number
            gid = found[1].roce_v2_gid()
            gid_index = gid.index if gid_index is None and gid else (gid_index or 0)
        self.device, self.port, self.gid_index = device, port, gid_index or 0
        self._mrs: list[MR] = []
        self._closed = False
        try:
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
            self.cq = CQ(self.ctx, min(self.depth + self.recv_depth, attr.max_cqe))
            cap = QPCap(max_send_wr=self.depth, max_recv_wr=self.recv_depth, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=ev.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
            self.qp = QP(self.pd, init)
            # INIT now, so receives can be posted before the peer is known.
            init_attr = QPAttr(port_num=port)
            init_attr.qp_access_flags = REMOTE_WRITE
            self.qp.to_init(init_attr)
            # pyverbs wants an SGE on every receive, though a write's immediate
            # never lands in it: all receives share this scratch region.
            self._recv_scratch = MR(self.pd, 64, ev.IBV_ACCESS_LOCAL_WRITE)
            self._send_scratch = MR(self.pd, 64, ev.IBV_ACCESS_LOCAL_WRITE)
            self._mrs += [self._recv_scratch, self._send_scratch]
        except (PyverbsError, PyverbsRDMAError) as exc:
            self.close()
            raise VerbsError(f"cannot set up a queue pair on {device} port {port}: {exc}") from exc
        self.psn = random.getrandbits(24)

    # -- memory -----------------------------------------------------------
    def register(self, array: np.ndarray, access: int = REMOTE_WRITE) -> MR:
        """Register a C-contiguous array's memory (kept alive by the caller)."""
        if not array.flags.c_contiguous:
            raise UsageError("only C-contiguous memory can be registered")
        if array.nbytes == 0 or array.nbytes > MAX_REGION:
            raise UsageError(f"a region must hold 1 byte to 4 GiB, not {array.nbytes}")
        try:
            mr = MR(self.pd, array.nbytes, access, address=array.ctypes.data)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"registering {array.nbytes} bytes failed: {exc}") from exc
        self._mrs.append(mr)
        return mr

    def deregister(self, mr: MR) -> None:
        if mr in self._mrs:
            self._mrs.remove(mr)
            mr.close()

    @staticmethod
    def remote_region(array: np.ndarray, mr: MR) -> RemoteRegion:
        return RemoteRegion(array.ctypes.data, array.nbytes, mr.rkey)

    # -- connection -------------------------------------------------------
    def params(self) -> RcParams:
        return RcParams(self.qp.qp_num, self.psn, str(self.gid), MTU_BYTES[self.active_mtu])

    def connect(self, remote: RcParams) -> None:
        mtu = min(remote.mtu, MTU_BYTES[self.active_mtu])
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = REMOTE_WRITE
        gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self.port)
        attr.path_mtu = MTU_ENUM[mtu]
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14      # 4.096 us * 2^14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7     # infinite: the receiver re-posts receives as it consumes them
        try:
            self.qp.to_rtr(attr)
            self.qp.to_rts(attr)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"connecting QP {self.qp.qp_num} to remote QP {remote.qpn} "
                             f"(gid {remote.gid}) failed: {exc}") from exc

    # -- data path --------------------------------------------------------
    def post_recv(self, wr_id: int = 0) -> None:
        """A receive for the immediate of an incoming write (no payload lands here)."""
        sge = SGE(self._recv_scratch.buf, 64, self._recv_scratch.lkey)
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))

    def post_write(self, mr: MR, addr: int, length: int, remote: RemoteRegion, remote_offset: int,
                   imm: int | None = None, wr_id: int = 0) -> None:
        if remote_offset < 0 or remote_offset + length > remote.length:
            raise TransportError(f"write of {length} bytes at offset {remote_offset} is outside "
                                 f"the {remote.length}-byte remote region")
        sge = SGE(addr, length, mr.lkey)
        opcode = ev.IBV_WR_RDMA_WRITE if imm is None else ev.IBV_WR_RDMA_WRITE_WITH_IMM
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                    imm_data=imm or 0, send_flags=ev.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote.rkey, remote.addr + remote_offset)
        try:
            self.qp.post_send(wr)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"posting a {length}-byte write failed: {exc}") from exc

    def poll(self, max_entries: int = 16, check: bool = True) -> list:
        """Completed work. With `check`, a failed completion raises with its status named;
        without, the caller inspects each with `completion_error()`."""
        n, wcs = self.cq.poll(num_entries=max_entries)
        wcs = wcs[:n]
        if check:
            for wc in wcs:
                err = completion_error(wc)
                if err:
                    raise VerbsError(err)
        return wcs

    def post_send_imm(self, imm: int, wr_id: int = 0) -> None:
        """A one-byte SEND carrying only an immediate (consumes one posted receive)."""
        sge = SGE(self._send_scratch.buf, 1, self._send_scratch.lkey)
        wr = SendWR(wr_id=wr_id, opcode=ev.IBV_WR_SEND_WITH_IMM, num_sge=1, sg=[sge],
                    imm_data=imm, send_flags=ev.IBV_SEND_SIGNALED)
        try:
            self.qp.post_send(wr)
        except (PyverbsError, PyverbsRDMAError) as exc:
            raise VerbsError(f"posting an immediate failed: {exc}") from exc

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
        for name in ("cq", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()

    def __enter__(self) -> "RcEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def completion_error(wc) -> str | None:
    if wc.status == ev.IBV_WC_SUCCESS:
        return None
    return f"work request {wc.wr_id} failed: {_wc_status_name(wc.status)} (status {wc.status})"


def is_receive(wc) -> bool:
    return bool(wc.opcode & ev.IBV_WC_RECV)


def _wc_status_name(status: int) -> str:
    try:
        return ev.ibv_wc_status(status).name
    except ValueError:
        return "unknown"
