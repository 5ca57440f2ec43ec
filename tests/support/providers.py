"""Every provider of the registry, as pytest parameters: those that need an
RDMA device are marked `rdma` (they run in the SoftRoCE VM)."""
import pytest

from rdmatensor.providers import REGISTRY

from .ranks import RAILS

PROVIDERS = [pytest.param(name, marks=pytest.mark.rdma) if info.needs_rdma else name
             for name, info in REGISTRY.items()]

# The scale tests (64 MiB, 1,000 tensors, three ranks, many threads) leave out
# the RDMA baseline (verbs-rpc): it is there to be measured against and keeps
# every correctness test of the contract, while emulated RDMA makes its scale
# runs cost minutes of the suite.
SCALE_PROVIDERS = [p for p in PROVIDERS if getattr(p, "values", (p,))[0] != "verbs-rpc"]


def each_with(providers: list, values: list) -> list:
    """(provider, value) parameters for every pair, each provider keeping its marks."""
    out = []
    for p in providers:
        name, marks = (p.values[0], p.marks) if hasattr(p, "values") else (p, ())
        out += [pytest.param(name, v, marks=marks, id=f"{name}-{v}") for v in values]
    return out

# verbs over two rails, for the contract tests whose writes are large enough to be striped
TWO_RAILS = pytest.param(RAILS, marks=pytest.mark.rdma, id="verbs-two-rails")
