"""Arenas: page-aligned memory, registered once, carved into slots.

An arena is either private anonymous memory (verbs, tcp, grpc) or shared
memory (shm, so a peer on the same host can map it). Either way it is
page-aligned and handed to a provider to register once; slots are views into
it, never separate allocations.

Shared memory has no name in any file system: it is an anonymous memfd, so
however the ranks end (SIGKILL, OOM, both at once) nothing is left in
/dev/shm; the memory goes with the last process that maps it. The memfd is
sealed at its size, so the mapper cannot be cut short (SIGBUS).

Its descriptor goes to one peer, once. Right after the memfd is made and
mapped, its descriptor is parked in the queue of a socket of this process
(in flight: in no descriptor table, so /proc/<pid>/fd shows a socket, which
cannot be opened, never the memory). The arena's `locator` names the
segment, this process's pid, its hand-over socket (abstract, served by a
thread while any arena waits) and a one-time nonce; it travels only over
the authenticated control plane. The peer connects, checks with
SO_PEERCRED that the socket is the owner's (the pid in the locator, this
user), and presents the nonce; the owner checks that the caller is a
process of this user and that the nonce is one it gave, then sends the
parked socket (SCM_RIGHTS) and forgets the nonce. A caller with a wrong
nonce, none, or of another user gets nothing, and is counted
(refused_handovers()) and logged.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import secrets
import selectors
import socket
import stat
import struct
import sys
import threading
import time

import numpy as np

from .errors import ForeignSegment, TransportError, UsageError
from .plan import MAX_ARENA_BYTES

PAGE = mmap.PAGESIZE
SEGMENT_PREFIX = "rdmatensor-"
JOB_ID = re.compile(r"[0-9a-f]{1,32}")
# name:pid:hand-over socket:nonce. The nonce is the secret: only a peer the
# control plane told it (an authenticated one) is handed the segment.
LOCATOR = re.compile(r"(rdmatensor-(?:[0-9a-f]{1,32}-)?[0-9a-f]{24}):([1-9][0-9]{0,9}):([0-9a-f]{24}):([0-9a-f]{32})")
NONCE_BYTES = 16
HANDOVER_TIMEOUT = 10.0    # seconds a caller has to present its nonce, and a mapper waits for the owner
MAX_PENDING = 64           # callers presenting a nonce at once; the oldest goes first
_POLL = 0.1                # how soon the hand-over thread sees that no arena waits any more
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_CRED = struct.Struct("3i")                    # struct ucred: pid, uid, gid
log = logging.getLogger("rdmatensor")


def segment_prefix(job: str | None = None) -> str:
    """What the names of this job's segments start with: rdmatensor-JOB- under a
    launcher (RDMATENSOR_JOB, hex), else rdmatensor-. Shown in /proc/*/maps."""
    job = os.environ.get("RDMATENSOR_JOB", "") if job is None else job
    return f"{SEGMENT_PREFIX}{job}-" if JOB_ID.fullmatch(job) else SEGMENT_PREFIX


def mapped_segments() -> list[str]:
    """The names of the rdmatensor segments this process maps now (its own and
    its peers'), for leak checks."""
    with open("/proc/self/maps") as f:
        return sorted({line.split("/memfd:", 1)[1].split()[0] for line in f
                       if "/memfd:" + SEGMENT_PREFIX in line})


def refused_handovers() -> int:
    """How many callers this process's hand-over socket sent away (wrong or no
    nonce, another user) since it started."""
    return _OFFERS.refused


def _peer_cred(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _digest(nonce: bytes) -> bytes:
    return hashlib.sha256(nonce).digest()     # looked up by its hash: no timing of the nonce itself


class _Offers:
    """This process's hand-over socket and the arenas waiting on it. A thread
    serves it while any arena waits; then the socket closes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: dict[bytes, socket.socket] = {}    # digest of a nonce -> the parked socket
        self.listener: socket.socket | None = None
        self.address = ""                                 # hex; the abstract name is derived from it
        self.refused = 0

    def offer(self, parked: socket.socket) -> tuple[bytes, str, str]:
        """Wait for the peer with `parked`; (the offer's digest, socket, nonce) for the locator."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        digest = _digest(nonce)
        with self.lock:
            if self.listener is None:
                address = secrets.token_hex(12)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    listener.bind(_abstract(address))
                    listener.listen(MAX_PENDING)
                    listener.setblocking(False)
                except BaseException:
                    listener.close()
                    raise
                self.listener, self.address = listener, address
                threading.Thread(target=self._serve, args=(listener,), daemon=True,
                                 name="rdmatensor-arena-handover").start()
            self.waiting[digest] = parked
            return digest, self.address, nonce.hex()

    def withdraw(self, digest: bytes) -> None:
        """The arena closes: nobody may take it any more."""
        with self.lock:
            parked = self.waiting.pop(digest, None)
        if parked is not None:
            parked.close()

    def forget(self) -> None:
        """In a forked child: the parent's offers and thread are not this process's."""
        self.lock = threading.Lock()
        for s in [*self.waiting.values(), self.listener]:
            if s is not None:
                s.close()
        self.waiting, self.listener, self.address = {}, None, ""

    def _refuse(self, pid: int, uid: int, why: str) -> None:
        self.refused += 1
        log.warning("refused a shared-memory hand-over to process %d (uid %d): %s", pid, uid, why)

    def _serve(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, list] = {}     # conn -> [nonce buffer, bytes read, deadline, pid, uid]

        def drop(conn: socket.socket) -> None:
            pending.pop(conn, None)
            sel.unregister(conn)
            conn.close()

        try:
            sel.register(listener, selectors.EVENT_READ)
            while True:
                with self.lock:               # stop and let go of the socket in one step: an offer
                    if self.listener is not listener:     # made after this starts a new one
                        return
                    if not self.waiting:
                        self.listener, self.address = None, ""
                        return
                now = time.monotonic()
                for conn in [c for c, st in pending.items() if st[2] <= now]:
                    self._refuse(pending[conn][3], pending[conn][4], "no nonce in time")
                    drop(conn)
                for key, _ in sel.select(_POLL):
                    if key.fileobj is listener:
                        self._accept(listener, sel, pending, drop)
                        continue
                    conn = key.fileobj
                    st = pending.get(conn)
                    if st is None:
                        continue
                    try:
                        n = conn.recv_into(memoryview(st[0])[st[1]:])
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        n = 0
                    if n == 0:
                        self._refuse(st[3], st[4], "hung up before its nonce")
                        drop(conn)
                        continue
                    st[1] += n
                    if st[1] == NONCE_BYTES:
                        pending.pop(conn)
                        sel.unregister(conn)
                        with conn:
                            self._hand_over(conn, bytes(st[0]), st[3], st[4])
        except Exception:  # noqa: BLE001 - a thread's end is logged, never silent
            log.exception("the shared-memory hand-over thread failed")
        finally:
            with self.lock:
                if self.listener is listener:     # it failed: the next offer starts a new one
                    self.listener, self.address = None, ""
            for conn in list(pending):
                drop(conn)
            sel.close()
            listener.close()

    def _accept(self, listener: socket.socket, sel, pending: dict, drop) -> None:
        """A caller: one of this user's waits for its nonce; anyone else is sent away."""
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            pid, uid = _peer_cred(conn)
        except OSError:
            conn.close()
            return
        if uid != os.geteuid():
            self._refuse(pid, uid, "a process of another user")
            conn.close()
            return
        if len(pending) >= MAX_PENDING:
            oldest = min(pending, key=lambda c: pending[c][2])
            self._refuse(pending[oldest][3], pending[oldest][4], "no nonce while others waited")
            drop(oldest)
        conn.setblocking(False)
        pending[conn] = [bytearray(NONCE_BYTES), 0, time.monotonic() + HANDOVER_TIMEOUT, pid, uid]
        sel.register(conn, selectors.EVENT_READ)

    def _hand_over(self, conn: socket.socket, nonce: bytes, pid: int, uid: int) -> None:
        with self.lock:
            parked = self.waiting.pop(_digest(nonce), None)
        if parked is None:
            self._refuse(pid, uid, "a nonce of no waiting arena")
            return
        with parked:                       # handed over or not, it goes: the nonce was used
            try:
                conn.settimeout(HANDOVER_TIMEOUT)
                socket.send_fds(conn, [b"\1"], [parked.fileno()])
            except OSError as exc:
                log.warning("a shared-memory hand-over to process %d failed: %s", pid, exc)


_OFFERS = _Offers()
os.register_at_fork(after_in_child=_OFFERS.forget)


def offer_descriptor(fd: int) -> tuple[bytes, str, str]:
    """Offer a duplicate of `fd` to one local process of this user that proves the
    nonce (fetch_descriptor): (the offer's key, the hand-over address, the nonce).
    The address and nonce travel only over an authenticated channel;
    withdraw_descriptor(key) once the peer took it or gave up."""
    parked, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with sender:
            socket.send_fds(sender, [b"\1"], [fd])
        return _OFFERS.offer(parked)
    except BaseException:
        parked.close()
        raise


def withdraw_descriptor(key: bytes) -> None:
    """Nobody may take the offer any more (its duplicate descriptor is closed)."""
    _OFFERS.withdraw(key)


def _abstract(address: str) -> str:
    return f"\0rdmatensor-arenas-{address}"


def _map_shared(fd: int, size: int) -> mmap.mmap:
    """mmap() of `fd`, leaving no descriptor of it behind. Python's mmap keeps
    a duplicate of the descriptor it maps (trackfd=False drops it from 3.13 on),
    through which /proc/<pid>/fd would open the segment: before 3.13 that
    duplicate is pointed at /dev/null instead."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, trackfd=False)
    segment = os.fstat(fd)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    for entry in os.listdir("/proc/self/fd"):
        dup = int(entry)
        try:
            st = os.fstat(dup)
        except OSError:
            continue                       # listdir's own descriptor, gone by now
        if dup != fd and (st.st_dev, st.st_ino) == (segment.st_dev, segment.st_ino):
            null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.dup2(null, dup, inheritable=False)   # mmap closes it with the mapping
            finally:
                os.close(null)
    return mapping


def _create_shared(name: str, size: int) -> tuple[mmap.mmap, socket.socket]:
    """The mapped segment, and the socket its descriptor is parked in."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = _map_shared(fd, size)
        try:
            parked, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                with sender:
                    socket.send_fds(sender, [b"\1"], [fd])
            except BaseException as exc:
                parked.close()
                if isinstance(exc, OSError) and exc.errno == errno.ETOOMANYREFS:
                    raise TransportError(f"cannot park shared segment {name}: this user's descriptors in flight "
                                         f"(arenas waiting for their peers) exceed its open-file limit: raise "
                                         f"`ulimit -n`") from exc
                raise
        except BaseException:
            mapping.close()
            raise
        return mapping, parked
    finally:
        os.close(fd)


def _take_one_fd(sock: socket.socket, what: str, flags: int = 0) -> int:
    """The one descriptor a message on `sock` carries (others it carried are closed)."""
    msg, fds, _, _ = socket.recv_fds(sock, 1, 1, socket.MSG_CMSG_CLOEXEC | flags)
    if len(fds) != 1 or msg != b"\1":
        for fd in fds:
            os.close(fd)
        raise ForeignSegment(f"{what} sent no descriptor")
    return fds[0]


def fetch_descriptor(name: str, pid: int, address: str, nonce: bytes) -> int:
    """The descriptor of segment `name`, from its owner `pid` (an arena's, or one
    offer_descriptor() offered), proven by the peer's credentials; the caller closes it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(HANDOVER_TIMEOUT)
        try:
            conn.connect(_abstract(address))
        except OSError as exc:
            raise ForeignSegment(f"cannot reach process {pid}'s hand-over of segment {name}: "
                                 f"{exc.strerror or exc}") from exc
        their_pid, their_uid = _peer_cred(conn)
        if their_pid != pid or their_uid != os.geteuid():
            raise ForeignSegment(f"the hand-over socket of segment {name} is process {their_pid}'s (uid "
                                 f"{their_uid}), not process {pid}'s of this user")
        try:
            conn.sendall(nonce)
            fd = _take_one_fd(conn, f"process {pid} (segment {name})")
        except OSError as exc:
            raise ForeignSegment(f"process {pid} did not hand over segment {name}: {exc}") from exc
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ForeignSegment(f"process {pid} handed over something else than segment {name}")
        with socket.socket(fileno=fd) as parked:
            fd = -1
            try:
                return _take_one_fd(parked, f"process {pid}'s segment {name}", socket.MSG_DONTWAIT)
            except OSError as exc:
                raise ForeignSegment(f"process {pid}'s hand-over of segment {name} held nothing: {exc}") from exc
    finally:
        if fd >= 0:
            os.close(fd)


def _open_shared(locator: str, size: int | None) -> tuple[str, mmap.mmap]:
    """Map a peer's segment (its name and the mapping); `size` None maps all of
    it. Only a sealed memfd of this user with the name the locator gives,
    handed over by the process it names, is mapped."""
    m = LOCATOR.fullmatch(locator)
    if not m:
        raise ForeignSegment("not an rdmatensor segment locator: " + repr(locator[:64]))
    name, pid, address, nonce = m.groups()
    if size is not None and size <= 0:
        raise ForeignSegment(f"shared segment {name} cannot be mapped at {size} bytes")
    fd = fetch_descriptor(name, int(pid), address, bytes.fromhex(nonce))
    try:
        st = os.fstat(fd)
        if (os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{name} (deleted)"
                or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
            raise ForeignSegment(f"process {pid} handed over something else than segment {name}")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ForeignSegment(f"segment {name} is not sealed at its size")
        if size is None:
            size = st.st_size
        if size <= 0 or st.st_size < size:
            raise ForeignSegment(f"shared segment {name} holds {st.st_size} bytes, expected {size}")
        return name, _map_shared(fd, size)
    finally:
        os.close(fd)                       # the mapping keeps the memory; no descriptor is left to open


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # a view is still alive: the mapping goes when the last one does


class Arena:
    def __init__(self, size: int, shared: bool = False):
        if not 0 < size <= MAX_ARENA_BYTES:
            raise UsageError(f"an arena holds 1 byte to 4 GiB, not {size}")
        size = (size + PAGE - 1) // PAGE * PAGE
        self.size = size
        self._name, self._offer = None, None
        if shared:
            name = f"{segment_prefix()}{secrets.token_hex(12)}"
            self._map, parked = _create_shared(name, size)
            try:
                self._offer, address, nonce = _OFFERS.offer(parked)
            except BaseException:
                parked.close()
                _unmap(self._map)
                raise
            self._name = f"{name}:{os.getpid()}:{address}:{nonce}"
        else:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self._map, dtype=np.uint8, count=size)
        self._closed = False

    @property
    def name(self) -> str | None:
        """How a peer on this host maps it, once: its locator (shared arenas
        only), a secret to tell only over the authenticated control plane."""
        return self._name

    @property
    def address(self) -> int:
        return self.buf.ctypes.data

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise UsageError(f"view [{offset}, {offset + nbytes}) is outside a {self.size}-byte arena")
        return self.buf[offset:offset + nbytes]

    def close(self) -> None:
        """Release the memory. Views must be gone (numpy holds the buffer otherwise)."""
        if self._closed:
            return
        self._closed = True
        self.buf = None
        _unmap(self._map)
        if self._offer is not None:
            _OFFERS.withdraw(self._offer)   # not taken yet: now nobody can; a peer's mapping keeps the memory
            self._offer = None

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MappedArena:
    """A peer's shared arena, mapped into this process (the shm provider's remote side)."""

    def __init__(self, name: str, size: int | None = None):
        """Map `size` bytes of the peer's segment (`name`: its locator; all of it when None)."""
        self.name, self._map = _open_shared(name, size)     # the segment's name: the locator's nonce is spent
        self.size = len(self._map)
        self.buf = np.frombuffer(self._map, dtype=np.uint8, count=self.size)

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf = None
        _unmap(self._map)
