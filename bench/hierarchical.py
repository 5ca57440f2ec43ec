"""The flat ring against the hierarchical all-reduce, side by side in one job.

    rdmatensor-run -np 4 -H hostA:2,hostB:2 python -m bench.hierarchical job       # real hosts
    python -m bench.hierarchical local --hosts 2 --per-host 2 --provider shm        # this host

Every rank all-reduces (Horovod API, eagerly) one float32 tensor per size,
in rounds: each round times --calls calls of the flat ring, then as many of
the hierarchical all-reduce (HOROVOD_HIERARCHICAL_ALLREDUCE, a set of its own
in the same plan), so both see the same machine. Every result is checked
against the exact sum. Rank 0 prints one JSON line: per size, the median
microseconds per call of each and flat / hierarchical (above 1: the
hierarchy is faster).

`local` starts the ranks on this host as --hosts "hosts" with loopback
addresses 127.0.0.1, 127.0.0.2, ...: the hierarchy is formed from the
addresses, while every pair uses --provider (shm or tcp), so it measures the
algorithms' steps over uniform links, not a slower link between hosts.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

HIERARCHICAL = "HOROVOD_HIERARCHICAL_ALLREDUCE"
SIZES = "1K,64K,1M,8M"


def _elements(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def job(sizes: list[int], rounds: int, calls: int) -> int:
    import numpy as np
    import tensorflow as tf

    import tf_plugin as hvd
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    want = n * (n + 1) / 2
    times = {(mode, size): [] for size in sizes for mode in ("flat", "hierarchical")}
    for size in sizes:
        x = tf.constant(np.full(size, rank + 1, np.float32))
        for r in range(rounds + 1):                 # round 0 plans both sets and warms up
            for mode in ("flat", "hierarchical"):
                os.environ[HIERARCHICAL] = "1" if mode == "hierarchical" else "0"
                t0 = time.perf_counter()
                for _ in range(calls):
                    out = hvd.allreduce(x, op=hvd.Sum, name=f"{mode}{size}")
                elapsed = (time.perf_counter() - t0) / calls
                got = out.numpy()
                if not (got == want).all():
                    raise SystemExit(f"rank {rank}: {mode} all-reduce of {size} floats gave {got[:4]}..., "
                                     f"not {want}")
                if r:
                    times[(mode, size)].append(elapsed)
    stats = hvd.stats()
    formed = stats["hierarchy"]
    if rank == 0:
        rows = []
        for size in sizes:
            flat, tree = (statistics.median(times[(m, size)]) * 1e6 for m in ("flat", "hierarchical"))
            rows.append({"bytes": size * 4, "flat_us": round(flat, 1), "hierarchical_us": round(tree, 1),
                         "flat_over_hierarchical": round(flat / tree, 3)})
        print(json.dumps({"ranks": n, "hierarchy": formed,
                          "providers": sorted(set(str(stats["provider"]).split("+"))),
                          "rounds": rounds, "calls": calls, "rows": rows}), flush=True)
    hvd.shutdown()
    return 0 if formed else 1


def local(hosts: int, per_host: int, provider: str, argv: list[str]) -> int:
    from rdmatensor.runner.cluster import free_ports
    n = hosts * per_host
    addresses = [f"127.0.0.{1 + r // per_host}" for r in range(n)]
    ports = free_ports(n)
    workers = [f"{a}:{p}" for a, p in zip(addresses, ports, strict=True)]
    token = secrets.token_hex(16)
    procs = []
    for r in range(n):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", RDMATENSOR_TOKEN=token, RDMATENSOR_PROVIDER=provider,
                   TF_NUM_INTRAOP_THREADS="1",
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}}))
        procs.append(subprocess.Popen([sys.executable, "-m", f"{__package__}.hierarchical", "job", *argv], env=env))
    return max(p.wait() for p in procs)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.hierarchical", description=__doc__.split("\n\n")[0])
    p.add_argument("where", choices=("job", "local"))
    p.add_argument("--sizes", default=SIZES, help=f"float32 elements per tensor (default {SIZES})")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10, help="calls timed together in a round")
    p.add_argument("--hosts", type=int, default=2, help="local: loopback addresses as hosts")
    p.add_argument("--per-host", type=int, default=2, help="local: ranks per host")
    p.add_argument("--provider", default="shm", help="local: every pair's provider")
    args = p.parse_args(argv)
    sizes = [_elements(s.strip()) for s in args.sizes.split(",") if s.strip()]
    if args.where == "local":
        rest = ["--sizes", args.sizes, "--rounds", str(args.rounds), "--calls", str(args.calls)]
        return local(args.hosts, args.per_host, args.provider, rest)
    return job(sizes, args.rounds, args.calls)


if __name__ == "__main__":
    raise SystemExit(main())
