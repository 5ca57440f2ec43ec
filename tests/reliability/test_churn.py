"""Hygiene under churn: 600 connect/transfer/close cycles of two ranks
(tcp, shm; 400 for the slower grpc baseline)
leave no file descriptor, thread, shared-memory segment or mapping behind,
and RSS stays flat after warm-up. Failed setups (plan mismatch, a peer that
never comes, a wrong token) and sessions whose data channel breaks release
everything too."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rdmatensor import AuthenticationError, PeerLost, Plan, PlanMismatch, TensorSpec

from ..support.ranks import check, run_ranks
from .helpers import rss_kib, rss_settled_kib, settle, shm_mappings, snapshot

PLAN = Plan([TensorSpec("a", (256,), np.float32, 0, 1), TensorSpec("b", (None,), np.float32, 1, 0)])
OTHER = Plan([TensorSpec("a", (255,), np.float32, 0, 1), TensorSpec("b", (None,), np.float32, 1, 0)])
CYCLES = 600
GRPC_CYCLES = 400          # the grpc baseline sets up slower: fewer keeps the suite short
WARMUP = 100
RSS_BOUND_KIB = 12 << 10


@pytest.fixture(autouse=True)
def quiet_rdmatensor_log():
    """Lost-channel warnings are expected here by the hundred; pytest would keep
    every record in memory, which would show up as RSS growth."""
    import logging
    log = logging.getLogger("rdmatensor")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _transfer(s, r):
    if r == 0:
        s.send("a", np.full(256, 1.5, np.float32))
        with s.recv("b") as v:
            assert v.shape == (3,) and (v == 2.5).all()
    else:
        with s.recv("a") as v:
            assert (v == 1.5).all()
        s.send("b", np.full(3, 2.5, np.float32))
    return True


def _report(name, cycles, t0, base, end, rss_base, rss_end):
    print(f"{name}: {cycles} cycles in {time.monotonic() - t0:.1f} s; after warm-up -> end: "
          f"fds {base['fds']}->{end['fds']}, threads {base['threads']}->{end['threads']}, "
          f"tasks {base['tasks']}->{end['tasks']}, shm mappings {end['shm_maps']}, "
          f"RSS {rss_base / 1024:.1f}->{rss_end / 1024:.1f} MiB ({(rss_end - rss_base) / 1024:+.1f})")


def _assert_clean(base, end, rss_base, rss_end):
    leaked = {k: end[k] - base[k] for k in base if end[k] > base[k]}
    assert not leaked, f"left behind: {leaked}; threads: {[t.name for t in threading.enumerate()]}"
    assert not shm_mappings(), shm_mappings()     # an arena not closed holds its memfd too: fds above
    assert rss_end - rss_base < RSS_BOUND_KIB, f"RSS grew by {(rss_end - rss_base) / 1024:.1f} MiB"


@pytest.mark.parametrize("provider", ["tcp", "shm", "grpc"])
def test_hundreds_of_sessions_leave_nothing_behind(provider):
    cycles = GRPC_CYCLES if provider == "grpc" else CYCLES
    t0 = time.monotonic()
    for i in range(cycles):
        assert check(run_ranks(2, PLAN, provider, _transfer, timeout=20)) == {0: True, 1: True}
        if i == WARMUP - 1:
            base = settle(snapshot())
            rss_base = rss_kib()
    end = settle(base)
    rss_end = rss_settled_kib(rss_base + RSS_BOUND_KIB)
    _report(provider, cycles, t0, base, end, rss_base, rss_end)
    _assert_clean(base, end, rss_base, rss_end)


def _lose_channel(s, r):
    """Rank 0 breaks its data connection under the session; rank 1 sees PeerLost."""
    if r == 0:
        s.debug_state()["channels"][1]._sock.shutdown(2)
        return True
    with pytest.raises(PeerLost):
        s.recv("a", timeout=10)
    return True


FAILURES = {
    # name: (cycles, run one cycle, check its results)
    "plan mismatch": (60, lambda p: run_ranks(2, PLAN, p, lambda s, r: None, plans={1: OTHER}, timeout=10),
                      lambda res: all(isinstance(v, PlanMismatch) for v in res.values())),
    "data channel cut": (60, lambda p: run_ranks(2, PLAN, p, _lose_channel, timeout=10),
                         lambda res: res == {0: True, 1: True}),
    "wrong token": (10, lambda p: run_ranks(2, PLAN, p, lambda s, r: None, tokens={1: "bad"}, timeout=0.3),
                    lambda res: isinstance(res[0], AuthenticationError) and isinstance(res[1], PeerLost)),
}


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_failed_and_broken_sessions_leave_nothing_behind(provider):
    t0 = time.monotonic()
    total = 0
    for rnd in range(2):      # the first round warms up (a busy process's first touch of memory is a step, not a leak)
        for name, (cycles, run, ok) in FAILURES.items():
            for _ in range(cycles):
                res = run(provider)
                assert ok(res), (name, {r: repr(v) for r, v in res.items()})
                del res           # an exception's traceback holds its session until dropped
                total += 1
        if rnd == 0:
            base = settle(snapshot())
            rss_base = rss_kib()
    end = settle(base)
    rss_end = rss_settled_kib(rss_base + RSS_BOUND_KIB)
    _report(f"{provider} failures", total, t0, base, end, rss_base, rss_end)
    _assert_clean(base, end, rss_base, rss_end)


MISMATCH_CYCLES = 800
SPIKE_BOUND_KIB = 200 << 10


def test_failed_setups_never_spike_memory():
    """A peer that fails setup shuts its control server down while the other
    rank's calls to it are in flight. With gRPC's transparent retries on, such a
    call retried in a tight loop against the closing server and kept every
    attempt's error: 0.3-1 GiB of heap within one failed setup, somewhere in
    the first 200-600 cycles. Measured after every cycle, with no garbage
    collection in between."""
    run, ok = FAILURES["plan mismatch"][1:]
    for _ in range(20):
        assert ok(run("shm"))
    base = rss_kib()
    peak = base
    for _ in range(MISMATCH_CYCLES):
        res = run("shm")
        assert ok(res), {r: repr(v) for r, v in res.items()}
        del res
        peak = max(peak, rss_kib())
    assert peak - base < SPIKE_BOUND_KIB, f"RSS rose by {(peak - base) >> 10} MiB during failed setups"


def test_a_closed_session_still_referenced_holds_no_thread_or_descriptor():
    """close() releases threads and sockets itself; it does not wait for the
    garbage collector (a failed connect's exception keeps its Session alive)."""
    base = settle(snapshot())
    kept = []

    def body(s, r):
        s.barrier("b")
        kept.append(s)
        return True

    for provider in ("tcp", "shm", "grpc"):
        for _ in range(5):
            check(run_ranks(2, PLAN, provider, body))
    assert all(s.closed for s in kept)
    end = settle(base)
    leaked = {k: end[k] - base[k] for k in base if end[k] > base[k]}
    assert not leaked, f"closed sessions still hold {leaked}: {[t.name for t in threading.enumerate()]}"
    assert not shm_mappings(), shm_mappings()
    kept.clear()
