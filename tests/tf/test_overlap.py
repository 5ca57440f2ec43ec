"""Gradients are all-reduced while backprop still runs (one launch op per bucket, the
rings on the communication thread), with the results of a plain all-reduce, over shm.
What happened when is read from the RDMATENSOR_TIMELINE trace, by order, not by duration."""
import json
from collections import defaultdict
from pathlib import Path

import pytest

from rdmatensor.errors import UsageError
from tf_plugin.core.timeline import Timeline

from .processes import run_workers

SCRIPT = Path(__file__).parent / "overlap_script.py"
STEPS, EAGER_STEPS, FIT_STEPS, TWICE = 6, 2, 4, 2


def rounds_of(trace: list) -> dict:
    """round -> {"ready": {bucket: ts}, "ring": {bucket: (start, end)}, "wait": {bucket: (start, end)}}"""
    rounds = defaultdict(lambda: {"ready": {}, "ring": {}, "wait": {}})
    for e in trace:
        kind = e["name"].split(" ")[0]
        if kind in ("ready", "ring", "wait"):
            at = e["ts"] if kind == "ready" else (e["ts"], e["ts"] + e["dur"])
            rounds[e["args"]["round"]][kind][e["args"]["bucket"]] = at
    return dict(rounds)


def test_gradients_reduced_while_backprop_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", str(16 << 10))
    monkeypatch.setenv("RDMATENSOR_TIMELINE", str(tmp_path / "new" / "timeline-{rank}.json"))   # its folder made
    run_workers(SCRIPT, 2, "shm", tmp_path, args=(STEPS,))
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reps:
        # the same variables on both ranks, bit for bit, and those of one process on the global batch
        assert rep["same"] and rep["max_diff"] < 1e-5 and rep["fit_same"]
        # two all-reduces of one tensor set in one graph (the loss, then twice the loss): doubled exactly
        assert rep["twice_exact"]
        # the first step plans the gradients (eager steps reuse the plan): no control call after it
        assert rep["calls"] == [rep["calls"][0]] * (STEPS + EAGER_STEPS)
        # output buffers come back once TensorFlow frees the gradients: none allocated after step 2
        assert rep["buffers"][1:] == [rep["buffers"][1]] * (STEPS + EAGER_STEPS - 1)
        s = rep["stats"]
        assert s["allreduces"] == STEPS + EAGER_STEPS + FIT_STEPS + TWICE and 0 < s["overlap"] <= 1
        assert s["extensions"] == 1                          # fit's gradients are the tape's tensor set
        assert 0 < s["overlapped_seconds"] < s["ring_seconds"] <= s["comm_seconds"]

        trace = json.loads((tmp_path / "new" / f"timeline-{rep['rank']}.json").read_text())    # valid JSON
        assert {"TensorFlow", "communication"} <= {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
        rounds = rounds_of(trace)
        assert sorted(rounds) == list(range(STEPS + EAGER_STEPS + FIT_STEPS + TWICE))
        buckets = sorted(rounds[0]["ready"])
        assert len(buckets) == 4                      # a bucket per conv layer
        assert rep["buffers"][1] <= 2 * len(buckets)
        for r in rounds.values():
            assert sorted(r["ready"]) == sorted(r["ring"]) == sorted(r["wait"]) == buckets
            for j in buckets:
                assert r["ready"][j] <= r["ring"][j][0]       # a ring starts once its bucket is handed over
                assert r["wait"][j][1] >= r["ring"][j][1]     # and its result is taken after it ends
            # one thread, buckets in the plan's order
            assert all(r["ring"][j][1] <= r["ring"][j + 1][0] for j in buckets[:-1])
        # inside tf.function (the tape's, then fit's), the first bucket's ring starts while backprop still
        # computes the last bucket's gradients: in every round where TensorFlow hands the last bucket over
        # well after the first (the script's backprop ends with a 50 ms wait), and that is most rounds.
        tape, fit = range(STEPS), range(STEPS + EAGER_STEPS, STEPS + EAGER_STEPS + FIT_STEPS)
        for graph in (tape, fit):
            tail = {k: (min(rounds[k]["ready"].values()), max(rounds[k]["ready"].values())) for k in graph}
            long_tail = [k for k in graph if tail[k][1] - tail[k][0] > 25_000]         # microseconds
            assert len(long_tail) >= len(graph) // 2, tail
            assert all(rounds[k]["ring"][0][0] < tail[k][1] for k in long_tail), (tail, rounds)


def test_a_time_line_that_cannot_be_written_is_a_usage_error_naming_the_rank(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match="rank 3 cannot write its time line"):
        Timeline(str(tmp_path / "a-file" / "timeline.json"), 3)


def test_fusion_threshold_from_init_or_the_environment(monkeypatch):
    import pytest
    from rdmatensor import PlanError

    import tf_plugin as hvd
    from tf_plugin.horovod.world import world
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", "1000")
    for argument, want in ((None, 1000), (50, 50)):
        hvd.init(fusion_threshold=argument)
        try:
            assert world().collectives.threshold == want
        finally:
            hvd.shutdown()
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", "-1")
    with pytest.raises(PlanError, match="fusion threshold -1"):
        hvd.init()
    assert not hvd.is_initialized()


def test_a_bucket_comes_back_as_views_of_its_flat_output_and_odd_members_as_their_own():
    """The wait op hands over one flat array per bucket, sliced in the graph: every
    member whose start and length sit on TensorFlow's alignment is a view of that
    array (no copy); one that does not (10 floats; 3 floats, even at the end) is its
    own output, a view too; every value lands in the right member, in its shape."""
    import numpy as np
    import tensorflow as tf

    from tf_plugin.core import buffers
    from tf_plugin.graph import overlap

    shapes = [(4, 4), (10,), (2, 8), (3,)]             # at offsets 0, 16, 32, 48
    layout = [(p, 16 * p, s) for p, s in enumerate(shapes)]
    flat = buffers.aligned_empty((51,), np.float32)
    flat[:] = np.arange(51)
    handed = []

    @tf.function
    def step():
        grads = [tf.zeros(s) for s in shapes]
        out = overlap.bucketed(grads, [layout], lambda j, arrays: handed.append(len(arrays)) or 0,
                               lambda j, number: flat, "test_allreduce")
        where = [tf.numpy_function(lambda a: np.int64(a.ctypes.data), [o], tf.int64, stateful=True) for o in out]
        return out, where

    out, where = step()
    assert handed == [4]
    for (p, offset, shape), o, at in zip(layout, out, where, strict=True):
        assert o.shape == shape and np.array_equal(o.numpy(), flat[offset:offset + int(np.prod(shape))].reshape(shape))
        assert int(at) == flat.ctypes.data + 4 * offset, f"member {p} was copied"

    @tf.function
    def misfit():       # a result laid out otherwise than the graph expects is refused, never sliced
        return overlap.bucketed([tf.zeros(s) for s in shapes], [layout], lambda j, arrays: 0,
                                lambda j, number: flat[:48], "test_allreduce")

    with pytest.raises(tf.errors.OpError, match=r"bucket 0's result is \(48,\) float32; the graph lays out \(51,\)"):
        misfit()
