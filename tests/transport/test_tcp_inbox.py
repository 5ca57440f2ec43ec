"""tcp's inbox (providers/tcp/inbox.py) on a real socket pair: the compiled one
(_inbox.c) and the Python one take in the same writes from a stream cut at
random places, land the same bytes, and refuse, stop and report a closed
connection the same way."""
from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest

from rdmatensor.memory import Arena
from rdmatensor.providers.tcp import inbox as inbox_mod
from rdmatensor.providers.emulated.write_header import WRITE_HEADER, WRITE_MAGIC

KEY = 0x1234
CAPACITY = 256                   # small, so that payloads often go straight into the region


@pytest.fixture(params=["compiled", "python"])
def kind(request, monkeypatch):
    """Every test here, on either inbox; the compiled one must be built."""
    if request.param == "compiled":
        assert inbox_mod.BUILD_ERROR is None, inbox_mod.BUILD_ERROR
        monkeypatch.delenv(inbox_mod.INBOX_ENV, raising=False)
    else:
        monkeypatch.setenv(inbox_mod.INBOX_ENV, "python")
    assert inbox_mod.compiled() == (request.param == "compiled")
    return request.param


def header(region, key, imm, offset, length, magic=WRITE_MAGIC) -> bytes:
    return WRITE_HEADER.pack(magic, region, key, imm, offset, length)


class Link:
    """An inbox on one end of a socket pair, region 0 exposed with KEY."""

    def __init__(self):
        self.tx, rx = socket.socketpair()
        self.rx = rx
        self.inbox = inbox_mod.make_inbox(rx, CAPACITY)
        self.arena = Arena(1 << 16)
        self.local = {0: (self.arena, KEY)}
        self.got = []

    def on_imm(self, imm):
        self.got.append(imm)

    def poll(self, event=None, seconds=0.2):
        return self.inbox.poll(event, self.local, self.on_imm, seconds)

    def bytes(self):
        return np.frombuffer(self.arena.buf, np.uint8)

    def close(self):
        self.inbox.close()
        for s in (self.tx, self.rx):
            s.close()
        self.arena.close()


@pytest.fixture
def link(kind):
    link = Link()
    yield link
    link.close()


def stream_of(writes) -> bytes:
    return b"".join(header(0, KEY, imm, off, len(data), ) + data for imm, off, data in writes)


def test_both_inboxes_take_in_the_same_writes_from_a_stream_cut_anywhere(kind):
    rng = random.Random(7)
    writes, expect = [], np.zeros(1 << 16, np.uint8)
    for imm in range(300):
        length = rng.choice([0, 1, 8, 31, 32, 33, 200, 255, 300, 5000, 40000])
        off = rng.randrange(0, (1 << 16) - length + 1)
        data = bytes(rng.randrange(256) for _ in range(min(length, 64))) * (length // 64 + 1)
        writes.append((imm, off, data[:length]))
    for _, off, data in writes:
        expect[off:off + len(data)] = np.frombuffer(data, np.uint8)
    stream = stream_of(writes)
    link = Link()
    try:
        def send():
            at = 0
            while at < len(stream):           # cut at random places, headers included
                n = rng.randrange(1, 3000)
                link.tx.sendall(stream[at:at + n])
                at += n
        sender = threading.Thread(target=send)
        sender.start()
        while len(link.got) < len(writes):
            assert link.poll(seconds=1.0) >= 0
        sender.join()
        assert link.got == list(range(300))
        assert np.array_equal(link.bytes(), expect)
        assert link.inbox.buffered == 0
    finally:
        link.close()


@pytest.mark.parametrize("bad", ["magic", "key", "region", "bounds"])
def test_a_header_that_does_not_land_is_refused_and_not_taken_in(link, bad):
    good = header(0, KEY, 1, 0, 4) + b"good"
    fields = {"magic": (0, KEY, 2, 8, 4, 0xBAD), "key": (0, KEY + 1, 2, 8, 4, WRITE_MAGIC),
              "region": (9, KEY, 2, 8, 4, WRITE_MAGIC), "bounds": (0, KEY, 2, (1 << 16) - 2, 4, WRITE_MAGIC)}
    region, key, imm, off, length, magic = fields[bad]
    link.tx.sendall(good + header(region, key, imm, off, length, magic) + b"evil" + stream_of([(3, 16, b"late")]))
    assert link.poll(seconds=0.5) == inbox_mod.REFUSED                # after taking in the good one
    assert link.inbox.refused == (magic, region, key, imm, off, length)
    assert link.got == [1]
    assert bytes(link.bytes()[:20]) == b"good" + bytes(16)       # neither the refused write nor the next landed
    assert link.poll(seconds=0.1) == inbox_mod.REFUSED           # and it stays refused
    assert link.got == [1]


def test_a_closed_connection_is_told_apart_from_one_cut_mid_message(kind):
    for cut, code in [(0, inbox_mod.CLOSED), (10, inbox_mod.CLOSED_MID), (WRITE_HEADER.size + 500,
                                                                           inbox_mod.CLOSED_MID)]:
        link = Link()
        try:
            whole = stream_of([(1, 0, b"x" * 8)])
            partial = header(0, KEY, 2, 0, 1000) + b"y" * 1000
            link.tx.sendall(whole + partial[:cut])
            link.tx.shutdown(socket.SHUT_WR)
            results = [link.poll(seconds=0.5) for _ in range(3)]
            assert [r for r in results if r < 0][:1] == [code], (cut, results)
            assert link.got == [1]                          # the whole one, and nothing of the cut one
        finally:
            link.close()


def test_poll_waits_for_its_event_and_stops_when_on_imm_says_lost(link):
    event = threading.Event()

    def on_imm(imm):
        link.got.append(imm)
        if imm == 9:
            event.set()
        return imm == 3                      # "lost": take in nothing more
    link.tx.sendall(stream_of([(1, 0, b""), (2, 0, b"ab"), (3, 0, b""), (4, 0, b"")]))
    assert link.inbox.poll(event, link.local, on_imm, 1.0) == 3       # 3 said stop: 4 stays buffered
    assert link.got == [1, 2, 3]
    assert link.inbox.poll(threading.Event(), link.local, on_imm, 0.05) == 1    # 4; then the time is up
    assert link.inbox.poll(threading.Event(), link.local, on_imm, 0.05) == 0
    later = threading.Timer(0.05, lambda: link.tx.sendall(stream_of([(8, 0, b""), (9, 0, b"")])))
    later.start()
    assert link.inbox.poll(event, link.local, on_imm, 5.0) == 2       # spins until 9 sets the event
    later.join()
    assert event.is_set() and link.got == [1, 2, 3, 4, 8, 9]


def test_a_closed_inbox_refuses_to_poll(link):
    link.inbox.close()
    with pytest.raises(ValueError, match="closed"):
        link.poll()
