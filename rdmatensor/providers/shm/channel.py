"""shm: peers on the same host, with no system call per message.

The receiver's arenas are shared-memory segments the sender maps; a write is
a memcpy into one, then an entry (the write header) in the receiver's
completion ring (completion_ring.py), which the receiver checks like a NIC (region,
key, bounds) before it reports the immediate. A waiting receiver polls its
ring for a short while, then sleeps on the Unix socket the sender dialed; the
sender sends a doorbell byte only when the ring says its consumer sleeps.
The socket carries nothing else: its hang-up is how a lost peer is seen, at
once, by a thread that sleeps until then.
"""
from __future__ import annotations

import math
import os
import secrets
import select
import socket
import time

import numpy as np

from ... import streaming
from ...errors import ForeignSegment, PeerLost, RdmaTensorError, RefusedWrite, TransportError
from ...memory import Arena, MappedArena
from ..contract import Capabilities, Pieces
from .completion_ring import ORDERED_CPU, CompletionRing
from ..emulated.stream_channel import StreamChannel

SLEEP_SLICE = 0.05         # the longest sleep before a waiter looks at its own side again
RING_FULL_TIMEOUT = 60.0   # a peer that takes in nothing this long is broken (credits keep a ring from filling)
# Completions taken in at a time: a sender that finds a whole step's credits
# waiting takes in one batch, writes, and so on, while its peer already reads.
DRAIN_BATCH = 64
_HANG_UP = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL


class ShmChannel(StreamChannel):
    name = "shm"
    capabilities = Capabilities(shared_arenas=True)

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        if (not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds")
                or not os.access("/proc/self/fd", os.R_OK)):
            return False, "shared arenas need memfd_create, descriptor passing and /proc"
        if not ORDERED_CPU:
            return False, "the shm completion ring relies on x86-64's store order"
        return True, "peers on this host map each other's arenas"

    def __init__(self, *args, max_incoming: int = 128, **kwargs):
        self._path = f"\0rdmatensor-{secrets.token_hex(12)}"   # abstract: no file to clean up
        super().__init__(*args, max_incoming=max_incoming, **kwargs)
        self._mapped: dict[int, tuple[MappedArena, memoryview]] = {}   # region id -> the peer's segment
        self._targets: dict[int, tuple[memoryview, int, int]] = {}     # region id -> (its view, size, key)
        self._ring_in = CompletionRing.create(max_incoming)    # the peer's completions to this side
        self._ring_out: CompletionRing | None = None           # this side's, in the peer's segment
        self._doorbell = select.poll()
        self._scratch = bytearray(4096)

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self._path)
        sock.listen()
        return sock

    def _address(self) -> dict:
        return {"path": self._path.encode().hex(), "host_id": host_id(), "ring": self._ring_in.name}

    def accept_peer(self, peer_params: dict) -> None:
        theirs = str(peer_params.get("host_id") or "")
        if theirs != host_id():
            if theirs.split(":", 1)[0] == host_id().split(":", 1)[0]:          # same boot: same host
                raise TransportError(f"peer {self.peer} runs on this host but in another PID namespace (another "
                                     f"container): shm takes the peer's memory only from the process whose pid "
                                     f"the peer announced, so both need one PID namespace (docker run --pid=host, "
                                     f"shareProcessNamespace in a Kubernetes pod), or set RDMATENSOR_PROVIDER=tcp")
            raise TransportError(f"peer {self.peer} is on another host: shm needs both on one host")

    def _dial(self, params: dict, timeout: float) -> socket.socket:
        self.accept_peer(params)
        deadline = time.monotonic() + timeout
        path = bytes.fromhex(params["path"]).decode()
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise PeerLost(f"cannot reach peer {self.peer}'s shm socket: {exc}") from exc
                time.sleep(0.05)

    def _connected(self, peer_params: dict) -> None:
        self._ring_out = CompletionRing.attach(str(peer_params["ring"]), self.peer)
        self._doorbell.register(self._sock, select.POLLIN | select.POLLRDHUP)

    def expose(self, region_id: int, arena: Arena) -> dict:
        if arena.name is None:
            raise TransportError("shm can only expose shared arenas")
        return {**super().expose(region_id, arena), "shm_name": arena.name}

    def attach(self, descriptor: dict) -> None:
        # Map first: a region the sender cannot map must not count as attached.
        rid = int(descriptor["region_id"])
        try:
            mapped = MappedArena(descriptor["shm_name"], int(descriptor["size"]))
        except (OSError, ValueError, RdmaTensorError) as exc:   # the peer named what we cannot map
            raise ForeignSegment(f"cannot map peer {self.peer}'s region {rid}: {exc}", peer=self.peer) from exc
        self._unmap(rid)
        self._mapped[rid] = (mapped, memoryview(mapped.buf))
        super().attach(descriptor)
        desc = self.remote[rid]
        self._targets[rid] = (self._mapped[rid][1], int(desc["size"]), int(desc["key"]))

    def _unmap(self, region_id: int) -> None:
        self._targets.pop(region_id, None)
        old = self._mapped.pop(region_id, None)
        if old:
            try:
                old[1].release()
            except BufferError:
                pass                     # a write still copies into it: the mapping goes after
            old[0].close()

    # -- the sender -------------------------------------------------------
    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        ring = self._ring_out
        if ring is not None and not (self._lost or self._closing or isinstance(src, Pieces)):
            # A small write: looked up, checked, copied and posted in one compiled
            # call; anything it does not take goes the way below, which raises.
            done, ring_bell = ring.write_many(self._targets, [(region_id, offset, src, imm)],
                                              streaming.STREAM_BYTES)
            if done:
                if ring_bell:
                    self._ring_doorbell()
                return
        n = src.nbytes
        key = self.check_remote(region_id, offset, n)["key"]
        target = self._mapped[region_id][1] if n else None
        if isinstance(src, Pieces):                     # each piece straight into the peer's slot
            stream, at = n >= streaming.STREAM_BYTES, offset
            for piece in src:
                streaming.copy(target[at:at + piece.nbytes], piece, stream)
                at += piece.nbytes
        elif n >= streaming.STREAM_BYTES:               # the peer reads it from memory, not from this core's cache
            streaming.copy(target[offset:offset + n], src, True)
        elif n:
            self._post(region_id, key, imm, offset, n, (target, src))   # the ring copies it, then posts
            return
        self._post(region_id, key, imm, offset, n)

    def write_many(self, writes: list) -> list:
        """Small writes go in one compiled call (the ring copies and posts each);
        from the first that cannot (large, pieces, a full ring, a bad region or
        bounds), write() takes them one at a time, and raises what it must."""
        ring = self._ring_out
        if ring is None or self._lost or self._closing:
            return super().write_many(writes)   # raises as write() does
        done, ring_bell = ring.write_many(self._targets, writes, streaming.STREAM_BYTES)
        if ring_bell:
            self._ring_doorbell()
        for w in writes[done:]:
            self.write(*w)
        return [None] * len(writes)

    def notify(self, imm: int) -> None:
        self._post(-1, 0, imm, 0, 0)

    def _post(self, region: int, key: int, imm: int, offset: int, length: int, payload: tuple | None = None) -> None:
        """Put a completion in the peer's ring, after copying `payload` (target,
        source) if given; ring the peer's doorbell only if it sleeps."""
        ring = self._ring_out
        if ring is None or self._lost or self._closing:
            raise PeerLost(f"the shm channel to peer {self.peer} is "
                           f"{'not connected' if ring is None else 'closed'}", peer=self.peer)
        if payload is None:                  # push and write are atomic (completion_ring.py): no lock here
            ring_bell = ring.push(region, key, imm, offset, length)
        else:
            ring_bell = ring.write(payload[0], offset, payload[1], region, key, imm)
        if ring_bell is None:
            ring_bell = self._push_when_room(ring, (region, key, imm, offset, length))
        if ring_bell:
            self._ring_doorbell()

    def _ring_doorbell(self) -> None:
        """Wake the peer, which sleeps on its doorbell (the ring said so)."""
        try:
            self._sock.send(b"\1", socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass                         # unread doorbells wait already: the peer wakes anyway
        except OSError as exc:
            raise PeerLost(f"peer {self.peer}'s doorbell failed: {exc}", peer=self.peer) from exc

    def _push_when_room(self, ring: CompletionRing, entry: tuple) -> bool:
        """The peer's ring is full: wait while it takes in, taking in this
        side's own completions meanwhile (the peer may wait for one of them)."""
        deadline = time.monotonic() + RING_FULL_TIMEOUT
        while (ring_bell := ring.push(*entry)) is None:
            if self._lost or self._closing:
                raise PeerLost(f"the shm channel to peer {self.peer} closed while its ring was full",
                               peer=self.peer)
            if time.monotonic() > deadline:
                raise TransportError(f"peer {self.peer} took in no completion for {RING_FULL_TIMEOUT:.0f} s",
                                     peer=self.peer)
            self.progress()
            time.sleep(0.0001)
        return ring_bell

    # -- the receiver -----------------------------------------------------
    def _poll(self, event, seconds: float) -> int:
        n = self._ring_in.poll(event, DRAIN_BATCH, self.local, self.on_imm, seconds)
        if n < 0:
            self._refuse(self._ring_in.refused)
        return n

    def _drain(self) -> int:
        """Take in a batch of completions: each checked like a NIC, then reported."""
        ring = self._ring_in
        n = ring.drain(DRAIN_BATCH, self.local, self.on_imm)
        if n < 0:
            self._refuse(ring.refused)
        return n

    def _refuse(self, refused: tuple) -> None:
        """The typed error for what the ring would not take in: a head that went
        backwards or past the capacity, or an entry that fails land()."""
        if len(refused) == 1:
            raise RefusedWrite(f"peer {self.peer} moved its completion ring's head to {refused[0]} "
                               f"(consumed {self._ring_in.tail}, {self._ring_in.entries} entries)", peer=self.peer)
        magic, region, key, _, offset, length = refused
        self.land(magic, region, key, offset, length)
        raise RefusedWrite(f"peer {self.peer} wrote a completion that does not land", peer=self.peer)

    def _doze(self, remaining: float) -> None:
        """Sleep on the doorbell, once the ring says so and is still empty."""
        ring = self._ring_in
        ring.sleeping(True)              # and a full barrier before the last look at head (completion_ring.py)
        try:
            if ring.available():
                return
            for _, events in self._doorbell.poll(math.ceil(min(remaining, SLEEP_SLICE) * 1000)):
                if events & select.POLLIN:
                    if self._sock.recv_into(self._scratch, len(self._scratch), socket.MSG_DONTWAIT) == 0:
                        self._hang_up()
                elif events & _HANG_UP:
                    self._hang_up()
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            ring.sleeping(False)

    def _hang_up(self) -> None:
        """The peer's end closed: what it completed before is still delivered."""
        while self._drain() and not self._lost:
            pass
        raise PeerLost(f"peer {self.peer} closed the connection", peer=self.peer)

    def _background(self) -> None:
        """Sleep until the connection hangs up (only then: doorbells are the waiters'),
        and report the loss at once."""
        watch = select.poll()
        watch.register(self._sock, select.POLLRDHUP)
        while not self._closing and not self._lost:
            try:
                if not watch.poll(1000):
                    continue
            except (OSError, ValueError):
                break
            with self._read_lock:        # a waiter taking in completions finishes first
                if not self._closing and not self._lost:
                    try:
                        self._hang_up()
                    except Exception as exc:  # noqa: BLE001 - typed and reported there
                        self._read_failed(exc)
            break

    def close(self) -> None:
        if self._closing:
            return
        super().close()
        for ring in (self._ring_in, self._ring_out):
            if ring is not None:
                ring.close()
        for rid in list(self._mapped):
            self._unmap(rid)


_HOST_ID = None


def host_id() -> str:
    """Identifies this host and PID namespace (a peer's arenas are taken only
    from the pid its locators name), so shm is not tried across them."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        except OSError:
            boot = socket.gethostname()
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = ""
        _HOST_ID = f"{boot}:{pid_ns}"
    return _HOST_ID
