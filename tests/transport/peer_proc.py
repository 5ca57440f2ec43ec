"""A rank in its own process, for tests that kill it.

    python -m tests.transport.peer_proc ROLE PROVIDER PORT0 PORT1

ROLE: `holder` receives "x" and holds the view forever; `streamer` sends
"big" again and again, each value filled with its step number; `idle`
connects and then does nothing.
"""
import sys
import time

import numpy as np

from rdmatensor import Plan, TensorSpec, connect

TOKEN = "fault-token"
BIG = 8 << 20


def fault_plan() -> Plan:
    return Plan([TensorSpec("x", (1024,), np.float32, 0, 1),
                 TensorSpec("big", (BIG,), np.uint8, 1, 0)])


def main():
    role, provider, p0, p1 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    peers = {0: f"127.0.0.1:{p0}", 1: f"127.0.0.1:{p1}"}
    with connect(1, peers, fault_plan(), provider=provider, token=TOKEN, timeout=60) as s:
        print("connected", flush=True)
        if role == "holder":
            held = s.recv("x")
            print("holding", flush=True)
            time.sleep(3600)
            held.release()
        elif role == "idle":
            time.sleep(3600)
        else:
            buf = s.buffer("big")
            step = 0
            while True:
                step += 1
                buf[:] = step % 251
                s.send("big", buf)


if __name__ == "__main__":
    main()
