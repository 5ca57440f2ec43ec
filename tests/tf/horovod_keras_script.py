"""A Keras training script written for horovod.tensorflow.keras: only the import line
differs. Run as every worker of a job; writes what it saw to OUT_DIR.

    python horovod_keras_script.py OUT_DIR
"""
import hashlib
import json
import os
import sys

import keras
import numpy as np

import tf_plugin.keras as hvd     # was: import horovod.tensorflow.keras as hvd

out_dir = sys.argv[1]
hvd.init()
EPOCHS, BATCH, WARMUP = 3, 16, 2
rng = np.random.default_rng(0)
x = rng.standard_normal((4 * BATCH * hvd.size(), 8)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)
x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]      # this rank's shard


def digest(variables):
    return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in variables)).hexdigest()


def same_everywhere(variables) -> bool:
    return len(set(hvd.allgather_object(digest(variables)))) == 1


def build(seed, **opt_args):
    keras.utils.set_random_seed(seed)              # differs per rank: the broadcast callback fixes it
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dense(4)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9), **opt_args)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt,
                  metrics=["accuracy"])
    return model


class Record(keras.callbacks.Callback):
    """What fit did, seen from a callback: local metrics (placed before the averaging),
    learning rates (after the warmup), control calls per batch."""

    def __init__(self):
        super().__init__()
        self.local, self.lrs, self.calls = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(hvd.stats()["control_calls"])

    def on_epoch_end(self, epoch, logs=None):
        self.local.append(float(logs["loss"]))


model = build(hvd.rank())
generations = hvd.stats()["generations"]
hvd.init(model)                                      # plan its gradients and variables ahead, in one exchange
report = {"planned_ahead_generations": hvd.stats()["generations"] - generations}
extensions = hvd.stats()["extensions"]
local, seen = Record(), Record()
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), local, hvd.callbacks.MetricAverageCallback(),
             hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05 * hvd.size(), warmup_epochs=WARMUP, verbose=1),
             seen]
if hvd.rank() == 0:                                  # checkpoints on rank 0 only
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "ckpt.weights.h5"),
                                                     save_weights_only=True))
history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=0, shuffle=False)
report.update({"rank": hvd.rank(), "size": hvd.size(), "history": history.history["loss"],
               "fit_extensions": hvd.stats()["extensions"] - extensions,
               "local_losses": local.local, "all_local_losses": hvd.allgather_object(local.local),
               "lrs": seen.lrs, "steps_per_epoch": len(seen.lrs) // EPOCHS, "calls": seen.calls,
               "trained_same": same_everywhere(model.trainable_variables + model.optimizer.variables),
               "iterations": int(model.optimizer.iterations)})
if hvd.rank() == 0:
    restored = build(123)
    restored.load_weights(os.path.join(out_dir, "ckpt.weights.h5"))
    report["checkpoint_matches"] = all(np.array_equal(a, b) for a, b in zip(restored.get_weights(),
                                                                           model.get_weights(), strict=True))

# backward_passes_per_step: gradients summed locally over 2 batches, one collective per update
model = build(hvd.rank(), backward_passes_per_step=2, average_aggregated_gradients=True)
before = hvd.stats()["extensions"]
model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
          verbose=0, shuffle=False)
report["aggregated_iterations"] = int(model.optimizer.iterations)
report["aggregated_same"] = same_everywhere(model.trainable_variables)
report["aggregated_extensions"] = hvd.stats()["extensions"] - before
report["stats"] = hvd.stats()
hvd.shutdown()
with open(f"{out_dir}/rank{report['rank']}.json", "w") as f:
    json.dump(report, f)
