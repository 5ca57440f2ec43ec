"""A completion ring: one direction's immediates in shared memory, no syscall per message.

The receiving side owns the segment (0600, unguessable name, unlinked at
close, like its arenas) and consumes; the peer maps it and produces. Each
entry is a write header (emulated/write_header.py's WRITE_HEADER: region, key, immediate,
offset, length), so the receiver checks an entry exactly as it checks a
header that came over a socket.

    0    magic, number of entries (a power of two)
    64   head: entries ever produced          (the producer's cache line)
    128  tail: entries ever consumed          (the consumer's)
    192  sleeping: while the consumer may sleep on its doorbell, the number
         of that sleep (1, 2, ...); 0 while it is awake
    256  entries, 32 bytes each

Ordering: the producer writes the payload, then the entry, then head; the
consumer reads head, then the entry, then stores tail. x86-64 keeps stores
in order and loads in order (total store order; the payload's memcpy fences
the non-temporal stores it uses for large copies), and head, tail and
`sleeping` are each one aligned 8-byte access, so no torn or early value is
seen. The one reordering x86
allows, a load passing an earlier store, matters where the producer checks
`sleeping` after publishing head and the consumer checks head after setting
`sleeping`: both sides put a full barrier in between (full_fence()), so at
least one of them sees the other's store and no wake-up is lost. Numbering
the sleeps lets the producer ring once per sleep, not once per entry while
the consumer wakes up.

The consumer trusts nothing the producer writes: head is checked against
tail and the capacity on every read, the consumer keeps its own tail, and
each entry is copied out of shared memory, then checked as a NIC checks a
write, before its immediate is reported.

The per-message operations (push, write, write_many, drain, poll) are
compiled (`_ring.c`, built by `make setup`): in Python they were about a
third of a round trip. The
Python ones below do the same where it is not built, or with
RDMATENSOR_SHM_RING=python.
"""
from __future__ import annotations

import itertools
import platform
import struct
import threading

import numpy as np

from ... import native
from ...errors import ForeignSegment
from ...memory import Arena, MappedArena
from ..emulated.waiting import Patience
from ..emulated.write_header import WRITE_HEADER, WRITE_MAGIC

RING_MAGIC = 0x52445452          # "RDTR"
INFO = struct.Struct("<II")      # magic, entries
HEAD_AT, TAIL_AT, SLEEPING_AT = 64, 128, 192     # 8-byte words, one cache line each
HEADER_BYTES = 256
ENTRY = WRITE_HEADER
MIN_ENTRIES = 64
_HEAD, _TAIL, _SLEEPING = HEAD_AT // 8, TAIL_AT // 8, SLEEPING_AT // 8

# The orderings above are x86-64's; other CPUs reorder plain stores and loads.
ORDERED_CPU = platform.machine().lower() in ("x86_64", "amd64")

_FENCE = threading.Lock()

RING_ENV = "RDMATENSOR_SHM_RING"     # "python" forces the Python ring where the compiled one is built
_compiled, BUILD_ERROR = native.load("rdmatensor.providers.shm._completion_ring")


def compiled() -> bool:
    """Whether new rings use the compiled operations."""
    return native.chosen(_compiled, RING_ENV)


def full_fence() -> None:
    """A full memory barrier between an earlier store and a later load.

    CPython's lock operations are atomic read-modify-writes (glibc's
    semaphore and mutex code), which on x86-64 are locked instructions: full
    barriers. This costs about 0.1 us, against 0.3-0.8 us for a ctypes call
    into libatomic."""
    _FENCE.acquire()
    _FENCE.release()


def entries_for(max_incoming: int) -> int:
    """Room for every immediate that can be in flight (credits bound them)."""
    n = MIN_ENTRIES
    while n < max_incoming:
        n *= 2
    return n


class CompletionRing:
    """One side of a ring: create() for the consumer, attach() for the producer."""

    def __init__(self, memory: Arena | MappedArena, entries: int):
        self.memory, self.entries = memory, entries
        self._mask = entries - 1
        self._bytes = memoryview(memory.buf)
        self._words = self._bytes[:HEADER_BYTES].cast("Q")
        self._head = 0           # the producer's own count of entries published
        self.rang = 0            # the producer's: the consumer's sleep it last rang the doorbell for
        self.sleeps = 0          # the consumer's: how many times it went to sleep
        self._tail = 0           # the consumer's own count (never read back from shared memory)
        self._refused: tuple | None = None    # what drain() would not take in: (head,) or an entry
        self._producer = threading.Lock()      # the Python push's steps, one thread at a time
        self._core = None
        if compiled():           # the same operations, compiled: bound here, no wrapper call per message
            self._core = core = _compiled.Ring(self._bytes, entries)
            self.push, self.write, self.write_many = core.push, core.write, core.write_many
            self.drain, self.poll, self.available = core.drain, core.poll, core.available
            self.sleeping, self.consumer_sleeping = core.sleeping, core.consumer_sleeping

    @property
    def head(self) -> int:
        return self._core.head if self._core is not None else self._head

    @property
    def tail(self) -> int:
        return self._core.tail if self._core is not None else self._tail

    @property
    def refused(self) -> tuple | None:
        return self._core.refused if self._core is not None else self._refused

    @property
    def name(self) -> str:
        return self.memory.name

    @classmethod
    def create(cls, max_incoming: int) -> "CompletionRing":
        """The consumer's ring, in a new shared segment."""
        entries = entries_for(max_incoming)
        arena = Arena(HEADER_BYTES + entries * ENTRY.size, shared=True)
        INFO.pack_into(arena.buf, 0, RING_MAGIC, entries)
        return cls(arena, entries)

    @classmethod
    def attach(cls, name: str, peer: int) -> "CompletionRing":
        """The producer's side: map the peer's ring, checking what its header claims."""
        mapped = MappedArena(name)
        try:
            if mapped.size < HEADER_BYTES:
                raise ForeignSegment(f"peer {peer}'s completion ring {name} is too small", peer=peer)
            magic, entries = INFO.unpack_from(mapped.buf, 0)
            if (magic != RING_MAGIC or entries < 1 or entries & (entries - 1)
                    or HEADER_BYTES + entries * ENTRY.size > mapped.size):
                raise ForeignSegment(f"peer {peer}'s segment {name} is not a completion ring", peer=peer)
            return cls(mapped, entries)
        except BaseException:
            mapped.close()
            raise

    # -- the producer -----------------------------------------------------
    def push(self, region: int, key: int, imm: int, offset: int, length: int) -> int | None:
        """Write the next entry and publish it, atomically with respect to the
        producer's other threads (the compiled push is one step under the
        interpreter lock). None (nothing written) while the ring is full (a
        stale tail only makes it look fuller than it is); else True if the
        consumer sleeps and nobody rang its doorbell for this sleep yet: ring
        it (this call counts it as rung)."""
        with self._producer:
            head = self._head
            if head - self._words[_TAIL] >= self.entries:
                return None
            ENTRY.pack_into(self._bytes, HEADER_BYTES + (head & self._mask) * ENTRY.size,
                            WRITE_MAGIC, region, key, imm, offset, length)
            self._words[_HEAD] = self._head = head + 1
            _FENCE.acquire()         # full_fence(), inline: head stored before `sleeping` is read
            _FENCE.release()
            sleep = self._words[_SLEEPING]
            if not sleep or sleep == self.rang:
                return False
            self.rang = sleep
            return True

    def write(self, target: memoryview, offset: int, src: np.ndarray, region: int, key: int, imm: int) -> bool | None:
        """Copy `src` into the mapped `target` at `offset` (ValueError, nothing
        copied, if it does not fit), then push() its entry."""
        n = src.nbytes
        if not 0 <= offset <= len(target) - n:
            raise ValueError(f"a {n}-byte write at {offset} does not fit {len(target)} bytes")
        target[offset:offset + n] = src
        return self.push(region, key, imm, offset, n)

    def write_many(self, targets: dict, writes: list, below: int) -> tuple[int, bool]:
        """write() of each (region, offset, src, imm) in order, the region looked
        up in `targets` (region id -> (mapped buffer, size, key)), while each is
        an array of 1 to below-1 bytes that fits its region and the ring has
        room. Stops at the first that is not, left to the caller: (how many
        went, whether the doorbell must ring)."""
        bell = False
        for done, (region, offset, src, imm) in enumerate(writes):
            target = targets.get(region)
            if (target is None or not isinstance(src, np.ndarray) or not 0 < src.nbytes < below
                    or not 0 <= offset <= target[1] - src.nbytes or self._head - self._words[_TAIL] >= self.entries):
                return done, bell
            bell |= bool(self.write(target[0], offset, src, region, target[2], imm))
        return len(writes), bell

    def consumer_sleeping(self) -> bool:
        return self._words[_SLEEPING] != 0

    # -- the consumer -----------------------------------------------------
    def drain(self, most: int, local: dict, on_imm) -> int:
        """Take in up to `most` entries: each copied out of shared memory, checked
        against `local` (region id -> (arena, key), the channel's exposed
        regions) as a NIC checks a write, then reported with on_imm(imm), whose
        true result means the channel is lost (take in no more). How many were
        taken in; -1, with `refused` set, when the next entry or head itself is
        the producer's fault (that entry is not taken in)."""
        return self._drain_some(most, local, on_imm)[0]

    def _drain_some(self, most: int, local: dict, on_imm) -> tuple[int, bool]:
        """drain(), and whether on_imm said the channel is lost."""
        tail = self._tail
        head = self._words[_HEAD]
        n = head - tail
        if not n:
            return 0, False
        if not 0 < n <= self.entries:
            self._refused = (head,)
            return -1, False
        n = min(n, most)
        first = tail & self._mask
        start = HEADER_BYTES + first * ENTRY.size
        if first + n <= self.entries:
            entries = ENTRY.iter_unpack(self._bytes[start:start + n * ENTRY.size])
        else:
            wrapped = first + n - self.entries
            entries = itertools.chain(ENTRY.iter_unpack(self._bytes[start:HEADER_BYTES + self.entries * ENTRY.size]),
                                      ENTRY.iter_unpack(self._bytes[HEADER_BYTES:HEADER_BYTES + wrapped * ENTRY.size]))
        taken = 0
        try:
            for entry in entries:
                magic, region, key, imm, offset, length = entry
                if magic != WRITE_MAGIC or (length and not _lands(local.get(region), key, offset, length)):
                    self._refused = entry
                    return -1, False
                taken += 1
                if on_imm(imm):
                    return taken, True
            return taken, False
        finally:
            if taken:
                self._tail += taken
                self._words[_TAIL] = self._tail

    def poll(self, event, most: int, local: dict, on_imm, seconds: float) -> int:
        """drain() until event.is_set() (an event of None: until any entry was
        taken in), on_imm says the channel is lost, or `seconds` passed,
        yielding the core between looks. How many were taken in; -1 as drain()."""
        found, patience = 0, Patience(seconds)
        while True:
            n, stop = self._drain_some(most, local, on_imm)
            if n < 0:
                return -1
            found += n
            if stop or (event.is_set() if event is not None else found):
                return found
            if patience.exhausted():
                return found

    def available(self) -> int:
        """How many entries wait; -1 when head is not to be believed."""
        n = self._words[_HEAD] - self._tail
        return n if 0 <= n <= self.entries else -1

    def sleeping(self, flag: bool) -> None:
        """Say that the consumer goes to sleep (a new sleep's number, then a
        full barrier before the caller's last look at head), or is awake."""
        if flag:
            self.sleeps += 1
            self._words[_SLEEPING] = self.sleeps
            full_fence()
        else:
            self._words[_SLEEPING] = 0

    def close(self) -> None:
        if self._core is not None:
            self._core.close()
        try:
            self._words.release()
            self._bytes.release()
        except BufferError:
            pass                 # a write still in flight holds it: the mapping goes when that ends
        self.memory.close()


def _lands(entry: tuple | None, key: int, offset: int, length: int) -> bool:
    """check_local()'s test, for an (arena, key) entry of the channel's exposed regions."""
    return entry is not None and key == entry[1] and offset + length <= entry[0].size
