"""hvd.allreduce, hvd.grouped_allreduce and DistributedGradientTape inside
tf.function on the native ops (RDMATENSOR_TF_OPS=native, 2 ranks on this host):
bit for bit what the Python path (RDMATENSOR_TF_OPS=python: the ring on the
communication thread) computes, with the native launch and completion ops in
the traced graphs and no numpy_function; hvd.shutdown closes the groups,
leaving no segment's descriptor or mapping, and a graph traced over a closed
group fails with FailedPrecondition; after a native all-reduce fails, every rank
recovers and the step traced before runs again; no Python of ours runs on a steady
step; in a process set of 3 ranks, removing the
set closes its groups; a graph with the ops saves and loads as a SavedModel, and
an inference export carries no collective. Real processes (rdmatensor-run), the real
op library, no mocks."""
import json
from pathlib import Path

import numpy as np
import pytest

from .processes import run_workers

SCRIPT = Path(__file__).parent / "native_path_script.py"
SETS_SCRIPT = Path(__file__).parent / "native_sets_script.py"
PY_FUNCS = {"PyFunc", "EagerPyFunc", "PyFuncStateless"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each path's run of the script: {path: [(report, results) per rank]}."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for path in ("native", "python"):
            mp.setenv("RDMATENSOR_TF_OPS", path)
            where = tmp_path_factory.mktemp(path)
            run_workers(SCRIPT, 2, "shm", where, timeout=240)
            out[path] = [(json.loads((where / f"rank{r}.json").read_text()), dict(np.load(where / f"rank{r}.npz")))
                         for r in range(2)]
    return out


def test_native_and_python_paths_agree_bit_for_bit(runs):
    for rank in range(2):
        native, python = runs["native"][rank][1], runs["python"][rank][1]
        assert sorted(native) == sorted(python) and len(native) > 40
        differ = [k for k in native if native[k].dtype != python[k].dtype or native[k].tobytes() != python[k].tobytes()]
        assert not differ, differ
    # each rank trained on its own data: the averaged gradients and the weights are the same on both
    first, second = runs["native"][0][1], runs["native"][1][1]
    assert all(first[k].tobytes() == second[k].tobytes() for k in first
               if k.startswith(("grad", "weight", "fit_weight", "twice")))
    for results in (first, second):      # two all-reduces of one set in one graph: the second doubled exactly
        assert all(np.array_equal(results[k][0], results[k][1]) for k in results if k.startswith("twice"))


def test_the_native_ops_are_in_the_traced_graphs(runs):
    for report, _ in runs["native"]:
        for name, types in report["graphs"].items():
            assert {"RdtShmAllreduceLaunchFused", "RdtShmAllreduceDoneFused"} <= set(types), name
            assert not PY_FUNCS & set(types), (name, types)
        # the tape's set, twice's, its gradients'... and fit's: a group of its own
        assert 0 < report["groups"]["before_fit"] < report["groups"]["after_fit"]
    for report, _ in runs["python"]:
        for name, types in report["graphs"].items():
            assert PY_FUNCS & set(types), name
            assert not {"RdtShmAllreduceLaunch", "RdtShmAllreduceLaunchFused"} & set(types), name
        assert report["groups"] == {"before_fit": 0, "after_fit": 0}


def test_a_gradient_whose_shape_the_tape_lost_is_planned_as_its_variable(runs):
    """A Dense over a 3-D input traced for any batch: the plain tape gives its kernel's
    gradient as (None, units); the distributed tape's set is still static, so the
    native ops run it (the graph check above covers seq_step), bit for bit as the
    Python path (the first test)."""
    for path in ("native", "python"):
        for report, results in runs[path]:
            assert report["seq_lost"], report["seq_lost"]          # the case is real: the plain tape lost it
            assert sorted(k for k in results if k.startswith("seq_grad")) == [f"seq_grad{j}" for j in range(4)]


def test_a_native_step_is_counted_in_stats_as_the_ring_counts_its_bytes(runs):
    """2 ranks: the tape's step moves its gradients' bytes each way, on both paths (the
    ring's fused bucket pads each member to 64 bytes; the native request is packed)."""
    for report, _ in runs["native"]:
        step = report["per_step"]
        assert step["bytes_sent"] == step["bytes_received"] == 4 * step["elements"], step
        assert step["native_requests"] >= 1, step
    for report, _ in runs["python"]:
        step = report["per_step"]
        assert 4 * step["elements"] <= step["bytes_sent"] < 4 * step["elements"] + 64 * 6, step
        assert step["native_requests"] == 0, step


def test_shutdown_closes_the_groups_and_a_graph_over_them_fails_clearly(runs):
    for report, _ in runs["native"]:
        assert report["open_before"] > 0 and report["open_after"] == 0
        assert report["after_shutdown"].startswith("FailedPrecondition"), report["after_shutdown"]
    for report, _ in runs["python"]:
        assert report["open_before"] == report["open_after"] == 0
        assert report["after_shutdown"] == "ran"


def test_a_process_set_on_the_native_ops_and_its_removal(tmp_path, monkeypatch):
    monkeypatch.setenv("RDMATENSOR_TF_OPS", "native")
    run_workers(SETS_SCRIPT, 3, "shm", tmp_path, timeout=240)
    x = np.arange(40, dtype=np.float32).reshape(5, 8)
    for rank in range(3):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert np.array_equal(rep["everyone"], x * 6) and np.array_equal(rep["everyone_after_removal"], x * 6)
        assert "RdtShmAllreduceLaunchFused" in rep["everyone_ops"] and not PY_FUNCS & set(rep["everyone_ops"])
        if rank in (0, 2):
            assert np.array_equal(rep["pair"], x * 4)
            assert np.array_equal(rep["pair_max"], [x * 3, x * 6])
            assert "RdtShmAllreduceLaunchFused" in rep["pair_ops"] and not PY_FUNCS & set(rep["pair_ops"])
            assert rep["pair_after_removal"].startswith("FailedPrecondition"), rep["pair_after_removal"]
            # the pair's group gone (its own segment and its peer's), the global set's still open
            assert rep["open_before"] > rep["open_after_removal"] > 0
        else:
            assert rep["open_before"] == rep["open_after_removal"] > 0
        assert rep["open_after_shutdown"] == 0


SAVED_SCRIPT = Path(__file__).parent / "native_saved_script.py"


def test_a_graph_with_the_native_ops_saves_and_loads_and_an_inference_export_has_no_collective(tmp_path):
    run_workers(SAVED_SCRIPT, 2, "shm", tmp_path, timeout=240)
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["native_ops"] == ["RdtShmAllreduceDoneFused", "RdtShmAllreduceLaunchFused",
                                     "RdtShmAllreduceMembers"], rep
        assert rep["step"] == [2.0, 4.0, 6.0]                 # x * v summed over 2 ranks, v = 1
        assert rep["loaded_step"] == [6.0, 10.0, 14.0]        # the loaded step, v = 1 + [2, 4, 6]
        assert rep["exported_collectives"] == [] and rep["exported_ops"] > 0


RECOVERY_SCRIPT = Path(__file__).parent / "native_recovery_script.py"


def test_after_a_native_all_reduce_fails_every_rank_recovers_and_the_traced_step_runs_again(tmp_path,
                                                                                              monkeypatch):
    # Before its mender, the step's group stayed broken: every later all-reduce of the set
    # raised AbortedError on both ranks, for the rest of the job. Before rank 1's watchdog
    # looked at the native groups, rank 0 waited for its timeout (DeadlineExceededError).
    monkeypatch.setenv("RDMATENSOR_TIMEOUT", "12")
    run_workers(RECOVERY_SCRIPT, 2, "shm", tmp_path, timeout=240)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["mismatch"] == "FailedPreconditionError", rep      # a mismatch, on both: Horovod's type
        assert rep["mismatch_seconds"] < 10, rep                       # the watchdog's 2 s, not the timeout
        for key in ("before", "retraced", "after"):
            assert np.array_equal(rep[key], 2 * x + 1), (key, rep)
        assert np.array_equal(rep["allgather"], np.concatenate([x, x + 1])), rep
    assert reports[0]["generations"] == reports[1]["generations"]


NO_PYTHON_SCRIPT = Path(__file__).parent / "native_no_python_script.py"
LIVENESS_THREADS = ("rdmatensor-heartbeat-", "rdmatensor-ctl_", "Thread-")     # the ping, its server's threads


def test_no_python_of_ours_runs_on_the_steady_native_step(tmp_path):
    """50 steady DistributedGradientTape steps under a profile hook on every Python
    thread: no function of rdmatensor/ or tf_plugin/ is called on the step's thread,
    the communication thread never starts, the divergence watchdog sleeps (it woke
    every 0.25 s before), and only the once-a-second liveness ping may run."""
    run_workers(NO_PYTHON_SCRIPT, 2, "shm", tmp_path, timeout=240)
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["native_requests"] == 50 and rep["python_rounds"] == 0, rep
        assert not rep["comm_thread_started"] and np.isfinite(rep["loss"]), rep
        threads = {frame.split(":")[0] for frame in rep["frames"]}
        assert all(t.startswith(LIVENESS_THREADS) for t in threads), rep["frames"]
        assert all(any(part in f for part in ("rdmatensor/control/", "rdmatensor/session/", "providers/contract.py",
                                              "checked_collectives.py:<lambda>"))    # the status a ping asks for
                   for f in rep["frames"]), rep["frames"]
