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
from .addressing import Fabric, port_identity, route
from .rc import REMOTE_WRITE, EndpointHelpers, RcParams, check_locked_memory, find_port, gid_bytes, gid_str

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
                     depth: int = 256, recv_depth: int | None = None, fabric: Fabric | None = None):
            device, port, gid_index = find_port(device, port, gid_index)
            self.fabric = fabric or Fabric.from_env()
            self.lid, self.link_layer = port_identity(device, port)
            with CONTEXT_LOCK:     # the pyverbs endpoint tells its completion channel's fd apart by it
                super().__init__(device, port, gid_index, depth, recv_depth or depth, random.getrandbits(24),
                                 self.fabric.pkey_index)

        def register(self, array, access: int = REMOTE_WRITE):
            check_locked_memory(array)
            return super().register(array, access)

        def params(self) -> RcParams:
            qpn, psn, gid, mtu = self.local()
            return RcParams(qpn, psn, gid_str(gid), MTU_BYTES[mtu], self.lid, self.link_layer, self.fabric.agreed())

        def connect(self, remote: RcParams) -> None:
            _, _, gid, mtu = self.local()
            r = route(self.link_layer, gid_str(gid), MTU_BYTES[mtu], self.gid_index, remote, self.fabric)
            try:
                dgid = gid_bytes(r.dgid) if r.is_global else bytes(16)
            except ValueError as exc:
                raise TransportError(f"unusable peer GID: {exc}") from exc
            self.connect_qp(remote.qpn, remote.psn, dgid, MTU_ENUM[r.path_mtu], int(r.is_global), r.dlid,
                            r.service_level, r.hop_limit, r.traffic_class, r.timeout, r.retry_count)
else:
    NativeEndpoint = None
