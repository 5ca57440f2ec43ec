"""Two ranks exchange a plan's worth of tensors through a Session, checked by hash.

Rank 0 sends every dtype, sizes from 1 byte to 64 MiB and a dynamic tensor
that grows; rank 1 checks each against the same seeded data and sends back a
summary tensor. Each rank prints one JSON line.

    python examples/two_ranks.py --rank 0 --peers HOST0:PORT,HOST1:PORT [--provider P]
    python examples/two_ranks.py vm       # under `rdmatensor softroce vm --hosts 2`
    python examples/two_ranks.py local    # both ranks as two processes on this host
    rdmatensor-run -H hostA:1,hostB:1 --provider verbs python examples/two_ranks.py job
                                          # as a job's rank: TF_CONFIG, RDMATENSOR_TOKEN/_PROVIDER
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from rdmatensor import Plan, TensorSpec, connect

SIZES = [1, 4096 + 1, 1 << 20, 64 << 20]
DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64"]
DYN_ROWS = [1, 1000, 50000, 3]


def make_plan() -> Plan:
    specs = [TensorSpec(f"blob{n}", (n,), np.uint8, 0, 1) for n in SIZES]
    specs += [TensorSpec(f"dt/{d}", (17, 33), d, 0, 1) for d in DTYPES]
    specs += [TensorSpec("dyn", (None, 8), np.float32, 0, 1),
              TensorSpec("summary", (2,), np.int64, 1, 0)]
    return Plan(specs)


def data(name: str, spec: TensorSpec, rows: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(name)) % (1 << 32) if False else len(name) * 7919 + (rows or 0))
    shape = (rows, 8) if rows is not None else spec.shape
    raw = rng.integers(0, 256, int(np.prod(shape)) * spec.dtype.itemsize, dtype=np.uint8)
    arr = raw.view(spec.dtype).reshape(shape)
    return (arr != 0) if spec.dtype == np.bool_ else np.nan_to_num(arr) if spec.dtype.kind in "fc" else arr


def run(rank: int, peers: dict, provider: str, token: str) -> dict:
    plan = make_plan()
    t0 = time.perf_counter()
    with connect(rank, peers, plan, provider=provider, token=token, timeout=120) as s:
        setup = time.perf_counter() - t0
        result = {"rank": rank, "provider": s.provider, "setup_s": round(setup, 3)}
        if rank == 0:
            for name, spec in plan.specs.items():
                if spec.src != 0:
                    continue
                if spec.is_static:
                    t = time.perf_counter()
                    s.send(name, data(name, spec))
                    if name == f"blob{64 << 20}":
                        result["MB_per_s_64MiB_incl_copy"] = round((64 << 20) / (time.perf_counter() - t) / 1e6, 1)
                else:
                    for rows in DYN_ROWS:
                        s.send(name, data(name, spec, rows))
            with s.recv("summary") as v:
                checked, bad = (int(x) for x in v)
            result.update(checked=checked, bad=bad, stats=s.stats())
        else:
            checked = bad = 0
            for name, spec in plan.specs.items():
                if spec.src != 0:
                    continue
                for rows in ([None] if spec.is_static else DYN_ROWS):
                    with s.recv(name) as v:
                        checked += 1
                        bad += int(not np.array_equal(v, data(name, spec, rows)))
            s.send("summary", np.array([checked, bad], np.int64))
            result.update(checked=checked, bad=bad, stats=s.stats())
        s.barrier("done")
    result["ok"] = result["bad"] == 0 and result["checked"] == len(SIZES) + len(DTYPES) + len(DYN_ROWS)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=("vm", "local", "job"))
    p.add_argument("--rank", type=int)
    p.add_argument("--peers", help="comma-separated control addresses, rank order")
    p.add_argument("--provider", default=os.environ.get("RDMATENSOR_PROVIDER", "auto"))
    p.add_argument("--port", type=int, default=47100)
    p.add_argument("--token", default=os.environ.get("RDMATENSOR_TOKEN", "example-token"))
    a = p.parse_args()
    if a.mode == "vm":
        addrs = os.environ["RDMATENSOR_VM_ADDRS"].split()
        rank = int(os.environ["RDMATENSOR_VM_INDEX"])
        peers = {r: f"{h}:{a.port}" for r, h in enumerate(addrs)}
    elif a.mode == "local":
        peers = ",".join(f"127.0.0.1:{a.port + r}" for r in range(2))
        other = subprocess.Popen([sys.executable, __file__, "--rank", "1", "--peers", peers,
                                  "--provider", a.provider, "--token", a.token])
        res = run(0, dict(enumerate(peers.split(","))), a.provider, a.token)
        print(json.dumps(res), flush=True)
        sys.exit(0 if res["ok"] and other.wait(120) == 0 else 1)
    elif a.mode == "job":
        from rdmatensor.runner.cluster import Cluster
        cluster = Cluster.from_tf_config()
        rank, peers = cluster.rank, cluster.peers()
    else:
        rank, peers = a.rank, dict(enumerate(a.peers.split(",")))
    res = run(rank, peers, a.provider, a.token)
    print(json.dumps(res), flush=True)
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
