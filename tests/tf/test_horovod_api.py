"""`import tf_plugin as hvd`: a script written for horovod.tensorflow runs with only its
import changed, each rank a process of its own (TF_CONFIG, token, provider from the
environment, as a launcher sets them)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .processes import ROOT, run_workers

SCRIPT = Path(__file__).parent / "horovod_tape_script.py"


def reports(out_dir, n=2):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def check_tape(rep, rank):
    assert (rep["rank"], rep["size"], rep["local_rank"], rep["local_size"]) == (rank, 2, rank, 2)
    # BatchNorm model without an input shape, broadcast inside the first step's tf.function:
    # moving statistics and optimizer slots are rank 0's on every rank after it ...
    assert rep["bn_moving_stats"] and rep["bn_all_same_after_broadcast"]
    # ... and the ranks end with bit-identical trainable variables and optimizer state
    assert rep["bn_trained_same"]
    # fp16 compression: the ring moves half the bytes (plus alignment padding of the fused bucket)
    assert rep["bn_bytes_per_step"] < 0.7 * 4 * rep["bn_trainable_elements"]
    # the first step extends the plan; from then on, no control call at all
    assert rep["bn_calls"] == [rep["bn_calls"][0]] * len(rep["bn_calls"])


def check_training(rep, rank):
    check_tape(rep, rank)
    assert rep["mlp_trained_same"]
    # no compression, 2 ranks: each rank sends its model's bytes per step, plus the padding that starts
    # every member of the fused bucket 64-byte aligned (under 64 bytes per gradient but the last)
    assert 4 * rep["mlp_trainable_elements"] <= rep["mlp_bytes_per_step"] < 4 * rep["mlp_trainable_elements"] + 3 * 64
    # two workers equal one process on the global batch
    assert rep["mlp_max_diff"] < 1e-5
    assert rep["mlp_calls"] == [rep["mlp_calls"][0]] * len(rep["mlp_calls"])
    # the first step extends the plan with the fused bucket; on the native ops
    # (RDMATENSOR_TF_OPS=native) the bucket is the native group's, the session's plan unchanged
    assert rep["mlp_extensions"] == (0 if rep["mlp_native_requests"] else 1), rep


def test_horovod_tape_script_on_two_processes(tmp_path):
    """Over tcp (test_keras_fit.py runs over shm)."""
    run_workers(SCRIPT, 2, "tcp", tmp_path)
    for rank, rep in enumerate(reports(tmp_path)):
        check_training(rep, rank)
        for check in ("sum_ok", "avg_ok", "avg_graph_ok", "int_sum_ok", "allgather_ok", "allgather_graph_ok",
                      "allgather_grown_ok", "broadcast_ok", "object_ok", "sparse_ok", "after_mismatch_ok"):
            assert rep[check] is True, (rank, check)
        assert rep["allgather_grows"] >= 1
        # a plan that differs between ranks fails on every rank, naming the tensor
        # ... as rdmatensor's PlanMismatch that is also TensorFlow's FailedPreconditionError (as Horovod)
        assert rep["mismatch"].startswith("tf_plugin.errors.CollectiveMismatch")
        assert "'differs'" in rep["mismatch"]
        # both shapes named: compared as proposals ("shape: [2] vs [3]"), or, where one rank has
        # the set planned already (sets are keyed by what they move, not by names), seen by the
        # watchdog ("... float32 [2] ... while ... float32 [3]")
        assert "shape: [2] vs [3]" in rep["mismatch"] or ("[2]" in rep["mismatch"] and "[3]" in rep["mismatch"])
        s = rep["stats"]
        # every generation added a set, but for at most one: the mismatch's reset, where one rank
        # had the set of its call planned already
        assert s["generations"] - s["tensor_sets"] in (0, 1) and s["extensions"] == s["generations"] - 1
        assert s["provider"] == "tcp"


@pytest.mark.rdma
def test_horovod_tape_script_over_verbs(rdma_port, tmp_path):
    """The tape script's in-graph part (BatchNorm, fp16, broadcast inside tf.function) over real
    RDMA: SoftRoCE in the VM under `make test`, where each process imports TensorFlow in ~50 s."""
    run_workers(SCRIPT, 2, "verbs", tmp_path, args=(3, "tape"), timeout=600)
    for rank, rep in enumerate(reports(tmp_path)):
        check_tape(rep, rank)
        assert rep["stats"]["provider"] == "verbs"


def test_single_process_job_without_tf_config(monkeypatch):
    """No launcher: a job of one, every collective the identity (as Horovod without mpirun)."""
    import numpy as np
    import tensorflow as tf

    import tf_plugin as hvd
    monkeypatch.delenv("TF_CONFIG", raising=False)
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
        x = tf.constant([[1.0, 2.0]])
        assert np.array_equal(hvd.allreduce(x, op=hvd.Sum), x) and np.array_equal(hvd.allgather(x), x)
        assert hvd.broadcast_object("o", root_rank=0) == "o"
        v = tf.Variable([3.0])
        hvd.broadcast_variables([v], root_rank=0)
        with tf.GradientTape() as tape:
            y = 2.0 * v
        assert np.array_equal(hvd.DistributedGradientTape(tape).gradient(y, [v])[0], [2.0])
        assert hvd.stats()["control_calls"] == 0
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(Exception, match="not initialized"):
        hvd.rank()


def test_package_import_is_cheap_and_names_resolve():
    """The launcher imports tf_plugin: no TensorFlow then. No submodule is named like an API
    function (importing it would replace the function on the package)."""
    code = ("import os, sys, tf_plugin as hvd; "
            "hvd.init; hvd.rank; hvd.local_size; hvd.broadcast_object; hvd.Average; "
            "assert 'tensorflow' not in sys.modules; here = hvd.__path__[0]; "
            "assert not [n for n in hvd.__all__ if os.path.exists(os.path.join(here, n + '.py'))]; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_local_rank_from_the_launcher_or_from_tf_config(monkeypatch):
    from rdmatensor.runner.cluster import Cluster
    from tf_plugin.horovod.world import local_of
    cluster = Cluster(("a:1", "b:2", "a:3", "a:4"), task_index=2)
    monkeypatch.delenv("RDMATENSOR_LOCAL_RANK", raising=False)
    monkeypatch.delenv("RDMATENSOR_LOCAL_SIZE", raising=False)
    assert local_of(cluster) == (1, 3)               # the workers of TF_CONFIG on host "a"
    monkeypatch.setenv("RDMATENSOR_LOCAL_RANK", "0")
    monkeypatch.setenv("RDMATENSOR_LOCAL_SIZE", "1")
    assert local_of(cluster) == (0, 1)               # what the launcher says wins
    monkeypatch.setenv("RDMATENSOR_LOCAL_RANK", "2")
    with pytest.raises(Exception, match="RDMATENSOR_LOCAL_RANK='2'"):
        local_of(cluster)
