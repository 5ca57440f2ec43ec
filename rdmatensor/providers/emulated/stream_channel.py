"""Emulated one-sided writes on a connection the peer dials: the shared core of tcp and shm.

The responder listens, the initiator dials and proves it was told the
responder's key over the authenticated control plane. What the connection
carries afterwards is the provider's: write headers, each followed by its
payload (tcp), or only doorbells, its hang-up reporting a lost peer (shm,
whose payloads and write headers travel through shared memory). Either way
each write header (region, key, immediate, offset, length) is checked against
the exposed regions exactly as a NIC checks an rkey (land()), and a refused
write closes the connection and is reported.
"""
from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import threading
import time
from abc import abstractmethod


from ...errors import PeerLost, RefusedWrite, TransportError
from ..contract import Channel
from .write_header import WRITE_MAGIC

AUTH_BYTES = 32
HANDSHAKE_TIMEOUT = 5.0     # seconds a dialer has to present the key
MAX_PENDING = 64           # handshakes in progress at once; the oldest goes first
SPIN_SECONDS = 50e-6       # a waiter polls this long before it sleeps
CLOSE_LINGER = 1.0         # seconds a closing side waits for the peer's end before it resets


class StreamChannel(Channel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._key = secrets.token_bytes(AUTH_BYTES)
        self._listener = self._listen()
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closing = False
        self._read_lock = threading.Lock()     # one thread takes in what arrives at a time
        self._last_inline = 0.0                # when a thread other than the channel's own last took writes in

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

    def _connected(self, peer_params: dict) -> None:
        """The connection is up: finish joining the peer (KeyError, ValueError
        or TypeError mean unusable parameters). Default: nothing more."""

    @abstractmethod
    def _poll(self, event, seconds: float) -> int:
        """Take in what has arrived, looking for up to `seconds` until `event` is set
        (None: until anything came); how many writes were taken in. Raises what broke."""

    @abstractmethod
    def _doze(self, remaining: float) -> None:
        """Sleep on the provider's doorbell, at most `remaining` seconds."""

    def _consume(self, event, deadline: float) -> int:
        """Under _read_lock: take in writes until `event` is set (None: until there
        were any) or the deadline: polling for SPIN_SECONDS, then sleeping on the
        doorbell, and so on; how many were taken in."""
        found = 0
        while True:
            found += self._poll(event, max(0.0, min(SPIN_SECONDS, deadline - time.monotonic())))
            if (event.is_set() if event is not None else found) or self._lost or self._closing:
                return found
            now = time.monotonic()
            if now >= deadline:
                return found
            self._doze(deadline - now)

    @abstractmethod
    def _background(self) -> None:
        """The channel's own thread, from connect() to close()."""

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
        self._listener.close()
        try:
            self._connected(peer_params)
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            raise TransportError(f"peer {self.peer} sent unusable {self.name} channel parameters: "
                                 f"{type(exc).__name__}: {exc}") from exc
        self._reader = threading.Thread(target=self._background, daemon=True,
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

    def wait_for(self, event, timeout: float) -> bool:
        """Take in writes on the waiting thread itself until `event` is set: no
        hand-off from another thread on the fast path. Another thread taking
        them in already means just waiting for it."""
        deadline = time.monotonic() + timeout
        self._before_wait()
        while True:
            if self._reader is None or self._lost or self._closing:
                return event.is_set()
            if self._read_lock.acquire(blocking=False):
                try:
                    self._consume(event, deadline)
                except Exception as exc:  # noqa: BLE001 - typed and reported there
                    self._read_failed(exc)
                finally:
                    self._last_inline = time.monotonic()
                    self._read_lock.release()
            else:
                event.wait(min(max(0.0, deadline - time.monotonic()), 0.0005))
            if event.is_set():
                return True
            if time.monotonic() >= deadline:
                return False

    def _before_wait(self) -> None:
        """What a thread does before it waits for the peer. Default: nothing."""

    def progress(self, block_for: float = 0.0) -> bool:
        """Take in writes that arrived (shm: a batch of them), on the calling
        thread, first waiting up to `block_for` seconds for one."""
        if self._reader is None or self._closing or self._lost:
            return False
        if not self._read_lock.acquire(blocking=False):
            return False
        try:
            return self._consume(None, time.monotonic() + block_for) > 0
        except Exception as exc:  # noqa: BLE001 - typed and reported there
            self._read_failed(exc)
            return False
        finally:
            if threading.current_thread() is not self._reader:
                self._last_inline = time.monotonic()
            self._read_lock.release()

    def land(self, magic: int, region: int, key: int, offset: int, length: int):
        """Check a write header as a NIC checks an rkey: the arena the payload
        lands in, or None for a zero-length write (an immediate alone, which
        like RDMA's names no region)."""
        if magic != WRITE_MAGIC:
            raise RefusedWrite(f"peer {self.peer} sent a malformed write header", peer=self.peer)
        return self.check_local(region, key, offset, length) if length else None

    def _fail(self, exc: Exception) -> None:
        if not self._closing:
            self.lost(exc)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read_failed(self, exc: Exception) -> None:
        """Taking in failed (every reader's `except Exception`): close the
        channel and report why, typed, never stop reading silently."""
        if isinstance(exc, OSError):
            exc = PeerLost(f"connection to peer {self.peer} failed: {exc}")
        elif not isinstance(exc, (PeerLost, TransportError)):
            exc = TransportError(f"{self.name} channel from peer {self.peer} failed: {exc!r}")
        self._fail(exc)

    def peer_said_bye(self) -> None:
        pass  # the connection's end follows everything the peer sent

    def _half_close(self) -> None:
        """End the sending side, then keep taking in until the peer's end. A
        socket closed with unread data sends a reset instead, and the reset
        throws away what is still in flight to the peer: the last megabytes of a
        sender that closes right after sending them (or an shm doorbell). The
        peer answers the end once it has read everything before it."""
        sock, reader = self._sock, self._reader
        if sock is None or reader is None or self._lost or reader is threading.current_thread():
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        reader.join(CLOSE_LINGER)

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
        self._half_close()
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
