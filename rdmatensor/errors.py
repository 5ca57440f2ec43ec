"""Every error rdmatensor raises derives from RdmaTensorError.

Errors carry `peer` (the rank involved) and `tensor` (the tensor's name)
where they are known, else None. Three families say who is at fault:

- local failures: `TransportError` (and `VerbsError`), `PeerLost`, the
  `Timeout`s, and the misuse errors (`UsageError`, `TensorMismatch`, ...);
- `RemoteError`: what a peer did wrong, seen by this rank: a refused write
  (`RefusedWrite`), a value with a bad header or checksum (`IntegrityError`),
  a control call refused as malformed (`BadRequest`), a write or growth
  without a credit (`CreditViolation`), a segment name that is not ours
  (`ForeignSegment`);
- setup disagreements: `PlanMismatch`, `AuthenticationError`.

`RemoteError` derives from `TransportError`, so code that catches
`TransportError` for refused writes keeps working.
"""


class RdmaTensorError(Exception):
    """Root of all rdmatensor errors."""

    def __init__(self, message: str = "", *, peer: int | None = None, tensor: str | None = None):
        super().__init__(message)
        self.peer, self.tensor = peer, tensor


class DeviceError(RdmaTensorError):
    """An RDMA device or port is missing, down or unusable."""


class SoftRoceError(RdmaTensorError):
    """SoftRoCE (rdma_rxe) could not be set up, on the host or in a VM."""


class VmTimeout(SoftRoceError):
    """A SoftRoCE VM did not finish in time and was killed."""


class PlanError(RdmaTensorError):
    """A plan or tensor spec is invalid."""


class PlanMismatch(RdmaTensorError):
    """Two ranks set up with different plans (or providers); the message names the first difference."""


class CallMismatch(PlanMismatch):
    """A value arrived tagged for another call than the one receiving it
    (`got`, `expected`); it was discarded, never handed over."""

    def __init__(self, message: str, *, got: int | None = None, expected: int | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.got, self.expected = got, expected


class TensorMismatch(RdmaTensorError):
    """An array's dtype or shape does not match its tensor spec."""


class UnknownTensor(RdmaTensorError):
    """A tensor name that is not in the plan, or not sent/received by this rank."""


class AuthenticationError(RdmaTensorError):
    """A caller presented a wrong token, or acted as a rank whose pair credential it lacks."""


class PeerLost(RdmaTensorError):
    """A peer closed, died or became unreachable."""


class TransportError(RdmaTensorError):
    """The data plane failed: a write, a completion, a connection."""


class VerbsError(TransportError):
    """A verbs call or a work completion failed on this rank."""


class RemoteError(TransportError):
    """A peer did something the protocol forbids; this rank refused it."""


class RefusedWrite(RemoteError):
    """A peer's write outside an exposed region, with a wrong key or a malformed write header."""


class IntegrityError(RemoteError):
    """A tensor arrived with a checksum or shape header that does not match its payload."""


class CreditViolation(RemoteError):
    """A peer wrote, or asked to grow, a slot whose credit it did not hold."""


class BadRequest(RemoteError):
    """A control call named a wrong rank, slot or size, or carried unusable descriptors."""


class ForeignSegment(RemoteError):
    """A peer named a shared-memory segment that is not an rdmatensor segment of this user, or too small."""


class DuplicateExchange(BadRequest):
    """A second Exchange for a pair that already exchanged."""


class UsageError(RdmaTensorError):
    """The API was misused: a closed session, a released view, a wrong rank."""


class TooManyBarriers(UsageError):
    """More barriers open at once than a coordinator keeps."""


class Timeout(RdmaTensorError):
    """A wait ran out of time."""


class SendTimeout(Timeout):
    """A sender waited too long for the receiver to release the previous value (its credit)."""


class RecvTimeout(Timeout):
    """A tensor did not arrive within the timeout."""


class ProviderUnavailable(RdmaTensorError):
    """The requested data provider cannot run here; the message says why."""


def by_name() -> dict[str, type[RdmaTensorError]]:
    """Every error class of this module, by name (how errors travel between ranks)."""
    return {cls.__name__: cls for cls in globals().values()
            if isinstance(cls, type) and issubclass(cls, RdmaTensorError)}
