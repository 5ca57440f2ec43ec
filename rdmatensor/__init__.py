"""rdmatensor: tensors moved by one-sided RDMA writes into preallocated, registered buffers.

    plan = Plan([TensorSpec("grad/w", (1024, 1024), "float32", src=1, dst=0)])
    with connect(rank, peers, plan, provider="auto", token=secret) as session:
        session.send("grad/w", array)                 # on rank 1
        with session.recv("grad/w") as view: ...      # on rank 0: read-only, zero-copy

Its files, in layers (tests/test_layout.py), lowest first:

    errors.py      every error class
    plan.py        TensorSpec and Plan: what moves where, and the slots it gets
    memory.py      Arena: page-aligned memory, registered once, carved into slots
    streaming.py   copies and sums streamed to memory (_streaming.c, its compiled twin)
    native.py      which compiled twin runs, and why one does not
    devices.py     the RDMA devices and ports of this machine (sysfs, verbs)
    environment.py the one rule for reading settings: a variable set to "" is unset
    control/       the gRPC control plane
    providers/     the data plane: one folder per provider
    session/       one rank's session: connect(), send, recv
    softroce/      SoftRoCE on the host or in qemu VMs
    runner/        rdmatensor-run and what any program's ranks need to find each other
    cli.py         the `rdmatensor` command (devices, softroce); __main__.py runs it
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
