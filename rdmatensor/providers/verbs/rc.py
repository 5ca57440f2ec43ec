"""What the two RC endpoints share: their contract, parameters and helpers.

An RC endpoint is one reliable-connected queue pair with its protection
domain, completion queue (and completion channel) and memory regions. There
are two with the same methods:

- `native_endpoint.NativeEndpoint`, compiled (`_native_endpoint.c`, built by `make
  setup` from libibverbs-dev): posts, polls and waits with nothing allocated
  and the GIL released where it blocks or spins. The default when built.
- `pyverbs_endpoint.RcEndpoint`, through Debian's pyverbs: the fallback.

`choose_endpoint.py` says which one a channel opens.

The contract (both):

    register(buffer, access) -> mr (.rkey)      deregister(mr)
    params() -> RcParams                         connect(RcParams)
    post_write(src, RemoteRegion, offset, imm=None) -> send number, 0 if the send queue is full
    post_writes([(src, RemoteRegion, offset, imm), ...]) -> the first's number, 0 without room
                                                 (up to MAX_CHAIN writes, one doorbell, all checked first)
    prepare_write(src, RemoteRegion, offset, imm=None) -> post: post() -> number, 0 if it did not post
                                                 (checked once; .halted makes every post() return 0)
    post_send_imm(imm) -> send number            post_send(src) -> send number
    owe(imm) -> bool (taken only while .deferring)   post_owed() -> bool (False: no room)   owed
    post_recv(count=1)                           post_recv_into(dst, recv_id)
    poll(max_entries=32, spin=0.0) -> [(wr_id, status, is_receive, imm, byte_len)]
    reap(on_imm, spin=0.0) -> (found, last send done, None or (wr_id, status, is_receive))
                                                 (poll(), receives given back, immediates to on_imm)
    wait_event(timeout) -> bool                  status_name(status) -> str
    wakeups -> {'wait_event': n, 'slept': n, 'handed_over': n}
                                                 (events taken by wait_event(), waits ended asleep,
                                                  waits left to the thread holding a lock)
    arrivals -> n                                (receives completed well: each one the peer posted)
    on_owed: None, or called once when owe() next takes an immediate
    waiter(channel, on_imm, poll_lock, spin, event_lock=None, sleep=0) -> w(flag, limit=None) -> True or None,
        or None for no waiter; w(None) polls once
                                                 (VerbsChannel.wait_for()'s spin in one call: the native one)
    close()                                      depth, recv_depth, device

Sends are numbered 1, 2, 3... in the order they were posted and complete in
that order (one RC send queue). Owed immediates (credits) are posted as
SEND WITH IMM ahead of the next post, in its chain, numbered before it; a
post counts them when it checks for room. A write's immediate carries the
last one owed instead where the two pair (base.pair_imm: one work request,
not two). Writes and sends go only from memory
registered without REMOTE_WRITE (both endpoints check it): staging and what
register_source() is given are registered READ_ONLY, access 0, the least
there is (the HCA only reads it, locally). A write outside the remote region
is a TransportError and is not posted.
"""
from __future__ import annotations

import functools
import resource
from dataclasses import asdict, dataclass
from typing import NamedTuple

from ...errors import VerbsError
from . import choose_port


# ibv_access_flags (verbs ABI): receive arenas may be written by the peer,
# never read remotely; memory we only send from is read by the NIC alone (no
# flag: local read); local-only buffers that receives land in are LOCAL_ONLY.
ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE = 1, 2
REMOTE_WRITE = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
LOCAL_ONLY = ACCESS_LOCAL_WRITE
READ_ONLY = 0
MAX_REGION = 4 << 30
RECV_BATCH = 16            # consumed receives given back with one post (a chain of work requests)
MAX_CHAIN = 32             # writes posted with one doorbell (post_writes)

@dataclass(frozen=True)
class RcParams:
    """What a peer needs to connect its QP to ours."""
    qpn: int
    psn: int
    gid: str
    mtu: int
    lid: int = 0                    # InfiniBand's address within a subnet (0 on RoCE)
    link_layer: str = "Ethernet"    # or "InfiniBand"
    fabric: str = ""                # the path settings both ends must share (addressing.Fabric.agreed)

    def to_dict(self) -> dict:
        return asdict(self)


class RemoteRegion(NamedTuple):
    """Where a peer may write: address, length, key (a tuple: the compiled endpoint reads it as one)."""
    addr: int
    length: int
    rkey: int


def gid_bytes(gid: str) -> bytes:
    """'fe80:0000:...' (8 groups of 4 hex digits, as sysfs and pyverbs write it) -> 16 bytes."""
    raw = bytes.fromhex(gid.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"a GID is 16 bytes, not {len(raw)}: {gid!r}")
    return raw


def gid_str(raw: bytes) -> str:
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def find_port(device: str | None, port: int, gid_index: int | None) -> tuple[str, int, int]:
    """(device, port, GID index) to open: as given, else as choose_port decides
    (RDMATENSOR_IB_HCA, RDMATENSOR_IB_GID_INDEX, the NIC nearest this rank);
    DeviceError naming what is missing."""
    if device is not None:
        return device, port, gid_index or 0
    device, port, chosen_gid = choose_port.choose()
    return device, port, chosen_gid if gid_index is None else gid_index


CAP_IPC_LOCK = 14          # capability(7): lock memory past RLIMIT_MEMLOCK


@functools.cache
def _locks_without_limit() -> bool:
    """CAP_IPC_LOCK in this process's effective set: read once, since a gather write
    registers its large pieces one by one on the step path."""
    caps = _status("CapEff")
    return caps is not None and bool(int(caps, 16) >> CAP_IPC_LOCK & 1)


def _status(field: str) -> str | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{-(-nbytes // 1024)} KiB"


def check_locked_memory(array) -> None:
    """Before registering `array`: VerbsError in one line naming the limit, the
    size needed and the fix, where the kernel would refuse it. Registration
    pins the pages it spans, counted against RLIMIT_MEMLOCK with those pinned
    already (`VmPin`) unless the process has CAP_IPC_LOCK (root has it, and so
    never sees this); past the limit, ibv_reg_mr fails with a bare ENOMEM."""
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if limit == resource.RLIM_INFINITY or _locks_without_limit():
        return
    page = resource.getpagesize()
    nbytes = memoryview(array).nbytes
    start = array.ctypes.data if hasattr(array, "ctypes") else 0
    pages = (start % page + nbytes + page - 1) // page
    pinned = int((_status("VmPin") or "0 kB").split()[0]) * 1024 // page
    if pages and pinned + pages > limit // page:
        raise VerbsError(
            f"registering {_size(nbytes)} for RDMA needs {_size((pinned + pages) * page)} of locked memory, above "
            f"this process's limit of {_size(limit)} (RLIMIT_MEMLOCK, no CAP_IPC_LOCK): raise it with "
            f"`ulimit -l unlimited`, a memlock line in /etc/security/limits.conf (`* - memlock unlimited`), "
            f"or `docker run --ulimit memlock=-1`")


class EndpointHelpers:
    """What both endpoints add to their verbs objects."""

    @staticmethod
    def remote_region(array, mr) -> RemoteRegion:
        """How a peer names `array` (registered as `mr`) to write into it."""
        return RemoteRegion(array.ctypes.data, array.nbytes, mr.rkey)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
