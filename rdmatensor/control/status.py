"""How an error crosses the control plane, both directions side by side.

A handler that refuses a call aborts with a gRPC status chosen by the error's
class (so plain gRPC clients see a sensible code) and names the class itself
in the trailing metadata key `rdmatensor-error` (with the tensor, if any, in
`rdmatensor-tensor`). The caller raises that same class again; only a call
without our code (gRPC's own failures, or a server that is not rdmatensor)
is mapped from its status.
"""
from __future__ import annotations

import grpc

from ..errors import (AuthenticationError, BadRequest, CreditViolation, DuplicateExchange, PeerLost, PlanMismatch,
                      RdmaTensorError, RefusedWrite, TooManyBarriers, TransportError, by_name)

ERROR_KEY = "rdmatensor-error"
TENSOR_KEY = "rdmatensor-tensor"

# The status a refusal is sent with, by error class (the first match along the MRO).
_STATUS = {
    DuplicateExchange: grpc.StatusCode.ALREADY_EXISTS,
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    AuthenticationError: grpc.StatusCode.PERMISSION_DENIED,
    RefusedWrite: grpc.StatusCode.PERMISSION_DENIED,
    PlanMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CreditViolation: grpc.StatusCode.FAILED_PRECONDITION,
    TooManyBarriers: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_ERRORS = by_name()


def abort(context, error: RdmaTensorError, default: grpc.StatusCode = grpc.StatusCode.ABORTED):
    """Refuse the call in progress with `error` (never returns)."""
    code = next((_STATUS[cls] for cls in type(error).__mro__ if cls in _STATUS), default)
    metadata = [(ERROR_KEY, type(error).__name__)]
    if error.tensor:
        metadata.append((TENSOR_KEY, error.tensor))
    context.set_trailing_metadata(tuple(metadata))
    context.abort(code, str(error))


def rpc_error(exc: grpc.RpcError, address: str, peer: int | None = None) -> RdmaTensorError:
    """The typed error behind a failed call to the control server at `address` (rank `peer`)."""
    code, details = exc.code(), exc.details()
    sent = dict(exc.trailing_metadata() or ())
    cls = _ERRORS.get(sent.get(ERROR_KEY, ""))
    if cls is not None:
        return cls(details, peer=peer, tensor=sent.get(TENSOR_KEY) or None)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{address} refused our token: {details}", peer=peer)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        who = f"rank {peer} at {address}" if peer is not None else f"peer at {address}"
        return PeerLost(f"{who} unreachable: {code.name} {details}", peer=peer)
    return TransportError(f"control call to {address} failed: {code.name} {details}", peer=peer)
