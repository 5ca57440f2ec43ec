"""One RDMA WRITE WITH IMM between two processes, checked byte for byte.

A server registers a receive buffer and hands its address and key to a
client, which writes seeded random bytes into it with one one-sided write.
Each side prints one JSON line (sha256 of the bytes, immediate, timing).

    python examples/rdma_write.py local                 # both sides, one host
    python examples/rdma_write.py server [--port P]
    python examples/rdma_write.py client HOST [--port P]
    python examples/rdma_write.py vm                    # side from RDMATENSOR_VM_ROLE

e.g. across two SoftRoCE VMs:
    rdmatensor softroce vm --hosts 2 -- python examples/rdma_write.py vm
"""
import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from rdmatensor.providers.verbs.choose_endpoint import endpoint_class
from rdmatensor.providers.verbs.rc import LOCAL_ONLY, RECV_BATCH, RcParams, RemoteRegion

IMM = 0x5EED0001
DEADLINE = 60.0


def _wait(ep, wanted):
    """The first completion (wr_id, status, is_receive, imm, byte_len) that `wanted` accepts."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        for done in ep.poll(16, 0.001):
            if done[1]:
                raise RuntimeError(f"work request {done[0]} failed: {ep.status_name(done[1])}")
            if wanted(done):
                return done
    raise TimeoutError(f"no completion within {DEADLINE:.0f} s")


def _exchange(sock, mine):
    f = sock.makefile("rw")
    f.write(json.dumps(mine) + "\n")
    f.flush()
    return json.loads(f.readline()), f


def server(port, size):
    with endpoint_class()() as ep, socket.create_server(("0.0.0.0", port)) as lsock:
        buf = np.zeros(size, dtype=np.uint8)
        mr = ep.register(buf)
        ep.post_recv(RECV_BATCH)      # receives go in batches; the write consumes one
        lsock.settimeout(DEADLINE)
        conn, _ = lsock.accept()
        region = ep.remote_region(buf, mr)
        peer, f = _exchange(conn, {"rc": ep.params().to_dict(), "addr": region.addr,
                                   "length": region.length, "rkey": region.rkey})
        ep.connect(RcParams(**peer["rc"]))
        f.write("ready\n")
        f.flush()
        done = _wait(ep, lambda c: c[2])
        f.write("done\n")
        f.flush()
        conn.close()
        return {"side": "server", "device": ep.device, "sha256": hashlib.sha256(buf).hexdigest(),
                "imm": done[3], "bytes": size}


def client(host, port, size, seed):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    with endpoint_class()() as ep:
        ep.register(data, access=LOCAL_ONLY)
        end = time.monotonic() + DEADLINE
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=DEADLINE)
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        peer, f = _exchange(sock, {"rc": ep.params().to_dict()})
        ep.connect(RcParams(**peer["rc"]))
        if f.readline().strip() != "ready":
            raise RuntimeError("server did not get ready")
        remote = RemoteRegion(peer["addr"], peer["length"], peer["rkey"])
        t0 = time.perf_counter()
        number = ep.post_write(data, remote, 0, imm=IMM)
        _wait(ep, lambda c: not c[2] and c[0] == number)
        seconds = time.perf_counter() - t0
        if f.readline().strip() != "done":
            raise RuntimeError("server did not confirm")
        return {"side": "client", "device": ep.device, "sha256": hashlib.sha256(data).hexdigest(),
                "imm": IMM, "bytes": size, "seconds": seconds, "MB_per_s": size / seconds / 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("side", choices=("local", "server", "client", "vm"))
    p.add_argument("host", nargs="?", help="server address (client side)")
    p.add_argument("--port", type=int, default=18515)
    p.add_argument("--size", type=int, default=4 << 20)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    side, host = a.side, a.host
    if side == "vm":
        side = os.environ.get("RDMATENSOR_VM_ROLE", "")
        host = os.environ.get("RDMATENSOR_VM_PEER_ADDR")
        if side not in ("server", "client"):
            sys.exit("vm: RDMATENSOR_VM_ROLE is not set; run under `rdmatensor softroce vm --hosts 2`")
    if side == "local":
        srv = subprocess.Popen([sys.executable, __file__, "server", "--port", str(a.port),
                                "--size", str(a.size)])
        result = client("127.0.0.1", a.port, a.size, a.seed)
        if srv.wait(timeout=DEADLINE) != 0:
            sys.exit("server side failed")
    elif side == "server":
        result = server(a.port, a.size)
    else:
        if not host:
            sys.exit("client: give the server's address")
        result = client(host, a.port, a.size, a.seed)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
