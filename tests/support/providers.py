"""Every provider of the registry, as pytest parameters: those that need an
RDMA device are marked `rdma` (they run in the SoftRoCE VM)."""
import pytest

from rdmatensor.providers import REGISTRY

PROVIDERS = [pytest.param(name, marks=pytest.mark.rdma) if info.needs_rdma else name
             for name, info in REGISTRY.items()]
