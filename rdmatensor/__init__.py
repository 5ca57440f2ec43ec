"""rdmatensor: tensors moved by one-sided RDMA writes into preallocated, registered buffers.

    plan = Plan([TensorSpec("grad/w", (1024, 1024), "float32", src=1, dst=0)])
    with connect(rank, peers, plan, provider="auto", token=secret) as session:
        session.send("grad/w", array)                 # on rank 1
        with session.recv("grad/w") as view: ...      # on rank 0: read-only, zero-copy
"""
from .control.service import TlsConfig
from .errors import (AuthenticationError, BadRequest, CallMismatch, CreditViolation, IntegrityError, PeerLost,
                     PlanError, PlanMismatch, ProviderUnavailable, RdmaTensorError, RecvTimeout, RefusedWrite,
                     RemoteError, SendTimeout, TensorMismatch, Timeout, TransportError, UnknownTensor, UsageError)
from .plan import Plan, TensorSpec
from .providers.contract import HeldPieces, Pieces
from .session import Received, Session, connect

__version__ = "0.1.0"
__all__ = ["Plan", "TensorSpec", "Pieces", "HeldPieces", "connect", "Session", "Received", "TlsConfig",
           "RdmaTensorError",
           "PlanError", "PlanMismatch", "CallMismatch", "TensorMismatch", "UnknownTensor", "AuthenticationError",
           "PeerLost", "TransportError", "RemoteError", "RefusedWrite", "IntegrityError", "CreditViolation",
           "BadRequest", "UsageError", "Timeout", "SendTimeout", "RecvTimeout", "ProviderUnavailable",
           "__version__"]
