"""send/recv ops inside tf.function: a model split in two stages computes what the whole does."""
import numpy as np
import pytest

from .conftest import run_ranks


@pytest.fixture(scope="module")
def split():
    """The mlp and its two stages: rank 0 runs the hidden layer, rank 1 the logits."""
    import tensorflow as tf
    from tf_plugin.training import models
    from tf_plugin.graph import ops
    model = models.build("mlp")
    hidden, logits = model.get_layer("hidden"), model.get_layer("logits")

    def stages(batch):
        @tf.function
        def stage0(x):
            ops.send(hidden(x), "act", dst=1)

        @tf.function
        def stage1():
            return logits(ops.recv("act", src=0, dtype=tf.float32, shape=(batch, 64)))
        return {0: (stage0, [tf.TensorSpec((batch, 784), tf.float32)]), 1: (stage1, [])}
    return model, stages


def _run(model, stages, plan, provider, batches):
    def body(s):
        fn = stages[s.rank][0]
        if s.rank == 0:
            for x in batches:
                fn(x)
            return s.stats()
        return [fn().numpy() for _ in batches], s.stats()
    res = run_ranks(plan, provider, body)
    for x, got in zip(batches, res[1][0], strict=False):
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-6)
    return res


def test_two_stage_pipeline_equals_unsplit_model(split):
    from tf_plugin.graph import ingest
    from tf_plugin.graph.analyzer import analyze_pipeline
    model, make = split
    stages = make(32)
    a = analyze_pipeline(stages)
    assert [(s.name, s.shape, s.src, s.dst) for s in a.plan.specs.values()] == [("act", (32, 64), 0, 1)]
    before = ingest.counts()
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((32, 784)).astype(np.float32) for _ in range(4)]
    res = _run(model, stages, a.plan, "tcp", batches)
    after = ingest.counts()
    # each received activation reached TensorFlow with no copy, and its slot came back
    # (else the next send would have waited forever)
    assert after["zero_copy"] - before["zero_copy"] == 4 and after["copied"] == before["copied"]
    assert res[0]["writes"] == 4 and res[0]["copies"] == 0 and res[0]["dynamic"] == 0


def test_dynamic_batch_pipeline_uses_the_fallback(split):
    model, make = split
    from tf_plugin.graph.analyzer import analyze_pipeline
    stages = make(None)
    a = analyze_pipeline(stages)
    assert a.plan.specs["act"].shape == (None, 64) and not a.plan.specs["act"].is_static
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((n, 784)).astype(np.float32) for n in (8, 100, 3)]
    res = _run(model, stages, a.plan, "tcp", batches)
    assert res[0]["dynamic"] == 3 and res[0]["fallbacks"] == 3
    assert res[0]["grows"] >= 1                     # 100 x 64 floats outgrow the first 4 KiB


def test_received_tensor_aliases_the_slot_until_tensorflow_frees_it():
    """The release rule: zero-copy while TensorFlow holds the tensor, slot back when it frees it."""
    import gc
    from rdmatensor import Plan, TensorSpec
    from tf_plugin.graph import ingest
    plan = Plan([TensorSpec("t", (16, 16), np.float32, 0, 1)])
    data = np.arange(256, dtype=np.float32).reshape(16, 16)

    def body(s):
        if s.rank == 0:
            s.send("t", data)
            s.send("t", data + 1)                   # waits for the credit: rank 1 must release
            return None
        received = s.recv("t")
        address = received.array.ctypes.data
        t = ingest.to_tensor(received)
        assert np.from_dlpack(t).ctypes.data == address and not received.released
        doubled = (t * 2).numpy()
        del t
        gc.collect()
        assert received.released                    # TensorFlow freed it: the slot went back
        copied = ingest.to_tensor(s.recv("t"), copy=True)
        return doubled, copied.numpy()

    doubled, copied = run_ranks(plan, "tcp", body)[1]
    np.testing.assert_array_equal(doubled, data * 2)
    np.testing.assert_array_equal(copied, data + 1)
