"""Failures: a killed peer is reported within a bounded time and never yields a
partly written tensor; a peer that never shows up fails setup; checksums catch
corruption."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rdmatensor import IntegrityError, PeerLost, Plan, TensorSpec, connect

from .peer_proc import TOKEN, chain_plan, fault_plan
from ..support.providers import PROVIDERS
from ..support.ranks import check, free_ports, run_ranks

ROOT = Path(__file__).resolve().parents[2]
DETECT_BOUND = 10.0


@pytest.fixture(params=PROVIDERS)
def provider(request):
    return request.param


def _spawn(role, provider, ports):
    return subprocess.Popen([sys.executable, "-m", "tests.transport.peer_proc", role, provider, *map(str, ports)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _wait_line(proc, text, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"peer exited ({proc.returncode}) before printing {text!r}")
    raise AssertionError(f"peer did not print {text!r}")


def test_receiver_killed_while_holding_a_view(provider):
    ports = free_ports(2)
    peers = {0: f"127.0.0.1:{ports[0]}", 1: f"127.0.0.1:{ports[1]}"}
    proc = _spawn("holder", provider, ports)
    try:
        with connect(0, peers, fault_plan(), provider=provider, token=TOKEN, timeout=60) as s:
            s.send("x", np.ones(1024, np.float32))
            _wait_line(proc, "holding")
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(PeerLost):
                s.send("x", np.full(1024, 2, np.float32), timeout=60)   # waits for a credit that never comes
            detected = time.monotonic() - t0
            with pytest.raises(PeerLost):
                s.send("x", np.full(1024, 3, np.float32))               # the error sticks
    finally:
        proc.kill()
        proc.wait()
    print(f"{provider}: dead receiver detected in {detected:.2f} s")
    assert detected < DETECT_BOUND


def test_sender_killed_mid_stream_never_yields_a_partial_tensor(provider):
    ports = free_ports(2)
    peers = {0: f"127.0.0.1:{ports[0]}", 1: f"127.0.0.1:{ports[1]}"}
    proc = _spawn("streamer", provider, ports)
    received, detected = 0, None
    try:
        with connect(0, peers, fault_plan(), provider=provider, token=TOKEN, timeout=60) as s:
            killer = t_kill = None
            try:
                while True:
                    with s.recv("big", timeout=60) as v:
                        first = int(v[0])
                        assert (v == first).all(), "a tensor arrived partly written"
                        received += 1
                    if killer is None:     # mid-stream: 1.5 s after the first tensor, however slow the start
                        killer = threading.Timer(1.5, os.kill, (proc.pid, signal.SIGKILL))
                        killer.start()
                        t_kill = time.monotonic() + 1.5
            except PeerLost:
                if t_kill is not None:        # else the sender died before its first tensor: failed below
                    detected = time.monotonic() - t_kill
            if killer is not None:
                killer.join()
    finally:
        proc.kill()
        proc.wait()
    print(f"{provider}: {received} complete tensors, sender death detected in {detected:.2f} s")
    assert received >= 1
    assert detected is not None and detected < DETECT_BOUND


def test_a_chain_of_waiting_ranks_names_the_rank_that_died_first(provider):
    """Rank 2 is killed; rank 0, waiting on it, fails and closes; rank 1, which only
    waits on rank 0 and never talks to rank 2, is told rank 2 was lost, not rank 0."""
    ports = free_ports(3)
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(ports)}
    proc = _spawn("chain_end", provider, ports)
    errors, times = {}, {}

    def rank(r, s):
        try:
            if r == 0:
                with s.recv("a", timeout=60):
                    pass
                _wait_line(proc, "sent")
                os.kill(proc.pid, signal.SIGKILL)
                times["kill"] = time.monotonic()
                s.recv("a", timeout=60)
            else:
                s.recv("b", timeout=60)
        except PeerLost as exc:
            errors[r], times[r] = exc, time.monotonic()

    try:
        def body(s, r):
            rank(r, s)
        check(run_ranks(2, chain_plan(), provider, body, peers=peers, token=TOKEN))
    finally:
        proc.kill()
        proc.wait()
    assert errors[0].peer == 2 and errors[1].peer == 2, (repr(errors[0]), repr(errors[1]))
    assert "rank 0 left because of it" in str(errors[1])
    print(f"{provider}: rank 2's death reached rank 0 in {times[0] - times['kill']:.2f} s, "
          f"rank 1 in {times[1] - times['kill']:.2f} s")
    assert times[1] - times["kill"] < DETECT_BOUND


def test_a_peer_that_never_shows_up_fails_setup():
    plan = Plan([TensorSpec("a", (4,), np.float32, 0, 1)])
    ports = free_ports(2)
    t0 = time.monotonic()
    with pytest.raises(PeerLost):
        connect(0, {0: f"127.0.0.1:{ports[0]}", 1: f"127.0.0.1:{ports[1]}"}, plan, provider="tcp",
                token=TOKEN, timeout=3)
    assert time.monotonic() - t0 < 10


def test_checksums_pass_intact_tensors_and_catch_corruption(provider):
    plan = Plan([TensorSpec("w", (333,), np.float64, 0, 1), TensorSpec("seq", (None, 3), np.int16, 0, 1)],
                checksum=True)
    rng = np.random.default_rng(5)
    w = [rng.standard_normal(333) for _ in range(3)]
    seqs = [rng.integers(-999, 999, (n, 3), dtype=np.int16) for n in (2, 3000, 7)]

    def body(s, r):
        if r == 0:
            for a, b in zip(w, seqs, strict=False):
                s.send("w", a)
                s.send("seq", b)
            return s.stats()
        ok = []
        for i in range(3):
            st = s.debug_state()["recv_slots"]["w"]
            if i == 1:      # corrupt one byte in the arena after it landed, before it is read
                deadline = time.monotonic() + 30
                while st.state != st.FULL and time.monotonic() < deadline:
                    s.debug_state()["channels"][0].progress()
                    time.sleep(0.001)
                st.memory[17] ^= 0xFF
                with pytest.raises(IntegrityError, match="checksum"):
                    s.recv("w")
            else:
                with s.recv("w") as v:
                    ok.append(bool(np.array_equal(v, w[i])))
            with s.recv("seq") as v:
                ok.append(bool(np.array_equal(v, seqs[i])))
        return ok, s.stats()["corrupt"]

    res = check(run_ranks(2, plan, provider, body))
    ok, corrupt = res[1]
    assert ok == [True] * 5 and corrupt == 1
