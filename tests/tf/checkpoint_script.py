"""Keras fit with checkpoints on rank 0 and resume, written the way a Horovod
user writes it (horovod's keras examples), only the import changed:

    python checkpoint_script.py OUT_DIR [KILL_STEP]

Trains EPOCHS epochs; rank 0 saves OUT_DIR/ckpt-{epoch}.keras at every
epoch's end. Started again, it resumes from rank 0's last checkpoint. With
KILL_STEP, rank 1 SIGKILLs itself at that global step (the job fails; rank 0
prints `failed SECONDS TYPE: MESSAGE`, SECONDS since the kill). At the end
rank 0 writes its model's and optimizer's variables to OUT_DIR/final.npz.

What makes the resumed job end bit for bit where the uninterrupted one ends:
every rank seeds the same way, TensorFlow's ops are deterministic, and the
order of every epoch's samples is a function of (seed, epoch), not of a
generator's state that a restart would reset.
"""
import glob
import os
import signal
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tf_plugin.keras as hvd              # was: import horovod.tensorflow.keras as hvd

out_dir = Path(sys.argv[1])
kill_step = int(sys.argv[2]) if len(sys.argv) > 2 else -1
EPOCHS, STEPS, GLOBAL_BATCH, SEED = 4, 6, 16, 42

hvd.init()
keras.utils.set_random_seed(SEED)
tf.config.experimental.enable_op_determinism()

rng = np.random.default_rng(SEED)
x = rng.standard_normal((STEPS * GLOBAL_BATCH, 12)).astype(np.float32)
y = (x[:, :3].sum(axis=1) > 0).astype(np.int32) + 2 * (x[:, 3] > 0)


def epochs_from(first_epoch: int) -> tf.data.Dataset:
    """This rank's batches from `first_epoch` on: each epoch a permutation drawn
    from (SEED, epoch), cut into global batches, this rank taking its share."""
    order = np.concatenate([np.random.default_rng([SEED, e]).permutation(len(x)) for e in range(first_epoch, EPOCHS)])
    per_rank = GLOBAL_BATCH // hvd.size()
    batches = order.reshape(-1, GLOBAL_BATCH)[:, hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank].reshape(-1)
    return tf.data.Dataset.from_tensor_slices((x[batches], y[batches])).batch(per_rank)


checkpoints = str(out_dir / "ckpt-{epoch}.keras")
resume_from_epoch = 0
if hvd.rank() == 0:
    done = [int(Path(p).stem.split("-")[1]) for p in glob.glob(str(out_dir / "ckpt-*.keras"))]
    resume_from_epoch = max(done, default=0)
resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0, name="resume_from_epoch")

if resume_from_epoch > 0 and hvd.rank() == 0:
    model = hvd.load_model(checkpoints.format(epoch=resume_from_epoch))
else:
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class KillAt(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if hvd.rank() == 1 and (self.model.optimizer.iterations.numpy() == kill_step):
            (out_dir / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), KillAt()]
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(checkpoints))
try:
    model.fit(epochs_from(resume_from_epoch), epochs=EPOCHS, initial_epoch=resume_from_epoch,
              steps_per_epoch=STEPS, callbacks=callbacks, shuffle=False, verbose=0)
except Exception as exc:  # noqa: BLE001 - reported, then the rank fails
    since = time.time() - float((out_dir / "killed").read_text())
    print(f"job {os.environ.get('RDMATENSOR_JOB')}", flush=True)
    print(f"failed {since:.2f} {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    sys.exit(1)
if hvd.rank() == 0:
    np.savez(out_dir / "final.npz", *[np.asarray(v) for v in model.variables + model.optimizer.variables])
    print(f"resumed from epoch {resume_from_epoch}; trained to step {int(model.optimizer.iterations)}")
