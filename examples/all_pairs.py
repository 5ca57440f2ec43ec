"""One rank of a job started by rdmatensor-run (TF_CONFIG), or by mpirun,
torchrun or srun (rank 0's rendezvous), with RDMATENSOR_TOKEN and
RDMATENSOR_PROVIDER (or auto), in which every rank sends one tensor to every
other: prints the provider of each of its pairs and whether every tensor
arrived intact.

    rdmatensor-run -np 4 -H hostA:2,hostB:2 python examples/all_pairs.py
    mpirun -np 4 -H hostA:2,hostB:2 -x RDMATENSOR_TOKEN -x MASTER_ADDR=hostA -x MASTER_PORT=29500 \
        python examples/all_pairs.py
    ... [--die RANK]

With --die, rank RANK then kills itself (SIGKILL) and rank 0 waits until the
launcher stops it: a rank lost on a remote host, as the launcher sees it.
"""
import argparse
import json
import os
import signal
import socket
import time

import numpy as np

from rdmatensor import Plan, TensorSpec, connect
from rdmatensor.runner import rendezvous_client as rendezvous
from rdmatensor.runner.cluster import Cluster

N = 1 << 16


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--die", type=int)
    args = p.parse_args()
    if os.environ.get("TF_CONFIG"):        # first, as hvd.init() does: rdmatensor-run sets mpirun's variables too
        cluster = Cluster.from_tf_config()
        me, peers = cluster.rank, cluster.peers()
    else:
        found = rendezvous.LauncherEnv.detect()
        with socket.socket() as probe:      # a free port for this rank's control server
            probe.bind((rendezvous.route_to(found.route), 0))
            port = probe.getsockname()[1]
        joined, server = rendezvous.join_launcher(found, port, 120.0)
        if server is not None:
            server.close()
        me, peers = joined["rank"], dict(enumerate(joined["workers"]))
    others = [r for r in peers if r != me]
    plan = Plan([TensorSpec(f"t{s}-{d}", (N,), np.float32, s, d) for s in peers for d in peers if s != d])
    ok = True
    with connect(me, peers, plan, provider=os.environ.get("RDMATENSOR_PROVIDER", "auto"),
                 token=os.environ["RDMATENSOR_TOKEN"], timeout=120) as s:
        for d in others:
            s.send(f"t{me}-{d}", np.full(N, me * 10 + d, np.float32))
        for src in others:
            with s.recv(f"t{src}-{me}") as v:
                ok = ok and bool((v == src * 10 + me).all())
        s.barrier("done")
    print(json.dumps({"rank": me, "providers": s.providers, "ok": ok}), flush=True)
    if args.die is not None and me == args.die:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.die is not None and me == 0:
        time.sleep(77)


if __name__ == "__main__":
    main()
