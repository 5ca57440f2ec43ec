"""The slot state machine and credit flow, without sockets: a recording
channel stands in for the provider, everything else is the real code.
Immediates go in as a channel delivers them (Credits.immediates(), compiled
where it is built); tests/session/test_slots.py runs this file on the
Python slots too."""
import threading

import numpy as np
import pytest

from rdmatensor.errors import CreditViolation, PeerLost, SendTimeout
from rdmatensor.memory import Arena
from rdmatensor.plan import Plan, TensorSpec
from rdmatensor.providers.contract import IMM_CREDIT, IMM_DATA, make_imm, pair_imm
from rdmatensor.providers.tcp.channel import TcpChannel
from rdmatensor.session.context import SessionContext
from rdmatensor.session.credits import Credits, RecvSlot, SendSlot
from rdmatensor.session.liveness import Liveness

PLAN = Plan([TensorSpec("a", (4,), np.float32, 0, 1), TensorSpec("b", (2,), np.int64, 1, 0)])


class Recorder:
    """Records the immediates a session sends and the losses it reports."""
    copies = 0

    def __init__(self):
        self.sent, self.lost_with = [], []

    def notify(self, imm):
        self.sent.append(imm)

    notify_later = notify

    def lost(self, error):
        self.lost_with.append(error)

    def wait_for(self, event, timeout):
        return event.wait(timeout)

    def progress(self, block_for=0.0):
        return False


def rank1():
    """Rank 1 of PLAN: it receives "a" from rank 0 and sends "b" to it."""
    ctx = SessionContext(1, {0: "127.0.0.1:1", 1: "127.0.0.1:2"}, PLAN, {0: TcpChannel}, "t", None, 1.0)
    live = Liveness(ctx, heartbeat=1.0, peer_timeout=10.0)
    credits = Credits(ctx, live)
    credits.deliver = credits.immediates(0)      # what rank 0's channel calls: compiled where it is built
    ctx.channels[0] = Recorder()
    memory = np.zeros(64, np.uint8)
    credits.add(0, [SendSlot(PLAN.slots["b"], 0, memory.copy())], [RecvSlot(PLAN.slots["a"], 0, memory)])
    return ctx, live, credits


def test_a_slot_goes_empty_full_held_empty_and_the_credit_goes_back():
    ctx, _, credits = rank1()
    st = credits.recv["a"]
    assert st.state == st.EMPTY and not st.arrived.is_set()
    assert not st.take(), "nothing to take before the DATA immediate"
    credits.deliver(make_imm(IMM_DATA, st.slot.index))
    assert st.state == st.FULL and st.arrived.is_set()
    assert st.take() and st.state == st.HELD
    assert ctx.channels[0].sent == [], "no credit while the user holds the view"
    credits.give_back(st)
    assert st.state == st.EMPTY and not st.arrived.is_set()
    assert ctx.channels[0].sent == [make_imm(IMM_CREDIT, st.slot.index)]


@pytest.mark.parametrize("held", [False, True])
def test_data_without_a_credit_is_a_credit_violation_and_loses_the_peer(held):
    ctx, _, credits = rank1()
    st = credits.recv["a"]
    credits.deliver(make_imm(IMM_DATA, st.slot.index))
    if held:
        st.take()
    credits.deliver(make_imm(IMM_DATA, st.slot.index))
    [error] = ctx.channels[0].lost_with
    assert isinstance(error, CreditViolation) and error.peer == 0 and error.tensor == "a"
    assert st.state == (st.HELD if held else st.FULL), "the value in the slot is kept"


@pytest.mark.parametrize("rules", ["compiled where built", "python"])
def test_a_pair_immediate_gives_a_credit_back_and_hands_a_value_over(rules):
    ctx, _, credits = rank1()
    deliver = credits.deliver if rules != "python" else (lambda imm: credits.on_imm(0, imm))
    a, b = credits.recv["a"], credits.send["b"]
    b.credit.clear()
    deliver(pair_imm(make_imm(IMM_DATA, a.slot.index), make_imm(IMM_CREDIT, b.slot.index)))
    assert b.credit.is_set() and a.state == a.FULL and a.tag == 0 and a.arrived.is_set()
    assert not ctx.channels[0].lost_with
    deliver(pair_imm(make_imm(IMM_DATA, a.slot.index), make_imm(IMM_CREDIT, b.slot.index)))
    [error] = ctx.channels[0].lost_with        # its value is still there: written without a credit
    assert isinstance(error, CreditViolation) and error.tensor == "a" and a.state == a.FULL


def test_pairing_is_refused_where_it_would_lose_a_tag_or_an_index():
    data, credit = make_imm(IMM_DATA, 3), make_imm(IMM_CREDIT, 9)
    assert pair_imm(data, credit) is not None
    assert pair_imm(make_imm(IMM_DATA, 3, tag=1), credit) is None
    assert pair_imm(make_imm(IMM_DATA, 1 << 15), credit) is None
    assert pair_imm(data, make_imm(IMM_CREDIT, 1 << 15)) is None
    assert pair_imm(data, make_imm(IMM_DATA, 9)) is None and pair_imm(credit, credit) is None


@pytest.mark.parametrize("imm", [make_imm(IMM_DATA, 1), make_imm(IMM_CREDIT, 7), make_imm(3, 0),
                                 pair_imm(make_imm(IMM_DATA, 1), make_imm(IMM_CREDIT, 0)),
                                 pair_imm(make_imm(IMM_DATA, 0), make_imm(IMM_CREDIT, 7))])
def test_an_immediate_for_no_slot_loses_the_peer(imm):
    ctx, _, credits = rank1()
    credits.deliver(imm)
    [error] = ctx.channels[0].lost_with
    assert isinstance(error, CreditViolation), error


def test_growth_needs_an_empty_slot():
    _, _, credits = rank1()
    st = credits.recv["a"]
    with Arena(4096) as first, Arena(4096) as second:
        assert st.regrow(5, first) is None and st.memory is first.buf
        credits.deliver(make_imm(IMM_DATA, st.slot.index))
        with pytest.raises(CreditViolation, match="still held"):
            st.regrow(6, second)
        assert st.grown == (5, first)
        st.memory = None


def test_a_sender_waits_for_the_credit_then_times_out_with_send_timeout():
    ctx, _, credits = rank1()
    st = credits.send["b"]
    credits.take(st, timeout=0.1)             # the first write needs no wait
    with pytest.raises(SendTimeout) as info:
        credits.take(st, timeout=0.1)
    assert info.value.peer == 0 and info.value.tensor == "b"
    assert ctx.counters.snapshot()["waits"] == 1
    threading.Timer(0.05, credits.deliver, (make_imm(IMM_CREDIT, st.slot.index),)).start()
    credits.take(st, timeout=5)               # the CREDIT immediate lets it go


def test_a_lost_peer_wakes_every_waiter_for_good():
    _, live, credits = rank1()
    recv, send = credits.recv["a"], credits.send["b"]
    send.credit.clear()
    live.lost(0, PeerLost("gone"))
    assert recv.arrived.is_set() and send.credit.is_set()
    assert not recv.take(), "woken, but there is no value"
    recv.release()
    assert recv.arrived.is_set(), "a release after the loss must not put waiters back to sleep"
    with pytest.raises(PeerLost):
        credits.take(send, timeout=0.1)
