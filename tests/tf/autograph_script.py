"""Which functions autograph rewrites while tracing a training step that uses the
plugin (test_tracing.py): one JSON list of their modules on stdout.

    python tests/tf/autograph_script.py       # one rank, no launcher
"""
import json

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.impl import api

import tf_plugin as hvd

converted = []
_convert = api._convert_actual


def recording(entity, program_ctx):
    converted.append(getattr(entity, "__module__", None) or "?")
    return _convert(entity, program_ctx)


api._convert_actual = recording

hvd.init()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
opt = keras.optimizers.SGD(0.1)


def helper(x):              # the user's own code: autograph rewrites it
    return x * 2.0


@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(helper(x)) - y))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    total = hvd.allreduce(loss, op=hvd.Sum, name="loss")
    parts = hvd.grouped_allreduce([loss, total], name="pair")
    return hvd.allgather(tf.reshape(total, [1]), name="all"), hvd.broadcast(parts[0], 0, name="b")


step(np.ones((2, 4), np.float32), np.ones((2, 2), np.float32))
print(json.dumps(sorted(set(converted))))
hvd.shutdown()
