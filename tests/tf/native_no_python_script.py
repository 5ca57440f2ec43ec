"""No Python of this project on the step's path in steady state: a
DistributedGradientTape step traced on the native ops, warmed up, then run
STEPS times with a profile hook on every Python thread (sys.setprofile on this
one; threading.setprofile, set before hvd.init, on every thread the job
starts). Records each function of rdmatensor/ or tf_plugin/ called during
those steps, by thread, and what the Python path's counters did. Run as every
worker of a 2-rank job on one host; writes OUT_DIR/rank{r}.json.

    python native_no_python_script.py OUT_DIR
"""
import collections
import json
import os
import sys
import threading

import keras
import numpy as np
import tensorflow as tf

import rdmatensor
import tf_plugin as hvd
from tf_plugin.core.world import world

STEPS = 50
OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (rdmatensor, hvd))
measuring = False
seen = collections.Counter()


def hook(frame, event, arg):
    if measuring and event == "call" and frame.f_code.co_filename.startswith(OURS):
        where = os.path.relpath(frame.f_code.co_filename, os.path.dirname(OURS[0].rstrip(os.sep)))
        seen[f"{threading.current_thread().name}: {where}:{frame.f_code.co_name}"] += 1


threading.setprofile(hook)      # every thread started from here on, the job's own among them
hvd.init()
r = hvd.rank()
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
opt = keras.optimizers.SGD(0.01)
x = tf.constant(np.random.default_rng([5, r]).standard_normal((8, 16)).astype(np.float32))
y = tf.constant(np.random.default_rng([6, r]).standard_normal((8, 4)).astype(np.float32))


@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


for _ in range(5):
    step(x, y)
before = hvd.stats()
comm = world().collectives.comm
sys.setprofile(hook)
measuring = True
for _ in range(STEPS):
    loss = step(x, y)
measuring = False
sys.setprofile(None)
threading.setprofile(None)
after = hvd.stats()
report = {"frames": dict(seen), "loss": float(loss),
          "native_requests": after["native_requests"] - before["native_requests"],
          "python_rounds": after["allreduces"] - before["allreduces"],
          "threads": sorted(t.name for t in threading.enumerate()),
          "comm_thread_started": getattr(comm, "_thread", None) is not None}
hvd.shutdown()
with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
    json.dump(report, f)
