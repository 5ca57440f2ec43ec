"""Arenas: page-aligned memory, registered once, carved into slots.

An arena is either private anonymous memory (verbs, tcp, grpc) or a POSIX
shared-memory segment (shm, so a peer on the same host can map it). Either
way it is page-aligned and handed to a provider to register once; slots are
views into it, never separate allocations.

A segment's name lives only until the peer has mapped it: MappedArena
unlinks it right after mapping, so a rank killed later (SIGKILL, OOM) leaves
nothing in /dev/shm; the memory goes with the last process that maps it.
Under a launcher, names carry the job's id (RDMATENSOR_JOB), so the
launcher can remove what a rank killed during setup left behind.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat

import numpy as np

from .errors import ForeignSegment, UsageError
from .plan import MAX_ARENA_BYTES, Slot

PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "rdmatensor-"
JOB_ID = re.compile(r"[0-9a-f]{1,32}")


def segment_prefix(job: str | None = None) -> str:
    """What the names of this job's segments start with: rdmatensor-JOB- under a
    launcher (RDMATENSOR_JOB, hex), else rdmatensor-."""
    job = os.environ.get("RDMATENSOR_JOB", "") if job is None else job
    return f"{SEGMENT_PREFIX}{job}-" if JOB_ID.fullmatch(job) else SEGMENT_PREFIX


def _map_shared(name: str, size: int | None, create: bool) -> mmap.mmap:
    """Map a segment; `size` None (opening only) maps all of it."""
    path = os.path.join(SHM_DIR, name)
    # 0600 and O_EXCL: only this user can map it, and never a segment someone planted.
    # Opening a peer's segment: no symlink followed, no FIFO waited on, and only a
    # regular file of this user's is mapped.
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_CREAT | os.O_EXCL if create else os.O_NONBLOCK
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        else:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ForeignSegment(f"{name} is not a shared segment of this user")
            if size is None:
                size = st.st_size
            if size <= 0 or st.st_size < size:
                raise ForeignSegment(f"shared segment {name} holds {st.st_size} bytes, expected {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


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
        self._name = None
        if shared:
            # Unguessable name: the segment is only reachable by whoever the
            # control plane told (an authenticated peer).
            self._name = f"{segment_prefix()}{secrets.token_hex(12)}"
            self._map = _map_shared(self._name, size, create=True)
        else:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self._map, dtype=np.uint8, count=size)
        self._closed = False

    @property
    def name(self) -> str | None:
        """The shared-memory segment's name (shared arenas only)."""
        return self._name

    @property
    def address(self) -> int:
        return self.buf.ctypes.data

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise UsageError(f"view [{offset}, {offset + nbytes}) is outside a {self.size}-byte arena")
        return self.buf[offset:offset + nbytes]

    def slot_view(self, slot: Slot) -> np.ndarray:
        return self.view(slot.offset, slot.size)

    def close(self) -> None:
        """Release the memory. Views must be gone (numpy holds the buffer otherwise)."""
        if self._closed:
            return
        self._closed = True
        self.buf = None
        _unmap(self._map)
        if self._name:
            _unlink(self._name)        # never mapped by a peer: the name is still there

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MappedArena:
    """A peer's shared arena, mapped into this process (the shm provider's remote side).
    Its name is unlinked once mapped: the two mappings keep the memory, and
    nothing is left in /dev/shm however either process ends."""

    def __init__(self, name: str, size: int | None = None):
        """Map `size` bytes of the peer's segment `name` (all of it when None)."""
        if "/" in name or not name.startswith(SEGMENT_PREFIX):
            raise ForeignSegment(f"{name!r} is not an rdmatensor segment name")
        self._map = _map_shared(name, size, create=False)
        _unlink(name)
        self.name, self.size = name, len(self._map)
        self.buf = np.frombuffer(self._map, dtype=np.uint8, count=self.size)

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf = None
        _unmap(self._map)
