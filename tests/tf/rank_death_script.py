"""A training job one of whose ranks is SIGKILLed mid-training, by a timer that
fires at a random moment of a step. Started by rdmatensor-run on every rank:

    python rank_death_script.py OUT_DIR MODE VICTIM KILL_STEP     # MODE: ring | ps

ring: the Horovod API (DistributedGradientTape inside tf.function); every
worker prints `step K DIGEST` (a digest of the all-reduced gradients) after
each step it completed. ps: tf_plugin.parameter_server.run, the victim a
worker. The victim writes when it died to OUT_DIR/killed; every other rank,
when the job fails under it, prints `failed SECONDS TYPE: MESSAGE` (seconds
since the kill), its pid and the job id, and exits with status 1.
"""
import hashlib
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

out_dir, mode, victim, kill_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rank = int(os.environ["RDMATENSOR_RANK"])
STEPS = 100_000                                  # never reached: a rank dies first


def die_soon():
    def die():
        (out_dir / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(random.uniform(0.0, 0.01), die).start()


def model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])


def data(k: int):
    rng = np.random.default_rng(1000 * k + rank)
    return rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 4, 8).astype(np.int32)


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def ring():
    import tf_plugin as hvd
    hvd.init()
    net, opt = model(), keras.optimizers.SGD(0.01)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables, strict=True))
        return grads

    hvd.broadcast_variables(net.variables, root_rank=0)
    for k in range(STEPS):
        if rank == victim and k == kill_step:
            die_soon()
        grads = train_step(*data(k))
        print(f"step {k} {hashlib.sha256(b''.join(np.asarray(g).tobytes() for g in grads)).hexdigest()[:16]}",
              flush=True)


def parameter_server():
    import tf_plugin.parameter_server as ps

    def batches():
        for k in range(STEPS):
            if rank == victim and k == kill_step:
                die_soon()
            yield data(k)

    def loss(y, logits):
        return loss_fn(y, logits)

    ps.run(model(), loss, keras.optimizers.SGD(0.01), batches(), STEPS)


try:
    ring() if mode == "ring" else parameter_server()
except Exception as exc:  # noqa: BLE001 - reported, then the rank fails
    since = time.time() - float((out_dir / "killed").read_text())
    print(f"pid {os.getpid()} job {os.environ['RDMATENSOR_JOB']}", flush=True)
    print(f"failed {since:.2f} {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    sys.exit(1)
