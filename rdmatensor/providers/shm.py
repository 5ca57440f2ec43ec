"""shm: peers on the same host. The receiver's arenas are shared-memory
segments; a write is a memcpy into the peer's mapped segment, then a header
on a Unix socket that the receiver checks (region, key, bounds) before it
reports the immediate."""
from __future__ import annotations

import os
import secrets
import socket
import time

import numpy as np

from ..errors import ForeignSegment, PeerLost, RdmaTensorError, TransportError
from ..memory import Arena, MappedArena
from .base import WRITE_HEADER, WRITE_MAGIC, Capabilities
from .stream import StreamChannel


class ShmChannel(StreamChannel):
    name = "shm"
    payload_inline = False
    capabilities = Capabilities(shared_arenas=True)

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        if not os.access("/dev/shm", os.W_OK):
            return False, "/dev/shm is not writable"
        return True, "peers on this host share /dev/shm"

    def __init__(self, *args, **kwargs):
        self._path = f"\0rdmatensor-{secrets.token_hex(12)}"   # abstract: no file to clean up
        super().__init__(*args, **kwargs)
        self._mapped: dict[int, MappedArena] = {}

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self._path)
        sock.listen()
        return sock

    def _address(self) -> dict:
        return {"path": self._path.encode().hex(), "host_id": host_id()}

    def _dial(self, params: dict, timeout: float) -> socket.socket:
        if params.get("host_id") != host_id():
            raise TransportError(f"peer {self.peer} is on another host: shm needs both on one host")
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
        old = self._mapped.pop(rid, None)
        if old:
            old.close()
        self._mapped[rid] = mapped
        super().attach(descriptor)

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        desc = self.check_remote(region_id, offset, src.nbytes)
        mapped = self._mapped[region_id]
        np.copyto(mapped.buf[offset:offset + src.nbytes], src)
        self._send(WRITE_HEADER.pack(WRITE_MAGIC, region_id, desc["key"], imm, offset, src.nbytes), None)

    def close(self) -> None:
        super().close()
        for m in self._mapped.values():
            m.close()
        self._mapped.clear()


_HOST_ID = None


def host_id() -> str:
    """Identifies this host (and IPC namespace) so shm is not tried across hosts."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        except OSError:
            boot = socket.gethostname()
        try:
            ipc = os.readlink("/proc/self/ns/ipc")
        except OSError:
            ipc = ""
        _HOST_ID = f"{boot}:{ipc}"
    return _HOST_ID
