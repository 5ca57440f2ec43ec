"""No value is ever handed to a call it was not written for, and a collective that
differs between ranks fails on every rank while the next one works: both wrong values
found by running Horovod's own tests, then a randomized sequence with calls changed
on one rank (call_identity_script.py), one process per rank."""
import json
from pathlib import Path

import pytest

from .processes import run_workers

SCRIPT = Path(__file__).parent / "call_identity_script.py"


def reports(out_dir, n):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def check(rep, size, calls):
    # Integer pre/postscale as Horovod: each factor applied in float64, truncated back to int32.
    assert rep["prescale"] == [sum(int(v * (r + 1) * 0.19) for r in range(size)) for v in (1, 2, 3, 50)]
    assert rep["postscale"] == [int(sum(v * (r + 1) for r in range(size)) * 0.19) for v in (1, 2, 3, 50)]
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
    assert random["slowest_raise"] < 10, random


@pytest.mark.parametrize("provider,size,calls", [("shm", 2, 150), ("tcp", 3, 150)])
def test_no_value_reaches_another_call_and_mismatches_fail_every_rank(tmp_path, provider, size, calls):
    run_workers(SCRIPT, size, provider, tmp_path, args=(calls, size), timeout=300)
    for rep in reports(tmp_path, size):
        check(rep, size, calls)
