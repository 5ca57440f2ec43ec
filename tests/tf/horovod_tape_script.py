"""A training script written for horovod.tensorflow (tape API): only the import
line differs. Run as every worker of a job; writes what it saw to OUT_DIR.

    python horovod_tape_script.py OUT_DIR [steps] [parts]    # parts: all (default), training or tape
"""
import hashlib
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd           # was: import horovod.tensorflow as hvd
from tests.tf.reference_steps import distributed_and_local

out_dir = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
parts = sys.argv[3] if len(sys.argv) > 3 else "all"
hvd.init()
report = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size()}
GLOBAL_BATCH = 32
rng = np.random.default_rng(0)                     # the same data on every rank; each takes its shard
images = rng.standard_normal((steps * GLOBAL_BATCH, 8)).astype(np.float32)
labels = rng.integers(0, 4, steps * GLOBAL_BATCH).astype(np.int32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def shard(step):
    lo = step * GLOBAL_BATCH + hvd.rank() * GLOBAL_BATCH // hvd.size()
    hi = lo + GLOBAL_BATCH // hvd.size()
    return images[lo:hi], labels[lo:hi]


def digest(variables):
    return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in variables)).hexdigest()


def same_everywhere(variables) -> bool:
    return len(set(hvd.allgather_object(digest(variables)))) == 1


# --- 1. Horovod's example: BatchNorm model without an input shape (no variables before the
# first call), different initial weights per rank, broadcast inside the first step's tf.function,
# fp16 compression.
keras.utils.set_random_seed(100 + hvd.rank())
model = keras.Sequential([keras.layers.Dense(16), keras.layers.BatchNormalization(),
                          keras.layers.Activation("relu"), keras.layers.Dense(4)])
opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)


@tf.function
def training_step(x, y, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


calls = []
for step in range(steps):
    training_step(*shard(step), step == 0)
    if step == 0:
        report["bn_all_same_after_broadcast"] = same_everywhere(model.variables + opt.variables)
        report["bn_moving_stats"] = [v.path for v in model.non_trainable_variables]
        sent = hvd.stats()["bytes_sent"]
    calls.append(hvd.stats()["control_calls"])
report["bn_calls"] = calls
report["bn_bytes_per_step"] = (hvd.stats()["bytes_sent"] - sent) / (steps - 1)
report["bn_trainable_elements"] = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
report["bn_trained_same"] = same_everywhere(model.trainable_variables + opt.variables)


def finish():
    report["stats"] = hvd.stats()
    hvd.shutdown()
    with open(f"{out_dir}/rank{report['rank']}.json", "w") as f:
        json.dump(report, f)


if parts == "tape":
    finish()
    sys.exit(0)


# --- 2. Two workers equal one process on the global batch: the same start on every rank (an eager
# broadcast), each rank trains on its half; a local copy trains on the whole batch.
def mlp(seed):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    return m


model, reference = mlp(7 + hvd.rank()), mlp(7)
hvd.broadcast_variables(model.variables, root_rank=0)
opt, ref_opt = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
dist_step, local_step = distributed_and_local(hvd, model, reference, opt, ref_opt, loss_fn)
dist_step = tf.function(dist_step)



calls, before = [], hvd.stats()
for step in range(steps):
    dist_step(*shard(step))
    local_step(images[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH],
               labels[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
    calls.append(hvd.stats()["control_calls"])
    if step == 0:
        sent = hvd.stats()["bytes_sent"]
after = hvd.stats()
report["mlp_calls"] = calls
report["mlp_bytes_per_step"] = (after["bytes_sent"] - sent) / (steps - 1)
report["mlp_trainable_elements"] = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
report["mlp_max_diff"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                             for a, b in zip(model.trainable_variables, reference.trainable_variables, strict=True))
report["mlp_trained_same"] = same_everywhere(model.trainable_variables)
report["mlp_extensions"] = after["extensions"] - before["extensions"]
report["mlp_native_requests"] = after["native_requests"] - before["native_requests"]


if parts == "training":
    finish()
    sys.exit(0)

# --- 3. The collectives one by one, eager and in a graph.
r, n = hvd.rank(), hvd.size()
x = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
total = n * (n + 1) / 2
report["sum_ok"] = bool(np.allclose(hvd.allreduce(x, op=hvd.Sum, name="x"), [total, 2 * total, 3 * total]))
report["avg_ok"] = bool(np.allclose(hvd.allreduce(x, name="x"), np.array([1, 2, 3]) * total / n))
report["avg_graph_ok"] = bool(np.allclose(tf.function(lambda t: hvd.allreduce(t, average=True, name="x"))(x),
                                          np.array([1, 2, 3]) * total / n))
report["int_sum_ok"] = bool(np.array_equal(hvd.allreduce(tf.constant([r, 10]), op=hvd.Sum, name="i"),
                                           [n * (n - 1) // 2, 10 * n]))
rows = tf.fill((r + 1, 2), float(r))               # rank r has r + 1 rows
gathered = hvd.allgather(rows, name="rows")
want = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
report["allgather_ok"] = bool(np.array_equal(gathered, want))
report["allgather_graph_ok"] = bool(np.array_equal(tf.function(lambda t: hvd.allgather(t, name="rows"))(rows), want))
grows = hvd.stats()["grows"]
bigger = tf.fill((5000 * (r + 1), 2), float(r))      # past the room the first call gave: the slot grows
report["allgather_grown_ok"] = bool(np.array_equal(hvd.allgather(bigger, name="rows")[-1], [n - 1.0] * 2))
report["allgather_grows"] = hvd.stats()["grows"] - grows
report["broadcast_ok"] = bool(np.array_equal(hvd.broadcast(tf.constant([r, r]), root_rank=n - 1), [n - 1, n - 1]))
report["object_ok"] = hvd.broadcast_object({"from": r, "list": [1, 2]}, root_rank=n - 1) == {"from": n - 1,
                                                                                           "list": [1, 2]}
sparse = tf.IndexedSlices(tf.fill((1, 2), float(r + 1)), tf.constant([r]), tf.constant([n, 2]))
dense = tf.convert_to_tensor(hvd.allreduce(sparse, op=hvd.Sum, name="sparse"))
report["sparse_ok"] = bool(np.array_equal(dense, [[k + 1.0, k + 1.0] for k in range(n)]))

# --- 4. A plan that differs between ranks fails on every rank, naming the tensor.
try:
    hvd.allreduce(tf.ones((2 + r,)), name="differs")
    report["mismatch"] = None
except Exception as exc:  # noqa: BLE001 - reported
    report["mismatch"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
report["after_mismatch_ok"] = hvd.allgather_object(r) == list(range(n))
finish()
