"""Both training modes and a pipeline split over real RDMA (SoftRoCE in the VM under
`make test`). Ranks are threads of the pytest process: TensorFlow is imported once
(~45 s in the VM), and every tensor still goes through a queue pair."""
import numpy as np
import pytest

pytestmark = pytest.mark.rdma
STEPS = 8        # every instruction is emulated in the VM: a few steps show the same agreement


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_training_over_verbs_matches_single_process(rdma_port, mode, close_to_reference):
    from tf_plugin.training import runner
    from tf_plugin.training.job import JobConfig, summarize
    config = JobConfig(mode=mode, model="mlp", provider="verbs", steps=STEPS, ps=1 if mode == "ps" else 0)
    s = summarize(config, runner.run_threads(config))
    assert s.provider_used == "verbs"
    close_to_reference("mlp", s.losses, steps=STEPS)
    # ps: 4 gradients from each worker, 4 variables to each; allreduce: the fused bucket's
    # reduce-scatter and all-gather chunk from each rank
    assert s.writes_per_step == (16 if mode == "ps" else 4)
    if mode == "allreduce":    # per rank: the fused bucket's members once into staging (a gather); its output's
        assert s.copies_per_step == 2 * 1      # chunk leaves from the output itself (registered): no copy
        # both of TensorFlow's memory: a chunk over several gradients (gather), or inside one (array)
        assert set(s.copies_by_purpose) <= {"gather", "array"} and sum(s.copies_by_purpose.values()) == 2.0
        assert s.bytes_copied_per_step > 0


def test_pipeline_over_verbs(rdma_port):
    import tensorflow as tf
    from tf_plugin.training import models
    from tf_plugin.graph import ops
    from tf_plugin.graph.analyzer import analyze_pipeline
    from .conftest import run_ranks
    model = models.build("mlp")
    hidden, logits = model.get_layer("hidden"), model.get_layer("logits")

    @tf.function
    def stage0(x):
        ops.send(hidden(x), "act", dst=1)

    @tf.function
    def stage1():
        return logits(ops.recv("act", src=0, dtype=tf.float32, shape=(None, 64)))

    plan = analyze_pipeline({0: (stage0, [tf.TensorSpec((None, 784), tf.float32)]), 1: (stage1, [])}).plan
    batches = [np.random.default_rng(n).standard_normal((n, 784)).astype(np.float32) for n in (16, 64)]

    def body(s):
        if s.rank == 0:
            for x in batches:
                stage0(x)
            return None
        return [stage1().numpy() for _ in batches]

    for x, got in zip(batches, run_ranks(plan, "verbs", body)[1], strict=False):
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-6)
