"""Every error rdmatensor raises derives from RdmaTensorError."""


class RdmaTensorError(Exception):
    """Root of all rdmatensor errors."""


class DeviceError(RdmaTensorError):
    """An RDMA device or port is missing, down or unusable."""


class SoftRoceError(RdmaTensorError):
    """SoftRoCE (rdma_rxe) could not be set up, on the host or in a VM."""


class VmTimeout(SoftRoceError):
    """A SoftRoCE VM did not finish in time and was killed."""


class PlanError(RdmaTensorError):
    """A plan or tensor spec is invalid."""


class PlanMismatch(RdmaTensorError):
    """Two ranks set up with different plans; the message names the first differing tensor."""


class TensorMismatch(RdmaTensorError):
    """An array's dtype or shape does not match its tensor spec."""


class UnknownTensor(RdmaTensorError):
    """A tensor name that is not in the plan, or not sent/received by this rank."""


class AuthenticationError(RdmaTensorError):
    """A peer presented a wrong token (or none)."""


class PeerLost(RdmaTensorError):
    """A peer closed, died or became unreachable."""


class TransportError(RdmaTensorError):
    """The data plane failed: a write, a completion, or a refused (out-of-bounds, wrong-key) access."""


class UsageError(RdmaTensorError):
    """The API was misused: a closed session, a released view, a wrong rank."""


class RecvTimeout(RdmaTensorError):
    """A tensor did not arrive within the timeout."""


class ProviderUnavailable(RdmaTensorError):
    """The requested data provider cannot run here; the message says why."""


class IntegrityError(TransportError):
    """A tensor arrived with a checksum or header that does not match its payload."""
