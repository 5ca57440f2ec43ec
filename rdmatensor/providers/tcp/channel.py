"""tcp: one-sided writes emulated over a TCP connection: no serialization.

A write is its header and payload in one sendmsg(). The receiver's inbox
(inbox.py, compiled in _inbox.c) reads what the socket holds into a small
buffer, so that many headers and small payloads come in with one system
call, checks each header as a NIC would and lands its payload (a payload
larger than what is buffered is received straight into the target slot). A
waiting thread takes writes in itself, polling the socket for a short while
before it sleeps on it; the background reader takes over only while nobody
waits. A released slot's credit is owed rather than sent alone
(notify_later): it rides with the next write to the peer.
"""
from __future__ import annotations

import math
import select
import socket
import time

import numpy as np

from ...errors import PeerLost, RefusedWrite, TransportError
from . import inbox
from ..contract import Pieces
from ..emulated.write_header import WRITE_HEADER, WRITE_MAGIC
from ..emulated.stream_channel import StreamChannel

IOV_PAIRS = 500            # writes per sendmsg (two parts each, more for Pieces; the kernel takes up to IOV_MAX = 1024)
DEFER_SECONDS = 0.005     # a credit may wait this long for a write to ride with (PARK_SECONDS)
SLEEP_SLICE = 0.05        # the longest sleep before a waiter looks at its own side again
PARK_SECONDS = 0.005      # the background reader leaves the socket to a waiter this long after it waited
RECEIVE_BUFFER = 16384    # headers and small payloads come in together; larger payloads go straight in


class TcpChannel(StreamChannel):
    name = "tcp"

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        return True, "sockets are always available"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inbox = None                       # once connected
        self._owed = bytearray()                 # credits not sent yet: they go first (under _send_lock)
        self._looks_by = math.inf                # when the background thread next looks at the channel

    def _listen(self) -> socket.socket:
        sock = socket.create_server((self.host, 0))
        return sock

    def _address(self) -> dict:
        return {"host": self.host, "port": self._listener.getsockname()[1]}

    def _dial(self, params: dict, timeout: float) -> socket.socket:
        host, port = str(params["host"]), int(params["port"])
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range")
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port),
                                                timeout=max(0.1, deadline - time.monotonic()))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise PeerLost(f"cannot reach peer {self.peer}'s tcp data port "
                                   f"{params['host']}:{params['port']}: {exc}") from exc
                time.sleep(0.05)

    def _accept(self, timeout: float) -> socket.socket:
        sock = super()._accept(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _connected(self, peer_params: dict) -> None:
        self._inbox = inbox.make_inbox(self._sock, RECEIVE_BUFFER)
        self._inline_poller = select.poll()      # the waiters' (used under _read_lock); the thread has its own
        self._inline_poller.register(self._sock, select.POLLIN | select.POLLRDHUP)

    # -- the sender -------------------------------------------------------
    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        if isinstance(src, Pieces):
            self.write_many([(region_id, offset, src, imm)])
            return
        desc = self.check_remote(region_id, offset, src.nbytes)
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, region_id, desc["key"], imm, offset, src.nbytes), src)

    def write_many(self, writes: list) -> list:
        """Every header and payload in as few system calls as the kernel takes
        (one sendmsg of up to IOV_PAIRS writes)."""
        parts = []
        for region_id, offset, src, imm in writes:
            desc = self.check_remote(region_id, offset, src.nbytes)
            parts.append(WRITE_HEADER.pack(WRITE_MAGIC, region_id, desc["key"], imm, offset, src.nbytes))
            if isinstance(src, Pieces):                 # a gather write: its pieces are the payload's iovecs
                parts += [memoryview(p).cast("B") for p in src if p.nbytes]
            elif src.nbytes:
                parts.append(memoryview(src).cast("B"))
        sock = self._socket()
        try:
            with self._send_lock:
                if self._owed:
                    parts.insert(0, self._take_owed())
                for i in range(0, len(parts), 2 * IOV_PAIRS):
                    _send_parts(sock, parts[i:i + 2 * IOV_PAIRS])
        except OSError as exc:
            raise PeerLost(f"sending to peer {self.peer} failed: {exc}") from exc
        return [None] * len(writes)

    def notify(self, imm: int) -> None:
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, -1, 0, imm, 0, 0), None)

    def notify_later(self, imm: int) -> None:
        """A credit costs a system call of its own, as much as a small write:
        it is owed instead, and goes with the next write to the peer (one
        sendmsg for both), before this side next waits, or with the background
        thread's next look, which is due within DEFER_SECONDS; when it is not,
        at once."""
        header = WRITE_HEADER.pack(WRITE_MAGIC, -1, 0, imm, 0, 0)
        with self._send_lock:
            if self._sock is not None and not (self._lost or self._closing) \
                    and self._looks_by - time.monotonic() <= DEFER_SECONDS:
                self._owed += header
                return
        self._send(header, None)

    def _look_again(self, sleep: float) -> float:
        """The background thread, before it sleeps: send what is owed (what the
        kernel takes at once) and say when it looks again; how long it sleeps.
        It never waits for the send lock: a sender holds it while blocked in the
        kernel until the peer reads, and the peer's sender may be blocked the
        same way, so this thread must go on reading. What was owed when that
        sender took the lock left with its write; the rest goes at the next look."""
        if not self._send_lock.acquire(blocking=False):
            sleep = min(sleep, PARK_SECONDS)
            self._looks_by = time.monotonic() + sleep      # one float: notify_later reads it under the lock
            return sleep
        try:
            self._send_owed(block=False)
            if self._owed:
                sleep = min(sleep, PARK_SECONDS)     # the rest at the next look
            self._looks_by = time.monotonic() + sleep
        finally:
            self._send_lock.release()
        return sleep

    def _before_wait(self) -> None:
        try:
            self._flush_owed(block=True)     # the peer may be waiting for one of them
        except PeerLost as exc:
            self._fail(exc)

    def _half_close(self) -> None:
        self._before_wait()
        super()._half_close()

    def close(self) -> None:
        super().close()
        with self._read_lock:            # no poll() runs: its descriptor can go
            if self._inbox is not None:
                self._inbox.close()

    def _flush_owed(self, block: bool) -> None:
        """Send the credits owed (not blocking: what the kernel takes at once)."""
        if self._owed:
            with self._send_lock:
                self._send_owed(block)

    def _send_owed(self, block: bool) -> None:
        """_flush_owed(), under _send_lock."""
        owed, sock = self._owed, self._sock
        if not owed or sock is None:
            return
        try:
            if block:
                sock.sendall(owed)
                sent = len(owed)
            else:
                sent = sock.send(owed, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise PeerLost(f"sending to peer {self.peer} failed: {exc}") from exc
        del owed[:sent]

    def _socket(self) -> socket.socket:
        sock = self._sock
        if sock is None:
            raise TransportError(f"{self.name} channel to peer {self.peer} is not connected")
        return sock

    def _take_owed(self) -> bytes:
        """Under _send_lock: the credits owed, which go first, in the same system call."""
        owed, self._owed = bytes(self._owed), bytearray()
        return owed

    def _send(self, header: bytes, payload: np.ndarray | None) -> None:
        """Header and payload in one system call (the rest, if the kernel took only part)."""
        sock = self._socket()
        try:
            with self._send_lock:
                if self._owed:
                    header = self._take_owed() + header
                if payload is None or not payload.nbytes:
                    sock.sendall(header)
                    return
                sent = sock.sendmsg([header, payload])
                if sent < len(header):
                    sock.sendall(header[sent:])
                    sent = len(header)
                if sent - len(header) < payload.nbytes:
                    sock.sendall(memoryview(payload)[sent - len(header):])
        except OSError as exc:
            raise PeerLost(f"sending to peer {self.peer} failed: {exc}") from exc

    # -- the receiver -----------------------------------------------------
    def _poll(self, event, seconds: float) -> int:
        n = self._inbox.poll(event, self.local, self.on_imm, seconds)
        if n < 0:
            self._inbox_failed(n)
        return n

    def _doze(self, remaining: float) -> None:
        self._inline_poller.poll(math.ceil(min(remaining, SLEEP_SLICE) * 1000))

    def _inbox_failed(self, code: int) -> None:
        """The typed error for what the inbox would not take in."""
        if code == inbox.REFUSED:
            magic, region, key, _, offset, length = self._inbox.refused
            self.land(magic, region, key, offset, length)
            raise RefusedWrite(f"peer {self.peer} sent a write that does not land", peer=self.peer)
        if code == inbox.CLOSED:
            raise PeerLost(f"peer {self.peer} closed the connection", peer=self.peer)
        raise PeerLost(f"peer {self.peer} closed the connection in the middle of a message", peer=self.peer)

    def _background(self) -> None:
        """Take in writes while no thread waits for them. While one does (or
        did in the last PARK_SECONDS), watch only for the connection's end, so
        as not to wake up with every message it takes in itself."""
        readable, hang_up = select.POLLIN | select.POLLRDHUP, select.POLLRDHUP
        watch, events = select.poll(), readable
        watch.register(self._sock, events)
        while not self._closing and not self._lost:
            parked = self._read_lock.locked() or time.monotonic() - self._last_inline < PARK_SECONDS
            try:
                sleep = self._look_again(PARK_SECONDS if parked else 0.2)
                if (hang_up if parked else readable) != events:
                    events = hang_up if parked else readable
                    watch.modify(self._sock, events)
                ready = watch.poll(sleep * 1000)
            except PeerLost as exc:     # what was owed could not be sent
                self._fail(exc)
                break
            except (OSError, ValueError):
                break
            if ready and not self.progress():
                time.sleep(0.0005)      # a waiter is taking it in: let it finish
        self._looks_by = math.inf


def _send_parts(sock, parts: list) -> None:
    """sendmsg() until every part went (the kernel may take only some)."""
    first = 0
    while first < len(parts):
        sent = sock.sendmsg(parts[first:] if first else parts)
        while first < len(parts) and sent >= len(parts[first]):
            sent -= len(parts[first])
            first += 1
        if sent:
            parts[first] = memoryview(parts[first])[sent:]
