"""rdmatensor: tensors moved by one-sided RDMA writes into preallocated, registered buffers."""
from .errors import RdmaTensorError

__version__ = "0.1.0"
__all__ = ["RdmaTensorError", "__version__"]
