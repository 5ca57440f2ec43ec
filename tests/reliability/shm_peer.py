"""A rank in its own process that moves tensors both ways over shm until it is
killed, for tests that look at what it leaves behind.

    python -m tests.reliability.shm_peer RANK PORT0 PORT1

Each step sends a static tensor and a dynamic one that grows every few steps
(new segments made while the job runs), then receives the peer's.
"""
import sys

import numpy as np

from rdmatensor import PeerLost, Plan, TensorSpec, connect

TOKEN = "shm-peer-token"


def plan() -> Plan:
    return Plan([TensorSpec(f"w{src}", (1 << 18,), np.float32, src, 1 - src) for src in (0, 1)]
                + [TensorSpec(f"seq{src}", (None,), np.uint8, src, 1 - src, capacity=256) for src in (0, 1)])


def main():
    rank, p0, p1 = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    peers = {0: f"127.0.0.1:{p0}", 1: f"127.0.0.1:{p1}"}
    try:
        with connect(rank, peers, plan(), provider="shm", token=TOKEN, timeout=60) as s:
            w = np.zeros(1 << 18, np.float32)
            step = 0
            while True:
                step += 1
                s.send(f"w{rank}", w)
                s.send(f"seq{rank}", np.zeros(256 << (step // 8 % 12), np.uint8))   # grows, up to 512 KiB
                with s.recv(f"w{1 - rank}"), s.recv(f"seq{1 - rank}"):
                    pass
                if step == 40:
                    print("steady", flush=True)
    except PeerLost as exc:
        print(f"PeerLost peer={exc.peer}", flush=True)


if __name__ == "__main__":
    main()
