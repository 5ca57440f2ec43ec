"""Emulated one-sided writes over a byte stream: the shared core of tcp and shm.

The responder listens, the initiator dials and proves it was told the
responder's key over the authenticated control plane. Each write is a header
(region, key, immediate, offset, length), checked against the exposed regions
exactly as a NIC checks an rkey, and then either the payload itself, received
straight into the target region (tcp), or nothing because the payload was
already copied into the peer's mapped region (shm). A refused write closes
the connection and is reported.
"""
from __future__ import annotations

import hmac
import secrets
import select
import selectors
import socket
import threading
import time
from abc import abstractmethod

import numpy as np

from ..errors import PeerLost, RefusedWrite, TransportError
from .base import WRITE_HEADER, WRITE_MAGIC, Channel

AUTH_BYTES = 32
HANDSHAKE_TIMEOUT = 5.0     # seconds a dialer has to present the key
MAX_PENDING = 64           # handshakes in progress at once; the oldest goes first


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


class StreamChannel(Channel):
    payload_inline = True      # tcp: payload follows the header on the stream

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._key = secrets.token_bytes(AUTH_BYTES)
        self._listener = self._listen()
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closing = False
        self._read_lock = threading.Lock()
        self._header = bytearray(WRITE_HEADER.size)
        self._last_inline = 0.0

    # -- what each stream transport provides -----------------------------
    @abstractmethod
    def _listen(self) -> socket.socket:
        """A listening socket for the peer's data connection."""

    @abstractmethod
    def _dial(self, params: dict, timeout: float) -> socket.socket:
        """Connect to the peer's listener described by its `params`."""

    @abstractmethod
    def _address(self) -> dict:
        """Where this side listens, as channel parameters."""

    def params(self) -> dict:
        return {**self._address(), "key": self._key.hex()}

    def connect(self, peer_params: dict, initiator: bool, timeout: float) -> None:
        if initiator:
            try:
                key = bytes.fromhex(peer_params["key"])
                sock = self._dial(peer_params, timeout)
            except (KeyError, ValueError, TypeError, OverflowError) as exc:   # fields missing or garbled
                raise TransportError(f"peer {self.peer} sent unusable {self.name} channel parameters: "
                                     f"{type(exc).__name__}: {exc}") from exc
            try:
                sock.sendall(key)
            except OSError as exc:
                sock.close()
                raise PeerLost(f"peer {self.peer} hung up during the {self.name} handshake: {exc}") from exc
        else:
            sock = self._accept(timeout)
        sock.settimeout(None)
        self._sock = sock
        # One poll object per user: the reader thread's, and the inline one
        # (used under _read_lock); a poll object is not safe to share.
        self._poller, self._inline_poller = select.poll(), select.poll()
        for p in (self._poller, self._inline_poller):
            p.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._listener.close()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"rdmatensor-{self.name}-{self.rank}<-{self.peer}")
        self._reader.start()

    def _accept(self, timeout: float) -> socket.socket:
        """Accept the peer that presents our key. Handshakes run side by side,
        each bounded by HANDSHAKE_TIMEOUT, so connections that send nothing or
        a wrong key neither block nor delay the real peer."""
        deadline = time.monotonic() + timeout
        pending: dict[socket.socket, list] = {}   # sock -> [token buffer, bytes read, handshake deadline]
        sel = selectors.DefaultSelector()

        def drop(sock: socket.socket) -> None:
            pending.pop(sock, None)
            try:
                sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()

        try:
            try:
                self._listener.setblocking(False)
                sel.register(self._listener, selectors.EVENT_READ)
            except (OSError, ValueError) as exc:
                raise PeerLost(f"{self.name} channel to peer {self.peer} is closed") from exc
            while True:
                now = time.monotonic()
                if self._closing:
                    raise PeerLost(f"{self.name} channel to peer {self.peer} closed while connecting")
                if now >= deadline:
                    raise PeerLost(f"peer {self.peer} did not open its {self.name} data connection "
                                   f"within {timeout:.0f} s")
                for sock in [s for s, st in pending.items() if st[2] <= now]:
                    drop(sock)      # too slow to say who it is
                wake = min([deadline] + [st[2] for st in pending.values()])
                try:
                    events = sel.select(max(0.0, wake - now))
                except (OSError, ValueError) as exc:      # the listener was closed under us
                    raise PeerLost(f"{self.name} channel to peer {self.peer} closed while "
                                   f"connecting: {exc}") from exc
                for key, _ in events:
                    if key.fileobj is self._listener:
                        try:
                            sock, _ = self._listener.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError as exc:
                            if self._closing or self._listener.fileno() < 0:
                                raise PeerLost(f"{self.name} channel to peer {self.peer} closed "
                                               f"while connecting") from exc
                            time.sleep(0.01)   # out of descriptors: let handshakes finish
                            continue
                        if len(pending) >= MAX_PENDING:
                            drop(min(pending, key=lambda s: pending[s][2]))
                        sock.setblocking(False)
                        pending[sock] = [bytearray(AUTH_BYTES), 0, time.monotonic() + HANDSHAKE_TIMEOUT]
                        sel.register(sock, selectors.EVENT_READ)
                        continue
                    sock = key.fileobj
                    st = pending.get(sock)
                    if st is None:
                        continue
                    try:
                        n = sock.recv_into(memoryview(st[0])[st[1]:])
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        n = 0
                    if n == 0:
                        drop(sock)
                        continue
                    st[1] += n
                    if st[1] < AUTH_BYTES:
                        continue
                    if hmac.compare_digest(bytes(st[0]), self._key):
                        pending.pop(sock)
                        sel.unregister(sock)
                        sock.setblocking(True)
                        return sock
                    drop(sock)      # not our peer: keep waiting for the real one
        finally:
            for sock in list(pending):
                drop(sock)
            sel.close()

    def _read_one(self, header: bytearray) -> None:
        """Take in one write: check it like a NIC, land its payload, report its immediate."""
        sock = self._sock
        if not _recv_exact(sock, memoryview(header)):
            raise PeerLost(f"peer {self.peer} closed the connection")
        magic, region, key, imm, offset, length = WRITE_HEADER.unpack(header)
        if magic != WRITE_MAGIC:
            raise RefusedWrite(f"peer {self.peer} sent a malformed write header", peer=self.peer)
        if length:
            arena = self.check_local(region, key, offset, length)
            if self.payload_inline:
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
        found = False
        try:
            wait_ms = int(block_for * 1000)
            while not self._closing and not self._lost and self._inline_poller.poll(0 if found else wait_ms):
                self._read_one(self._header)
                found = True
        except (PeerLost, TransportError) as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(PeerLost(f"connection to peer {self.peer} failed: {exc}"))
        except Exception as exc:  # noqa: BLE001 - never stop reading without reporting why
            self._fail(TransportError(f"{self.name} channel from peer {self.peer} failed: {exc!r}"))
        finally:
            self._read_lock.release()
        return found

    def _fail(self, exc: Exception) -> None:
        if not self._closing:
            self.lost(exc)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read_loop(self) -> None:
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

    def notify(self, imm: int) -> None:
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, -1, 0, imm, 0, 0), None)

    def peer_said_bye(self) -> None:
        pass  # the stream's EOF follows everything the peer sent

    def lost(self, error: Exception) -> None:
        """Report the loss and tear the connection down, so that no sender stays
        blocked in sendall() to a peer that stopped reading (the session's
        heartbeat calls this for a peer that stopped answering)."""
        super().lost(error)
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for s in (self._sock, self._listener):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        with self._read_lock:
            pass                        # an inline reader finishes its message first
