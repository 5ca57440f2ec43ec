"""Gradients all-reduced while backprop runs: a small CNN whose backward pass ends with
BACKWARD_TAIL seconds of waiting (a weightless layer between the first two convolutions,
whose gradient sleeps: the first conv layer's gradients, the last bucket, come after it),
trained with DistributedGradientTape inside tf.function, then
eagerly, then by Keras' fit with DistributedOptimizer. Run as every worker of a job (RDMATENSOR_FUSION_THRESHOLD and
RDMATENSOR_TIMELINE from the environment); writes what it saw to OUT_DIR.

    python overlap_script.py OUT_DIR [steps]
"""
import hashlib
import json
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd
import tf_plugin.keras as hvd_keras
from tests.tf.reference_steps import distributed_and_local

out_dir = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
EAGER_STEPS, FIT_STEPS = 2, 4
# Two inter-op threads: with one (TensorFlow's default for a rank bound to one core), the executor
# runs, in some processes and then every step, each weight gradient after the whole input-gradient
# chain, so every bucket is handed over at the end of backprop and there is nothing to overlap.
tf.config.threading.set_inter_op_parallelism_threads(2)
hvd.init()
GLOBAL_BATCH = 64
rng = np.random.default_rng(0)                 # the same data on every rank; each takes its shard
total = steps + EAGER_STEPS
images = rng.standard_normal((total * GLOBAL_BATCH, 32, 32, 3)).astype(np.float32)
labels = rng.integers(0, 10, total * GLOBAL_BATCH).astype(np.int32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch(step, shard=True):
    lo = step * GLOBAL_BATCH
    if not shard:
        return images[lo:lo + GLOBAL_BATCH], labels[lo:lo + GLOBAL_BATCH]
    lo += hvd.rank() * GLOBAL_BATCH // hvd.size()
    return images[lo:lo + GLOBAL_BATCH // hvd.size()], labels[lo:lo + GLOBAL_BATCH // hvd.size()]


class SlowBackward(keras.layers.Layer):
    """The identity, whose gradient takes BACKWARD_TAIL seconds: backprop's tail is then long
    whatever TensorFlow's executor does with this small model's ops on a busy machine."""

    def call(self, x):
        @tf.custom_gradient
        def identity(x):
            def grad(dy):
                return tf.numpy_function(lambda d: time.sleep(BACKWARD_TAIL) or d, [dy], dy.dtype, stateful=False)
            return tf.identity(x), grad
        return identity(x)


BACKWARD_TAIL = 0.05


def cnn(seed, slow=False):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((32, 32, 3)),
                             keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                             *([SlowBackward()] if slow else []),
                             keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                             keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                             keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])


def digest(variables):
    return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in variables)).hexdigest()


model, reference = cnn(3 + hvd.rank(), slow=True), cnn(3)      # different starts, fixed by the broadcast
hvd.broadcast_variables(model.variables, root_rank=0)
opt, ref_opt = keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.05)
dist_step, local_step = distributed_and_local(hvd, model, reference, opt, ref_opt, loss_fn)
graph_step = tf.function(dist_step)
calls, buffers = [], []
for step in range(total):
    (graph_step if step < steps else dist_step)(*batch(step))      # the last steps run eagerly
    local_step(*batch(step, shard=False))
    calls.append(hvd.stats()["control_calls"])
    buffers.append(hvd.stats()["output_buffers"])
report = {
    "rank": hvd.rank(), "calls": calls, "buffers": buffers,
    "max_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(model.trainable_variables, reference.trainable_variables, strict=True)),
    "same": len(set(hvd.allgather_object(digest(model.trainable_variables)))) == 1,
}

# Keras fit with DistributedOptimizer: the same gradients, so the same tensor set (no new plan)
model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=loss_fn)
x, y = zip(*(batch(step) for step in range(FIT_STEPS)), strict=True)
model.fit(np.concatenate(x), np.concatenate(y), batch_size=GLOBAL_BATCH // hvd.size(), epochs=1, shuffle=False,
          verbose=0)
report["fit_same"] = len(set(hvd.allgather_object(digest(model.trainable_variables)))) == 1


@tf.function
def twice(x, y):
    """Two all-reduces of one tensor set in one graph: each its own round, never mixed."""
    with tf.GradientTape(persistent=True) as tape:
        loss_value = loss_fn(y, model(x))
        doubled = 2.0 * loss_value
    once = hvd.DistributedGradientTape(tape).gradient(loss_value, model.trainable_variables)
    again = hvd.DistributedGradientTape(tape).gradient(doubled, model.trainable_variables)
    return once, again


once, again = twice(*batch(0))
report["twice_exact"] = all(np.array_equal(2 * np.asarray(a), np.asarray(b)) for a, b in zip(once, again,
                                                                                              strict=True))
report["stats"] = hvd.stats()
hvd.shutdown()                                   # ends the time line's JSON array
with open(f"{out_dir}/rank{report['rank']}.json", "w") as f:
    json.dump(report, f)
