"""The emulated NICs (tcp, shm) enforce bounds against a hostile peer.

The attacker speaks the data-channel wire format itself (emulated/stream_channel.py: the
32-byte auth key; then for tcp 32-byte WRITE_HEADERs, each followed by its
payload; for shm the payload in the shared segment and the same header as
an entry of the receiver's completion ring, ring.py, written through a raw
mapping of it). Every write with a wrong key, an unexposed region, an offset
or length outside the region, a bad magic, a header that is cut short or
followed by junk (tcp), a stream cut mid-payload (tcp) or a ring index moved
where no entry can be (shm) is refused: the connection is closed, on_lost is
called once with a typed error, no immediate is delivered for it, and every
byte of the receiver's memory (canary-filled) outside the writes it accepted
is unchanged. The same holds end to end against a real Session whose peer
turns hostile.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmatensor import PeerLost, Plan, RefusedWrite, TensorSpec, connect
from rdmatensor.control import control_pb2 as pb
from rdmatensor.control import control_pb2_grpc as pb_grpc
from rdmatensor.control.service import ControlClient, start_server
from rdmatensor.memory import PAGE, Arena, MappedArena
from rdmatensor.providers.contract import IMM_DATA, WIRE_VERSION, make_imm
from rdmatensor.providers.emulated.write_header import WRITE_HEADER, WRITE_MAGIC
from rdmatensor.providers.shm.completion_ring import ENTRY, HEAD_AT, HEADER_BYTES, INFO, CompletionRing
from rdmatensor.providers.shm.channel import ShmChannel, host_id
from rdmatensor.providers.emulated.stream_channel import AUTH_BYTES, HANDSHAKE_TIMEOUT
from rdmatensor.providers.tcp.channel import TcpChannel

from ..support.ranks import TOKEN, free_ports
from .helpers import assert_untouched, canary_arena

PROVIDERS = {"tcp": TcpChannel, "shm": ShmChannel}
SIZES = (3 * PAGE, PAGE)          # the two regions the victim exposes


def header(region, key, imm, offset, length, magic=WRITE_MAGIC) -> bytes:
    return WRITE_HEADER.pack(magic, region, key, imm, offset, length)


class RingWriter:
    """The attacker's side of the victim's shm completion ring: a raw mapping
    and the layout, no rdmatensor code. Each entry is followed by a doorbell."""

    def __init__(self, name: str):
        self.segment = MappedArena(name)
        self.entries = INFO.unpack_from(self.segment.buf, 0)[1]
        self.head = 0

    def put(self, sock: socket.socket, entry: bytes) -> None:
        at = HEADER_BYTES + (self.head % self.entries) * ENTRY.size
        self.segment.buf[at:at + ENTRY.size] = np.frombuffer(entry, np.uint8)
        self.move_head(sock, self.head + 1)

    def move_head(self, sock: socket.socket, head: int) -> None:
        struct.pack_into("<Q", self.segment.buf, HEAD_AT, head % 2 ** 64)
        self.head = head
        sock.sendall(b"\1")

    def close(self) -> None:
        self.segment.close()


class Victim:
    """One channel end (rank 1) exposing two canary-filled regions to rank 0,
    with a third, unexposed arena next to them."""

    def __init__(self, provider: str):
        self.provider = provider
        shared = provider == "shm"
        self.imms: list[int] = []
        self.lost: list[Exception] = []
        self.lost_event = threading.Event()
        self.ch = PROVIDERS[provider](1, 0, "127.0.0.1", on_imm=self.imms.append, on_lost=self._on_lost)
        # shm: the attacker's own completion ring, for the victim to map; and its view of the victim's
        self.own_ring = CompletionRing.create(64) if shared else None
        self.ring: RingWriter | None = None
        self.arenas = [Arena(size, shared=shared) for size in SIZES]
        self.private = Arena(PAGE, shared=shared)
        self.expected = [canary_arena(a) for a in self.arenas]
        self.private_expected = canary_arena(self.private)
        self.descs = [self.ch.expose(i, a) for i, a in enumerate(self.arenas)]
        self.params = self.ch.params()
        self.accept_error: list[Exception] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()
        self.mapped: list[MappedArena] = []

    def _on_lost(self, exc: Exception) -> None:
        self.lost.append(exc)
        self.lost_event.set()

    def _accept(self) -> None:
        try:
            self.ch.connect({"ring": self.own_ring.name} if self.own_ring else {}, initiator=False, timeout=20)
        except Exception as exc:  # noqa: BLE001
            self.accept_error.append(exc)

    def accepted(self, timeout: float = 10) -> bool:
        self._accepter.join(timeout)
        return not self._accepter.is_alive() and not self.accept_error

    def dial(self, key: bytes | None = None) -> socket.socket:
        """A raw connection to the victim's data port; sends `key` (the right one by default)."""
        if self.provider == "tcp":
            s = socket.create_connection((self.params["host"], self.params["port"]), timeout=10)
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(bytes.fromhex(self.params["path"]).decode())   # blocking: waits for backlog room
            s.settimeout(10)
        if key is None:
            key = bytes.fromhex(self.params["key"])
        if key:
            s.sendall(key)
        return s

    def send(self, sock, data: bytes) -> None:
        """Hostile bytes: on the stream (tcp), or each 32-byte header as a ring entry (shm)."""
        if self.provider == "tcp":
            sock.sendall(data)
            return
        self._ring()
        for i in range(0, len(data), ENTRY.size):
            self.ring.put(sock, data[i:i + ENTRY.size])

    def _ring(self) -> RingWriter:
        if self.ring is None:
            self.ring = RingWriter(self.params["ring"])
        return self.ring

    def legit_write(self, sock, region: int, offset: int, payload: bytes, imm: int) -> None:
        """A write the victim must accept; the expected memory is updated."""
        desc = self.descs[region]
        if self.provider == "shm":
            if not self.mapped:
                self.mapped = [MappedArena(d["shm_name"], d["size"]) for d in self.descs]
            self.mapped[region].buf[offset:offset + len(payload)] = np.frombuffer(payload, np.uint8)
            self.send(sock, header(region, desc["key"], imm, offset, len(payload)))
        else:
            sock.sendall(header(region, desc["key"], imm, offset, len(payload)) + payload)
        self.expected[region][offset:offset + len(payload)] = np.frombuffer(payload, np.uint8)

    def wait_imms(self, n: int, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while len(self.imms) < n and time.monotonic() < deadline:
            self.ch.progress(0.002)       # shm keeps completions until someone asks
        assert len(self.imms) >= n, f"only {len(self.imms)} of {n} immediates arrived"

    def wait_lost(self, timeout: float = 5) -> bool:
        deadline = time.monotonic() + timeout
        while not self.lost_event.is_set() and time.monotonic() < deadline:
            self.ch.progress(0.002)
        return self.lost_event.is_set()

    def check_memory(self) -> None:
        for i, arena in enumerate(self.arenas):
            assert_untouched(arena, self.expected[i], f"{self.provider} region {i}")
        assert_untouched(self.private, self.private_expected, f"{self.provider} unexposed arena")

    def __enter__(self) -> "Victim":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.ch.close()
        for m in self.mapped + [r for r in (self.ring, self.own_ring) if r is not None]:
            m.close()
        for a in self.arenas + [self.private]:
            a.close()


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once the other end has closed (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def refused(victim: Victim, sock: socket.socket, error=RefusedWrite, imms: int = 1) -> Exception:
    """The hostile write was refused: loss reported once, typed; connection
    closed; only the legit immediates delivered; memory intact."""
    assert victim.wait_lost(5), "the loss was not reported"
    assert closed_by_peer(sock), "the victim kept the connection open"
    time.sleep(0.05)
    assert len(victim.lost) == 1, victim.lost
    assert isinstance(victim.lost[0], error), repr(victim.lost[0])
    assert len(victim.imms) == imms, victim.imms
    victim.check_memory()
    return victim.lost[0]


def _cases(provider: str):
    """(name, make the hostile bytes from the victim's descriptors, expected error)."""
    tcp = provider == "tcp"

    def bad(region=0, key=None, offset=0, length=64, magic=WRITE_MAGIC, payload=True):
        def make(v: Victim) -> bytes:
            k = v.descs[0]["key"] if key is None else key(v) if callable(key) else key
            data = header(region, k, make_imm(IMM_DATA, 5), offset(v) if callable(offset) else offset,
                          length(v) if callable(length) else length, magic)
            n = length(v) if callable(length) else length
            return data + (b"\x5a" * min(n, 1 << 16) if tcp and payload else b"")
        return make

    size0 = lambda v: v.arenas[0].size                                  # noqa: E731
    return [
        ("wrong key", bad(key=lambda v: v.descs[0]["key"] ^ 1), RefusedWrite),
        ("other region's key", bad(key=lambda v: v.descs[1]["key"]), RefusedWrite),
        ("key zero", bad(key=0), RefusedWrite),
        ("unexposed region", bad(region=2), RefusedWrite),
        ("negative region", bad(region=-1), RefusedWrite),
        ("offset at the end", bad(offset=size0, length=1), RefusedWrite),
        ("straddles the end", bad(offset=lambda v: size0(v) - 10, length=20), RefusedWrite),
        ("one byte too long", bad(length=lambda v: size0(v) + 1), RefusedWrite),
        ("huge length", bad(length=2 ** 64 - 1, payload=False), RefusedWrite),
        ("huge offset", bad(offset=2 ** 64 - 1, length=1), RefusedWrite),
        ("offset + length wraps 64 bits", bad(offset=2 ** 64 - 16, length=32), RefusedWrite),
        ("bad magic", bad(magic=0xDEADBEEF), RefusedWrite),
        ("zero magic, zero length", bad(magic=0, length=0), RefusedWrite),
        ("junk after a header (oversized header)",
         lambda v: header(0, v.descs[0]["key"], 7, 0, 0) + b"\xff" * WRITE_HEADER.size, RefusedWrite),
    ] + ([
        ("truncated header", lambda v: header(0, v.descs[0]["key"], 7, 0, 64)[:20], PeerLost),
        ("stream cut mid-payload",
         lambda v: header(0, v.descs[0]["key"], 9, 100, 4096) + b"\x33" * 1000, PeerLost),
    ] if tcp else [
        # the ring's head moved where no entry can be: the receiver trusts only its own tail
        ("ring head past the capacity", _move_head(lambda r: r.head + r.entries + 1), RefusedWrite),
        ("ring head moved backwards", _move_head(lambda r: r.head - 1), RefusedWrite),
        ("ring head at 2**64 - 1", _move_head(lambda r: 2 ** 64 - 1), RefusedWrite),
    ])


def _move_head(where):
    """A hostile shm case: move the victim's ring head to where(ring), ring the doorbell."""
    def make(v: Victim):
        ring = v._ring()
        return lambda sock: ring.move_head(sock, where(ring))
    return make


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_hostile_writes_are_refused_and_memory_is_untouched(provider):
    cases = _cases(provider)
    for name, make, error in cases:
        v = Victim(provider)
        try:
            sock = v.dial()
            assert v.accepted(), v.accept_error
            v.legit_write(sock, 0, 8, bytes(range(200)), make_imm(IMM_DATA, 1))
            v.legit_write(sock, 1, PAGE - 16, b"\x11" * 16, make_imm(IMM_DATA, 2))
            v.wait_imms(2)
            data = make(v)
            if name == "stream cut mid-payload":
                # What arrived before the cut may land, inside the announced range only.
                v.expected[0][100:1100] = 0x33
            if name.startswith("junk"):
                imms = 3          # the header before the junk is a valid zero-length write
            else:
                imms = 2
            try:
                data(sock) if callable(data) else v.send(sock, data)
            except OSError:
                pass       # refused before we finished sending: fine
            if error is PeerLost:
                sock.shutdown(socket.SHUT_WR)
            refused(v, sock, error, imms=imms)
            sock.close()
        except AssertionError as exc:
            raise AssertionError(f"{provider}, {name}: {exc}") from exc
        finally:
            v.close()
    print(f"{provider}: {len(cases)} hostile writes refused, memory intact")


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_random_headers_are_refused_unless_fully_valid(provider):
    """Two hundred random headers (region, key, offset, length, magic drawn
    near and far from the valid ones): each is accepted only if every check
    passes, and then lands exactly where it says; otherwise refused as above."""
    counts = {"accepted": 0, "refused": 0}
    tcp = provider == "tcp"

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(region=st.sampled_from([0, 0, 1, 1, 2, -1, 2 ** 20, -(2 ** 31)]),
           key_kind=st.sampled_from(["right", "right", "wrong", "other"]),
           offset=st.one_of(st.integers(0, 2 * PAGE), st.integers(0, 4 * PAGE),
                            st.sampled_from([2 ** 63, 2 ** 64 - 1])),
           length=st.one_of(st.integers(1, PAGE), st.integers(1, 2 * PAGE), st.sampled_from([2 ** 32, 2 ** 64 - 1])),
           bad_magic=st.sampled_from([False, False, False, True]))
    def case(region, key_kind, offset, length, bad_magic):
        with Victim(provider) as v:
            sock = v.dial()
            assert v.accepted(), v.accept_error
            right = v.descs[region]["key"] if region in (0, 1) else 1
            key = {"right": right, "wrong": right ^ 0x80000000, "other": v.descs[1 - region]["key"]
                   if region in (0, 1) else 2}[key_kind]
            valid = (not bad_magic and region in (0, 1) and key_kind == "right"
                     and offset + length <= v.arenas[region].size)
            payload = bytes((offset + i) & 0xFF for i in range(length)) if valid or length <= 2 * PAGE else b""
            if valid:
                v.legit_write(sock, region, offset, payload, make_imm(IMM_DATA, 3))
                v.wait_imms(1)
                assert not v.lost, v.lost
                v.check_memory()
                counts["accepted"] += 1
            else:
                try:
                    v.send(sock, header(region, key, make_imm(IMM_DATA, 3), offset, length,
                                        0x12345678 if bad_magic else WRITE_MAGIC) + (payload if tcp else b""))
                except OSError:
                    pass
                refused(v, sock, RefusedWrite, imms=0)
                counts["refused"] += 1
            sock.close()

    case()
    print(f"{provider}: random headers {counts}")
    assert counts["refused"] >= 50 and counts["accepted"] >= 5


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_zero_length_write_touches_nothing(provider):
    """A zero-length write carries only its immediate (a credit); like an RDMA
    NIC, no region or key is checked for it, and no byte moves."""
    with Victim(provider) as v:
        sock = v.dial()
        assert v.accepted()
        v.send(sock, header(-1, 0, make_imm(IMM_DATA, 4), 0, 0) + header(99, 123, 5, 2 ** 64 - 1, 0))
        v.wait_imms(2)
        assert v.imms == [make_imm(IMM_DATA, 4), 5] and not v.lost
        v.check_memory()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_handshake_refuses_wrong_keys_and_is_not_delayed_by_silent_dialers(provider):
    with Victim(provider) as v:
        key = bytes.fromhex(v.params["key"])
        wrong = [v.dial(bytes(AUTH_BYTES)), v.dial(key[:-1] + bytes([key[-1] ^ 1])),
                 v.dial(header(0, v.descs[0]["key"], 1, 0, 0))]      # data before the key
        for s in wrong:
            assert closed_by_peer(s), "a dialer with a wrong key was kept"
            s.close()
        silent = [v.dial(b"") for _ in range(10)] + [v.dial(key[:5])]   # never finish the handshake
        t0 = time.monotonic()
        real = v.dial()
        assert v.accepted(5), "the real peer was not accepted"
        took = time.monotonic() - t0
        assert took < HANDSHAKE_TIMEOUT / 2, f"silent dialers delayed the real peer by {took:.1f} s"
        for s in silent:       # handed no channel: closed once the real peer is in
            assert closed_by_peer(s, 2), "a silent dialer was kept after the real peer connected"
            s.close()
        v.legit_write(real, 0, 0, b"ok", make_imm(IMM_DATA, 0))
        v.wait_imms(1)
        assert not v.lost
        v.check_memory()
        real.close()


def test_truncated_header_then_silence_does_not_hang_close():
    with Victim("tcp") as v:
        sock = v.dial()
        assert v.accepted()
        sock.sendall(header(0, v.descs[0]["key"], 1, 0, 64)[:17])
        time.sleep(0.2)
        t0 = time.monotonic()
        v.ch.close()
        assert time.monotonic() - t0 < 2
        assert not v.ch._reader.is_alive()
        assert not v.imms
        v.check_memory()
        sock.close()


def test_grpc_baseline_push_checks_like_a_nic():
    """The grpc baseline's receiving end applies the same checks to a Push."""
    from rdmatensor.providers.baselines.grpc_channel import GrpcChannel
    imms, lost = [], []
    ch = GrpcChannel(1, 0, "127.0.0.1", on_imm=imms.append, on_lost=lost.append)
    arena = Arena(2 * PAGE)
    expected = canary_arena(arena)
    desc = ch.expose(0, arena)
    try:
        ch.receive(pb.PushRequest(rank=0, region_id=0, key=desc["key"], offset=10, payload=b"\1" * 10, imm=1))
        expected[10:20] = 1
        for bad in [dict(key=desc["key"] ^ 1, offset=0), dict(region_id=1, offset=0),
                    dict(offset=2 * PAGE - 5), dict(offset=2 ** 64 - 1)]:
            req = pb.PushRequest(rank=0, payload=b"\2" * 10, imm=2, **{"region_id": 0, "key": desc["key"], **bad})
            with pytest.raises(RefusedWrite):
                ch.receive(req)
        assert imms == [1]
        assert_untouched(arena, expected, "grpc region")
    finally:
        ch.close()
        arena.close()


# ------------------------------------------------------ a session's peer turns hostile

PLAN = Plan([TensorSpec("a", (1024,), np.float32, 0, 1), TensorSpec("d", (None,), np.int32, 0, 1),
             TensorSpec("b", (64,), np.float64, 1, 0)])


class _Coordinator(pb_grpc.ControlServicer):
    """Just enough of rank 0's control server for rank 1 to finish setup."""

    def Barrier(self, request, context):
        return pb.BarrierReply()

    def Bye(self, request, context):
        return pb.ByeReply()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_hostile_rank_cannot_write_outside_its_slots(provider):
    """Rank 0 holds the token and sets up like a real rank, then writes past
    its region: rank 1's session reports a RefusedWrite, a tensor that came
    before is delivered intact, and rank 1's memory is otherwise untouched."""
    server, port = start_server("127.0.0.1:0", TOKEN, _Coordinator(), pb_grpc.BaselineServicer())
    peers = {0: f"127.0.0.1:{port}", 1: f"127.0.0.1:{free_ports(1)[0]}"}
    own = Arena(PAGE, shared=True)                   # rank 0's "receive" region, for rank 1 to attach
    own_ring = CompletionRing.create(64)             # and its completion ring (shm)
    writer = None
    ready, attacked = threading.Event(), threading.Event()
    out: dict = {}

    def rank1():
        try:
            with connect(1, peers, PLAN, provider=provider, token=TOKEN, timeout=20) as s:
                ch = s.debug_state()["channels"][0]
                out["expected"] = {rid: canary_arena(arena) for rid, (arena, _) in ch.local.items()}
                out["arenas"] = {rid: arena for rid, (arena, _) in ch.local.items()}
                ready.set()
                attacked.wait(20)
                with s.recv("a", timeout=10) as v:
                    out["a"] = v.copy()
                try:
                    s.recv("d", timeout=10)
                except Exception as exc:  # noqa: BLE001
                    out["d"] = exc
                for rid, arena in out["arenas"].items():
                    out[f"diff{rid}"] = np.flatnonzero(arena.buf != out["expected"][rid])
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc
            ready.set()

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    client = ControlClient(peers[1], TOKEN)
    try:
        if provider == "tcp":
            params = pb.ChannelParams(provider="tcp", host="127.0.0.1", port=1, key="00" * 32)
        else:
            params = pb.ChannelParams(provider="shm", path=b"\0nobody".hex(), host_id=host_id(), key="00" * 32,
                                      ring=own_ring.name)
        reply = client.call(client.control.Exchange, pb.ExchangeRequest(
            rank=0, peer=1, plan_digest=PLAN.digest, plan_specs=PLAN.to_json(), channel=params,
            regions=[pb.Region(region_id=0, size=own.size, key=1, shm_name=own.name)],
            pair_secret="5e" * 16, wire=WIRE_VERSION), timeout=20,
            wait_for_ready=True)
        ch = {f.name: v for f, v in reply.channel.ListFields()}
        region = reply.regions[0]
        if provider == "tcp":
            sock = socket.create_connection((ch["host"], ch["port"]), timeout=10)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(bytes.fromhex(ch["path"]).decode())
        sock.sendall(bytes.fromhex(ch["key"]))
        assert ready.wait(20) and "error" not in out, out.get("error")
        a = np.arange(1024, dtype=np.float32).view(np.uint8).tobytes()
        if provider == "shm":
            seg = MappedArena(region.shm_name, region.size)
            seg.buf[:len(a)] = np.frombuffer(a, np.uint8)
            seg.close()
            writer = RingWriter(ch["ring"])
            writer.put(sock, header(0, region.key, make_imm(IMM_DATA, 0), 0, len(a)))
        else:
            sock.sendall(header(0, region.key, make_imm(IMM_DATA, 0), 0, len(a)) + a)
        out["expected"][0][:len(a)] = np.frombuffer(a, np.uint8)
        # Past the end of the region, with the right key, for slot "d".
        if provider == "shm":
            writer.put(sock, header(0, region.key, make_imm(IMM_DATA, 1), region.size - 8, 64))
        else:
            sock.sendall(header(0, region.key, make_imm(IMM_DATA, 1), region.size - 8, 64) + b"\xee" * 64)
        attacked.set()
        assert closed_by_peer(sock)
        t.join(30)
        assert "error" not in out, out.get("error")
        np.testing.assert_array_equal(out["a"], np.arange(1024, dtype=np.float32))
        assert isinstance(out["d"], RefusedWrite), repr(out["d"])
        assert "outside" in str(out["d"])
        for rid in out["arenas"]:
            assert out[f"diff{rid}"].size == 0, f"region {rid}: bytes changed at {out[f'diff{rid}'][:10]}"
        sock.close()
    finally:
        attacked.set()
        client.close()
        t.join(30)
        server.stop(0)
        if writer is not None:
            writer.close()
        own_ring.close()
        own.close()


def test_a_lost_channel_unblocks_a_sender_stuck_on_a_silent_peer():
    """The peer accepts the connection and then reads nothing (hung, or cut off
    with its kernel still acking): a big write blocks in sendall. When the
    loss is declared (the session's heartbeat does this), the write fails
    with PeerLost at once instead of hanging until TCP gives up."""
    listener = socket.create_server(("127.0.0.1", 0))
    lost = []
    ch = TcpChannel(0, 1, "127.0.0.1", on_imm=lambda imm: None, on_lost=lost.append)
    result: dict = {}
    try:
        key = bytes(range(AUTH_BYTES))
        accepted: list = []
        acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
        acceptor.start()
        ch.connect({"host": "127.0.0.1", "port": listener.getsockname()[1], "key": key.hex()},
                   initiator=True, timeout=10)
        acceptor.join(10)
        ch.attach({"region_id": 0, "size": 256 << 20, "key": 1})
        big = np.zeros(256 << 20, np.uint8)

        def writer():
            try:
                ch.write(0, 0, big, make_imm(IMM_DATA, 0))
                result["done"] = True
            except Exception as exc:  # noqa: BLE001
                result["error"] = exc
        t = threading.Thread(target=writer, daemon=True)
        t.start()
        time.sleep(0.5)
        assert t.is_alive(), f"the write should be stuck on the silent peer: {result}"
        t0 = time.monotonic()
        ch.lost(PeerLost("rank 1 stopped answering"))
        t.join(5)
        assert not t.is_alive(), "the sender is still blocked after the loss"
        assert time.monotonic() - t0 < 2
        assert isinstance(result.get("error"), PeerLost), result
        assert len(lost) == 1
    finally:
        ch.close()
        listener.close()
        for s in accepted:
            s.close()
