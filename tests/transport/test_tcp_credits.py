"""tcp's owed credits: a released slot's credit rides with the next write to
the peer, and reaches a waiting sender even when the receiver never writes
or waits again."""
from __future__ import annotations

import time

import numpy as np

from rdmatensor import Plan, TensorSpec
from tests.support.ranks import check, run_ranks

PLAN = Plan([TensorSpec("x", (8,), np.uint8, src=0, dst=1), TensorSpec("y", (8,), np.uint8, src=1, dst=0)])
ROUNDS = 50


def test_an_owed_credit_reaches_the_sender_while_the_receiver_sleeps():
    def body(s, rank):
        if rank == 1:
            y = s.buffer("y")
            for k in range(ROUNDS):                # the channel is busy: credits are owed, then ride with y
                with s.recv("x") as v:
                    assert v[0] == k % 256
                s.send("y", y)
            s.recv("x").release()
            owed = bool(s._ctx.channels[0]._owed)  # nothing to ride with: it stays owed...
            time.sleep(1.5)                        # ...while this rank neither writes nor waits
            with s.recv("x") as v:
                assert v[0] == 255
            return owed
        x = s.buffer("x")
        for k in range(ROUNDS + 1):
            x[0] = k % 256
            s.send("x", x)
            if k < ROUNDS:
                s.recv("y").release()
        t = time.monotonic()
        x[:] = 255
        s.send("x", x, timeout=1.0)    # needs the credit rank 1 owes: SendTimeout if it never left
        return time.monotonic() - t

    results = check(run_ranks(2, PLAN, "tcp", body))
    assert results[1] is True, "the last credit was sent at once: nothing was owed"
    assert results[0] < 1.0
