"""Our errors cross the control plane as themselves: the class travels as an
explicit code in the trailing metadata (with the tensor), not as a reused
gRPC status, and the caller raises the same class naming the peer."""
import grpc
import pytest

from rdmatensor import errors
from rdmatensor.control import control_pb2 as pb
from rdmatensor.control import control_pb2_grpc as pb_grpc
from rdmatensor.control.service import ControlClient, start_server
from rdmatensor.control.status import ERROR_KEY, abort

from ..support.ranks import TOKEN

SENT = [errors.CreditViolation("'d' is still held", tensor="d"), errors.PlanMismatch("plans differ"),
        errors.BadRequest("slot 9 is not a dynamic tensor"), errors.AuthenticationError("not rank 0's pair credential"),
        errors.PeerLost("rank 0 is gone"), errors.SendTimeout("waited"), errors.UsageError("closed")]


class Refuser(pb_grpc.ControlServicer):
    def __init__(self):
        self.error = None

    def Grow(self, request, context):
        abort(context, self.error)

    def Ping(self, request, context):        # a refusal gRPC makes itself: no code of ours
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not ours")


@pytest.fixture(scope="module")
def server():
    refuser = Refuser()
    srv, port = start_server("127.0.0.1:0", TOKEN, refuser, pb_grpc.BaselineServicer())
    client = ControlClient(f"127.0.0.1:{port}", TOKEN, peer=3)
    yield refuser, client
    client.close()
    srv.stop(0)


@pytest.mark.parametrize("error", SENT, ids=lambda e: type(e).__name__)
def test_an_error_comes_back_as_its_own_class(server, error):
    refuser, client = server
    refuser.error = error
    with pytest.raises(errors.RdmaTensorError) as info:
        client.call(client.control.Grow, pb.GrowRequest(), timeout=5)
    got = info.value
    assert type(got) is type(error) and str(got) == str(error)
    assert got.peer == 3 and got.tensor == error.tensor


def test_a_failed_precondition_without_our_code_is_no_plan_mismatch(server):
    _, client = server
    with pytest.raises(errors.TransportError, match="FAILED_PRECONDITION") as info:
        client.call(client.control.Ping, pb.PingRequest(), timeout=5)
    assert not isinstance(info.value, errors.PlanMismatch)


def test_the_code_is_in_the_trailing_metadata(server):
    refuser, client = server
    refuser.error = errors.CreditViolation("held", tensor="d")
    with pytest.raises(grpc.RpcError) as info:
        client.control.Grow(pb.GrowRequest(), metadata=client.metadata, timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (ERROR_KEY, "CreditViolation") in tuple(info.value.trailing_metadata())


def test_a_grow_refused_for_a_held_slot_is_a_credit_violation():
    """The receiver refuses to move a slot its user still holds: the sender
    learns CreditViolation (it was PlanMismatch before the code travelled)."""
    import numpy as np
    from rdmatensor import Plan, TensorSpec
    from ..support.ranks import check, run_ranks
    plan = Plan([TensorSpec("d", (None,), np.int32, 0, 1, capacity=64)])

    def body(s, r):
        if r == 1:
            s.barrier("sent")
            view = s.recv("d")               # held from here on
            s.barrier("held")
            s.barrier("tried")
            view.release()
            return None
        s.send("d", np.arange(4, dtype=np.int32))
        s.barrier("sent")
        s.barrier("held")
        st = s.debug_state()["send_slots"]["d"]
        st.credit.set()                       # act as a sender that kept a credit it no longer has
        with pytest.raises(errors.CreditViolation, match="still held") as info:
            s.send("d", np.arange(5000, dtype=np.int32))
        s.barrier("tried")
        return info.value.peer, info.value.tensor

    assert check(run_ranks(2, plan, "tcp", body))[0] == (1, "d")
