"""What a write from memory that is not registered would cost either way: copying
it into registered staging (what verbs does now with TensorFlow's tensors), or
registering it for that write alone and deregistering it after (no cache, so
never a stale registration), on this host's RDMA device:

    python -m rdmatensor softroce vm -- .venv/bin/python -m bench.registration_cost

Per size: the median over --rounds of the mean microseconds of each, and
their ratio (below 1: registering is the cheaper).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from .cli import parse_sizes


def _mean_us(work, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        work()
    return (time.perf_counter() - t) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.registration_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,1M,4M,16M")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    from rdmatensor.devices import active_port
    if not active_port():
        raise SystemExit("bench.registration_cost: no ACTIVE RDMA port here (run it inside `rdmatensor softroce vm`)")
    from rdmatensor.providers.verbs.choose_endpoint import endpoint_class
    from rdmatensor.providers.verbs.rc import READ_ONLY
    ep = endpoint_class()(depth=16, recv_depth=16)
    print("| size | register + deregister, us | copy, us | register / copy |")
    print("| --- | --- | --- | --- |")
    try:
        for size in parse_sizes(a.sizes):
            src, staging = np.ones(size, np.uint8), np.empty(size, np.uint8)
            n = max(5, min(200, (64 << 20) // size))
            def register(src=src):
                ep.deregister(ep.register(src, READ_ONLY))

            def copy(src=src, staging=staging):
                np.copyto(staging, src)

            rounds = [(_mean_us(register, n), _mean_us(copy, n)) for _ in range(a.rounds)]
            reg, copied = (statistics.median(r[i] for r in rounds) for i in (0, 1))
            ratios = [r / c for r, c in rounds]
            print(f"| {size >> 10} KiB | {reg:.0f} | {copied:.0f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    finally:
        ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
