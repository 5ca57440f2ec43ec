"""Broken scripts, each rank its own process (rdmatensor-run, 2 ranks), the
Horovod API: what every rank sees when the ranks disagree. Writes
OUT_DIR/rank{R}.json: per case, the error's class, message, tensor and peer
attributes and the seconds it took, and whether the job could go on.

    python hostile_script.py OUT_DIR

Cases, in order: models that differ; a NaN in one rank's gradients, eagerly
and an Inf inside tf.function (run with RDMATENSOR_CHECK_FINITE=1); a tensor whose shape changes on one rank only
(then init() again: the sessions failed); an allreduce on one rank only.
"""
import json
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd

out_dir = sys.argv[1]
TIMEOUT = 3.0
hvd.init(timeout=TIMEOUT)
rank = hvd.rank()
report = {}


def caught(case, fn):
    t0 = time.monotonic()
    try:
        fn()
        report[case] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the point of the case
        report[case] = {"error": type(exc).__name__, "message": str(exc), "tensor": getattr(exc, "tensor", None),
                        "peer": getattr(exc, "peer", None), "seconds": time.monotonic() - t0}


def still_works() -> bool:
    return bool(np.array_equal(hvd.allreduce(tf.constant([1.0, 3.0]), op=hvd.Sum, name="ok"), [2.0, 6.0]))


def combined_gradients(layers, x):
    """One step of a Horovod tape script: the model's gradients on x, combined over the ranks."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), *layers])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)


# 1. The ranks trace different models (rank 1's hidden layer is wider).
def different_models():
    combined_gradients([keras.layers.Dense(8 + rank, name="hidden"), keras.layers.Dense(2, name="out")],
                       tf.ones((4, 6)))


caught("different_models", different_models)
report["different_models"]["after_ok"] = still_works()


# 2. A NaN in rank 1's data, so in its gradients (RDMATENSOR_CHECK_FINITE=1).
def nan_gradients():
    x = np.ones((4, 6), np.float32)
    if rank == 1:
        x[2, 4] = np.nan
    combined_gradients([keras.layers.Dense(3, name="dense")], x)


caught("nan", nan_gradients)
report["nan"]["after_ok"] = still_works()


# 2b. The same inside tf.function (the overlapped all-reduce: one launch and one wait op per bucket).
def nan_in_graph():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, name="dense")])

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    step(np.ones((4, 6), np.float32))                 # traced and planned, all finite
    x = np.ones((4, 6), np.float32)
    if rank == 1:
        x[0, 0] = np.inf
    step(x)


caught("nan_in_graph", nan_in_graph)
report["nan_in_graph"]["after_ok"] = still_works()


# 3. A tensor whose shape changes between steps on rank 1 only.
def shape_changes():
    for step in range(5):
        n = 5 if rank == 1 and step == 3 else 4
        hvd.allreduce(tf.ones(n), name="grad")


caught("shape_change", shape_changes)
hvd.shutdown()                   # the divergence failed this rank's sessions: join again
hvd.init(timeout=TIMEOUT)
report["shape_change"]["after_ok"] = still_works()


# 4. allreduce called on rank 0 only; rank 1 does something else for longer than the timeout.
def one_rank_only():
    if rank == 0:
        hvd.allreduce(tf.ones(3), name="lonely")
    else:
        time.sleep(TIMEOUT + 1)


caught("one_rank_only", one_rank_only)
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(report, f)
