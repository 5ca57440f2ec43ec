"""The bootstrap channel: small objects between the workers of a job, before
(and besides) any tensor plan.

At init() every worker connects one session whose plan holds, per ordered
pair of ranks, one dynamic-shape byte tensor (`boot/r{src}/r{dst}`, shape
(None,)). Through it go what the collectives must agree on before a tensor
can move: the tensor sets a new plan generation adds (compared on every
rank), the control ports of that generation's session, broadcast_object and
allgather_object payloads. Tensors never go this way on the fast path.

Each message carries its exchange's number and a tag saying what it is:
ranks in different collectives fail with a message naming both instead of
misreading bytes, and a message left over from an exchange that failed on
its receiver is dropped, never read by a later exchange.
One slot per pair and one credit per slot keep every pair's messages in
order. This module does not import TensorFlow.
"""
from __future__ import annotations

import random
import socket
import threading

import numpy as np

from rdmatensor import Plan, PlanMismatch, TensorSpec, connect

CAPACITY = 64 << 10            # initial room per pair; larger objects grow the slot once


def boot_name(src: int, dst: int) -> str:
    return f"boot/r{src}/r{dst}"


def bootstrap_plan(ranks: int) -> Plan:
    return Plan([TensorSpec(boot_name(s, d), (None,), np.uint8, s, d, capacity=CAPACITY)
                 for s in range(ranks) for d in range(ranks) if s != d])


class Bootstrap:
    """Byte messages between `size` ranks: allgather and broadcast."""

    def __init__(self, rank: int, peers: dict[int, str], provider: str, token: str, timeout: float):
        self.rank, self.size = rank, len(peers)
        self.exchanges = 0                 # collective calls made through this channel
        self._ahead: dict[int, tuple[str, bytes]] = {}    # a message peek() took in before its exchange did
        self._reading = threading.Lock()   # one reader of the slots at a time: an exchange, or peek()
        self.session = connect(rank, peers, bootstrap_plan(self.size), provider=provider, token=token,
                               timeout=timeout) if self.size > 1 else None

    def _send(self, dst: int, tag: str, data: bytes) -> None:
        message = np.frombuffer(f"{self.exchanges}:{tag}".encode() + b"\0" + data, np.uint8)
        self.session.send(boot_name(self.rank, dst), message)

    def _recv(self, src: int, tag: str) -> bytes:
        """`src`'s message of this exchange. One left over from an exchange that
        failed on this rank is dropped: a message is only read by its own exchange."""
        while True:
            seq, got, data = self.take(src)
            if seq == self.exchanges and got == tag:
                return data
            if seq < self.exchanges:
                continue
            if seq > self.exchanges:
                with self._reading:
                    self._ahead[src] = (seq, got, data)     # the next exchange's, if this rank catches up
            raise PlanMismatch(f"rank {src} is in {got!r} (exchange {seq}) while rank {self.rank} is in {tag!r} "
                               f"(exchange {self.exchanges}): the ranks called different collectives")

    def take(self, src: int, timeout: float | None = None) -> tuple[int, str, bytes]:
        """The next message from `src`: (its exchange number, its tag, its data)."""
        with self._reading:
            if src in self._ahead:
                return self._ahead.pop(src)
            return self._read(src, timeout)

    def _read(self, src: int, timeout: float | None) -> tuple[int, str, bytes]:
        with self.session.recv(boot_name(src, self.rank), timeout) as view:
            raw = view.tobytes()                 # out of the slot: it goes back to the sender now
        head, _, data = raw.partition(b"\0")
        seq, _, tag = head.decode(errors="replace").partition(":")
        return int(seq) if seq.isdigit() else -1, tag, data

    def peek(self, src: int) -> tuple[str, bytes] | None:
        """`src`'s next message of this exchange or a later one, if it has arrived,
        left for the exchange that reads it (tag, data); None if there is none yet,
        or an exchange is reading right now."""
        if not self._reading.acquire(blocking=False):
            return None
        try:
            while src not in self._ahead and src in self.unread():
                message = self._read(src, 0)
                if message[0] >= self.exchanges:   # older ones belong to exchanges that failed here
                    self._ahead[src] = message
            message = self._ahead.get(src)
            return message[1:] if message is not None else None
        finally:
            self._reading.release()

    def unread(self) -> list[int]:
        """The ranks whose next message has arrived and is not read yet."""
        waiting = set(self.session.unread()) if self.session is not None else set()
        return [src for src in range(self.size) if src in self._ahead or boot_name(src, self.rank) in waiting]

    def allgather(self, tag: str, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order."""
        self.exchanges += 1
        if self.size == 1:
            return [data]
        for dst in range(self.size):
            if dst != self.rank:
                self._send(dst, tag, data)
        return [data if src == self.rank else self._recv(src, tag) for src in range(self.size)]

    def broadcast(self, tag: str, data: bytes | None, root: int) -> bytes:
        """`data` as root_rank gave it (the other ranks pass None)."""
        if not 0 <= root < self.size:
            raise ValueError(f"root_rank {root} is not a rank of this job (size {self.size})")
        self.exchanges += 1
        if self.size == 1:
            return data
        if self.rank != root:
            return self._recv(root, tag)
        for dst in range(self.size):
            if dst != root:
                self._send(dst, tag, data)
        return data

    def stats(self) -> dict:
        return self.session.stats() if self.session is not None else {}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


class PortReservation:
    """A free TCP port on `host` for a control server, held (bound, not listening)
    until close(), which is called right before the server binds it. It is taken
    below the kernel's ephemeral range where there is room: outgoing connections
    and port-0 listeners (the tcp provider's data channels) never get those, so
    nothing takes the port between close() and the server's bind."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        low = _ephemeral_low()
        candidates = [random.randrange(RESERVED_LOW, low) for _ in range(64)] if low > RESERVED_LOW + 1000 else []
        for port in candidates + [0]:
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                self._sock.bind((host, port))
                break
            except OSError:
                self._sock.close()
                if port == 0:
                    raise
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()


RESERVED_LOW = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
