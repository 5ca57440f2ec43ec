"""The control plane under attack.

Without the token a caller gets UNAUTHENTICATED and nothing else: no reply,
no descriptor, no key, and the server does not even read its message. With the
token, random bytes, malformed protobufs and well-formed but wrong requests
(wrong peer, unknown rank, duplicated Exchange, huge or negative Grow, Barrier
spam) to every method are refused or harmless: never an unhandled exception
(UNKNOWN), never a state change, and the two ranks under attack then complete
a transfer. Raw garbage on the control port is dropped by the HTTP/2 layer.
"""
from __future__ import annotations

import random
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmatensor import AuthenticationError, Plan, TensorSpec
from rdmatensor.control import control_pb2 as pb
from rdmatensor.control import control_pb2_grpc as pb_grpc
from rdmatensor.control import proof as proof_module
from rdmatensor.control.proof import UNBOUND, Signer, digest
from rdmatensor.control.service import PROOF_KEY, ControlClient, proving
from rdmatensor.providers.contract import WIRE_VERSION

from ..support.ranks import TOKEN, check, run_ranks
from .helpers import LivePair, fd_count

PLAN = Plan([TensorSpec("a", (1024,), np.float32, 0, 1),
             TensorSpec("d", (None,), np.int32, 0, 1, capacity=256),
             TensorSpec("b", (64,), np.float64, 1, 0)])
DYN_SLOT = next(s.index for s in PLAN.pairs[(0, 1)].slots if s.spec.name == "d")
GOOD = ()                  # good calls go through proving channels, which add the proof
CALL_TIMEOUT = 5.0
MAX_GROW = 4 << 30

# Every method of every service in control.proto, as "/package.Service/Method".
METHODS = {f"/{svc.full_name}/{m.name}": m for svc in pb.DESCRIPTOR.services_by_name.values()
           for m in svc.methods}
REQUEST_TYPES = {path: getattr(pb, m.input_type.name) for path, m in METHODS.items()}
EXCHANGE = "/rdmatensor.control.Control/Exchange"
GROW = "/rdmatensor.control.Control/Grow"
BARRIER = "/rdmatensor.control.Control/Barrier"
BYE = "/rdmatensor.control.Control/Bye"
PING = "/rdmatensor.control.Control/Ping"
PUSH = "/rdmatensor.control.Baseline/Push"

# What a refused call may answer, per method, on a live tcp pair. UNKNOWN (a
# handler raised) is never acceptable; INTERNAL is gRPC's own answer to bytes
# that do not parse as the request type.
REFUSED = {
    EXCHANGE: {"INVALID_ARGUMENT", "PERMISSION_DENIED", "ALREADY_EXISTS"},
    GROW: {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED"},
    BARRIER: {"PERMISSION_DENIED"},    # a barrier needs the caller's pair credential
    BYE: {"OK", "PERMISSION_DENIED"},   # refused without the pair secret; a stream channel ignores it anyway
    PING: {"PERMISSION_DENIED"},   # a heartbeat needs the caller's pair credential too
    PUSH: {"PERMISSION_DENIED"},   # no grpc channel in a tcp session
}
ANY_METHOD = {"INVALID_ARGUMENT", "PERMISSION_DENIED", "FAILED_PRECONDITION", "OK",
              "UNIMPLEMENTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ALREADY_EXISTS"}


def code_of(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def wait_listening(address: str, timeout: float = 20.0) -> None:
    """Wait for a control server without making any call on it."""
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout)


def exchange_request(rank=0, peer=1, digest=None, provider="tcp", regions=()):
    return pb.ExchangeRequest(
        rank=rank, peer=peer, plan_digest=PLAN.digest if digest is None else digest,
        plan_specs=PLAN.to_json(),
        channel=pb.ChannelParams(provider=provider, host="127.0.0.1", port=9, key="00" * 32),
        regions=list(regions) or [pb.Region(region_id=0, size=8192, key=12345)], pair_secret="5e" * 16,
        wire=WIRE_VERSION)


def secrets_of(session, peer: int) -> list[str]:
    """What an attacker must never learn: channel key, region keys, segment names."""
    ch = session.debug_state()["channels"][peer]
    out = [ch._key.hex()]
    for _, (arena, key) in ch.local.items():
        out += [str(key), f"{key:x}", f"{key:08x}"]
        if arena.name:
            out.append(arena.name)
    return out


def assert_pair_works(pair: LivePair, tag: str) -> None:
    """No error stuck on either rank, no slot redirected, and a static, a
    dynamic (growing) and a reverse tensor plus a barrier all go through."""
    s0, s1 = pair.sessions[0], pair.sessions[1]
    for s in (s0, s1):
        state = s.debug_state()
        assert state["error"] is None and not state["peer_errors"], (state["error"], state["peer_errors"])
    assert s1.debug_state()["recv_slots"]["d"].grown is None, "a Grow nobody legitimate sent took effect"
    small, big = np.arange(7, dtype=np.int32), np.arange(5000, dtype=np.int32)

    def r0(s):
        s.send("a", np.full(1024, 3.5, np.float32))
        s.send("d", small)
        with s.recv("b") as v:
            got_b = bool((v == 2.0).all())
        s.send("d", big)
        s.barrier(tag)
        return got_b

    def r1(s):
        s.send("b", np.full(64, 2.0))
        with s.recv("a") as v:
            got_a = bool((v == 3.5).all())
        with s.recv("d") as v:
            got_small = np.array_equal(v, small)
        with s.recv("d") as v:
            got_big = np.array_equal(v, big)
        s.barrier(tag)
        return got_a, got_small, got_big

    assert pair.run(r0, r1) == (True, (True, True, True))


# ---------------------------------------------------------------- no token

def proof(token: str, method: str, body: bytes) -> str:
    return Signer(token).sign(method, UNBOUND if method == PUSH else digest(body))


# label -> the metadata a caller without a valid proof of the token sends, for (method, body)
WRONG_PROOFS = {
    "no metadata": lambda m, b: (),
    "empty": lambda m, b: ((PROOF_KEY, ""),),
    "the token itself": lambda m, b: (("rdmatensor-token", TOKEN),),
    "the token as the proof": lambda m, b: ((PROOF_KEY, TOKEN),),
    "wrong token": lambda m, b: ((PROOF_KEY, proof("wrong", m, b)),),
    "prefix": lambda m, b: ((PROOF_KEY, proof(TOKEN[:-1], m, b)),),
    "longer": lambda m, b: ((PROOF_KEY, proof(TOKEN + "x", m, b)),),
    "other case": lambda m, b: ((PROOF_KEY, proof(TOKEN.upper(), m, b)),),
    "another method's": lambda m, b: ((PROOF_KEY, proof(TOKEN, PING if m != PING else BYE, b)),),
    "another body's": lambda m, b: ((PROOF_KEY, Signer(TOKEN).sign(m, digest(b + b"x"))),),
    "unbound": lambda m, b: ((PROOF_KEY, Signer(TOKEN).sign(m, UNBOUND)),) if m != PUSH else (),
    "an hour old": lambda m, b: ((PROOF_KEY, _old(m, b, 3600)),),
    "4 KiB": lambda m, b: ((PROOF_KEY, "t" * 4096),),
    "other key": lambda m, b: (("authorization", TOKEN),),
    "binary key": lambda m, b: ((PROOF_KEY + "-bin", TOKEN.encode()),),
}


def _old(method: str, body: bytes, seconds: int) -> str:
    """A good proof made `seconds` ago: outside the window the receiver allows."""
    stamp, nonce, bound = str(int((time.time() - seconds) * 1000)), "0123456789abcdef-1", digest(body)
    return f"{stamp}.{nonce}.{bound}.{proof_module._mac(TOKEN, method, stamp, nonce, bound)}"


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_wrong_token_is_refused_and_learns_no_descriptor(provider):
    pair = LivePair(PLAN, provider, start=(1,))     # rank 1 waits for rank 0's Exchange
    try:
        wait_listening(pair.peers[1])
        seen = []          # everything any refused call got back
        with grpc.insecure_channel(pair.peers[1]) as channel:
            stub, base = pb_grpc.ControlStub(channel), pb_grpc.BaselineStub(channel)
            perfect = exchange_request(provider=provider)
            calls = {EXCHANGE: (stub.Exchange, perfect),
                     GROW: (stub.Grow, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=1 << 20)),
                     BARRIER: (stub.Barrier, pb.BarrierRequest(rank=0, name="x#0")),
                     BYE: (stub.Bye, pb.ByeRequest(rank=0)),
                     PUSH: (base.Push, pb.PushRequest(rank=0, payload=b"x" * 64))}
            for label, make in WRONG_PROOFS.items():
                for method, (call, request) in calls.items():
                    md = make(method, request.SerializeToString())
                    if not md and label == "unbound":
                        continue
                    with pytest.raises(grpc.RpcError) as info:
                        call.with_call(request, metadata=md, timeout=CALL_TIMEOUT)
                    err = info.value
                    assert err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL), \
                        (label, method, err)
                    if err.code() == grpc.StatusCode.UNAUTHENTICATED:     # a right token's stale proof: why
                        want = ("a proof of the job token 3600 s away from this host's clock" if label == "an hour old"
                                else "wrong or missing rdmatensor token")
                        assert err.details().startswith(want), (label, err.details())
                    else:                      # a body other than the proof's: refused as it is read
                        assert label == "another body's", (label, method, err)
                    assert not [k for k, _ in (err.trailing_metadata() or ()) if k.startswith("rdmatensor")]
                    seen += [err.details(), err.debug_error_string(),
                             repr(err.initial_metadata()), repr(err.trailing_metadata())]
            # A good proof taken once is refused the second time: a replay.
            md = ((PROOF_KEY, proof(TOKEN, BYE, pb.ByeRequest(rank=0).SerializeToString())),)
            bye = pb.ByeRequest(rank=0)
            assert code_of(lambda: stub.Bye(bye, metadata=md, timeout=CALL_TIMEOUT)) == "PERMISSION_DENIED"  # taken
            assert code_of(lambda: stub.Bye(bye, metadata=md, timeout=CALL_TIMEOUT)) == "UNAUTHENTICATED"    # replayed
            # The same perfect Exchange as raw bytes: no reply message comes back at all.
            raw = channel.unary_unary(EXCHANGE, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                raw(perfect.SerializeToString(), metadata=((PROOF_KEY, proof("wrong", EXCHANGE, b"")),),
                    timeout=CALL_TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = ControlClient(pair.peers[1], "wrong")
        with pytest.raises(AuthenticationError, match="refused our token"):
            client.call(client.control.Exchange, perfect, timeout=CALL_TIMEOUT)
        client.close()

        # The real rank 0 still gets the (unconsumed) Exchange and the pair works.
        pair.start_rank(0)
        pair.wait_ready(0)
        pair.wait_ready(1)
        leaked = [s for s in secrets_of(pair.sessions[1], 0) if any(s in text for text in seen)]
        assert not leaked, f"a refused caller saw {leaked}"
        assert_pair_works(pair, "after-wrong-tokens")
    finally:
        pair.close()


SERVER_SCRIPT = r"""
import sys
from rdmatensor.control.service import start_server
from rdmatensor.control import control_pb2_grpc as g
server, port = start_server("127.0.0.1:0", "tok", g.ControlServicer(), g.BaselineServicer())
print(port, flush=True)
for _ in sys.stdin:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(hwm, flush=True)
"""


def test_unauthenticated_message_is_not_even_read():
    """A caller without the token cannot make the server buffer a big message
    (the control plane accepts up to 1 GiB for the grpc baseline)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        def hwm_mib():
            proc.stdin.write("\n")
            proc.stdin.flush()
            return int(proc.stdout.readline()) / 1024

        opts = [("grpc.max_send_message_length", 1 << 30)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            raw = ch.unary_unary(EXCHANGE, request_serializer=None, response_deserializer=None)
            big = b"\0" * (256 << 20)
            before = hwm_mib()
            t0 = time.monotonic()
            assert code_of(lambda: raw(big, metadata=((PROOF_KEY, proof("bad", EXCHANGE, big)),), timeout=60)) \
                == "UNAUTHENTICATED"
            refused_in = time.monotonic() - t0
            after_refused = hwm_mib()
            # The measurement sees reads: with the token, a 64 MiB request is read.
            code_of(lambda: raw(big[:64 << 20], metadata=((PROOF_KEY, proof("tok", EXCHANGE, big[:64 << 20])),),
                                timeout=60))
            after_read = hwm_mib()
        print(f"256 MiB unauthenticated: refused in {refused_in:.2f} s, server peak +"
              f"{after_refused - before:.0f} MiB; 64 MiB authenticated: +{after_read - after_refused:.0f} MiB")
        assert after_refused - before < 32, "the server read an unauthenticated message"
        assert after_read - after_refused > 48, "the measurement does not see a read message"
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------- with the token, before setup

def test_wrong_requests_before_setup_do_not_consume_the_exchange():
    """Rank 1 waits for rank 0: Exchanges naming a wrong peer or a rank that is
    not its lower-ranked peer, and invalid Grow/Bye/Push, are refused without
    a state change; then the real rank 0 sets up and the pair works."""
    pair = LivePair(PLAN, "tcp", start=(1,))
    try:
        wait_listening(pair.peers[1])
        client = ControlClient(pair.peers[1], TOKEN)
        c = client.control
        cases = [
            (c.Exchange, exchange_request(peer=0), "INVALID_ARGUMENT"),            # wrong peer rank
            (c.Exchange, exchange_request(peer=2), "INVALID_ARGUMENT"),
            (c.Exchange, exchange_request(peer=-1), "INVALID_ARGUMENT"),
            (c.Exchange, exchange_request(rank=1), "PERMISSION_DENIED"),           # itself
            (c.Exchange, exchange_request(rank=5), "PERMISSION_DENIED"),           # unknown rank
            (c.Exchange, exchange_request(rank=-7), "PERMISSION_DENIED"),
            (c.Exchange, exchange_request(rank=2 ** 31 - 1), "PERMISSION_DENIED"),
            # no pair credential exists before the Exchange: every Grow is refused
            (c.Grow, pb.GrowRequest(rank=0, slot=-1, nbytes=64), "PERMISSION_DENIED"),
            (c.Grow, pb.GrowRequest(rank=0, slot=-(2 ** 31), nbytes=64), "PERMISSION_DENIED"),
            (c.Grow, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=2 ** 64 - 1), "PERMISSION_DENIED"),
            (c.Grow, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=MAX_GROW + 1), "PERMISSION_DENIED"),
            (c.Grow, pb.GrowRequest(rank=0, slot=0, nbytes=64), "PERMISSION_DENIED"),   # a static slot
            (c.Grow, pb.GrowRequest(rank=9, slot=0, nbytes=64), "PERMISSION_DENIED"),
            (c.Bye, pb.ByeRequest(rank=9, reason="x" * 10000), "PERMISSION_DENIED"),
            (client.baseline.Push, pb.PushRequest(rank=0, region_id=0, key=1, payload=b"z" * 100),
             "PERMISSION_DENIED"),
        ]
        for method, request, want in cases:
            got = code_of(lambda method=method, request=request: method(request, metadata=GOOD,
                                                                         timeout=CALL_TIMEOUT))
            assert got == want, (request, got)
        client.close()
        pair.start_rank(0)
        pair.wait_ready(0)
        pair.wait_ready(1)
        assert_pair_works(pair, "after-pre-setup")
    finally:
        pair.close()


# ------------------------------------------------- with the token, live pair

ranks = st.one_of(st.sampled_from([0, 1, 2, -1, 7]), st.integers(-2 ** 31, 2 ** 31 - 1))
i32 = st.one_of(st.sampled_from([0, 1, 2, -1, 2 ** 20, -(2 ** 31), 2 ** 31 - 1]),
                st.integers(-2 ** 31, 2 ** 31 - 1))
u32 = st.one_of(st.sampled_from([0, 1, 2 ** 32 - 1]), st.integers(0, 2 ** 32 - 1))
u64 = st.one_of(st.sampled_from([0, 1, 4095, 4096, MAX_GROW, MAX_GROW + 1, 2 ** 63, 2 ** 64 - 1]),
                st.integers(0, 2 ** 64 - 1))
text = st.text(max_size=40)
shm_names = st.one_of(text, st.sampled_from(["rdmatensor-" + "0" * 24, "rdmatensor-..", "../../etc/passwd",
                                             "rdmatensor-x/../../tmp", "rdmatensor-\0", ""]))
regions = st.builds(pb.Region, region_id=i32, size=u64, addr=u64, key=u32, shm_name=shm_names)
channels = st.builds(pb.ChannelParams, provider=st.one_of(st.sampled_from(["tcp", "shm", "grpc", "verbs", ""]), text),
                     qpn=u32, psn=u32, gid=text, mtu=u32, host=text, port=u32, path=text, host_id=text,
                     key=st.one_of(text, st.just("00" * 32)), address=text)
exchanges = st.builds(pb.ExchangeRequest, rank=ranks, peer=ranks,
                      plan_digest=st.one_of(st.just(PLAN.digest), text),
                      plan_specs=st.one_of(st.sampled_from([PLAN.to_json(), "{", "[]", '{"specs": 5}', "null"]), text),
                      channel=channels, regions=st.lists(regions, max_size=4))
grows = st.builds(pb.GrowRequest, rank=ranks, slot=i32, nbytes=u64)
barriers = st.builds(pb.BarrierRequest, rank=ranks, name=st.one_of(text, st.just("rdmatensor-setup#0")))
byes = st.builds(pb.ByeRequest, rank=ranks, reason=text)
pushes = st.builds(pb.PushRequest, rank=ranks, region_id=i32, key=u32, offset=u64,
                   payload=st.binary(max_size=300), imm=u32)
calls = st.one_of(st.tuples(st.just(EXCHANGE), exchanges), st.tuples(st.just(GROW), grows),
                  st.tuples(st.just(BARRIER), barriers), st.tuples(st.just(BYE), byes),
                  st.tuples(st.just(PUSH), pushes))


def _legit_grow(target: int, msg) -> bool:
    """The one Grow that is meant to succeed: rank 0 asking rank 1 for room for
    its dynamic slot. From a token holder it cannot be told apart from the
    real sender (see test_a_spurious_grow_does_not_redirect_a_slot)."""
    return target == 1 and msg.rank == 0 and msg.slot == DYN_SLOT and msg.nbytes <= MAX_GROW


class Barrage:
    """Sends attack calls to both ranks of a live pair and checks each answer.
    Barrier calls wait for ranks that never come, so they are collected as
    futures and checked at the end."""

    def __init__(self, pair: LivePair):
        self.pair = pair
        self.raw = {r: grpc.insecure_channel(pair.peers[r]) for r in (0, 1)}
        self.channels = {r: proving(ch, TOKEN) for r, ch in self.raw.items()}
        self.codes: Counter = Counter()
        self.pending: list = []
        self.cases = 0

    def send(self, target: int, method: str, payload: bytes, allowed: set[str]) -> None:
        self.cases += 1
        raw = self.channels[target].unary_unary(method, request_serializer=None, response_deserializer=None)
        if method == BARRIER or method not in REFUSED:
            fut = raw.future(payload, metadata=GOOD, timeout=self.pair.timeout + 10)
            self.pending.append((method, fut, allowed, payload))
            return
        code = code_of(lambda: raw(payload, metadata=GOOD, timeout=CALL_TIMEOUT))
        self.codes[(method.rsplit("/", 1)[1], code)] += 1
        assert code in allowed, f"{method} {payload[:200]!r} -> {code}"

    def finish(self) -> None:
        for method, fut, allowed, payload in self.pending:
            try:
                fut.result()
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            self.codes[(method.rsplit("/", 1)[1], code)] += 1
            assert code in allowed, f"{method} {payload[:200]!r} -> {code}"
        self.pending.clear()

    def close(self) -> None:
        for ch in self.raw.values():
            ch.close()


def test_a_thousand_malformed_calls_with_the_token_are_refused_or_harmless():
    pair = LivePair(PLAN, "tcp", timeout=3.0)
    barrage = Barrage(pair)
    s0, s1 = pair.sessions[0], pair.sessions[1]
    exchanged = (s0.debug_state()["exchanged"], s1.debug_state()["exchanged"])
    t0 = time.monotonic()
    try:
        # 1. Structured: every field of every request drawn at random (hypothesis).
        @settings(max_examples=600, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(target=st.sampled_from([0, 1]), call=calls)
        def structured(target, call):
            method, msg = call
            if method == GROW and _legit_grow(target, msg):
                msg.nbytes = MAX_GROW + 1 + msg.nbytes      # "huge sizes in Grow"
            barrage.send(target, method, msg.SerializeToString(), REFUSED[method])

        structured()
        structured_cases = barrage.cases

        # 2. Random bytes to every method (including unknown ones).
        rng = random.Random(20240611)
        methods = sorted(METHODS) + ["/rdmatensor.control.Control/NoSuchMethod", "/x.Y/Z"]
        for i in range(300):
            method = methods[i % len(methods)]
            payload = rng.randbytes(rng.choice([0, 1, 5, 40, 300, 5000]))
            allowed = {"INTERNAL"} | REFUSED.get(method, ANY_METHOD)
            if method == GROW:
                try:
                    if _legit_grow(i % 2, pb.GrowRequest.FromString(payload)):
                        continue
                except Exception:  # noqa: BLE001 - does not parse: that is the point
                    pass
            barrage.send(i % 2, method, payload, allowed)

        # 3. Valid requests with bytes flipped, cut or appended.
        bases = [(EXCHANGE, exchange_request()), (GROW, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=2 ** 64 - 1)),
                 (BARRIER, pb.BarrierRequest(rank=1, name="mutant")), (BYE, pb.ByeRequest(rank=1, reason="r")),
                 (PUSH, pb.PushRequest(rank=0, region_id=0, key=7, offset=8, payload=b"p" * 64, imm=1))]
        for i in range(200):
            method, msg = bases[i % len(bases)]
            data = bytearray(msg.SerializeToString())
            for _ in range(rng.randint(1, 4)):
                op = rng.choice("flip cut add".split())
                if op == "flip" and data:
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                elif op == "cut" and data:
                    del data[rng.randrange(len(data)):]
                else:
                    data[rng.randrange(len(data) + 1):0] = rng.randbytes(rng.randint(1, 16))
            target = 1 if method in (EXCHANGE, GROW) else i % 2
            if method == GROW:
                try:
                    if _legit_grow(target, pb.GrowRequest.FromString(bytes(data))):
                        continue
                except Exception:  # noqa: BLE001
                    pass
            barrage.send(target, method, bytes(data), {"INTERNAL"} | REFUSED[method])

        # 4. The named cases.
        secret = s0.debug_state()["pair_secrets"][1]
        c = ControlClient(pair.peers[1], TOKEN)
        duplicate = pb.ExchangeRequest(rank=0, peer=1, plan_digest=PLAN.digest, plan_specs=PLAN.to_json(),
                                       channel=pb.ChannelParams(provider="tcp", host="127.0.0.1", port=1,
                                                                key=s0.debug_state()["channels"][1]._key.hex()),
                                       pair_secret="5e" * 16, wire=WIRE_VERSION,
                                       regions=[pb.Region(region_id=rid, size=a.size, key=k)
                                                for rid, (a, k) in s0.debug_state()["channels"][1].local.items()])
        named = [(1, EXCHANGE, duplicate, "ALREADY_EXISTS"),                # duplicated exchange
                 (1, EXCHANGE, exchange_request(peer=0), "INVALID_ARGUMENT"),  # wrong peer rank
                 (0, EXCHANGE, exchange_request(rank=1, peer=0), "PERMISSION_DENIED"),
                 (1, EXCHANGE, exchange_request(rank=3), "PERMISSION_DENIED"),  # unknown rank
                 # with rank 0's pair credential, bad sizes and slots are still refused
                 (1, GROW, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=2 ** 64 - 1, pair_secret=secret),
                  "INVALID_ARGUMENT"),
                 (1, GROW, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=MAX_GROW + 1, pair_secret=secret),
                  "INVALID_ARGUMENT"),
                 (1, GROW, pb.GrowRequest(rank=0, slot=-1, nbytes=10, pair_secret=secret), "INVALID_ARGUMENT"),
                 (1, GROW, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=10), "PERMISSION_DENIED"),
                 (0, GROW, pb.GrowRequest(rank=1, slot=0, nbytes=10), "PERMISSION_DENIED"),
                 # a heartbeat answers only the peer holding the pair credential
                 (1, PING, pb.PingRequest(rank=0, pair_secret=secret), "OK"),
                 (1, PING, pb.PingRequest(rank=0), "PERMISSION_DENIED"),
                 (1, PING, pb.PingRequest(rank=0, pair_secret="5e" * 16), "PERMISSION_DENIED"),
                 (1, PING, pb.PingRequest(rank=3, pair_secret=secret), "PERMISSION_DENIED")]
        for target, method, msg, want in named:
            barrage.send(target, method, msg.SerializeToString(), {want})
        c.close()
        for i in range(100):                                                # Barrier spam
            barrage.send(i % 2, BARRIER, pb.BarrierRequest(rank=i % 3, name=f"spam-{i}").SerializeToString(),
                         REFUSED[BARRIER])
        barrage.finish()
        cases = barrage.cases
        elapsed = time.monotonic() - t0
        print(f"{cases} calls with the token ({structured_cases} structured) in {elapsed:.1f} s: "
              f"{dict(sorted(barrage.codes.items()))}; "
              f"barrier names left on rank 0: {s0.debug_state()['open_barriers']}")
        assert cases >= 1000
        assert not [k for k in barrage.codes if k[1] == "UNKNOWN"]
        assert (s0.debug_state()["exchanged"], s1.debug_state()["exchanged"]) == exchanged
        assert_pair_works(pair, "after-barrage")
    finally:
        barrage.close()
        pair.close()


def _garbage(rng: random.Random, i: int) -> bytes:
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    kind = i % 6
    if kind == 0:
        return rng.randbytes(rng.randint(1, 4096))
    if kind == 1:
        return preface + rng.randbytes(rng.randint(1, 4096))
    if kind == 2:      # a frame header announcing 16 MiB, then not much
        return preface + (2 ** 24 - 1).to_bytes(3, "big") + bytes([0, 0]) + b"\0\0\0\1" + rng.randbytes(100)
    if kind == 3:      # SETTINGS frames with random contents, many of them
        return preface + b"".join(bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + rng.randbytes(6) for _ in range(200))
    if kind == 4:      # a HEADERS frame on stream 1 with random HPACK
        block = rng.randbytes(rng.randint(1, 300))
        return preface + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]) + len(block).to_bytes(3, "big") + \
            bytes([1, 5, 0, 0, 0, 1]) + block
    return b"GET / HTTP/1.1\r\nHost: x\r\n" + rng.randbytes(200) + b"\r\n\r\n"


def test_raw_garbage_on_the_control_port_is_dropped():
    pair = LivePair(PLAN, "tcp", timeout=3.0)
    try:
        time.sleep(0.2)
        fds_before = fd_count()
        rng = random.Random(7)
        sel = selectors.DefaultSelector()
        socks = []
        for i in range(160):
            host, port = pair.peers[i % 2].rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=5)
            try:
                s.sendall(_garbage(rng, i))
            except OSError:
                pass            # already closed on us: fine
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            socks.append(s)
        # Read whatever comes back (a GOAWAY) for a moment, then hang up.
        closed_by_server = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and sel.get_map():
            for key, _ in sel.select(0.1):
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    closed_by_server += 1
                    sel.unregister(key.fileobj)
        for s in socks:
            s.close()
        sel.close()
        deadline = time.monotonic() + 5
        while fd_count() > fds_before and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"160 garbage connections: {closed_by_server} closed by the server within 1.5 s; "
              f"fds {fds_before} -> {fd_count()}")
        assert fd_count() <= fds_before, "the control server kept descriptors of garbage connections"
        assert_pair_works(pair, "after-garbage")
    finally:
        pair.close()


# ------------------------------------------------------ blocking calls

def test_barrier_flood_cannot_starve_other_calls(monkeypatch):
    """Barrier calls wait for every rank; a flood of them (from a rank with its
    credential, gone rogue) gets a bounded share of the server's threads (the
    rest are refused at once), and Exchange, Grow and Bye are still answered
    promptly meanwhile."""
    import rdmatensor.control.service as service
    monkeypatch.setattr(service, "WORKERS", 48)       # 24 for blocking calls, the rest reserved
    pair = LivePair(PLAN, "tcp", timeout=3.0)
    try:
        secret = pair.sessions[1].debug_state()["pair_secrets"][0]
        with grpc.insecure_channel(pair.peers[0]) as ch:
            stub = pb_grpc.ControlStub(proving(ch, TOKEN))
            flood = [stub.Barrier.future(pb.BarrierRequest(rank=1, name=f"flood-{i}", pair_secret=secret),
                                         metadata=GOOD, timeout=20)
                     for i in range(100)]
            time.sleep(0.5)
            t0 = time.monotonic()
            assert code_of(lambda: stub.Grow(pb.GrowRequest(rank=1, slot=0, nbytes=1), metadata=GOOD,
                                             timeout=2)) == "PERMISSION_DENIED"
            assert code_of(lambda: stub.Exchange(exchange_request(rank=1, peer=0), metadata=GOOD,
                                                 timeout=2)) == "PERMISSION_DENIED"
            assert code_of(lambda: stub.Bye(pb.ByeRequest(rank=9), metadata=GOOD, timeout=2)) == "PERMISSION_DENIED"
            answered_in = time.monotonic() - t0
            codes = Counter()
            for f in flood:
                try:
                    f.result()
                    codes["OK"] += 1
                except grpc.RpcError as exc:
                    codes[exc.code().name] += 1
        print(f"barrier flood of 100: {dict(codes)}; other calls answered in {answered_in * 1000:.0f} ms")
        assert answered_in < 1.5
        assert codes["RESOURCE_EXHAUSTED"] >= 100 - 24
        assert set(codes) <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
        assert_pair_works(pair, "after-flood")
    finally:
        pair.close()


def test_barrier_of_more_ranks_than_the_old_thread_pool():
    """The coordinator holds one server thread per waiting rank: 20 ranks used to
    deadlock a 16-thread server until the setup timed out."""
    n = 20
    plan = Plan([TensorSpec(f"r{i}", (4,), np.float32, i, (i + 1) % n) for i in range(n)])

    def body(s, r):
        s.barrier("wide")
        return True

    t0 = time.monotonic()
    assert all(check(run_ranks(n, plan, "tcp", body, timeout=20)).values())
    assert time.monotonic() - t0 < 15


# ----------------------------------------- what needs session.py changes

def test_barrier_from_a_rank_outside_the_plan_is_refused_at_once():
    pair = LivePair(PLAN, "tcp", timeout=2.0)
    try:
        client = ControlClient(pair.peers[0], TOKEN)
        t0 = time.monotonic()
        code = code_of(lambda: client.control.Barrier(pb.BarrierRequest(rank=42, name="nobody#0"),
                                                      metadata=GOOD, timeout=5))
        took = time.monotonic() - t0
        client.close()
        assert code in ("INVALID_ARGUMENT", "PERMISSION_DENIED") and took < 0.5, (code, took)
    finally:
        pair.close()


def test_a_token_holder_cannot_arrive_at_a_barrier_as_another_rank():
    """Rank 2 shares no tensor with the coordinator (rank 0), yet its Barrier
    calls carry a pair credential: without it, or with rank 2's own credential
    while claiming to be rank 1, a Barrier is refused at once and counts for
    nobody; the real barrier then needs the real ranks."""
    plan = Plan([TensorSpec("x", (4,), np.float32, 0, 1), TensorSpec("y", (4,), np.float32, 1, 2)])
    arrived, rank1_comes = threading.Event(), threading.Event()

    def body(s, r):
        if r == 2:
            own = s.debug_state()["pair_secrets"][0]
            with grpc.insecure_channel(s.peers[0]) as ch:
                barrier = pb_grpc.ControlStub(proving(ch, TOKEN)).Barrier
                t0 = time.monotonic()
                codes = [code_of(lambda req=req: barrier(req, metadata=GOOD, timeout=5)) for req in (
                    pb.BarrierRequest(rank=2, name="held#0"),
                    pb.BarrierRequest(rank=2, name="held#0", pair_secret="0" * 32),
                    pb.BarrierRequest(rank=1, name="held#0", pair_secret=own),
                    pb.BarrierRequest(rank=1, name="held#0", pair_secret=own + "x"))]
                took = time.monotonic() - t0
            arrived.set()
            s.barrier("held")
            return codes, took
        if r == 1:
            assert arrived.wait(30)
            time.sleep(0.5)
            rank1_comes.set()
        s.barrier("held")        # had a forged arrival counted, rank 0 would pass before rank 1 came
        return rank1_comes.is_set()

    res = check(run_ranks(3, plan, "tcp", body, timeout=10))
    codes, took = res[2]
    assert codes == ["PERMISSION_DENIED"] * 4 and took < 2, (codes, took)
    assert res[0] is True


def test_a_push_without_the_pair_credential_is_refused_and_harms_no_channel():
    """On the grpc baseline a Push is a write: a token holder pushing as rank 0
    is refused before any region check, so it cannot make rank 1 drop its real
    channel (a refused write would end it)."""
    pair = LivePair(PLAN, "grpc", timeout=5.0)
    try:
        client = ControlClient(pair.peers[1], TOKEN)
        for secret in ("", "0" * 32, pair.sessions[1].debug_state()["pair_secrets"][0][:-1]):
            with pytest.raises(AuthenticationError, match="pair credential"):
                client.call(client.baseline.Push, pb.PushRequest(rank=0, region_id=0, key=1, payload=b"x" * 8,
                                                                 imm=0, pair_secret=secret), timeout=5)
        client.close()
        assert_pair_works(pair, "after-forged-push")
    finally:
        pair.close()


def test_a_spurious_grow_does_not_redirect_a_slot():
    pair = LivePair(PLAN, "tcp", timeout=5.0)
    try:
        client = ControlClient(pair.peers[1], TOKEN)       # a third party with the token
        with pytest.raises(AuthenticationError, match="pair credential"):
            client.call(client.control.Grow, pb.GrowRequest(rank=0, slot=DYN_SLOT, nbytes=100), timeout=5)
        client.close()
        small = np.arange(7, dtype=np.int32)

        def r1(s):
            with s.recv("d") as v:
                return v.copy()
        got = pair.run(lambda s: s.send("d", small), r1)[1]
        assert np.array_equal(got, small), got
    finally:
        pair.close()


# ------------------------------------------- a hostile peer's replies

class _FakeRank1(pb_grpc.ControlServicer):
    """Rank 1's control server as an attacker runs it: Exchange answers `reply`."""

    def __init__(self):
        self.reply = pb.ExchangeReply()

    def Exchange(self, request, context):
        return self.reply

    def Bye(self, request, context):
        return pb.ByeReply()


def _hostile_replies(provider: str, tmp_path):
    from rdmatensor.providers.shm.channel import host_id
    good_key = "ab" * 32
    if provider == "tcp":
        ch = lambda **kw: pb.ChannelParams(provider="tcp", **kw)          # noqa: E731
        return [
            ("empty reply", pb.ExchangeReply(), "TransportError"),
            ("no key", pb.ExchangeReply(channel=ch(host="127.0.0.1", port=9)), "TransportError"),
            ("key not hex", pb.ExchangeReply(channel=ch(host="127.0.0.1", port=9, key="zz")), "TransportError"),
            ("no port", pb.ExchangeReply(channel=ch(host="127.0.0.1", key=good_key)), "TransportError"),
            ("port 70000", pb.ExchangeReply(channel=ch(host="127.0.0.1", port=70000, key=good_key)),
             "TransportError"),
            ("NUL in host", pb.ExchangeReply(channel=ch(host="a\0b", port=9, key=good_key)), "PeerLost"),
            ("unreachable port", pb.ExchangeReply(channel=ch(host="127.0.0.1", port=1, key=good_key)), "PeerLost"),
        ]
    # shm: the regions locate segments (name:pid:hand-over socket:nonce) for rank 0 to map.
    import os
    from rdmatensor.memory import Arena
    planted = tmp_path / "victim-file"
    planted.write_bytes(b"precious" * 512)
    unsealed = os.memfd_create("rdmatensor-" + "1" * 24)
    os.ftruncate(unsealed, 4096)
    opened = [os.open(planted, os.O_RDWR), unsealed]
    real = Arena(4096, shared=True)
    me = os.getpid()
    nonce = "0" * 32
    handing = {what: _FakeHandover(fd, parked) for what, fd, parked in [
        ("file", opened[0], False), ("parked file", opened[0], True), ("unsealed", unsealed, True),
        ("nothing", None, False)]}
    at = lambda what, name="rdmatensor-" + "1" * 24, pid=me: f"{name}:{pid}:{handing[what].address}:{nonce}"  # noqa: E731
    real_name, _, real_address, real_nonce = real.name.split(":")
    ch = pb.ChannelParams(provider="shm", path=b"\0nobody".hex(), host_id=host_id(), key=good_key)
    region = lambda name, size=4096: pb.Region(region_id=0, size=size, key=1, shm_name=name)  # noqa: E731
    cases = [
        ("other host", pb.ExchangeReply(channel=pb.ChannelParams(provider="shm", path="00", host_id="elsewhere",
                                                                 key=good_key)), "TransportError"),
        ("same host, another PID namespace", pb.ExchangeReply(channel=pb.ChannelParams(
            provider="shm", path="00", host_id=host_id().split(":", 1)[0] + ":pid:[1]", key=good_key)),
         "TransportError"),
        ("path not hex", pb.ExchangeReply(channel=pb.ChannelParams(provider="shm", path="xyz", host_id=host_id(),
                                                                   key=good_key)), "TransportError"),
        ("no such process", pb.ExchangeReply(channel=ch, regions=[region(
            f"rdmatensor-{'0' * 24}:4000000000:{'0' * 24}:{nonce}")]), "ForeignSegment"),
        ("path escape", pb.ExchangeReply(channel=ch, regions=[region("../../etc/passwd")]), "ForeignSegment"),
        ("a /proc/<pid>/fd locator (no nonce)", pb.ExchangeReply(channel=ch, regions=[region(
            f"{real_name}:{me}:{opened[0]}")]), "ForeignSegment"),
        ("a socket that is not the named process's", pb.ExchangeReply(channel=ch, regions=[region(
            at("file", pid=1))]), "ForeignSegment"),
        ("hands over a file", pb.ExchangeReply(channel=ch, regions=[region(at("file"))]), "ForeignSegment"),
        ("hands over a file, parked", pb.ExchangeReply(channel=ch, regions=[region(at("parked file"))]),
         "ForeignSegment"),
        ("hands over an unsealed memfd", pb.ExchangeReply(channel=ch, regions=[region(at("unsealed"))]),
         "ForeignSegment"),
        ("hands over nothing", pb.ExchangeReply(channel=ch, regions=[region(at("nothing"))]), "ForeignSegment"),
        ("a real segment, a wrong nonce", pb.ExchangeReply(channel=ch, regions=[region(
            f"{real_name}:{me}:{real_address}:{nonce}")]), "ForeignSegment"),
        ("size 0", pb.ExchangeReply(channel=ch, regions=[region(real.name, 0)]), "ForeignSegment"),
        ("another segment's name", pb.ExchangeReply(channel=ch, regions=[region(
            f"rdmatensor-{'2' * 24}:{me}:{real_address}:{real_nonce}")]), "ForeignSegment"),
    ]
    return cases, (opened, [real, *handing.values()]), planted


class _FakeHandover:
    """A hostile owner's hand-over socket, in this process: to each caller it
    sends `fd` (inside a parked socket if `parked`), or nothing if None."""

    def __init__(self, fd: int | None, parked: bool):
        import secrets
        self.fd, self.parked = fd, parked
        self.address = secrets.token_hex(12)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(f"\0rdmatensor-arenas-{self.address}")
        self.listener.listen()
        self.listener.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                if len(conn.recv(16, socket.MSG_WAITALL)) < 16 or self.fd is None:
                    continue                    # the caller went (a wrong pid), or nothing to give
                if not self.parked:
                    socket.send_fds(conn, [b"\1"], [self.fd])
                    continue
                held, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
                with held, sender:
                    socket.send_fds(sender, [b"\1"], [self.fd])
                    socket.send_fds(conn, [b"\1"], [held.fileno()])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_hostile_exchange_replies_give_typed_errors_and_leave_nothing(provider, tmp_path):
    """Rank 0 sets up against a rank 1 that answers Exchange with missing,
    garbled or dangerous channel parameters and regions: rank 0's connect()
    fails with a typed error, quickly, writes into no file a segment name
    points at, and leaves no thread or descriptor behind."""
    from rdmatensor import RdmaTensorError, connect
    from rdmatensor.control.service import start_server
    from .helpers import settle, snapshot
    from ..support.ranks import free_ports
    base = snapshot()
    fake = _FakeRank1()
    server, port = start_server("127.0.0.1:0", TOKEN, fake, pb_grpc.BaselineServicer())
    planted, extra = None, []
    try:
        if provider == "tcp":
            cases = _hostile_replies(provider, tmp_path)
        else:
            cases, extra, planted = _hostile_replies(provider, tmp_path)
        for reply in (reply for _, reply, _ in cases):
            reply.wire = WIRE_VERSION          # a hostile peer of this release (an older one: the first case)
        for name, reply, want in [("an older release", pb.ExchangeReply(), "PlanMismatch"), *cases]:
            fake.reply = reply
            peers = {0: f"127.0.0.1:{free_ports(1)[0]}", 1: f"127.0.0.1:{port}"}
            t0 = time.monotonic()
            try:
                connect(0, peers, PLAN, provider=provider, token=TOKEN, timeout=2.0)
                raise AssertionError(f"{name}: connect succeeded")
            except RdmaTensorError as exc:
                got = repr(exc)
                assert type(exc).__name__ == want, (name, got)
            took = time.monotonic() - t0
            assert took < 6, (name, took)
        if planted is not None:
            assert planted.read_bytes() == b"precious" * 512
    finally:
        server.stop(0)
        if extra:
            import os
            for fd in extra[0]:
                os.close(fd)
            for closable in extra[1]:
                closable.close()
    end = settle(base)
    assert all(end[k] <= base[k] for k in base), (base, end)
