"""Horovod's process sets on 3 ranks (one process per rank, started by
rdmatensor-run): collectives among some ranks only, with exact values, and
Horovod's errors for a rank outside a set or a set never registered. Writes
OUT_DIR/rank{R}.json.

    python process_sets_script.py OUT_DIR
"""
import json
import sys

import numpy as np
import tensorflow as tf

import tf_plugin as hvd

out_dir = sys.argv[1]
even, odd = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1])
duplicate = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[even, odd, duplicate])
rank, size = hvd.rank(), hvd.size()
assert size == 3, size
mine = even if rank in (0, 2) else odd
members = mine.ranks
report = {"rank": rank, "ids": [even.process_set_id, odd.process_set_id, duplicate.process_set_id],
          "sizes": [even.size(), odd.size()], "set_rank": mine.rank(), "included": [even.included(), odd.included()],
          "size_op": int(hvd.size_op(process_set_id=even.process_set_id).numpy()),
          "included_op": int(hvd.process_set_included_op(process_set_id=even.process_set_id).numpy())}


def value(r, shape=(5, 3), dtype=np.int32):
    return (np.arange(np.prod(shape)).reshape(shape) + 100 * r).astype(dtype)


def same(got, want):
    got = np.asarray(got)
    return bool(got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want))


checks = {}
for step in range(3):             # planned on the first, reused after: values of each call, never another's
    x = value(rank + 10 * step)
    checks[f"sum{step}"] = same(hvd.allreduce(tf.constant(x), op=hvd.Sum, process_set=mine),
                                sum(value(r + 10 * step) for r in members).astype(np.int32))
    f = value(rank + step, (4,), np.float32)
    checks[f"average{step}"] = same(hvd.allreduce(tf.constant(f), process_set=mine),
                                    (sum(value(r + step, (4,), np.float32) for r in members)
                                     * np.float32(1.0 / len(members))).astype(np.float32))
    rows = value(rank, (rank + 1, 2))
    checks[f"allgather{step}"] = same(hvd.allgather(tf.constant(rows), process_set=mine),
                                      np.concatenate([value(r, (r + 1, 2)) for r in members]))
    root = members[-1]
    checks[f"broadcast{step}"] = same(hvd.broadcast(tf.constant(x), root, process_set=mine), value(root + 10 * step))
    # the global set in between: its own plan, its own values
    checks[f"global{step}"] = same(hvd.allreduce(tf.constant(x), op=hvd.Sum),
                                   sum(value(r + 10 * step) for r in range(size)).astype(np.int32))

n = len(members)
parts = np.arange(n * 2, dtype=np.int64).reshape(n * 2, 1) + 1000 * rank
got, counts = hvd.alltoall(tf.constant(parts), splits=[2] * n, process_set=mine)
checks["alltoall"] = same(got, np.concatenate([np.arange(mine.rank() * 2, mine.rank() * 2 + 2, dtype=np.int64)
                                               .reshape(2, 1) + 1000 * r for r in members]))
checks["alltoall_counts"] = counts.numpy().tolist() == [2] * n
checks["reducescatter"] = same(hvd.reducescatter(tf.constant(value(rank, (4, 2))), op=hvd.Sum, process_set=mine),
                               sum(value(r, (4, 2)) for r in members).astype(np.int32)[
                                   [slice(0, 2), slice(2, 4)][mine.rank()] if n == 2 else slice(0, 4)])
checks["allgather_object"] = hvd.allgather_object({"r": rank}, process_set=mine) == [{"r": r} for r in members]
checks["broadcast_object"] = hvd.broadcast_object(rank * 7, root_rank=members[0], process_set=mine) == members[0] * 7

w = tf.Variable(float(rank))
with tf.GradientTape() as tape:
    loss = w * w
tape = hvd.DistributedGradientTape(tape, process_set=mine)
(g,) = tape.gradient(loss, [w])
checks["tape"] = float(g.numpy()) == 2.0 * sum(members) / n
other = odd if mine is even else even
with tf.GradientTape() as tape:
    loss = w * w
(g,) = hvd.DistributedGradientTape(tape, process_set=other).gradient(loss, [w])
checks["tape_outside"] = float(g.numpy()) == 2.0 * rank      # as Horovod: a rank outside keeps its gradient


def adasum_reference(a, b):     # test_adasum_tensorflow.py's, for two ranks; one rank's is its own
    dot = np.dot(a, b)
    return (1 - dot / np.dot(a, a) / 2) * a + (1 - dot / np.dot(b, b) / 2) * b


# Adasum within a set (Horovod's takes the global set only): [0, 2] pairs, [1] is its own
grads = {r: np.random.default_rng(7 + r).standard_normal(5) for r in range(size)}
checks["adasum"] = bool(np.allclose(hvd.allreduce(tf.constant(grads[rank]), op=hvd.Adasum, process_set=mine),
                                    adasum_reference(grads[0], grads[2]) if n == 2 else grads[rank]))



def tf1_optimizer():
    """hvd.DistributedOptimizer of a TF1 optimizer in a TF1 graph, over the set: v -= mean of the ranks."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        v = tf.compat.v1.get_variable("v", initializer=[0.0], use_resource=False)

        class Fixed(tf.compat.v1.train.GradientDescentOptimizer):
            def compute_gradients(self, *args, **kwargs):
                return [(tf.constant([float(rank)]), v)]
        opt = hvd.DistributedOptimizer(Fixed(1.0), process_set=mine)
        update = opt.apply_gradients(opt.compute_gradients())
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(update)
        return float(sess.run(v)[0])


checks["tf1_optimizer"] = tf1_optimizer() == -sum(members) / n

errors = {}
try:
    hvd.allreduce(tf.ones(4), process_set=other)
except tf.errors.InvalidArgumentError as exc:
    errors["not_member"] = str(exc)
fake = hvd.ProcessSet([0])
fake.process_set_id = 10
try:
    hvd.allreduce(tf.ones(4), process_set=fake)
except ValueError as exc:
    errors["unregistered"] = str(exc)
try:
    hvd.broadcast(tf.ones(4), 1 if mine is even else 0, process_set=mine)
except tf.errors.InvalidArgumentError as exc:
    errors["root_outside"] = str(exc)

# Added after init (every rank), used, refused twice, removed.
pair = hvd.add_process_set([0, 1])
report["pair_id"] = pair.process_set_id
if rank in (0, 1):
    checks["pair_sum"] = same(hvd.allreduce(tf.constant(value(rank)), op=hvd.Sum, process_set=pair),
                              (value(0) + value(1)).astype(np.int32))
try:
    hvd.add_process_set(hvd.ProcessSet([1, 0]))
except ValueError as exc:
    errors["duplicate"] = str(exc)
report["removed"] = [hvd.remove_process_set(pair), hvd.remove_process_set(pair)]
report["pair_after"] = pair.process_set_id
checks["global_after"] = same(hvd.allreduce(tf.constant(value(rank)), op=hvd.Sum),
                              sum(value(r) for r in range(size)).astype(np.int32))
report["checks"], report["errors"] = checks, errors
with open(f"{out_dir}/rank{rank}.json", "w") as fh:
    json.dump(report, fh)
hvd.shutdown()
