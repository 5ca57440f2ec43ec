"""No value is ever handed to a call it was not written for, and a collective that
differs between ranks fails on every rank while the next one works: both wrong values
found by running Horovod's own tests, then a randomized sequence with calls changed
on one rank (call_identity_script.py), one process per rank."""
import json
from pathlib import Path

import numpy as np
import pytest

from .processes import run_workers

SCRIPT = Path(__file__).parent / "call_identity_script.py"


def reports(out_dir, n):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def check(rep, size, calls):
    # Integer pre/postscale as Horovod: each factor rounded to float32 (its op attribute), applied in
    # float64, truncated back to int32 (real Horovod 0.28.1 on 2 ranks: [0, 0, 1, 27] and [0, 1, 1, 28]).
    f = float(np.float32(0.19))
    assert rep["prescale"] == [sum(int(v * (r + 1) * f) for r in range(size)) for v in (1, 2, 3, 50)]
    assert rep["postscale"] == [int(sum(v * (r + 1) for r in range(size)) * f) for v in (1, 2, 3, 50)]
    assert rep["int_average"] == [int(sum(v * (r + 1) for r in range(size)) * (1.0 / size))
                                  for v in (-3, 3, -5, 7)]
    # One allgather name, two dtypes, both planned, one per rank: a typed error on every rank,
    # at once (not at the timeout), and the next agreeing call gets its own values.
    d = rep["diverged"]
    assert d["error"] == "CollectiveMismatch" and d["is_failed_precondition"] and "'leftover'" in d["message"], d
    assert "float32" in d["message"] and "int32" in d["message"]
    assert d["seconds"] < 10, d
    assert rep["after"] is True and rep["after_shape"] == [sum(17 + 15 * r for r in range(size)), 17, 17]
    assert rep["judged"] == ([] if rep["rank"] else ["None"]) and rep["judged_ok"], rep["judged"]
    random = rep["random"]
    assert random["wrong"] == [], random["wrong"]
    assert random["agreed_ok"] == random["agreed"] and random["agreed"] + random["changed"] == calls
    assert random["changed"] > 0 and random["changed_raised"] == random["changed"]
    assert random["slowest_raise"] < 10, random.get("slow")


@pytest.mark.parametrize("provider,size,calls", [("shm", 2, 150), ("tcp", 3, 150)])
def test_no_value_reaches_another_call_and_mismatches_fail_every_rank(tmp_path, provider, size, calls):
    run_workers(SCRIPT, size, provider, tmp_path, args=(calls, size), timeout=300)
    for rep in reports(tmp_path, size):
        check(rep, size, calls)


# ----------------------------------------------------------------------------------------------
# Five cases that once gave a wrong value or no error (five_cases_script.py: one job, 2 ranks, shm).
FIVE = Path(__file__).parent / "five_cases_script.py"


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    out = tmp_path_factory.mktemp("five")
    run_workers(FIVE, 2, "shm", out, timeout=240)
    return reports(out, 2)


def raised_everywhere(calls: list, index: int) -> None:
    for rank, c in enumerate(calls):
        got = c[index]
        assert got.get("error") and got["failed_precondition"], f"rank {rank}, call {index}: {got}"


def test_a_grouped_call_of_two_dtypes_never_hands_on_a_failed_calls_bucket_or_error(five):
    calls = [rep["grouped"] for rep in five]
    for c in calls:
        assert c[0] == {"values": [2.0, 2.0]}, c
    raised_everywhere(calls, 1)
    for c in calls:
        assert c[2] == {"values": [200.0, 200.0]}, c
        assert c[3] == {"values": [2000.0, 2000.0]}, c


def test_an_empty_tensor_on_one_rank_is_a_mismatch_and_later_calls_get_their_own_values(five):
    calls = [rep["empty"] for rep in five]
    raised_everywhere(calls, 0)
    assert "shape" in calls[0][0]["message"] or "[0]" in calls[0][0]["message"], calls[0][0]
    for c in calls:
        assert c[1] == {"values": [[30.0, 60.0, 90.0]]}, c
        assert c[2] == {"values": [[60.0, 120.0, 180.0]]}, c
        assert c[3] == {"values": [[]]}, c


def test_reducescatter_against_allreduce_of_one_name_raises_on_both_ranks(five):
    calls = [rep["kinds"] for rep in five]
    raised_everywhere(calls, 0)
    assert calls[0][1] == {"values": [[3, 6]]} and calls[1][1] == {"values": [[9, 12]]}, calls
    for c in calls:
        assert c[2] == {"values": [[3, 6, 9, 12]]}, c


def test_integer_scaling_is_horovods_float32_factors_one_truncation(five):
    for rep in five:
        # Average with postscale 1.5 over 2 ranks: trunc(-23 * 0.75) = -17 (not trunc(trunc(-11.5) * 1.5) = -16).
        # prescale 0.19 is float32(0.19) = 0.18999999761...: trunc(18.99...) = 18 per rank, 36 in all.
        assert rep["scaling"] == [{"values": [[-17]]}, {"values": [[36]]}], rep["scaling"]


def test_scale_factors_that_differ_between_ranks_raise_on_every_rank(five):
    calls = [rep["factors"] for rep in five]
    raised_everywhere(calls, 0)
    raised_everywhere(calls, 1)
    assert "scale" in calls[0][0]["message"], calls[0][0]
    for c in calls:
        assert c[2] == {"values": [[4.0, 8.0, 12.0]]}, c


def test_ranks_that_disagree_on_a_broadcasts_root_raise_at_once(five):
    calls = [rep["roots"] for rep in five]
    raised_everywhere(calls, 0)          # each its own root, nothing to send: once both waited for ever
    raised_everywhere(calls, 1)          # each the other's: once both waited as receivers
    for c in calls:
        assert all("did not arrive" not in x["message"] for x in c[:2]), c     # seen, not timed out
        assert c[2] == {"values": [[2, 4, 6]]}, c
