"""Clusters from what a cluster manager sets: Slurm's step variables (agreeing with
TensorFlow's own SlurmClusterResolver) and Kubeflow's TF_CONFIG with a chief."""
import json
import subprocess
import sys

import pytest

from rdmatensor.runner.cluster import Cluster, expand_hostlist, expand_tasks_per_node


def slurm(procid, nodes="node[01-02]", tasks="2(x2)"):
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": tasks,
            "SLURM_STEP_NUM_TASKS": str(sum(expand_tasks_per_node(tasks)))}


def test_slurm_hostlists_and_tasks_per_node_expand():
    assert expand_hostlist("node[01-03,7],gpu1") == ["node01", "node02", "node03", "node7", "gpu1"]
    assert expand_hostlist("a1,b[9-10]") == ["a1", "b9", "b10"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    for bad in ("node[01-", "node]1[", ""):
        with pytest.raises(ValueError, match="malformed"):
            expand_hostlist(bad)
    with pytest.raises(ValueError, match="malformed Slurm tasks-per-node"):
        expand_tasks_per_node("2(x)")


def test_slurm_step_gives_every_task_its_rank_and_address():
    views = [Cluster.from_slurm(ps=1, env=slurm(p)) for p in range(4)]
    assert {v.workers for v in views} == {("node01:8889", "node02:8888", "node02:8889")}
    assert {v.ps for v in views} == {("node01:8888",)}
    assert [(v.task_type, v.task_index, v.rank) for v in views] == [
        ("ps", 0, 3), ("worker", 0, 0), ("worker", 1, 1), ("worker", 2, 2)]
    outside_step = {"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert Cluster.from_slurm(env=outside_step, port_base=9000).workers == ("n1:9000", "n2:9000")
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST is not set"):
        Cluster.from_slurm(env={"SLURM_PROCID": "0"})
    with pytest.raises(ValueError, match="SLURM_PROCID 4 is not one of the step's 4 tasks"):
        Cluster.from_slurm(env=slurm(4))
    with pytest.raises(ValueError, match="2 node\\(s\\) but tasks for 1"):
        Cluster.from_slurm(env=slurm(0, tasks="4"))


def test_slurm_cluster_agrees_with_tensorflows_resolver(monkeypatch):
    import tensorflow as tf
    SlurmClusterResolver = tf.distribute.cluster_resolver.SlurmClusterResolver
    for proc in range(4):
        for key, value in slurm(proc, "node[01-02]", "2,2").items():
            monkeypatch.setenv(key, value)
        # no GPUs here: one per task, never assigned, keeps the resolver away from nvidia-smi
        resolver = SlurmClusterResolver(jobs={"worker": 3, "ps": 1}, gpus_per_node=2, gpus_per_task=1,
                                  auto_set_gpu=False)
        spec = resolver.cluster_spec().as_dict()
        ours = Cluster.from_slurm(ps=1)
        assert (list(ours.workers), list(ours.ps)) == (spec["worker"], spec["ps"])
        assert (ours.task_type, ours.task_index) == resolver.get_task_info()


def test_tf_config_from_slurm_on_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "rdmatensor.runner.cluster", "--slurm"], capture_output=True,
                          text=True,
                          env={**slurm(3), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"cluster": {"worker": ["node01:8888", "node01:8889", "node02:8888",
                                                              "node02:8889"]},
                                       "task": {"type": "worker", "index": 3}}


def test_kubeflow_tf_config_with_a_chief():
    """TFJob names worker 0 `chief` when the job has a Chief replica."""
    text = json.dumps({"cluster": {"chief": ["job-chief-0:2222"], "worker": ["job-worker-0:2222"]},
                       "task": {"type": "worker", "index": 0}})
    c = Cluster.from_tf_config(text)
    assert c.workers == ("job-chief-0:2222", "job-worker-0:2222") and c.rank == 1
