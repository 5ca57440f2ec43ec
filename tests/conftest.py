"""Markers: `rdma` tests need an RDMA device (`make test` runs them inside the
SoftRoCE VM when the host has none); `vm` tests boot SoftRoCE VMs themselves.
Under CI=true a skipped rdma or vm test counts as a failure: in CI the real
thing is reachable, so a skip would hide a broken setup."""
import os
import shutil

import pytest

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and ({"rdma", "vm"} & set(item.keywords)):
        report.outcome = "failed"
        report.longrepr = f"an rdma/vm test skipped under CI=true: {report.longrepr}"


@pytest.fixture(scope="session")
def rdma_port():
    """(device, port) with an ACTIVE port, or skip."""
    from rdmatensor.devices import active_port
    found = active_port()
    if not found:
        pytest.skip("no ACTIVE RDMA port here: run with `make test` (SoftRoCE VM) "
                    "or under `rdmatensor softroce vm`")
    return found


@pytest.fixture(scope="session")
def vm_ready():
    from rdmatensor.softroce.initramfs import find_kernel
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 not installed (make setup)")
    find_kernel()
