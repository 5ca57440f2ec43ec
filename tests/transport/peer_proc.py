"""A rank in its own process, for tests that kill it.

    python -m tests.transport.peer_proc ROLE PROVIDER PORT0 PORT1 [PORT2]

ROLE: `holder` receives "x" and holds the view forever; `streamer` sends
"big" again and again, each value filled with its step number; `idle`
connects and then does nothing; `chain_end` is rank 2 of chain_plan(): it
sends "a" once and waits to be killed.
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


def chain_plan() -> Plan:
    """Rank 2 -> rank 0 -> rank 1: rank 1 never talks to rank 2."""
    return Plan([TensorSpec("a", (16,), np.float32, 2, 0), TensorSpec("b", (16,), np.float32, 0, 1)])


def main():
    role, provider = sys.argv[1], sys.argv[2]
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(sys.argv[3:])}
    if role == "chain_end":
        with connect(2, peers, chain_plan(), provider=provider, token=TOKEN, timeout=60) as s:
            s.send("a", np.ones(16, np.float32))
            print("sent", flush=True)
            time.sleep(3600)
        return
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
            step = 0
            while True:
                step += 1
                # buffer() each time: it waits until the last write no longer reads the staging
                # memory (on verbs the NIC still reads it after send() returned; refilled at once,
                # the receiver got a tensor half 3s, half 4s)
                buf = s.buffer("big")
                buf[:] = step % 251
                s.send("big", buf)


if __name__ == "__main__":
    main()
