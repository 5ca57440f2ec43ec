"""Heartbeats over verbs, on real SoftRoCE: a peer whose messages keep
arriving is alive, so it is not pinged. While tensors stream no RPC runs
beside them (on SoftRoCE a rank's CPU is its NIC's); once they stop, the
pings come back. A sender killed mid-stream is still found lost in bounded
time: test_faults.py, on every provider."""
from __future__ import annotations

import time

import numpy as np
import pytest

from rdmatensor import Plan, TensorSpec
from rdmatensor.providers.verbs.choose_endpoint import ENDPOINT_ENV, ENDPOINTS
from tests.support.ranks import check, run_ranks

pytestmark = pytest.mark.rdma

PLAN = Plan([TensorSpec("x", (16 << 10,), np.uint8, src=0, dst=1)])
BEAT = 0.2          # heartbeats this far apart: 10 in the 2 s stream if every one pinged
LAST = 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_peer_whose_tensors_keep_arriving_is_not_pinged(rdma_port, monkeypatch, endpoint):
    monkeypatch.setenv(ENDPOINT_ENV, endpoint)      # both count arrivals

    def body(s, rank):
        s.barrier("start")
        before = s.stats()["pings"]
        if rank == 0:
            x = s.buffer("x")
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                s.send("x", x)
            s.send("x", x, tag=LAST)
        else:
            last = False
            while not last:
                got = s.recv("x")
                last = got.tag == LAST
                got.release()
        streaming = s.stats()["pings"] - before
        s.barrier("streamed")
        time.sleep(1.0)                           # nothing arrives: both ping again
        idle = s.stats()["pings"] - before - streaming
        return streaming, idle

    results = check(run_ranks(2, PLAN, "verbs", body, heartbeat=BEAT, peer_timeout=10.0))
    for rank, (streaming, idle) in results.items():
        # Rank 1 hears writes, rank 0 credits; a beat may fall at the stream's edges.
        assert streaming <= 2, f"rank {rank} pinged its peer {streaming} times in 2 s of streaming"
        assert idle >= 2, f"rank {rank} pinged its peer {idle} times in 1 s of silence ({BEAT} s heartbeat)"

