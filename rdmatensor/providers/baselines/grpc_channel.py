"""grpc: the baseline rdmatensor replaces. Every write is serialized into a
gRPC message (payload bytes copied into protobuf), sent as a unary call to
the peer's control server and copied into the slot there. It exists to be
measured against, and as the last fallback."""
from __future__ import annotations

import numpy as np

from ...control.service import ControlClient, pb
from ...errors import PeerLost, TransportError
from ..contract import Channel, ControlPlane


class GrpcChannel(Channel):
    """Counts in `copies` the serialization on send and the copy into the slot on receipt."""
    name = "grpc"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._client: ControlClient | None = None
        self._closed = False
        self.control: ControlPlane | None = None

    def configure(self, control: ControlPlane) -> None:
        self.control = control

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        return True, "grpcio installed (baseline)"

    def params(self) -> dict:
        return {"address": self.control.address if self.control else ""}

    def connect(self, peer_params: dict, initiator: bool, timeout: float) -> None:
        if self.control is None:
            raise TransportError(f"grpc channel to peer {self.peer} was never configured", peer=self.peer)
        self._client = ControlClient(peer_params["address"], self.control.token, self.control.tls, peer=self.peer)
        self._timeout = max(timeout, 60.0)

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        desc = self.check_remote(region_id, offset, src.nbytes)
        self.copies += 1
        self._push(region_id, desc["key"], offset, src.tobytes(), imm)

    def notify(self, imm: int) -> None:
        self._push(-1, 0, 0, b"", imm)

    def _push(self, region_id, key, offset, payload, imm) -> None:
        if self._closed or self._client is None:
            raise PeerLost(f"grpc channel to peer {self.peer} is closed", peer=self.peer)
        self._client.call(self._client.baseline.Push,
                          pb.PushRequest(rank=self.rank, region_id=region_id, key=key, offset=offset,
                                         payload=payload, imm=imm, pair_secret=self.control.pair_secret()),
                          timeout=self._timeout)

    def receive(self, request) -> None:
        """The receiving end of a Push, run on a control-server thread. A refused
        write ends the channel, as a NIC's protection error ends a QP."""
        length = len(request.payload)
        try:
            if length:
                arena = self.check_local(request.region_id, request.key, request.offset, length)
                arena.buf[request.offset:request.offset + length] = np.frombuffer(request.payload, np.uint8)
                self.copies += 1
            self.on_imm(request.imm)
        except TransportError as exc:
            self.lost(exc)
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._client:
                self._client.close()
