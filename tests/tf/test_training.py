"""Distributed training over tcp equals single-process training on the same data and seed."""
import json
import subprocess
import sys

import pytest

from .conftest import STEPS


def test_ps_two_workers_one_ps_processes_match_single_process(tmp_path, close_to_reference):
    """The launcher: one process per rank, TF_CONFIG each, results in JSON."""
    out = tmp_path / "ps.json"
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--mode", "ps", "--workers", "2",
                           "--ps", "1", "--provider", "tcp", "--model", "mlp", "--steps", str(STEPS),
                           "--json", str(out), "--seed", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("steps/s", "bytes moved/step", "copies/step", "communication", "final loss"):
        assert line in proc.stdout
    job = json.loads(out.read_text())["jobs"][0]
    s = job["summary"]
    assert s["provider_used"] == "tcp" and (s["workers"], s["ps"]) == (2, 1)
    assert len(job["ranks"]) == 3 and {r["role"] for r in job["ranks"]} == {"worker", "ps"}
    close_to_reference("mlp", s["losses"])
    # 4 variables: each worker pushes 4 gradients, the ps pushes 4 variables to each worker
    assert s["writes_per_step"] == 16
    assert s["bytes_per_step"] == 2 * 2 * (784 * 64 + 64 + 64 * 10 + 10) * 4
    assert s["copies_per_step"] == 0                   # tcp writes from TensorFlow's buffers
    assert s["zero_copy_ingest_per_step"] == 16        # every received tensor reaches TF uncopied


def test_allreduce_two_workers_match_single_process(close_to_reference):
    from tf_plugin.training import runner
    from tf_plugin.training.job import JobConfig, summarize
    config = JobConfig(mode="allreduce", model="mlp", provider="tcp", steps=STEPS)
    results = runner.run_threads(config)
    s = summarize(config, results)
    close_to_reference("mlp", s.losses)
    assert results[0].losses != results[1].losses      # own shards
    assert s.writes_per_step == 2 * 2                  # 2 ranks x (1 rs + 1 ag) chunk of the fused bucket
    assert s.copies_per_step == 0                      # the fused bucket leaves from TF's buffers (gather write)
    unfused = JobConfig(mode="allreduce", model="mlp", provider="tcp", steps=3, fusion=False)
    s = summarize(unfused, runner.run_threads(unfused))
    close_to_reference("mlp", s.losses, 3)
    assert s.writes_per_step == 2 * 4 * 2              # per variable
    assert s.copies_per_step == 0                      # tcp writes from TF's buffers


def test_dynamic_sparse_gradients_train_with_fallback_counted(close_to_reference):
    """The embedding's gradient crosses as deduplicated rows: a dynamic first dimension."""
    from tf_plugin.training import runner
    from tf_plugin.training.job import JobConfig, summarize
    steps = 10
    config = JobConfig(mode="ps", model="embed", provider="tcp", steps=steps, ps=1)
    results = runner.run_threads(config)
    close_to_reference("embed", summarize(config, results).losses, steps)
    for r in results[:2]:                              # each worker: values + indices every step
        assert r.dynamic == 2 * steps
        assert r.fallbacks == 2 * steps
    assert results[2].dynamic == 0                     # the ps sends dense variables


def test_horovod_like_tape_inside_tf_function(close_to_reference):
    """RingGradientTape + broadcast, the ring running inside tf.function."""
    import numpy as np
    import tensorflow as tf
    from rdmatensor import connect
    from tf_plugin.training import models
    from tf_plugin.executor.ring import RingAllReduce
    from tf_plugin.graph.ring_tape import RingGradientTape, broadcast
    from tf_plugin.graph.analyzer import analyze
    from rdmatensor.runner.cluster import Cluster

    steps, cluster = 5, Cluster.local(2)
    results = {}

    def rank(task):
        try:
            model = models.build("mlp", seed=task.rank)   # different on purpose: broadcast fixes it
            analysis = analyze(model, "allreduce", workers=2)
            with connect(task.rank, task.peers(), analysis.plan, provider="tcp", token="t") as s:
                ring = RingAllReduce(s, analysis)
                broadcast(ring, model.variables)
                opt, data = models.optimizer(), models.dataset("mlp")

                @tf.function
                def train_step(x, y):
                    with tf.GradientTape() as tape:
                        loss = models.loss_fn(y, model(x))
                    tape = RingGradientTape(tape, ring)
                    grads = tape.gradient(loss, model.trainable_variables)
                    opt.apply_gradients(zip(grads, model.trainable_variables, strict=False))
                    return loss
                results[task.rank] = [float(train_step(*models.batch(data, k, 64, task.rank, 2)))
                                      for k in range(steps)]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            import traceback
            exc.trace = traceback.format_exc()
            results[task.rank] = exc

    import threading
    threads = [threading.Thread(target=rank, args=(t,)) for t in cluster.tasks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r, res in results.items():
        assert not isinstance(res, BaseException), f"rank {r}:\n{res.trace}"
    close_to_reference("mlp", np.mean([results[0], results[1]], axis=0), steps)


@pytest.mark.parametrize("mode", ["allreduce"])
def test_tensorflow_own_strategy_trains_the_same_model(tmp_path, mode, close_to_reference):
    """The tf-grpc baseline (MultiWorkerMirroredStrategy) learns exactly what the plugin does,
    and the launcher reports the two as a ratio."""
    out = tmp_path / "cmp.json"
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--mode", mode, "--workers", "2",
                           "--provider", "tcp,tf-grpc", "--model", "mlp", "--steps", str(STEPS),
                           "--threads", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["comparison"]["baseline"] == "tf-grpc"
    assert doc["comparison"]["ratios"]["tcp"] > 0
    for job in doc["jobs"]:
        close_to_reference("mlp", job["summary"]["losses"])
