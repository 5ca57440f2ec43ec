"""Every error rdmatensor raises derives from RdmaTensorError."""


class RdmaTensorError(Exception):
    """Root of all rdmatensor errors."""


class DeviceError(RdmaTensorError):
    """An RDMA device or port is missing, down or unusable."""


class SoftRoceError(RdmaTensorError):
    """SoftRoCE (rdma_rxe) could not be set up, on the host or in a VM."""


class VmTimeout(SoftRoceError):
    """A SoftRoCE VM did not finish in time and was killed."""
