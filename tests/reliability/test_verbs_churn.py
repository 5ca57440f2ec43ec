"""Verbs hygiene under churn, on a real RDMA device (SoftRoCE in the VM under
`make test`): connect/transfer/close cycles leave no queue pair, memory
region, completion queue or protection domain in the kernel (`rdma res show`,
iproute2), and no file descriptor or thread in the process.

A verbs connect costs about 4 s under qemu TCG, so the default is a modest
number of cycles; RDMATENSOR_VERBS_CHURN_CYCLES=200 runs the long version."""
from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest

from rdmatensor import Plan, TensorSpec

from ..support.ranks import check, run_ranks
from .helpers import rdma_resources as resources, settle, snapshot

pytestmark = pytest.mark.rdma
CYCLES = int(os.environ.get("RDMATENSOR_VERBS_CHURN_CYCLES", "8"))
PLAN = Plan([TensorSpec("a", (4096,), np.float32, 0, 1), TensorSpec("b", (None,), np.float32, 1, 0)])


def test_verbs_sessions_release_qps_mrs_and_descriptors(rdma_port):
    if not shutil.which("rdma"):
        pytest.skip("iproute2's rdma tool is not installed")
    during = []

    def body(s, r):
        if r == 0:
            s.send("a", np.full(4096, 2.0, np.float32))
            with s.recv("b") as v:
                assert v.shape == (5,) and (v == 3.0).all()
            s.barrier("counted")           # rank 1 counts while both sessions are open
            s.barrier("done")
        else:
            with s.recv("a") as v:
                assert (v == 2.0).all()
            s.send("b", np.full(5, 3.0, np.float32))
            s.barrier("counted")
            if not during:
                during.append(resources())
            s.barrier("done")
        return True

    check(run_ranks(2, PLAN, "verbs", body, timeout=60))    # warm-up: imports, device caches
    base = settle(snapshot())
    kernel_base = resources()
    t0 = time.monotonic()
    for _ in range(CYCLES):
        assert check(run_ranks(2, PLAN, "verbs", body, timeout=60)) == {0: True, 1: True}
    elapsed = time.monotonic() - t0
    end = settle(base, within=10)
    kernel_end = resources()
    print(f"verbs: {CYCLES} cycles in {elapsed:.1f} s ({elapsed / max(CYCLES, 1):.1f} s each); "
          f"kernel objects before {kernel_base}, with two sessions open {during[0]}, after {kernel_end}; "
          f"fds {base['fds']}->{end['fds']}, threads {base['threads']}->{end['threads']}")
    # The counts see a session's objects (two ranks: QPs, MRs, CQs, PDs of both)...
    assert all(during[0][k] > kernel_base[k] for k in ("qp", "mr")), (during[0], kernel_base)
    # ...and none of them is left after close.
    assert kernel_end == kernel_base, (kernel_base, kernel_end)
    leaked = {k: end[k] - base[k] for k in base if end[k] > base[k]}
    assert not leaked, f"left behind: {leaked}; threads: {[t.name for t in threading.enumerate()]}"
