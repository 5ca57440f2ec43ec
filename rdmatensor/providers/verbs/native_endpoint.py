"""The RC endpoint, compiled (`_native_endpoint.c`): the same contract as the
pyverbs one (see rc.py), with posting, polling and waiting in C.

The extension is built by `make setup` (scripts/build_native.sh) from
Debian's libibverbs-dev; `BUILD_ERROR` says why it cannot be imported here,
or is None.
"""
from __future__ import annotations

import random

from ...devices import CONTEXT_LOCK, MTU_BYTES, MTU_ENUM
from ...errors import TransportError
from .rc import EndpointHelpers, RcParams, find_port, gid_bytes, gid_str

try:
    from . import _native_endpoint
    BUILD_ERROR: str | None = None
except ImportError as exc:
    _native_endpoint = None
    BUILD_ERROR = str(exc)


if _native_endpoint is not None:
    class NativeEndpoint(EndpointHelpers, _native_endpoint.Endpoint):
        """One RC queue pair on `device` (default: the first ACTIVE port), owned by C."""

        status_name = staticmethod(_native_endpoint.status_name)

        def __init__(self, device: str | None = None, port: int = 1, gid_index: int | None = None,
                     depth: int = 256, recv_depth: int | None = None):
            device, port, gid_index = find_port(device, port, gid_index)
            with CONTEXT_LOCK:     # the pyverbs endpoint tells its completion channel's fd apart by it
                super().__init__(device, port, gid_index, depth, recv_depth or depth, random.getrandbits(24))

        def params(self) -> RcParams:
            qpn, psn, gid, mtu = self.local()
            return RcParams(qpn, psn, gid_str(gid), MTU_BYTES[mtu])

        def connect(self, remote: RcParams) -> None:
            mtu = min(remote.mtu, MTU_BYTES[self.local()[3]])
            try:
                gid = gid_bytes(remote.gid)
            except ValueError as exc:
                raise TransportError(f"unusable peer GID: {exc}") from exc
            self.connect_qp(remote.qpn, remote.psn, gid, MTU_ENUM[mtu])
else:
    NativeEndpoint = None
