"""Arenas: page-aligned memory, registered once, carved into slots.

An arena is either private anonymous memory (verbs, tcp, grpc) or shared
memory (shm, so a peer on the same host can map it). Either way it is
page-aligned and handed to a provider to register once; slots are views into
it, never separate allocations.

Shared memory has no name in any file system: it is an anonymous memfd that
the peer opens through /proc/<pid>/fd of the rank that made it (a
`locator`), so however the ranks end (SIGKILL, OOM, both at once) nothing is
left in /dev/shm; the memory goes with the last process that holds it. The
memfd is sealed at its size, so the mapper cannot be cut short (SIGBUS).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import stat

import numpy as np

from .errors import ForeignSegment, UsageError
from .plan import MAX_ARENA_BYTES

PAGE = mmap.PAGESIZE
SEGMENT_PREFIX = "rdmatensor-"
JOB_ID = re.compile(r"[0-9a-f]{1,32}")
# name:pid:fd; the name carries an unguessable token, so only a peer the
# control plane told (an authenticated one) can name the segment.
LOCATOR = re.compile(r"(rdmatensor-(?:[0-9a-f]{1,32}-)?[0-9a-f]{24}):([1-9][0-9]{0,9}):([0-9]{1,9})")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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


def _create_shared(name: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise


def _open_shared(locator: str, size: int | None) -> mmap.mmap:
    """Map a peer's segment; `size` None maps all of it. Only a sealed memfd of
    this user with the name the locator gives is mapped, whatever the fd
    number turned out to be by the time it was opened."""
    m = LOCATOR.fullmatch(locator)
    if not m:
        raise ForeignSegment(f"{locator!r} is not an rdmatensor segment locator")
    name, pid, number = m.groups()
    try:
        fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ForeignSegment(f"cannot open segment {name} of process {pid}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if (os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{name} (deleted)"
                or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
            raise ForeignSegment(f"process {pid}'s fd {number} is not the segment {name}")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ForeignSegment(f"segment {name} is not sealed at its size")
        if size is None:
            size = st.st_size
        if size <= 0 or st.st_size < size:
            raise ForeignSegment(f"shared segment {name} holds {st.st_size} bytes, expected {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


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
        self._name, self._fd = None, -1
        if shared:
            name = f"{segment_prefix()}{secrets.token_hex(12)}"
            self._fd, self._map = _create_shared(name, size)
            self._name = f"{name}:{os.getpid()}:{self._fd}"
        else:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self._map, dtype=np.uint8, count=size)
        self._closed = False

    @property
    def name(self) -> str | None:
        """How a peer on this host maps it, its locator (shared arenas only)."""
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
        if self._fd >= 0:
            os.close(self._fd)         # peers' mappings keep the memory, nothing else does
            self._fd = -1

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MappedArena:
    """A peer's shared arena, mapped into this process (the shm provider's remote side)."""

    def __init__(self, name: str, size: int | None = None):
        """Map `size` bytes of the peer's segment (`name`: its locator; all of it when None)."""
        self._map = _open_shared(name, size)
        self.name, self.size = name, len(self._map)
        self.buf = np.frombuffer(self._map, dtype=np.uint8, count=self.size)

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf = None
        _unmap(self._map)
