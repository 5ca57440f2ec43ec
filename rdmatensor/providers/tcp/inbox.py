"""tcp's inbox: what the connection delivers, taken in as a NIC would.

The sender puts each write's header (emulated/write_header.py) and payload in one
sendmsg(). The inbox reads what the socket holds into a small buffer, so
that many headers and small payloads come in with one system call; checks
each complete header against the channel's exposed regions (`local`:
region id -> (arena, key)) as a NIC checks an rkey; lands the payload (the
buffered part copied, the rest received straight into the region); then
reports the immediate with on_imm(imm), whose true result means the channel
is lost (take in nothing more).

    poll(event, local, on_imm, seconds) -> int

takes in writes until event.is_set() (an event of None: until any was taken
in), on_imm says the channel is lost, or `seconds` passed, yielding the core
between looks at the socket. It returns how many it took in, or:

    REFUSED (-1)     the next header does not land; `refused` holds it, not
                     taken in (the channel raises its typed error for it)
    CLOSED (-2)      the peer closed the connection between messages
    CLOSED_MID (-3)  ... in the middle of one

The per-message work is compiled (`_inbox.c`, built by `make setup`): in
Python it was about ten interpreter frames per message. The Python Inbox
below does the same where it is not built, or with RDMATENSOR_TCP_INBOX=python.
"""
from __future__ import annotations

import socket

from ... import native
from ..emulated.waiting import Patience
from ..emulated.write_header import WRITE_HEADER, WRITE_MAGIC

REFUSED, CLOSED, CLOSED_MID = -1, -2, -3
INBOX_ENV = "RDMATENSOR_TCP_INBOX"   # "python" forces the Python inbox where the compiled one is built
_compiled, BUILD_ERROR = native.load("rdmatensor.providers.tcp._inbox")


def compiled() -> bool:
    """Whether new inboxes are the compiled ones."""
    return native.chosen(_compiled, INBOX_ENV)


def make_inbox(sock: socket.socket, capacity: int):
    """An inbox reading `sock` (connected, blocking), buffering up to `capacity` bytes."""
    if compiled():
        return _compiled.Inbox(sock.fileno(), capacity)
    return Inbox(sock, capacity)


class Inbox:
    def __init__(self, sock: socket.socket, capacity: int):
        if capacity < 2 * WRITE_HEADER.size:
            raise ValueError(f"an inbox holds at least two headers, not {capacity} bytes")
        self._sock = sock
        self._rx = bytearray(capacity)
        self._view = memoryview(self._rx)
        self._start = self._end = 0          # what the buffer holds, not taken in yet
        self.refused: tuple | None = None
        self._closed = False

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def poll(self, event, local: dict, on_imm, seconds: float) -> int:
        found, patience = 0, Patience(seconds)
        while True:
            if self._closed:
                raise ValueError("the inbox is closed")
            n, stop = self._land_buffered(local, on_imm)
            if n < 0:
                return n
            found += n
            if stop or (event.is_set() if event is not None else found):
                return found
            got = self._fill()
            if got < 0:
                return got
            if got:
                continue
            if patience.exhausted():
                return found

    def close(self) -> None:
        self._closed = True          # (the socket is the channel's)

    def _fill(self) -> int:
        """Move what the socket holds into the buffer, never blocking: bytes (0: none yet), or CLOSED(_MID)."""
        start, end = self._start, self._end
        if start == end:
            start = end = self._start = self._end = 0
        elif len(self._rx) - end < WRITE_HEADER.size:       # keep room for at least a header
            self._rx[:end - start] = self._rx[start:end]
            start, end = 0, end - start
            self._start, self._end = start, end
        try:
            got = self._sock.recv_into(self._view[end:], 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        if got == 0:
            return CLOSED if start == end else CLOSED_MID
        self._end = end + got
        return got

    def _land_buffered(self, local: dict, on_imm) -> tuple[int, bool]:
        """Take in every write whose header is buffered: (how many or an error code, lost)."""
        found, rx, view = 0, self._rx, self._view
        while self._end - self._start >= WRITE_HEADER.size:
            at = self._start
            header = WRITE_HEADER.unpack_from(rx, at)
            magic, region, key, imm, offset, length = header
            entry = local.get(region)
            if magic != WRITE_MAGIC or (length and not (entry is not None and key == entry[1]
                                                        and offset + length <= entry[0].size)):
                self.refused = header
                return REFUSED, False
            at += WRITE_HEADER.size
            if length:
                have = min(self._end - at, length)
                target = memoryview(entry[0].buf)[offset:offset + length]
                target[:have] = view[at:at + have]
                at += have
                if have < length:            # the rest straight into the region
                    self._start = self._end = 0
                    if not _recv_exact(self._sock, target[have:]):
                        return CLOSED_MID, False
                    at = 0
            self._start = at
            found += 1
            if on_imm(imm):
                return found, True
        return found, False


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True
