"""A short seeded form of the differential run (tests/differential): random
collectives of every kind, op and dtype Horovod's CPU build takes, eager and
each in a tf.function of its own (the native all-reduce there), with changes
on one rank, through tf_plugin, judged against the numpy model of Horovod's
semantics. Every agreeing call must equal the model (bit for bit on 2 ranks),
every changed call must raise on every member, and the next call must work.
The full run against real Horovod: `make horovod-diff`."""
import numpy as np
import pytest

from tests.differential.compare import judge, load
from tests.differential.model import expected
from tests.differential.sequence import as_seen_by, call, inputs, seeds_of

from .processes import run_workers


def run(tmp_path, ranks, provider, seeds, calls, graph=0.0):
    worker = tmp_path / "worker.py"       # run_workers starts a script: this one runs the package's worker
    worker.write_text("import runpy\nrunpy.run_module('tests.differential.worker', run_name='__main__')\n")
    run_workers(worker, ranks, provider, tmp_path, args=("rdmatensor", seeds, calls, graph), timeout=400)
    return judge(ranks, seeds_of(seeds), calls, load(tmp_path, "rdmatensor", ranks), None, graph)


@pytest.mark.parametrize("ranks,provider,seeds,calls,graph", [(2, "shm", "101,102", 150, 0.5), (3, "tcp", "1", 260, 0)])
def test_random_collectives_match_the_model_and_every_change_raises_everywhere(tmp_path, ranks, provider, seeds,
                                                                               calls, graph):
    # seed 1 on 3 ranks, call 251: an empty broadcast whose dtype differs on one non-root rank;
    # the root once released the other non-root before hearing from that one, which returned
    # normally and was one call ahead of the others from then on.
    # seed 101 on 2 ranks in graphs, call 127: an all-reduce whose prescale differs on one rank
    # returned on both (the native group was made for both ranks' sets); seed 104, call 116: an
    # empty tensor on one rank (the Python path) against the native path left the ranks' call
    # numbers apart, and the next call failed too.
    result = run(tmp_path, ranks, provider, seeds, calls, graph)
    counts = result["counts"]
    assert not result["problems"], result["problems"][:5]
    assert counts["changed calls"] > 0 and counts["values checked"] > calls, counts
    assert counts.get("calls in a graph", 0) >= graph * calls, counts
    assert not counts.get("changed but returned") and not counts.get("wrong values"), counts


def test_the_comparison_catches_a_wrong_value(tmp_path):
    """The judge itself: the model's own values pass; one value off, or a changed
    call that returns, is reported."""
    seed, calls, ranks = 7, 60, 2
    record = {r: {} for r in range(ranks)}
    for index in range(calls):
        c = call(seed, index, ranks)
        views = {r: as_seen_by(c, r, seed) for r in range(ranks)}
        by_rank = {r: inputs(views[r], r, seed) for r in c.members}
        for r in c.members:
            record[r][(seed, index)] = (("error", "FailedPreconditionError", "") if c.mismatch else
                                        ("ok", expected(views, by_rank, r)))
    assert judge(ranks, [seed], calls, record, None)["problems"] == []
    index = next(i for i in range(calls) if record[0][(seed, i)][0] == "ok" and record[0][(seed, i)][1][0].size
                 and record[0][(seed, i)][1][0].dtype.kind in "iuf")
    record[0][(seed, index)][1][0].reshape(-1)[0] += 1
    changed = next(i for i in range(calls) if record[1][(seed, i)][0] == "error")
    record[1][(seed, changed)] = ("ok", [np.zeros(1)])
    counts = judge(ranks, [seed], calls, record, None)["counts"]
    assert counts.get("wrong values") == 1 and counts.get("changed but returned") == 1, counts
