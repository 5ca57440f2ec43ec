"""The analyzer's plan lists exactly the tensors that cross processes."""
import json

import numpy as np
import pytest

from rdmatensor.runner.cluster import Cluster


@pytest.fixture(scope="module")
def mlp():
    from tf_plugin.training import models
    return models.build("mlp")


def _shapes(model):
    return [tuple(v.shape) for v in model.trainable_variables]


def test_ps_plan_lists_exactly_the_variables_shapes(mlp):
    from tf_plugin.graph.analyzer import analyze
    a = analyze(mlp, "ps", workers=2, ps=1)
    specs = list(a.plan.specs.values())
    for w in range(2):
        grads = [s for s in specs if s.name.startswith(f"grad/w{w}/")]
        params = [s for s in specs if s.name.startswith(f"param/w{w}/")]
        assert [s.shape for s in grads] == _shapes(mlp) == [s.shape for s in params]
        assert all(s.src == w and s.dst == 2 and s.is_static for s in grads)
        assert all(s.src == 2 and s.dst == w for s in params)
    assert len(specs) == 2 * 2 * len(mlp.trainable_variables)
    assert a.static_bytes_per_step() == 4 * 4 * sum(int(np.prod(s)) for s in _shapes(mlp))


def test_ps_shards_variables_round_robin(mlp):
    from tf_plugin.graph.analyzer import analyze
    a = analyze(mlp, "ps", workers=2, ps=2)
    servers = [a.plan.specs[f"grad/w0/{v.key}"].dst for v in a.variables]
    assert servers == [2, 3, 2, 3]


def test_allreduce_chunks_partition_every_gradient(mlp):
    from tf_plugin.graph.analyzer import analyze
    from tf_plugin.executor.schedule import ring_name
    n = 3
    a = analyze(mlp, "allreduce", workers=n, fusion=False)
    for v, shape in zip(a.variables, _shapes(mlp), strict=False):
        assert v.shape == shape and not v.sparse
        for phase in ("rs", "ag"):
            for step in range(n - 1):
                chunks = [a.plan.specs[ring_name(v.key, phase, step, r)] for r in range(n)]
                assert sum(c.shape[0] for c in chunks) == np.prod(shape)
                assert [(c.src, c.dst) for c in chunks] == [(0, 1), (1, 2), (2, 0)]
        assert a.plan.specs[f"bcast/{v.key}/r1"].shape == shape
    # per step: 2(N-1) chunks per rank and variable; the broadcast goes once
    per_step = [s for s in a.plan.specs.values() if s.name not in a.once]
    assert len(per_step) == 2 * (n - 1) * n * 4
    assert a.static_bytes_per_step() == 2 * (n - 1) * 4 * sum(int(np.prod(s)) for s in _shapes(mlp))


def test_fused_allreduce_is_one_ring_over_aligned_members(mlp):
    from tf_plugin.graph.analyzer import analyze
    from tf_plugin.executor.schedule import ring_name
    a = analyze(mlp, "allreduce", workers=2)
    (bucket,) = a.buckets                                                     # under the fusion threshold
    sizes = [int(np.prod(s)) for s in _shapes(mlp)]
    # last layer first: the order backprop produces the gradients in
    assert [(m[0], m[2]) for m in bucket.members] == [(v.key, n) for v, n in zip(a.variables, sizes,
                                                                                 strict=False)][::-1]
    assert all(offset * 4 % 64 == 0 for _, offset, _ in bucket.members)      # TF-aligned views
    assert bucket.size >= sum(sizes) and bucket.size - sum(sizes) < 16 * len(sizes)
    chunks = [a.plan.specs[ring_name(bucket.key, p, 0, r)] for p in ("rs", "ag") for r in range(2)]
    assert len([s for s in a.plan.specs.values() if s.name not in a.once]) == 4
    assert sum(c.shape[0] for c in chunks) == 2 * bucket.size


def test_tf_function_with_input_signature():
    import tensorflow as tf
    from tf_plugin.graph.analyzer import analyze
    w = tf.Variable(tf.zeros((5, 3)), name="w")
    b = tf.Variable(tf.zeros((3,)), name="b")

    @tf.function(input_signature=[tf.TensorSpec((None, 5), tf.float32)])
    def f(x):
        return tf.matmul(x, w) + b

    a = analyze(f, "ps", workers=1, ps=1)
    assert {s.name: s.shape for s in a.plan.specs.values()} == {
        "grad/w0/w": (5, 3), "param/w0/w": (5, 3), "grad/w0/b": (3,), "param/w0/b": (3,)}


def test_sparse_gradient_is_dynamic_and_bounded():
    from tf_plugin.training import models
    from tf_plugin.graph.analyzer import analyze
    a = analyze(models.build("embed"), "ps", workers=2, ps=1)
    values = a.plan.specs["grad/w0/embed/embedding/embeddings/values"]
    indices = a.plan.specs["grad/w0/embed/embedding/embeddings/indices"]
    assert values.shape == (None, 16) and indices.shape == (None,)
    assert values.capacity == models.VOCAB * 16 * 4         # never more rows than the table has
    assert a.plan.specs["param/w0/embed/embedding/embeddings"].shape == (models.VOCAB, 16)
    with pytest.raises(Exception, match="dense"):
        analyze(models.build("embed"), "allreduce", workers=2, sparse="dedupe")


def test_explain_table_and_cli(mlp, capsys):
    from tf_plugin.graph.analyzer import analyze
    from tf_plugin.training.explain import main
    a = analyze(mlp, "ps", workers=2, ps=1)
    text = a.explain()
    for spec in a.plan.specs.values():
        assert spec.name in text
    assert "0->2" in text and "slots" in text and "arenas" in text
    assert f"total static bytes per step: {a.static_bytes_per_step()}" in text
    assert main(["--model", "cnn", "--mode", "allreduce", "--workers", "2", "--no-fusion"]) == 0
    out = capsys.readouterr().out
    assert "ring/cnn/conv/kernel/rs0/r0" in out and "optimizer state" in out


def test_cluster_from_tf_config():
    cfg = {"cluster": {"chief": ["a:1"], "worker": ["b:2", "c:3"], "ps": ["d:4"]},
           "task": {"type": "worker", "index": 1}}
    c = Cluster.from_tf_config(json.dumps(cfg))
    assert c.workers == ("a:1", "b:2", "c:3") and c.ps == ("d:4",)
    assert c.rank == 2 and c.is_worker
    ps = Cluster.from_tf_config(json.dumps({**cfg, "task": {"type": "ps", "index": 0}}))
    assert ps.rank == 3 and ps.peers() == {0: "a:1", 1: "b:2", 2: "c:3", 3: "d:4"}
    assert Cluster.from_tf_config(ps.to_tf_config()) == ps
    assert [t.rank for t in Cluster.local(2, 1).tasks()] == [0, 1, 2]
    with pytest.raises(ValueError):
        Cluster.from_tf_config(json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker",
                                                                                  "index": 3}}))


def test_buckets_follow_backprop_and_the_fusion_threshold(monkeypatch):
    from rdmatensor import PlanError
    from tf_plugin.core.layout import VarInfo, buckets_of, fusion_threshold
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    infos = [VarInfo("conv1", (1000,), f32, False, {}), VarInfo("big", (5000,), f32, False, {}),
             VarInfo("half", (100,), f16, False, {}), VarInfo("a", (500,), f32, False, {}),
             VarInfo("b", (10,), f32, False, {}), VarInfo("logits", (600,), f32, False, {})]
    buckets = buckets_of(infos, fusion=True, threshold=4096)
    # last layer first; a bucket is closed once it holds 4096 bytes (small gradients ride with the next
    # one); dtypes never mixed; a bucket comes before every bucket whose last gradient comes later
    assert [[m[0] for m in b.members] for b in buckets] == [["logits", "b", "a"], ["half"], ["big"], ["conv1"]]
    assert [b.dtype for b in buckets] == [f32, f16, f32, f32]
    first = buckets[0]
    assert [(m[1], m[2]) for m in first.members] == [(0, 600), (608, 10), (624, 500)] and first.size == 1124
    for b in buckets[:3:2]:                        # closed: over the threshold by less than the last member
        assert 0 <= (b.size - b.members[-1][2]) * 4 < 4096 <= b.size * 4
    # threshold 0 (or no fusion): one gradient per bucket, still last layer first
    assert [b.members[0][0] for b in buckets_of(infos, fusion=True, threshold=0)] == \
        [v.key for v in reversed(infos)]
    assert [b.key for b in buckets_of(infos, fusion=False)] == [v.key for v in reversed(infos)]
    # Horovod's knob, under our name
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", "12")
    assert fusion_threshold() == 12 and fusion_threshold(7) == 7
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", "4MB")
    with pytest.raises(PlanError, match="RDMATENSOR_FUSION_THRESHOLD='4MB'"):
        fusion_threshold()


def test_the_last_gradients_backprop_makes_start_a_small_bucket_of_their_own():
    """The tail: the gradients made last (the first variables), up to threshold / 8 bytes,
    close what is filling and start buckets of their own; none when the last gradient
    alone exceeds that; everything in one when all of it fits."""
    from tf_plugin.core.layout import TAIL_SHARE, VarInfo, buckets_of
    f32 = np.dtype(np.float32)

    def members(sizes, threshold=8192):
        infos = [VarInfo(f"v{i}", (n,), f32, False, {}) for i, n in enumerate(sizes)]
        return [[m[0] for m in b.members] for b in buckets_of(infos, fusion=True, threshold=threshold)]
    assert TAIL_SHARE == 8                      # 1024 bytes of 8192: 256 floats
    # v0..v2 (100 + 100 + 50 floats) fit in the tail, v3 (300) does not: without the tail the
    # 8200 bytes would be one bucket, closed by v0
    assert members([100, 100, 50, 300, 1500]) == [["v4", "v3"], ["v2", "v1", "v0"]]
    assert members([100, 100, 50, 300, 1000, 1000]) == [["v5", "v4", "v3"], ["v2", "v1", "v0"]]
    assert members([300, 1500]) == [["v1", "v0"]]                 # v0 alone exceeds the tail: none
    assert members([100, 100, 50]) == [["v2", "v1", "v0"]]                     # all of it is the tail
    assert members([100, 100, 50, 300], threshold=0) == [["v3"], ["v2"], ["v1"], ["v0"]]
