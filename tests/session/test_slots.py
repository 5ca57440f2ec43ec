"""The compiled slot state (session/_slots.c) against the Python one
(session/slots.py): the same transitions for any sequence of operations, and
the compiled on_imm moves a slot only on an immediate the rules allow,
leaving everything else to them untouched."""
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from rdmatensor.providers.contract import IMM_CREDIT, IMM_DATA, IMM_PAIR, INDEX_BITS, MAX_TAG, make_imm, pair_imm
from rdmatensor.session import slots
from rdmatensor.session.flag import Flag

ROOT = Path(__file__).resolve().parents[2]


def test_the_compiled_slots_are_built_and_used():
    assert slots.BUILD_ERROR is None, slots.BUILD_ERROR       # make setup builds them
    assert slots.compiled is not None and slots.SlotState is slots.compiled.SlotState


def test_the_python_slots_pass_the_credit_tests_too():
    env = {**os.environ, slots.SLOTS_ENV: "python"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests/session/test_credits.py"),
                          "-k", "not the_python_slots"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


def _observe(st) -> tuple:
    return st.state, st.tag if st.state != "empty" else None, st.arrived.is_set(), st.memory, st.grown, st.view


def test_both_state_machines_agree_on_any_sequence():
    rng = random.Random(3)
    for trial in range(200):
        machines = [slots.compiled.SlotState("m0", Flag()), slots._SlotState("m0", Flag())]
        for step in range(40):
            op = rng.choice(["arrive", "arrive", "take", "release", "wake", "replace", "view"])
            arg = rng.randrange(MAX_TAG + 1)
            results = []
            for st in machines:
                if op == "arrive":
                    results.append(st.arrive(arg))
                elif op == "replace":
                    results.append(st.replace((step, "arena"), f"m{step}"))
                elif op == "view":
                    st.view = arg
                    results.append(None)
                else:
                    results.append(getattr(st, op)())
            assert results[0] == results[1], (trial, step, op)
            assert _observe(machines[0]) == _observe(machines[1]), (trial, step, op)


def test_the_compiled_on_imm_moves_only_what_the_rules_allow():
    """Valid DATA, CREDIT and PAIR immediates never reach the rules; every
    other one reaches them with the slots as they were."""
    rng = random.Random(5)
    recv = [slots.compiled.SlotState(np.zeros(4, np.uint8), Flag()) for _ in range(3)]
    credits = [Flag() for _ in range(2)]
    to_rules = []

    def rules(imm):
        to_rules.append((imm, [_observe(st)[:3] for st in recv], [f.is_set() for f in credits]))
        return True

    on_imm = slots.compiled.Immediates(rules, INDEX_BITS)
    on_imm.bind(recv, credits)
    for _ in range(3000):
        kind = rng.choice([IMM_DATA, IMM_DATA, IMM_CREDIT, IMM_PAIR, IMM_PAIR, 3])
        index, tag, credit = rng.randrange(5), rng.randrange(8), rng.randrange(3)
        if kind == IMM_PAIR:
            imm, tag = pair_imm(make_imm(IMM_DATA, index), make_imm(IMM_CREDIT, credit)), 0
        else:
            imm = make_imm(kind, index, tag)
        before = ([_observe(st)[:3] for st in recv], [f.is_set() for f in credits])
        said = on_imm(imm)
        valid = ((kind in (IMM_DATA, IMM_PAIR) and index < 3 and before[0][index][0] == "empty"
                  and (kind == IMM_DATA or credit < 2))
                 or (kind == IMM_CREDIT and index < 2))
        if valid:
            assert said is None and not to_rules
            if kind != IMM_CREDIT:
                assert recv[index].state == "full" and recv[index].tag == tag and recv[index].arrived.is_set()
            if kind != IMM_DATA:
                assert credits[credit if kind == IMM_PAIR else index].is_set()
        else:
            assert said is True and to_rules[-1] == (imm, *before)
            to_rules.clear()
        if rng.random() < 0.3:                  # the receiver takes and releases, the sender spends credits
            st = recv[rng.randrange(3)]
            st.take()
            st.release()
            credits[rng.randrange(2)].clear()


def test_both_received_kinds_lend_release_once_and_name_the_tensor():
    import weakref

    import pytest

    from rdmatensor import UsageError
    from rdmatensor.session import recv
    assert recv.Received is slots.compiled.Received
    for kind, state_kind in ((slots.compiled.Received, slots.compiled.SlotState), (recv._Received, slots._SlotState)):
        class Credits:
            given = []

            def give_back(self, st):
                self.given.append(st)
                st.release()

        class State(state_kind):
            name = "w/kernel"
        st = State(np.zeros(4, np.uint8), Flag())
        assert st.arrive(7) and st.take()
        array = np.arange(4.0)
        credits = Credits()
        got = kind(credits, st, array)
        assert (got.name, got.tag, got.released) == ("w/kernel", 7, False)
        assert (st.recvs, st.bytes_received) == (1, 32)           # counted where it is handed out
        assert weakref.ref(got)() is got
        with got as view:
            assert view is array
        assert got.released and got.array is None and credits.given == [st] and st.state == "empty"
        got.release()                                     # idempotent: the slot went back once
        assert credits.given == [st]
        with pytest.raises(UsageError, match="'w/kernel' was already released") as info:
            got.__enter__()
        assert info.value.tensor == "w/kernel", kind
