"""The shm completion ring (providers/ring.py) between two real channels:
entries wrap around, a full ring holds the sender back until the receiver
takes in, a sleeping receiver is woken by its doorbell (not by a timeout),
and a peer killed while the receiver sleeps is reported at once. Every test
runs on the compiled ring (_ring.c) and on the Python one, and the two take
in the same entries and refuse the same ones."""
from __future__ import annotations

import os
import platform
import random
import signal
import struct
import threading
import time

import numpy as np
import pytest

from rdmatensor import PeerLost, Pieces, TransportError, connect
from rdmatensor.memory import Arena
from rdmatensor.providers.shm import channel as shm
from rdmatensor.providers.shm import completion_ring as ring_mod
from rdmatensor.providers.emulated.write_header import WRITE_MAGIC
from rdmatensor.providers.shm.completion_ring import (ENTRY, HEAD_AT, HEADER_BYTES, MIN_ENTRIES, RING_ENV,
                                                     SLEEPING_AT, TAIL_AT, CompletionRing)
from rdmatensor.providers.shm.channel import ShmChannel

from .peer_proc import TOKEN, fault_plan
from .test_faults import _spawn, _wait_line
from ..support.ranks import free_ports


@pytest.fixture(params=["compiled", "python"])
def ring_kind(request, monkeypatch):
    """Every test here, on either ring; the compiled one must be built where shm runs."""
    if request.param == "compiled":
        assert platform.machine() != "x86_64" or ring_mod.BUILD_ERROR is None, ring_mod.BUILD_ERROR
        monkeypatch.delenv(RING_ENV, raising=False)
    else:
        monkeypatch.setenv(RING_ENV, "python")
    return request.param


class Pair:
    """Channel `a` (rank 0) writes into region 0 of channel `b` (rank 1)."""

    def __init__(self, max_incoming: int = 1):
        self.got = {0: [], 1: []}
        self.lost = {0: [], 1: []}
        self.arrived = threading.Event()
        self.a = ShmChannel(0, 1, "127.0.0.1", on_imm=self.got[0].append, on_lost=self.lost[0].append,
                            max_incoming=max_incoming)
        self.b = ShmChannel(1, 0, "127.0.0.1", on_imm=self._on_imm_b, on_lost=self.lost[1].append,
                            max_incoming=max_incoming)
        self.arena = Arena(1 << 16, shared=True)
        self.a.attach(self.b.expose(0, self.arena))
        accepter = threading.Thread(target=self.b.connect, args=(self.a.params(), False, 10))
        accepter.start()
        self.a.connect(self.b.params(), True, 10)
        accepter.join(10)

    def _on_imm_b(self, imm: int) -> None:
        self.got[1].append(imm)
        self.arrived.set()

    def take_in(self, n: int, timeout: float = 5) -> list[int]:
        deadline = time.monotonic() + timeout
        while len(self.got[1]) < n and time.monotonic() < deadline:
            self.b.progress(0.01)
        return self.got[1]

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.arena.close()


@pytest.fixture
def pair(ring_kind):
    p = Pair()
    yield p
    p.close()


def test_entries_wrap_around_in_order_with_their_payloads(pair, ring_kind):
    assert (pair.b._ring_in._core is not None) == (ring_kind == "compiled")
    entries = pair.b._ring_in.entries
    assert entries == MIN_ENTRIES
    n = entries * 4 + 7
    seen = []
    for i in range(n):
        pair.a.write(0, 8 * i, np.array([i * 3], np.uint64).view(np.uint8), i)
        if i % 37 == 36:                       # take in at uneven points, across the wrap
            pair.b.progress()
            seen.append(len(pair.got[1]))
    assert pair.take_in(n) == list(range(n))
    assert np.array_equal(pair.arena.buf[:8 * n].view(np.uint64), np.arange(n, dtype=np.uint64) * 3)
    assert pair.b._ring_in.tail == n > 4 * entries
    assert seen == [37 * (k + 1) for k in range(len(seen))]
    assert not pair.lost[0] and not pair.lost[1]


def test_a_full_ring_holds_the_sender_back_until_the_receiver_takes_in(pair):
    entries = pair.a._ring_out.entries
    for i in range(entries):
        pair.a.notify(i)
    blocked = threading.Thread(target=pair.a.notify, args=(entries,), daemon=True)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a write went into a full ring"
    assert pair.got[1] == []
    assert pair.b.progress()                   # takes in the full ring, making room
    blocked.join(5)
    assert not blocked.is_alive(), "the sender stayed blocked after the receiver took in"
    assert pair.take_in(entries + 1) == list(range(entries + 1))


def test_a_sleeping_receiver_is_woken_by_its_doorbell(pair, monkeypatch):
    monkeypatch.setattr(shm, "SLEEP_SLICE", 30.0)        # only the doorbell can wake it in time
    result = {}

    def waiter():
        result["ok"] = pair.b.wait_for(pair.arrived, 20)
        result["at"] = time.monotonic()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not pair.a._ring_out.consumer_sleeping() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pair.a._ring_out.consumer_sleeping(), "the receiver never went to sleep"
    time.sleep(0.05)
    t0 = time.monotonic()
    pair.a.notify(7)
    t.join(5)
    assert not t.is_alive() and result["ok"]
    woke = result["at"] - t0
    print(f"sleeping receiver woken {woke * 1e6:.0f} us after the write")
    assert woke < 1.0
    assert pair.got[1] == [7]
    assert not pair.a._ring_out.consumer_sleeping()


def test_the_receiver_trusts_its_own_tail_and_ignores_a_scribbled_sleep_word(pair):
    """The producer can write the whole ring segment: a tail or sleep word it
    scribbles on changes nothing the receiver checks."""
    seg = pair.a._ring_out.memory          # the producer's own mapping (the name goes once it is mapped)
    pair.a.notify(1)
    struct.pack_into("<Q", seg.buf, TAIL_AT, 2 ** 63)
    struct.pack_into("<Q", seg.buf, SLEEPING_AT, 0xFFFF)
    assert pair.b.wait_for(pair.arrived, 5)
    pair.arrived.clear()
    struct.pack_into("<Q", seg.buf, TAIL_AT, 0)
    pair.a.notify(2)
    assert pair.take_in(2) == [1, 2]
    assert not pair.lost[1]


def test_a_peer_killed_while_the_receiver_sleeps_is_reported_at_once(ring_kind):
    ports = free_ports(2)
    peers = {0: f"127.0.0.1:{ports[0]}", 1: f"127.0.0.1:{ports[1]}"}
    proc = _spawn("idle", "shm", ports)
    out = {}
    try:
        with connect(0, peers, fault_plan(), provider="shm", token=TOKEN, timeout=60) as s:
            _wait_line(proc, "connected")

            def receiver():
                try:
                    s.recv("big", timeout=30)
                except PeerLost as exc:
                    out["error"], out["at"] = exc, time.monotonic()

            t = threading.Thread(target=receiver, daemon=True)
            t.start()
            ring = s.debug_state()["channels"][1]._ring_in
            deadline = time.monotonic() + 10
            while not ring.consumer_sleeping() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert ring.consumer_sleeping(), "rank 0 never went to sleep on its ring"
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            t.join(10)
    finally:
        proc.kill()
        proc.wait()
    assert "error" in out, "recv() did not raise PeerLost"
    detected = out["at"] - t0
    print(f"peer killed while rank 0 slept: PeerLost after {detected * 1e3:.1f} ms")
    assert detected < 0.5


def test_everything_completed_before_the_peer_hangs_up_is_delivered_first(ring_kind):
    """More completions than one batch wait in the ring when the writer's end
    closes: the receiver takes in every one, in order, and only then reports
    the loss."""
    n = 3 * shm.DRAIN_BATCH + 5
    pair = Pair(max_incoming=n)
    try:
        for i in range(n):
            pair.a.notify(i)
        pair.a.close()
        deadline = time.monotonic() + 5
        while not pair.lost[1] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pair.got[1] == list(range(n))
        assert len(pair.lost[1]) == 1 and isinstance(pair.lost[1][0], PeerLost)
    finally:
        pair.close()


class Region:
    size = 4096


def test_both_rings_take_in_the_same_entries_and_refuse_the_same_one():
    """Random entries, most valid, some not (magic, region, key, bounds, an
    offset that overflows), produced by hand: the compiled and the Python
    drain() report the same immediates, stop at the same entry, refuse it
    the same way, and leave the same tail."""
    local = {0: (Region(), 77), 3: (Region(), 5)}
    rng = random.Random(7)
    seen = set()
    for trial in range(300):
        results = []
        script = [rng.random() for _ in range(8)]
        for kind in ("compiled", "python"):
            os.environ[RING_ENV] = "" if kind == "compiled" else "python"
            try:
                ring = CompletionRing.create(64)
            finally:
                os.environ.pop(RING_ENV, None)
            assert (ring._core is not None) == (kind == "compiled")
            r = random.Random(trial)
            n = r.randrange(1, 70)
            head = 0
            for i in range(n):
                magic, region, key, off, length = WRITE_MAGIC, r.choice([0, 3]), 0, r.randrange(4096), 0
                key = local[region][1]
                length = r.randrange(0, 4096 - off + 1)
                bad = r.random()
                if bad < 0.03:
                    magic ^= 1
                elif bad < 0.06:
                    region = 9
                elif bad < 0.09:
                    key += 1
                elif bad < 0.12:
                    length = 4097 - off
                elif bad < 0.14:
                    off, length = 2 ** 64 - 8, 16
                if i < 64:
                    ENTRY.pack_into(ring.memory.buf, HEADER_BYTES + i * ENTRY.size, magic, region, key, i, off, length)
                    head = i + 1
            struct.pack_into("<Q", ring.memory.buf, HEAD_AT, head if script[0] > 0.05 else 2 ** 64 - 1)
            got = []
            stop_at = r.randrange(0, 80)
            taken = []

            def on_imm(imm, got=got, stop_at=stop_at):
                got.append(imm)
                return len(got) == stop_at
            while True:
                k = ring.drain(r.randrange(1, 20), local, on_imm)
                taken.append(k)
                if k <= 0 or len(got) == stop_at:
                    break
            results.append((got, taken, ring.refused, ring.tail, ring.available()))
            ring.close()
        assert results[0] == results[1], trial
        refused = results[0][2]
        seen.add("bad head" if refused and len(refused) == 1 else "bad entry" if refused else
                 "stopped by on_imm" if results[0][1][-1] > 0 else "all taken in")
    assert seen == {"bad head", "bad entry", "stopped by on_imm", "all taken in"}, seen


def test_the_compiled_ring_refuses_bad_arguments():
    assert ring_mod.BUILD_ERROR is None, ring_mod.BUILD_ERROR     # make setup builds it (x86-64)
    ring = CompletionRing.create(64)
    core = ring._core
    with pytest.raises(OverflowError):
        core.push(2 ** 31, 0, 0, 0, 0)
    with pytest.raises(OverflowError):
        core.push(0, 2 ** 32, 0, 0, 0)
    with pytest.raises(TypeError):
        core.push(0, 0, 0)
    with pytest.raises(TypeError):
        core.drain(1, [], print)
    assert ring.head == 0                           # nothing was written
    with pytest.raises(ValueError):
        ring_mod._compiled.Ring(bytearray(300), 64)  # too small for 64 entries
    with pytest.raises(ValueError):
        ring_mod._compiled.Ring(bytearray(4096), 48)  # not a power of two
    ring.close()
    with pytest.raises(ValueError):
        core.push(0, 0, 0, 0, 0)                    # closed: the memory is gone


def test_a_write_that_does_not_fit_copies_nothing_and_posts_nothing(ring_kind):
    os.environ[RING_ENV] = "" if ring_kind == "compiled" else "python"
    try:
        ring = CompletionRing.create(64)
    finally:
        os.environ.pop(RING_ENV, None)
    target = bytearray(64)
    src = np.arange(16, dtype=np.uint8)
    assert ring.write(memoryview(target), 48, src, 0, 9, 5) is False     # fits exactly: copied, posted
    assert bytes(target[48:]) == bytes(range(16)) and ring.head == 1
    for offset in (49, 64, -1, 2 ** 40):
        with pytest.raises(ValueError):
            ring.write(memoryview(target), offset, src, 0, 9, 6)
    assert bytes(target[:48]) == bytes(48) and ring.head == 1
    got = []
    assert ring.drain(8, {0: (Region(), 9)}, got.append) == 1 and got == [5]
    ring.close()


def test_write_many_goes_in_one_call_until_a_write_it_cannot_take(pair):
    """Small writes go together; a large one, pieces, or a bad one is left to
    write(), in order: every payload lands, every immediate arrives in order,
    and a write outside the region raises and posts nothing."""
    big = shm.streaming.STREAM_BYTES
    arena = Arena(4 * big, shared=True)
    pair.a.attach(pair.b.expose(1, arena))
    small = [np.full(8, i, np.uint8) for i in range(6)]
    writes = [(0, 8 * i, small[i], i) for i in range(3)]
    writes.append((1, 0, np.full(big, 7, np.uint8), 3))                       # streamed, by write()
    writes.append((0, 64, Pieces([small[4][:3], small[4][3:]]), 4))          # pieces, by write()
    writes.append((0, 72, small[5], 5))
    assert pair.a.write_many(writes) == [None] * 6
    assert pair.take_in(6) == list(range(6))
    assert bytes(pair.arena.buf[:24]) == bytes([0] * 8 + [1] * 8 + [2] * 8)
    assert bytes(pair.arena.buf[64:80]) == bytes([4] * 8 + [5] * 8)
    assert np.all(arena.buf[:big] == 7)
    with pytest.raises(TransportError, match="outside"):
        pair.a.write_many([(0, 8 * 10, small[0], 10), (0, (1 << 16) - 4, small[1], 11)])
    assert pair.take_in(7) == list(range(6)) + [10]                           # the first went, the bad one not
    time.sleep(0.05)
    assert pair.b.progress() is False and pair.got[1] == list(range(6)) + [10]
    with pytest.raises(TransportError, match="no region 9"):
        pair.a.write_many([(9, 0, small[0], 12)])
    ring = pair.a._ring_out                   # the ring itself: how far one call goes
    assert ring.write_many(pair.a._targets, writes, big)[0] == 3
    assert ring.write_many(pair.a._targets, writes[5:] + writes[:3], big)[0] == 4
    arena.close()
