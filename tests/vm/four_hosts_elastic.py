"""One worker of the four-host elastic check (four_hosts_check.py), started by
`rdmatensor-run --min-np 3 --max-np 4 --host-discovery-script` on four hosts,
one slot each (the script: `cat OUT_DIR/hosts`, a directory every VM shares):

    python tests/vm/four_hosts_elastic.py OUT_DIR HOST,HOST,HOST,HOST VICTIM_HOST

A linear regression over the Horovod API, its state committed every COMMIT
steps. In global step KILL_AT the worker on VICTIM_HOST takes its host out
of the hosts file and SIGKILLs itself: the host is lost. The others roll back
to their last commit and train on three hosts; after ADD_AT steps of that,
rank 0 offers the host again, a new worker starts there and joins at the next
commit, and the job ends once it trained COMMIT steps with the others (decided
alike on every rank: by the size, and the state rank 0 synced).

Every worker prints, for each step it completed, `step K size N loss L weights
DIGEST`, and `final DIGEST` at the end.
"""
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd

out_dir, hosts, victim = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
HOSTS = len(hosts)
COMMIT, BATCH, KILL_AT, ADD_AT, STEPS = 4, 16, 6, 3, 12
WAIT_LIMIT = 600      # steps on three hosts after the host was offered again: it never came back
W_TRUE = np.linspace(-1.0, 1.0, 8).astype(np.float32)

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


def offer(names: list[str]) -> None:
    """The hosts the discovery script offers from now on, one slot each (written whole, then
    renamed: never read half-written)."""
    tmp = out_dir / "hosts.tmp"
    tmp.write_text("".join(f"{h}:1\n" for h in names))
    tmp.replace(out_dir / "hosts")


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


def training(state):
    while state.step < STEPS or state.rejoined < 0 or state.step < state.rejoined + COMMIT:
        if state.lost >= 0 and state.rejoined < 0 and hvd.size() == HOSTS:
            state.rejoined = state.step
        if state.step == KILL_AT and hvd.size() == HOSTS and state.lost < 0 \
                and os.environ.get("RDMATENSOR_HOST") == victim:
            offer([h for h in hosts if h != victim])
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.size() < HOSTS and state.lost >= 0 and state.step - state.lost >= ADD_AT:
            if state.step - state.lost > ADD_AT + WAIT_LIMIT:
                raise RuntimeError(f"{victim} was offered again {WAIT_LIMIT} steps ago and no worker joined")
            time.sleep(0.5)       # waiting for the host to come back: no hurry
        x, y = batch(state.step, hvd.rank())
        loss = hvd.allreduce(train_step(x, y), name="loss")
        print(f"step {state.step} size {hvd.size()} loss {float(loss):.6f} weights {digest()}", flush=True)
        state.step += 1
        if hvd.size() < HOSTS:
            if state.lost < 0:
                state.lost = state.step - 1          # the first step on three hosts
            if hvd.rank() == 0 and state.step - state.lost == ADD_AT:
                offer(hosts)
        if state.step % COMMIT == 0:
            state.commit()


state = hvd.elastic.TensorFlowKerasState(model, opt, step=0, lost=-1, rejoined=-1)
hvd.elastic.run(training)(state)
print(f"final {digest()}", flush=True)
