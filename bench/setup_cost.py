"""What setup costs: plan, register, exchange descriptors, against the number of
tensors. It should grow with bytes and peers, not with round trips per tensor."""
from __future__ import annotations

import time

import numpy as np

from rdmatensor import Plan, TensorSpec, connect

from .points import SETUP_TIMEOUT, TOKEN


def setup_plan(count: int, tensor_bytes: int) -> Plan:
    return Plan([TensorSpec(f"t{i}", (tensor_bytes,), np.uint8, i % 2, 1 - i % 2) for i in range(count)])


def run_setup(rank: int, peers: dict, provider: str, count: int, tensor_bytes: int) -> dict | None:
    t0 = time.perf_counter()
    plan = setup_plan(count, tensor_bytes)
    t_plan = time.perf_counter() - t0
    with connect(rank, peers, plan, provider=provider, token=TOKEN, timeout=SETUP_TIMEOUT) as s:
        t_setup = time.perf_counter() - t0
        calls = s.stats()["control_calls"]
        s.barrier("setup-done")
    if rank:
        return None
    return {"mode": "setup", "provider": provider, "tensors": count, "bytes": count * tensor_bytes,
            "plan_s": t_plan, "setup_s": t_setup, "control_calls": calls}
