"""Something other than the peer answers at the peer's control address (a
process that took the port of a rank that died or never started, without the
job's token): it learns nothing a request carries beyond Hello, and the rank
that called gets AuthenticationError naming the address, never its reply."""
from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest

from rdmatensor import AuthenticationError, Plan, TensorSpec, connect
from rdmatensor.control import control_pb2 as pb
from rdmatensor.control import control_pb2_grpc as pb_grpc
from rdmatensor.control.proof import Signer, answer, check_answer, digest
from rdmatensor.control.service import ControlClient

from ..support.ranks import TOKEN, free_ports

PLAN = Plan([TensorSpec("t", (16,), np.float32, 0, 1)])


class Impostor(pb_grpc.ControlServicer):
    """Answers every call as a server would, and keeps what it was sent."""

    def __init__(self, answer_with: str | None = None):
        self.requests: list[tuple[str, bytes]] = []
        self.answer_with = answer_with          # a token to sign its replies with (not the job's)

    def _reply(self, name, request, context, reply):
        self.requests.append((name, request.SerializeToString()))
        if self.answer_with:
            proof = dict(context.invocation_metadata()).get("rdmatensor-proof", "")
            context.set_trailing_metadata(
                (("rdmatensor-answer", answer(self.answer_with, proof, digest(reply.SerializeToString()))),))
        return reply

    def Hello(self, request, context):
        return self._reply("Hello", request, context, pb.HelloReply())

    def Exchange(self, request, context):
        return self._reply("Exchange", request, context,
                           pb.ExchangeReply(channel=pb.ChannelParams(provider="tcp", host="127.0.0.1", port=9)))

    def Barrier(self, request, context):
        return self._reply("Barrier", request, context, pb.BarrierReply())


@pytest.fixture
def impostor(request):
    servicer = Impostor(getattr(request, "param", None))
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_ControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.mark.parametrize("impostor", [None, "another job's token"], indirect=True)
def test_an_impostor_gets_hello_and_nothing_else(impostor):
    servicer, address = impostor
    client = ControlClient(address, TOKEN, peer=1)
    request = pb.ExchangeRequest(rank=0, peer=1, pair_secret="5e" * 16,
                                 regions=[pb.Region(region_id=0, size=8192, addr=4096, key=12345)])
    with pytest.raises(AuthenticationError, match=f"rank 1 at {address}: a reply that does not prove the job token"):
        client.call(client.control.Exchange, request, timeout=10)
    assert [name for name, _ in servicer.requests] == ["Hello"]
    assert servicer.requests[0][1] == b""                    # Hello carries nothing
    # and every later call is refused the same way, before its body leaves
    with pytest.raises(AuthenticationError):
        client.call(client.control.Barrier, pb.BarrierRequest(rank=0, name="x", pair_secret="5e" * 16), timeout=10)
    assert [name for name, _ in servicer.requests] == ["Hello", "Hello"]
    client.close()


def test_a_rank_whose_peer_is_an_impostor_fails_setup_naming_it(impostor):
    servicer, address = impostor
    mine = f"127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(AuthenticationError, match=address):
        connect(0, {0: mine, 1: address}, PLAN, provider="tcp", token=TOKEN, timeout=15)
    assert {name for name, _ in servicer.requests} == {"Hello"}     # no Exchange: no descriptor, no key


def test_a_replys_proof_is_bound_to_its_call_and_its_body():
    signer = Signer(TOKEN)
    first, second = (signer.sign("/rdmatensor.control.Control/Exchange", digest(b"req")) for _ in range(2))
    body = digest(b"reply")
    check_answer(TOKEN, first, body, answer(TOKEN, first, body))
    for call, reply, given in ((second, body, answer(TOKEN, first, body)),           # another call's
                               (first, digest(b"other"), answer(TOKEN, first, body)),  # another body's
                               (first, body, answer("not the token", first, body)),    # another token's
                               (first, body, None), (first, body, "")):
        with pytest.raises(AuthenticationError):
            check_answer(TOKEN, call, reply, given)
