"""A graph with the native all-reduce ops saved and loaded as a SavedModel (where
the op library is loaded: after hvd.init), and a Keras model trained with
DistributedOptimizer exported for inference with no collective in it. Run as
every worker of a 2-rank job on one host; writes what it saw to OUT_DIR.

    python native_saved_script.py OUT_DIR
"""
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd
import tf_plugin.keras as hvd_keras

hvd.init()
r = hvd.rank()
out = sys.argv[1]
report = {}


class M(tf.Module):
    """A step that all-reduces x * v and adds the result to v."""

    def __init__(self):
        self.v = tf.Variable(np.ones(3, np.float32))
    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
    def step(self, x):
        g = hvd.allreduce(x * self.v, op=hvd.Sum)
        self.v.assign_add(g)
        return g
m = M()
report["step"] = m.step(tf.constant([1.0, 2.0, 3.0])).numpy().tolist()
types = {o.type for o in m.step.get_concrete_function().graph.get_operations()}
report["native_ops"] = sorted(t for t in types if t.startswith("Rdt"))
path = os.path.join(out, f"m{r}")
tf.saved_model.save(m, path)
loaded = tf.saved_model.load(path)
report["loaded_step"] = loaded.step(tf.constant([1.0, 1.0, 1.0])).numpy().tolist()
# a Keras model trained with DistributedOptimizer, exported for inference
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), batch_size=4, epochs=1, verbose=0)
model.export(os.path.join(out, f"k{r}"))
served = tf.saved_model.load(os.path.join(out, f"k{r}"))
ops = set()
for f in served.signatures.values():
    ops |= {o.type for o in f.graph.get_operations()}
    for fn in f.graph.as_graph_def().library.function:
        ops |= {n.op for n in fn.node_def}
report["exported_collectives"] = sorted(t for t in ops if t.startswith("Rdt") or "PyFunc" in t)
report["exported_ops"] = len(ops)
with open(os.path.join(out, f"rank{r}.json"), "w") as f:
    json.dump(report, f)
