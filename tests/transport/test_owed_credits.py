"""Owed credits (tcp, and verbs while a rank polls): a released slot's credit
rides with the next write to the peer, and one that nothing follows still
reaches a waiting sender while the receiver neither writes nor waits again
(the channel's background thread sends it)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from rdmatensor import Plan, TensorSpec
from tests.support.ranks import check, run_ranks

PLAN = Plan([TensorSpec("x", (8,), np.uint8, src=0, dst=1), TensorSpec("y", (8,), np.uint8, src=1, dst=0)])
ROUNDS = 50


def owed(channel) -> int:
    return channel.ep.owed if channel.name == "verbs" else len(channel._owed)


@pytest.mark.parametrize("provider", ["tcp", pytest.param("verbs", marks=pytest.mark.rdma)])
def test_an_owed_credit_reaches_the_sender_while_the_receiver_sleeps(provider, request):
    if provider == "verbs":
        request.getfixturevalue("rdma_port")

    def body(s, rank):
        if rank == 1:
            y, seen = s.buffer("y"), 0
            for k in range(ROUNDS):                # the channel is busy: credits are owed, then ride with y
                with s.recv("x") as v:
                    assert v[0] == k % 256
                seen += owed(s._ctx.channels[0])
                s.send("y", y)
            s.recv("x").release()
            last = owed(s._ctx.channels[0])        # nothing to ride with...
            time.sleep(1.5)                        # ...while this rank neither writes nor waits
            with s.recv("x") as v:
                assert v[0] == 255
            return seen, last
        for k in range(ROUNDS + 1):
            x = s.buffer("x")                  # writable again once the last write no longer reads it
            x[0] = k % 256
            if k == ROUNDS and provider == "tcp":
                # tcp owes the last credit only once the channel's thread has seen rank 1 wait (it
                # then leaves the socket to it and looks every PARK_SECONDS); a thread that took
                # every write in itself (rank 1 came back to wait after they arrived) sleeps up to
                # 0.2 s before it looks again, and until then each credit goes at once: so rank 1
                # waits longer than that for this write
                time.sleep(0.3)
            s.send("x", x)
            if k < ROUNDS:
                s.recv("y").release()
        t = time.monotonic()
        x = s.buffer("x")              # the last write may still read it: refilled once it no longer does
        x[:] = 255
        s.send("x", x, timeout=1.0)    # needs the credit rank 1 released last: SendTimeout if it never left
        return time.monotonic() - t

    results = check(run_ranks(2, PLAN, provider, body))
    seen, last = results[1]
    if provider == "tcp":
        assert last > 0, f"the last credit was sent at once, not owed ({seen} owed before it): nothing was tested"
    else:
        assert seen + last > 0, "every credit was sent at once: none was owed"
    assert results[0] < 1.0
