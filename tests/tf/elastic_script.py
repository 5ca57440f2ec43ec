"""An elastic training job, started by `rdmatensor-run --min-np/--max-np
--host-discovery-script` (the script: `cat OUT_DIR/hosts`):

    python elastic_script.py OUT_DIR MODE STEPS KILL_AT ADD_AT     # MODE: tape | fit | warmup

(warmup: tape, with one training step before hvd.elastic.run, and the killed
worker's slot still offered.)

A linear regression, its state committed every COMMIT steps. Worker 1 (the
first rank 1) sets the hosts file to one slot fewer and SIGKILLs itself in the middle
of global step KILL_AT (-1: never). Once the job trained ADD_AT steps after
the kill (-1: never), rank 0 sets the hosts file back to 3 slots: the launcher
starts a new worker, which joins at the next commit (tape: training goes on
past STEPS until it trained COMMIT steps with the others). Every rank prints, for
each step it completed, `step K size N loss L weights DIGEST` (K the global
step, L the loss averaged over the ranks), `resumed SECONDS` at its first step
after a reset caused by the kill (seconds since it), and `final DIGEST` at the
end; the victim writes when it died to OUT_DIR/killed. `early` (at step 2,
3 ranks) and `final` also say how many fds and threads the worker has.
"""
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd

out_dir, mode, steps, kill_at, add_at = Path(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:6])
COMMIT, BATCH = 4, 16
W_TRUE = np.linspace(-1.0, 1.0, 8).astype(np.float32)
worker = int(os.environ["RDMATENSOR_WORKER_ID"])
resumed = [False]                      # set by the reset callback: the next step is the first after a reset

hvd.init()
keras.utils.set_random_seed(7)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, use_bias=False)])
opt = keras.optimizers.SGD(0.05)
opt.build(model.trainable_variables)


def batch(step: int, rank: int):
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((BATCH, 8)).astype(np.float32)
    return x, (x @ W_TRUE + 0.01 * rng.standard_normal(BATCH).astype(np.float32))[:, None]


def digest() -> str:
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()[:16]


def killed_since() -> float | None:
    path = out_dir / "killed"
    return time.time() - float(path.read_text()) if path.exists() else None


def die_in_this_step(step: int) -> None:
    if worker == 1 and step == kill_at and not (out_dir / "killed").exists():
        if mode != "warmup":      # warmup: the slot stays offered, a new worker starts there
            (out_dir / "hosts").write_text(f"localhost:{hvd.size() - 1}\n")
        (out_dir / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def resources() -> str:
    """Open fds, and the threads Python started: a thread of TensorFlow's pools that first runs a
    numpy_function is registered too (a _DummyThread, never removed), and which of the pool's
    threads does so first is the scheduler's choice, not a leak."""
    ours = [t.name for t in threading.enumerate() if not isinstance(t, threading._DummyThread)]
    return f"fds {len(os.listdir('/proc/self/fd'))} threads {len(ours)} {','.join(sorted(ours))}"


def report(step: int, loss: float, state) -> None:
    if resumed[0]:
        print(f"resumed {killed_since():.2f}", flush=True)
        resumed[0] = False
    print(f"step {step} size {hvd.size()} loss {loss:.6f} weights {digest()}", flush=True)
    if step == 2 and hvd.size() == 3:
        print(f"early {resources()}", flush=True)
    if hvd.rank() == 0 and add_at >= 0 and killed_since() is not None and hvd.size() == 2:
        state.after_kill = getattr(state, "after_kill", 0) + 1
        if state.after_kill == add_at:
            (out_dir / "hosts").write_text("localhost:3\n")


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


def tape_training(state):
    # With ADD_AT, the job also goes on until the new worker trained COMMIT steps with the others
    # (decided alike on every rank: the size, and the state rank 0 synced)
    while state.step < steps or (add_at >= 0 and (state.joined_at < 0 or state.step < state.joined_at + COMMIT)) \
            or (mode == "warmup" and not hvd.broadcast_object(joiner_failed.exists(), 0, name="joiner")):
        if add_at >= 0 and hvd.size() == 3 and state.joined_at < 0 and killed_since() is not None:
            state.joined_at = state.step
        if hvd.size() < 3 and (add_at >= 0 or mode == "warmup"):
            time.sleep(0.05)
        x, y = batch(state.step, hvd.rank())
        die_in_this_step(state.step)
        loss = hvd.allreduce(train_step(x, y), name="loss")
        report(state.step, float(loss), state)
        state.step += 1
        if state.step % COMMIT == 0:
            state.commit()


class Steps(keras.callbacks.Callback):
    """fit's side of the same job: the global step, the kill, the report."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_begin(self, batch, logs=None):
        die_in_this_step(self.state.step)

    def on_train_batch_end(self, batch, logs=None):
        loss = hvd.allreduce(tf.constant(logs["loss"], tf.float32), name="loss")
        report(self.state.step, float(loss), self.state)
        self.state.step += 1


def fit_training(state):
    per_epoch = COMMIT
    epochs = steps // per_epoch
    x = np.concatenate([batch(s, hvd.rank())[0] for s in range(per_epoch)])
    y = np.concatenate([batch(s, hvd.rank())[1] for s in range(per_epoch)])
    model.fit(x, y, batch_size=BATCH, epochs=epochs - state.epoch, shuffle=False, verbose=0,
              callbacks=[Steps(state), hvd.elastic.UpdateEpochStateCallback(state),     # the epoch, then commit it
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=per_epoch)])


if mode == "fit":
    import tf_plugin.keras as hvd_keras
    hvd = hvd_keras                                                    # noqa: F811 - the Keras face
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss="mse")
    state = hvd.elastic.KerasState(model, step=0, epoch=0)         # the compiled (distributed) optimizer
else:
    state = hvd.elastic.TensorFlowKerasState(model, opt, step=0, joined_at=-1)
joiner_failed = out_dir / "joiner failed"
if mode == "warmup":
    # A collective before run(), as Horovod's synthetic benchmark's warm-up step: a worker
    # that joins later calls it while the others sync the state (they train until it failed).
    try:
        train_step(*batch(0, hvd.rank()))
    except tf.errors.OpError:
        if worker >= 3:
            joiner_failed.write_text("")
        raise
# a reset after the kill (the callback runs once the job re-formed): its first step says when it came
state.register_reset_callbacks([lambda: resumed.__setitem__(0, killed_since() is not None)])
hvd.elastic.run(fit_training if mode == "fit" else tape_training)(state)
print(f"final {digest()} {resources()}", flush=True)
