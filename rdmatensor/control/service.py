"""Control-plane server and client: token authentication, optional TLS, and
gRPC status codes mapped to rdmatensor's typed errors."""
from __future__ import annotations

import hmac
from concurrent import futures
from dataclasses import dataclass

import grpc

from ..errors import AuthenticationError, PeerLost, PlanMismatch, RdmaTensorError, TransportError
from . import control_pb2 as pb
from . import control_pb2_grpc as pb_grpc

TOKEN_KEY = "rdmatensor-token"
MAX_MESSAGE = 1 << 30          # the grpc baseline carries whole tensors


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes: this side's certificate chain and key, and the CA that signs its peers'."""
    cert_chain: bytes
    private_key: bytes
    root_ca: bytes
    server_name: str | None = None   # override the name checked in peers' certificates


class _TokenCheck(grpc.ServerInterceptor):
    """Refuse any call that does not carry the session token: a peer without it
    never reaches a handler, so it never learns a descriptor."""

    def __init__(self, token: str):
        self._token = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing rdmatensor token")
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_KEY and hmac.compare_digest(value.encode(), self._token):
                return continuation(details)
        return self._deny


_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
            # A peer still starting up is retried quickly, not after gRPC's 1 s default.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500)]


def start_server(address: str, token: str, control, baseline, tls: TlsConfig | None = None,
                 workers: int = 16) -> tuple[grpc.Server, int]:
    """Serve `control` (a ControlServicer) and `baseline` on `address` ("host:port", port 0 picks one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rdmatensor-ctl"),
                         interceptors=[_TokenCheck(token)], options=_OPTIONS)
    pb_grpc.add_ControlServicer_to_server(control, server)
    pb_grpc.add_BaselineServicer_to_server(baseline, server)
    if tls:
        creds = grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)],
                                            root_certificates=tls.root_ca, require_client_auth=True)
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise TransportError(f"cannot listen for the control plane on {address}")
    server.start()
    return server, port


class ControlClient:
    """Stubs to one peer's control server, with the token attached to every call."""

    def __init__(self, address: str, token: str, tls: TlsConfig | None = None):
        self.address = address
        if tls:
            creds = grpc.ssl_channel_credentials(tls.root_ca, tls.private_key, tls.cert_chain)
            opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls.server_name)]
                               if tls.server_name else [])
            self.channel = grpc.secure_channel(address, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.metadata = ((TOKEN_KEY, token),)
        self.calls = 0
        self.control = pb_grpc.ControlStub(self.channel)
        self.baseline = pb_grpc.BaselineStub(self.channel)

    def call(self, method, request, timeout: float, wait_for_ready: bool = False):
        self.calls += 1
        try:
            return method(request, timeout=timeout, metadata=self.metadata, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.address) from None

    def close(self) -> None:
        self.channel.close()


def rpc_error(exc: grpc.RpcError, address: str) -> RdmaTensorError:
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{address} refused our token: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return PlanMismatch(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return PeerLost(f"peer at {address} unreachable: {code.name} {details}")
    return TransportError(f"control call to {address} failed: {code.name} {details}")


__all__ = ["pb", "pb_grpc", "start_server", "ControlClient", "TlsConfig", "rpc_error"]
