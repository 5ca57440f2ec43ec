"""Who takes a verbs completion, on real SoftRoCE. On SoftRoCE the NIC is the
kernel: CPU that a rank spends being woken is taken from its NIC.

- A receiver that waits longer than its spin sleeps on the completion
  channel itself and is woken by the completion it waits for, not handed it
  by the background thread; it leaves the CQ armed, so the next sleeper is
  woken too.
- A sender takes in its completions and credits itself after each write
  (a look, which marks the channel polled), so its background thread is
  not woken for each of them."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from rdmatensor import Plan, TensorSpec
from rdmatensor.providers.verbs import channel as verbs_channel
from rdmatensor.session import slots
from tests.support.ranks import check, run_ranks

pytestmark = pytest.mark.rdma

PLAN = Plan([TensorSpec("x", (1024,), np.uint8, src=0, dst=1), TensorSpec("go", (1,), np.int64, src=1, dst=0)])


def test_a_waiting_receiver_is_woken_by_its_completion_and_leaves_the_queue_armed(rdma_port, monkeypatch):
    monkeypatch.setattr(verbs_channel, "SPIN_SECONDS", 0.001)     # waits of 0.1 s: asleep almost all of it
    monkeypatch.setattr(verbs_channel, "SLEEP_SECONDS", 10.0)     # however long a loaded machine makes them

    def body(s, rank):
        go = s.buffer("go") if rank == 1 else None
        if rank == 0:
            for k in range(3):
                s.recv("go").release()
                time.sleep(0.1)                   # the receiver is asleep by now
                x = s.buffer("x")
                x[:] = k + 1
                s.send("x", x)
            return None
        ch = s._ctx.channels[0]
        before = ch.ep.wakeups
        for k in range(2):
            s.send("go", go)
            with s.recv("x") as v:
                assert v[0] == k + 1 and v[-1] == k + 1
        woken = ch.ep.wakeups["slept"] - before["slept"]
        handed = ch.ep.wakeups["handed_over"] - before["handed_over"]
        # Nothing else may take events now: whoever took the last one must have armed the CQ again.
        with ch._event_lock:
            s.send("go", go)
            armed = ch.ep.wait_event(20.0)
        with s.recv("x") as v:
            assert v[0] == 3
        return woken, handed, armed

    results = check(run_ranks(2, PLAN, "verbs", body))
    woken, handed, armed = results[1]
    assert woken == 2, (f"{woken} of the receiver's 2 waits ended asleep on the completion channel; "
                        f"{handed} left to a thread holding its poll or event lock")
    assert armed, "no event came for a completion after a waiter slept on the channel: it left the CQ unarmed"


PAIR = Plan([TensorSpec("x", (64 << 10,), np.uint8, src=0, dst=1)])


@pytest.mark.parametrize("hop", ["compiled", "python"])
def test_a_sender_looks_at_its_own_completions_after_each_write(rdma_port, monkeypatch, hop):
    if hop == "python":
        monkeypatch.setattr(slots, "compiled", None)

    def body(s, rank):
        if rank == 1:
            for _ in range(20):
                s.recv("x").release()
            return None
        ch = s._ctx.channels[1]
        x = s.buffer("x")
        looked = []
        for _ in range(20):
            s.wait_released(["x"])                # the credit is in: send() will not wait (a wait marks it too)
            ch._polled_at = -math.inf
            s.send("x", x)
            looked.append(ch._polled_at > -math.inf)     # marked by the look (the background thread never marks it)
        return looked

    looked = check(run_ranks(2, PAIR, "verbs", body))[0]
    assert all(looked), f"no look at the completions after writes {[i for i, v in enumerate(looked) if not v]}"


def test_a_value_written_before_the_peers_goodbye_is_handed_over_though_a_waiter_polled_last(rdma_port):
    """A peer flushes its writes, then says goodbye over the control plane. Their
    completions may still sit in the CQ, unreaped, when the goodbye arrives just
    after a waiter polled (the background thread then leaves the CQ to it): the
    peer must be reported gone only after they are taken in, or the value it sent
    last is lost (PeerLost instead of the value, seen once in the suite)."""
    def body(s, rank):
        if rank == 0:
            s.recv("go").release()
            x = s.buffer("x")
            x[:] = 7
            s.send("x", x)
            return None                           # the session closes: flush, then goodbye
        ch = s._ctx.channels[0]
        s.send("go", s.buffer("go"))
        ch._polled_at = time.monotonic() + 3600   # as if a waiter had just polled, for as long as this runs
        deadline = time.monotonic() + 60
        while 0 not in s._live._said_bye and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 in s._live._said_bye, "rank 0 never said goodbye"
        time.sleep(0.5)                           # the background thread has taken the goodbye in
        with s.recv("x", timeout=5) as v:
            return int(v[0]), int(v[-1])

    assert check(run_ranks(2, PLAN, "verbs", body))[1] == (7, 7)
