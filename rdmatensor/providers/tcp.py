"""tcp: one-sided writes emulated over a TCP connection, payload received
straight into the target slot (recv_into): no serialization, no extra copy."""
from __future__ import annotations

import select
import socket
import threading
import time

import numpy as np

from ..errors import PeerLost, TransportError
from .base import WRITE_HEADER, WRITE_MAGIC
from .stream import StreamChannel


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean EOF before the first byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise PeerLost("connection closed in the middle of a message")
        got += n
    return True


class TcpChannel(StreamChannel):
    name = "tcp"

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        return True, "sockets are always available"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header = bytearray(WRITE_HEADER.size)
        self._last_inline = 0.0

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
        # One poll object per user: the reader thread's, and the inline one
        # (used under _read_lock); a poll object is not safe to share.
        self._poller, self._inline_poller = select.poll(), select.poll()
        for p in (self._poller, self._inline_poller):
            p.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)

    # -- the sender -------------------------------------------------------
    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        desc = self.check_remote(region_id, offset, src.nbytes)
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, region_id, desc["key"], imm, offset, src.nbytes), src)

    def notify(self, imm: int) -> None:
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, -1, 0, imm, 0, 0), None)

    def _send(self, header: bytes, payload: np.ndarray | None) -> None:
        if self._sock is None:
            raise TransportError(f"{self.name} channel to peer {self.peer} is not connected")
        try:
            with self._send_lock:
                self._sock.sendall(header)
                if payload is not None and payload.nbytes:
                    self._sock.sendall(memoryview(payload))
        except OSError as exc:
            raise PeerLost(f"sending to peer {self.peer} failed: {exc}") from exc

    # -- the receiver -----------------------------------------------------
    def _read_one(self, header: bytearray) -> None:
        """Take in one write: check it like a NIC, land its payload, report its immediate."""
        sock = self._sock
        if not _recv_exact(sock, memoryview(header)):
            raise PeerLost(f"peer {self.peer} closed the connection")
        magic, region, key, imm, offset, length = WRITE_HEADER.unpack(header)
        arena = self.land(magic, region, key, offset, length)
        if arena is not None:
            target = memoryview(arena.buf)[offset:offset + length]
            if not _recv_exact(sock, target):
                raise PeerLost(f"peer {self.peer} closed the connection mid-payload")
        self.on_imm(imm)

    def wait_for(self, event, timeout: float) -> bool:
        """Block in the kernel on the socket itself and take in what arrives on
        this thread: one wake-up per message, no hand-off from the reader thread,
        no spinning. Another thread already reading means just waiting."""
        deadline = time.monotonic() + timeout
        while not event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            t0 = time.monotonic()
            if not self.progress(block_for=min(remaining, 0.05)) and time.monotonic() - t0 < 0.0001:
                event.wait(min(remaining, 0.0005))     # someone else is reading, or the channel is down
        return True

    def progress(self, block_for: float = 0.0) -> bool:
        """Take in every write waiting on the socket, on the calling thread,
        first waiting up to `block_for` seconds for one to arrive."""
        if threading.current_thread() is not self._reader:
            self._last_inline = time.monotonic()
        if self._sock is None or self._closing or self._lost:
            return False
        if not self._read_lock.acquire(blocking=False):
            return False
        try:
            return bool(self._guarded(self._take_in, int(block_for * 1000)))
        finally:
            self._read_lock.release()

    def _take_in(self, wait_ms: int) -> bool:
        found = False
        while not self._closing and not self._lost and self._inline_poller.poll(0 if found else wait_ms):
            self._read_one(self._header)
            found = True
        return found

    def _background(self) -> None:
        """Background progress: wake when the socket is readable, unless a
        waiting thread is already spinning on it."""
        while not self._closing and not self._lost:
            try:
                ready = self._poller.poll(200)
            except (OSError, ValueError):
                break
            if not ready:
                continue
            if self._read_lock.locked() or time.monotonic() - self._last_inline < 0.002:
                time.sleep(0.0005)      # a waiter is reading inline: let it take this
                continue
            self.progress()
