"""The two RC endpoints on a real RDMA device (SoftRoCE in the VM under `make
test`): the compiled one (`_native_endpoint.c`, the default) and pyverbs' carry
the same session byte for byte and talk to each other; the compiled one
refuses a bad post before posting it, reports a dead peer, closes twice, and
waits with the GIL released."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rdmatensor import PeerLost, Plan, TensorSpec, TransportError, UsageError, connect
from rdmatensor.providers.contract import IMM_CREDIT, IMM_DATA, make_imm, pair_imm
from rdmatensor.providers.verbs.choose_endpoint import ENDPOINT_ENV, endpoint_class
from rdmatensor.providers.verbs.rc import LOCAL_ONLY, MAX_CHAIN, READ_ONLY, REMOTE_WRITE
from rdmatensor.providers.verbs.pyverbs_endpoint import RcEndpoint
from rdmatensor.providers.verbs.native_endpoint import NativeEndpoint
from rdmatensor.session.flag import Flag

from ..support.ranks import check, free_ports, run_ranks
from ..transport.peer_proc import TOKEN, fault_plan

pytestmark = pytest.mark.rdma
ROOT = Path(__file__).resolve().parents[2]
KINDS = {"native": NativeEndpoint, "pyverbs": RcEndpoint}


def connected(a_kind: str = "native", b_kind: str = "native"):
    """Two endpoints joined to each other in this process, receives posted."""
    a, b = endpoint_class(a_kind)(), endpoint_class(b_kind)()
    for ep in (a, b):
        ep.post_recv(ep.recv_depth)
    a.connect(b.params())
    b.connect(a.params())
    return a, b


def source_and_target(a, b, src: np.ndarray):
    """`src` registered as a's staging (read by the NIC alone, as the channel registers it), and a zeroed
    page of b's a may write: (page, its remote region)."""
    canary = np.zeros(4096, np.uint8)
    a.register(src, READ_ONLY)
    return canary, b.remote_region(canary, b.register(canary, REMOTE_WRITE))


@pytest.fixture
def pair(rdma_port):
    """Two compiled endpoints joined to each other, closed after the test."""
    a, b = connected()
    yield a, b
    a.close()
    b.close()


def completions(*endpoints, want: int, within: float = 30.0) -> list[tuple]:
    """(endpoint index, wr_id, status, is_receive, imm, byte_len) until `want` arrived."""
    got, end = [], time.monotonic() + within
    while len(got) < want and time.monotonic() < end:
        for i, ep in enumerate(endpoints):
            got += [(i, *c) for c in ep.poll(16, 0.001)]
    assert len(got) >= want, f"{len(got)} of {want} completions within {within} s: {got}"
    return got


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_same_exchange_over_either_endpoint(rdma_port, kind, monkeypatch):
    monkeypatch.setenv(ENDPOINT_ENV, kind)
    plan = Plan([TensorSpec("w", (300, 7), np.float32, 0, 1), TensorSpec("b", (5,), np.int64, 1, 0),
                 TensorSpec("dyn", (None,), np.uint8, 0, 1)])
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 7)).astype(np.float32)
    dyn = [rng.integers(0, 256, n, dtype=np.uint8) for n in (10, 70000, 3)]

    def body(s, r):
        assert type(s._ctx.channels[1 - r].ep) is KINDS[kind]       # the endpoint asked for
        assert (s._ctx.channels[1 - r].waiter() is None) == (kind == "pyverbs")    # the compiled spin: native only
        if r == 0:
            for step in range(3):
                s.send("w", w + step)
                s.send("dyn", dyn[step])
                with s.recv("b") as v:
                    assert v.tolist() == [step] * 5
            return True
        for step in range(3):
            with s.recv("w") as v:
                assert np.array_equal(v, w + step)
            with s.recv("dyn") as v:
                assert np.array_equal(v, dyn[step])
            s.send("b", np.full(5, step, np.int64))
        return True

    assert check(run_ranks(2, plan, "verbs", body, timeout=60)) == {0: True, 1: True}


@pytest.mark.parametrize("a_kind,b_kind", [("native", "pyverbs"), ("pyverbs", "native")])
def test_the_endpoints_talk_to_each_other(rdma_port, a_kind, b_kind):
    a, b = connected(a_kind, b_kind)
    try:
        src = np.random.default_rng(1).integers(0, 256, 10000, dtype=np.uint8)
        dst = np.zeros(12000, np.uint8)
        a.register(src, LOCAL_ONLY)
        region = b.remote_region(dst, b.register(dst, REMOTE_WRITE))
        number = a.post_write(src, region, 1000, imm=0x12345678)
        a.post_send_imm(0x0BADCAFE)
        done = completions(a, b, want=4)
        assert sorted(c[4] for c in done if c[0] == 1) == [0x0BADCAFE, 0x12345678]    # immediates, as sent
        assert all(c[2] == 0 for c in done) and number in [c[1] for c in done if c[0] == 0]
        assert np.array_equal(dst[1000:11000], src) and not dst[:1000].any() and not dst[11000:].any()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("a_kind,b_kind", [("native", "native"), ("pyverbs", "native")])
def test_fabric_settings_reach_the_queue_pair_and_it_still_delivers(rdma_port, a_kind, b_kind):
    """A traffic class, service level, hop limit, timeout, retry count and MTU cap
    (addressing.Fabric) are taken by both endpoints, and the write still lands."""
    from rdmatensor.providers.verbs.addressing import Fabric
    fabric = Fabric(traffic_class=106, service_level=3, hop_limit=8, timeout=16, retry_count=5, mtu=1024)
    a, b = endpoint_class(a_kind)(fabric=fabric), endpoint_class(b_kind)(fabric=fabric)
    try:
        for ep in (a, b):
            ep.post_recv(ep.recv_depth)
        assert a.params().fabric == fabric.agreed() and a.params().link_layer == "Ethernet"
        a.connect(b.params())
        b.connect(a.params())
        src = np.arange(5000, dtype=np.uint8)
        dst = np.zeros(8192, np.uint8)
        a.register(src, LOCAL_ONLY)
        region = b.remote_region(dst, b.register(dst, REMOTE_WRITE))
        a.post_write(src, region, 100, imm=7)
        done = completions(a, b, want=2)
        assert [c[4] for c in done if c[0] == 1] == [7] and np.array_equal(dst[100:5100], src)
    finally:
        a.close()
        b.close()
    c, d = endpoint_class("native")(fabric=Fabric(traffic_class=96)), endpoint_class("native")()
    try:
        with pytest.raises(TransportError, match="fabric settings differ"):
            c.connect(d.params())
    finally:
        c.close()
        d.close()


def test_the_hca_setting_picks_or_excludes_the_device(rdma_port, monkeypatch):
    from rdmatensor.errors import DeviceError
    device = rdma_port[0].name
    monkeypatch.setenv("RDMATENSOR_IB_HCA", device)
    ep = NativeEndpoint()
    gid_index = ep.gid_index
    assert ep.device == device
    ep.close()
    monkeypatch.setenv("RDMATENSOR_IB_GID_INDEX", str(gid_index))
    ep = RcEndpoint()
    assert (ep.device, ep.gid_index) == (device, gid_index)
    ep.close()
    monkeypatch.setenv("RDMATENSOR_IB_HCA", "^" + device)
    with pytest.raises(DeviceError, match=f"no ACTIVE RDMA port left by RDMATENSOR_IB_HCA='\\^{device}'"):
        NativeEndpoint()


def test_native_refuses_a_bad_write_before_posting_it(pair):
    a, b = pair
    src = np.ones(4096, np.uint8)
    receive_arena = np.zeros(4096, np.uint8)
    canary = np.full(8192, 0xAB, np.uint8)          # the remote region is its first half
    a.register(src, LOCAL_ONLY)
    a.register(receive_arena, REMOTE_WRITE)
    region = b.remote_region(canary, b.register(canary, REMOTE_WRITE))._replace(length=4096)
    with pytest.raises(TransportError, match="outside the 4096-byte remote region"):
        a.post_write(src[:100], region, 4000, imm=1)          # 4000 + 100 > 4096
    with pytest.raises(TransportError, match="outside"):
        a.post_write(src[:1], region, -1)
    with pytest.raises(TransportError, match=r"registered staging memory: \[0x[0-9a-f]+, \+16\)"):
        a.post_write(np.ones(16, np.uint8), region, 0)         # not registered
    with pytest.raises(TransportError, match="registered staging memory"):
        a.post_write(receive_arena[:16], region, 0)            # registered for the peer, not to send from
    with pytest.raises(TransportError, match="registered staging memory"):
        a.post_send(np.ones(16, np.uint8))
    assert a.in_flight == 0                                    # nothing was posted...
    time.sleep(0.2)
    assert not a.poll(16) and not b.poll(16)                   # ...nothing completed...
    assert (canary == 0xAB).all()                              # ...and no byte moved
    assert a.post_write(src[:96], region, 4000, imm=2) == 1    # the last bytes in bounds do go
    completions(a, b, want=2)
    assert (canary[4000:4096] == 1).all() and (canary[4096:] == 0xAB).all()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_chain_of_writes_lands_whole_in_order_or_not_at_all(rdma_port, kind):
    a, b = connected(kind, "native")
    try:
        src = np.arange(4096, dtype=np.uint8)
        canary = np.full(8192, 0xAB, np.uint8)
        a.register(src, LOCAL_ONLY)
        region = b.remote_region(canary, b.register(canary, REMOTE_WRITE))._replace(length=4096)
        writes = [(src[i * 100:(i + 1) * 100], region, i * 128, 100 + i) for i in range(MAX_CHAIN)]
        bad = writes[:5] + [(src[:100], region, 4000, 99)] + writes[5:8]          # the sixth is out of bounds
        with pytest.raises(TransportError, match="outside the 4096-byte remote region"):
            a.post_writes(bad)
        with pytest.raises(UsageError, match="1 to 32 writes"):
            a.post_writes(writes + writes[:1])
        assert a.in_flight == 0
        time.sleep(0.2)
        assert not a.poll(16) and not b.poll(16) and (canary == 0xAB).all()       # none of the chain went
        assert a.post_writes(writes) == 1                                         # numbers 1..32
        done = completions(a, b, want=2 * MAX_CHAIN)
        assert [c[1] for c in done if c[0] == 0] == list(range(1, MAX_CHAIN + 1))  # in order, each numbered
        assert [c[4] for c in done if c[0] == 1] == [100 + i for i in range(MAX_CHAIN)]
        for i in range(MAX_CHAIN):
            assert np.array_equal(canary[i * 128:i * 128 + 100], src[i * 100:(i + 1) * 100])
        assert (canary[4096:] == 0xAB).all()
        assert a.post_writes(writes[:3]) == MAX_CHAIN + 1                         # numbering goes on
        completions(a, b, want=6)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_owed_immediates_lead_the_next_post_and_none_is_lost(rdma_port, kind):
    """Credits owed while deferring go ahead of the next post, numbered before
    it; post_owed() sends them alone; once deferring is off none is taken, so
    clearing it and posting what is owed leaves nothing behind."""
    a, b = connected(kind, "native")
    try:
        src = np.arange(64, dtype=np.uint8)
        canary, region = source_and_target(a, b, src)
        assert a.owe(1) is False and a.owed == 0                  # not deferring: post it yourself
        a.deferring = True
        assert a.owe(11) and a.owe(12) and a.owed == 2
        time.sleep(0.2)
        assert not b.poll(16)                                     # owed: nothing went yet
        assert a.post_write(src[:8], region, 0, 500) == 3         # the two credits are sends 1 and 2
        got = completions(a, b, want=6)
        assert [c[1] for c in got if c[0] == 0] == [1, 2, 3]
        assert [c[4] for c in got if c[0] == 1] == [11, 12, 500]             # in order
        assert a.owed == 0 and np.array_equal(canary[:8], src[:8])
        assert a.owe(13) and a.post_owed() and a.owed == 0        # alone
        assert [c[4] for c in completions(a, b, want=2) if c[0] == 1] == [13]
        assert a.owe(14) and a.post_writes([(src[8:16], region, 8, 501), (src[16:24], region, 16, 502)]) == 6
        assert [c[4] for c in completions(a, b, want=6) if c[0] == 1] == [14, 501, 502]
        for imm in range(100, 100 + MAX_CHAIN + 1):               # a full list goes out before the next is owed
            assert a.owe(imm)
        assert a.owed == 1
        assert a.post_send_imm(7) == 7 + MAX_CHAIN + 2               # after 1..7 above, 32 and the one owed
        want = list(range(100, 100 + MAX_CHAIN + 1)) + [7]
        assert [c[4] for c in completions(a, b, want=2 * len(want)) if c[0] == 1] == want
        assert a.owe(15)
        a.deferring = False
        assert a.owe(16) is False and a.post_owed() and a.owed == 0
        assert [c[4] for c in completions(a, b, want=2) if c[0] == 1] == [15]
        assert a.in_flight == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_owed_credit_rides_in_the_next_write_where_it_pairs(rdma_port, kind):
    """A credit owed and a tag-0 DATA write go as one work request (a PAIR
    immediate); a write that cannot carry it (a tag) lets it lead the chain; in
    a chain the last credits owed ride in the first writes that pair; with no
    room in the send queue nothing goes and the credit stays owed."""
    a, b = connected(kind, "native")
    try:
        src = np.arange(64, dtype=np.uint8)
        canary, region = source_and_target(a, b, src)
        a.deferring = True
        credit, data = make_imm(IMM_CREDIT, 4), make_imm(IMM_DATA, 9)
        assert a.owe(credit) and a.post_write(src[:8], region, 0, data) == 1      # one send, not two
        got = completions(a, b, want=2)
        assert [c[4] for c in got if c[0] == 1] == [pair_imm(data, credit)] and a.owed == 0
        tagged = make_imm(IMM_DATA, 9, tag=3)
        assert a.owe(credit) and a.post_write(src[:8], region, 0, tagged) == 3
        assert [c[4] for c in completions(a, b, want=4) if c[0] == 1] == [credit, tagged]
        c1, c2, c3 = (make_imm(IMM_CREDIT, i) for i in (1, 2, 3))
        assert a.owe(c1) and a.owe(c2) and a.owe(c3)
        first = a.post_writes([(src[:8], region, 0, tagged), (src[8:16], region, 8, make_imm(IMM_DATA, 5)),
                               (src[16:24], region, 16, make_imm(IMM_DATA, 6))])
        assert first == 5 and a.owed == 0                 # c1 leads: send 4; the writes are 5, 6, 7
        assert [c[4] for c in completions(a, b, want=8) if c[0] == 1] == [
            c1, tagged, pair_imm(make_imm(IMM_DATA, 5), c3), pair_imm(make_imm(IMM_DATA, 6), c2)]
        assert np.array_equal(canary[:24], src[:24])
        filled = 0
        while a.post_send_imm(make_imm(IMM_DATA, 0)):    # b does not give receives back: they pile up in a's queue
            filled += 1
        assert filled and a.in_flight == a.depth and a.owe(credit)
        assert a.post_write(src[:8], region, 0, data) == 0 and a.owed == 1    # no room: the credit stays owed
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_prepared_write_posts_as_post_write_and_nothing_once_halted(rdma_port, kind):
    """prepare_write() checks once (a write outside the region is refused then);
    each call posts the same write, carrying an owed credit where it pairs;
    it posts nothing (returns 0) while halted, with no room, or once the
    endpoint is closed."""
    a, b = connected(kind, "native")
    try:
        src = np.zeros(64, np.uint8)
        canary, region = source_and_target(a, b, src)
        with pytest.raises(TransportError, match="outside"):
            a.prepare_write(src, region, 4090, 1)
        data = make_imm(IMM_DATA, 2)
        post = a.prepare_write(src[:16], region, 32, data)
        for i in (1, 2, 3):
            src[:16] = i
            assert post() == i
            [(_, _, _, _, imm, _)] = [c for c in completions(a, b, want=2) if c[0] == 1]
            assert imm == data and (canary[32:48] == i).all()
        a.deferring = True
        assert a.owe(make_imm(IMM_CREDIT, 6)) and post() == 4 and a.owed == 0
        assert [c[4] for c in completions(a, b, want=2) if c[0] == 1] == [pair_imm(data, make_imm(IMM_CREDIT, 6))]
        a.halted = True
        src[:16] = 9
        assert post() == 0 and a.in_flight == 0
        time.sleep(0.2)
        assert not b.poll(16) and (canary[32:48] == 3).all()
        a.halted = False
        while a.post_send_imm(make_imm(IMM_CREDIT, 0)):   # fill the send queue: no completion is taken
            pass
        assert a.in_flight == a.depth and post() == 0
    finally:
        a.close()
        b.close()
    assert post() == 0                                  # closed: the caller's checked path raises


@pytest.mark.parametrize("kind", list(KINDS))
def test_reap_hands_every_immediate_over_in_order_and_gives_receives_back(rdma_port, kind):
    """Three times the receive queue's depth of immediates: reap() passes each to
    on_imm in order and gives its receive back (else the sender would stall
    with no receive to consume), and reports the sender's last number."""
    a, b = connected("native", kind)
    try:
        got, total, last = [], 3 * b.recv_depth, 0
        end = time.monotonic() + 60
        for imm in range(total):
            while not a.post_send_imm(imm):                    # the send queue is full: take completions
                last = max(last, a.reap(got.append)[1])
            found, done, failed = b.reap(got.append)
            assert failed is None and done == 0               # b sends nothing
            assert time.monotonic() < end
        while len(got) < total and time.monotonic() < end:
            assert b.reap(got.append, 0.01)[2] is None
        assert got == list(range(total))
        while last < total and time.monotonic() < end:
            last = max(last, a.reap(got.append, 0.01)[1])
        assert last == total and len(got) == total             # a received nothing
    finally:
        a.close()
        b.close()


def test_the_compiled_wait_polls_as_the_channel_does_and_hands_it_a_failure(rdma_port):
    """The hop's spin in C (Endpoint.waiter): a ping-pong whose every recv waits
    through it; it gives up (None) when another thread holds the poll lock or
    nothing comes within its spin, keeping the channel's books (_sent,
    _polled_at); a failed completion becomes the channel's error, named."""
    plan = Plan([TensorSpec("x", (8,), np.float32, 0, 1), TensorSpec("y", (8,), np.float32, 1, 0)])
    done = threading.Event()           # rank 1 stays until rank 0 is through (its close would be a loss too)

    def body(s, r):
        ch = s._ctx.channels[1 - r]
        w = ch.waiter()
        assert type(w).__name__ == "Waiter"
        for step in range(50):
            if r == 0:
                buf = s.buffer("x")
                buf[:] = step
                s.send("x", buf)
                with s.recv("y") as v:
                    assert (v == step + 1).all()
            else:
                with s.recv("x") as v:
                    got = float(v[0])
                buf = s.buffer("y")
                buf[:] = got + 1
                s.send("y", buf)
        s.barrier("pinged")
        if r == 1:
            assert done.wait(60)
            return None
        try:
            flag = Flag()
            with ch._poll_lock:
                assert w(flag) is None                     # another thread reaps: wait_for() decides
            before = time.monotonic()
            for _ in range(100):                           # (the channel's own thread may hold the lock a moment)
                assert w(flag) is None and w(flag, 0.0) is None    # nothing comes within the spin (or the limit)
                if ch._polled_at >= before:
                    break
            assert before <= ch._polled_at <= time.monotonic() and ch._sent >= 50
            flag.set()
            assert w(flag) is True
            st = s._credits.send["x"]
            region = ch._regions[st.region]
            number = ch.ep.post_write(st.staging_bytes, region._replace(rkey=region.rkey ^ 0x5a5a), st.offset, st.imm)
            end = time.monotonic() + 30
            while 1 not in s.debug_state()["peer_errors"] and time.monotonic() < end:
                w(Flag())                                  # it (or the channel's own thread) reaps the failure
            error = s.debug_state()["peer_errors"].get(1)
            assert isinstance(error, TransportError), error
            assert f"write to peer 1: work request {number} failed: IBV_WC_REM_ACCESS_ERR" in str(error)
            assert w(Flag()) is None                       # halted now: nothing more to poll here
        finally:
            done.set()
        return True

    assert check(run_ranks(2, plan, "verbs", body, timeout=60))[0] is True


def test_native_write_the_peer_refuses_fails_with_its_status_named(pair):
    """A write into memory the peer deregistered is refused by its NIC: the
    completion names the status, and the queue pair's later work is flushed.
    (On SoftRoCE here a write to a queue pair that is gone did not complete
    within 20 s, so a dead peer is found by the session's heartbeats: the
    next test.)"""
    a, b = pair
    src = np.ones(64, np.uint8)
    dst = np.zeros(64, np.uint8)
    a.register(src, LOCAL_ONLY)
    mr = b.register(dst, REMOTE_WRITE)
    region = b.remote_region(dst, mr)
    b.deregister(mr)
    assert a.post_write(src, region, 0, imm=7) == 1
    assert a.post_send_imm(8) == 2
    done, end = [], time.monotonic() + 60
    while sum(not c[2] for c in done) < 2 and time.monotonic() < end:
        done += a.poll(16, 0.01)
    assert [(c[0], a.status_name(c[1])) for c in done if not c[2]] == [
        (1, "IBV_WC_REM_ACCESS_ERR"), (2, "IBV_WC_WR_FLUSH_ERR")]
    # the receives posted on the failed queue pair are flushed too, and known as receives
    assert {a.status_name(c[1]) for c in done if c[2]} <= {"IBV_WC_WR_FLUSH_ERR"}
    assert not dst.any()


def test_a_session_write_to_a_killed_peer_is_reported(rdma_port):
    ports = free_ports(2)
    peers = {0: f"127.0.0.1:{ports[0]}", 1: f"127.0.0.1:{ports[1]}"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.transport.peer_proc", "idle", "verbs", *map(str, ports)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        with connect(0, peers, fault_plan(), provider="verbs", token=TOKEN, timeout=60) as s:
            assert "connected" in proc.stdout.readline()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            t0 = time.monotonic()
            with pytest.raises((PeerLost, TransportError)):
                s.send("x", np.ones(1024, np.float32))     # holds the credit: the write is posted...
                s.send("x", np.ones(1024, np.float32), timeout=30)   # ...and the next one learns its fate
            assert time.monotonic() - t0 < 30
            with pytest.raises(PeerLost):
                s.send("x", np.ones(1024, np.float32))                # it sticks
    finally:
        proc.kill()
        proc.wait()


def test_native_close_is_idempotent_and_later_calls_are_typed_errors(rdma_port):
    a, b = connected()
    buf = np.zeros(4096, np.uint8)
    mr = a.register(buf, LOCAL_ONLY)
    b.close()
    a.close()
    a.close()
    assert a.closed and mr.closed and not a.memory_regions
    for call in (lambda: a.post_send_imm(1), lambda: a.poll(4), lambda: a.wait_event(0.01),
                 lambda: a.register(buf), lambda: a.post_recv(16)):
        with pytest.raises(TransportError, match="closed"):
            call()
    buf[:] = 1                              # the memory is ours again


def test_native_waits_with_the_gil_released(pair):
    """While one thread blocks on the completion channel, or spins on the CQ,
    another Python thread keeps running."""
    a, b = pair
    for wait in (lambda: a.wait_event(0.5), lambda: a.poll(16, 0.5)):
        finished = threading.Event()

        def waiter(wait=wait, finished=finished):
            wait()
            finished.set()

        t = threading.Thread(target=waiter)
        counted = 0
        t.start()
        time.sleep(0.01)                    # the waiter is inside
        while not finished.is_set():
            counted += 1
        t.join()
        assert counted > 1000, f"the other thread ran {counted} loops while one waited"


def test_native_wait_event_wakes_on_a_completion(pair):
    a, b = pair
    src = np.ones(16, np.uint8)
    a.register(src, LOCAL_ONLY)
    dst = np.zeros(16, np.uint8)
    region = b.remote_region(dst, b.register(dst, REMOTE_WRITE))
    a.post_write(src, region, 0, imm=5)
    t0 = time.monotonic()
    assert b.wait_event(30)                 # the immediate's receive completed
    assert time.monotonic() - t0 < 30
    assert completions(b, want=1)[0][4] == 5
