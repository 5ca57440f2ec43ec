"""tcp: one-sided writes emulated over a TCP connection, payload received
straight into the target slot (recv_into): no serialization, no extra copy."""
from __future__ import annotations

import socket
import time

import numpy as np

from ..errors import PeerLost
from .base import WRITE_HEADER, WRITE_MAGIC
from .stream import StreamChannel


class TcpChannel(StreamChannel):
    name = "tcp"

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        return True, "sockets are always available"

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

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        desc = self.check_remote(region_id, offset, src.nbytes)
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, region_id, desc["key"], imm, offset, src.nbytes), src)
