"""Two-process RDMA WRITE WITH IMM check: a server registers a receive buffer
and hands its address and key to a client, which writes seeded random bytes
into it. Both print one JSON line; the test compares them.

    python write_peer.py server PORT SIZE SEED
    python write_peer.py client HOST PORT SIZE SEED
"""
import hashlib
import json
import socket
import sys
import time

import numpy as np

from rdmatensor.providers.rc_endpoint import LOCAL_ONLY, RcEndpoint, RcParams, RemoteRegion

IMM = 0x5EED0001
DEADLINE = 60.0


def _wait(ep, want):
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        for wc in ep.poll():
            if want(wc):
                return wc
        time.sleep(0.0005)
    raise TimeoutError("no completion within %.0f s" % DEADLINE)


def _exchange(sock, mine):
    f = sock.makefile("rw")
    f.write(json.dumps(mine) + "\n")
    f.flush()
    return json.loads(f.readline()), f


def server(port, size, seed):
    with RcEndpoint() as ep, socket.create_server(("0.0.0.0", port)) as lsock:
        buf = np.zeros(size, dtype=np.uint8)
        mr = ep.register(buf)
        ep.post_recv(wr_id=1)
        conn, _ = lsock.accept()
        region = ep.remote_region(buf, mr)
        peer, f = _exchange(conn, {"rc": ep.params().to_dict(), "addr": region.addr,
                                   "length": region.length, "rkey": region.rkey})
        ep.connect(RcParams(**peer["rc"]))
        f.write("ready\n")
        f.flush()
        t0 = time.monotonic()
        wc = _wait(ep, lambda wc: wc.wr_id == 1)
        result = {"sha256": hashlib.sha256(buf.tobytes()).hexdigest(), "imm": wc.imm_data,
                  "byte_len": wc.byte_len, "seconds": time.monotonic() - t0}
        f.write("done\n")
        f.flush()
        conn.close()
        print(json.dumps(result), flush=True)


def client(host, port, size, seed):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    with RcEndpoint() as ep:
        mr = ep.register(data, access=LOCAL_ONLY)
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
        assert f.readline().strip() == "ready"
        remote = RemoteRegion(peer["addr"], peer["length"], peer["rkey"])
        t0 = time.monotonic()
        ep.post_write(mr, data.ctypes.data, size, remote, 0, imm=IMM, wr_id=7)
        _wait(ep, lambda wc: wc.wr_id == 7)
        seconds = time.monotonic() - t0
        assert f.readline().strip() == "done"
        print(json.dumps({"sha256": hashlib.sha256(data.tobytes()).hexdigest(), "imm": IMM,
                          "seconds": seconds, "mb_per_s": size / seconds / 1e6}), flush=True)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "server":
        server(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
