"""The ring all-reduce (executor/ring.py) with TensorFlow's tensors:

    ring = RingAllReduce(session, analyze(model, "allreduce", workers))
    broadcast(ring, model.variables)               # rank 0's values everywhere, once
    grads = allreduce(ring, grads)                 # averaged over workers, eagerly
    tape = RingGradientTape(tape, ring)            # the same inside tf.function

Gradients reach the ring with no copy on CPU and come back with none (DLPack).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..core.layout import bcast_name, var_key
from ..executor.ring import RingAllReduce
from . import ingest, overlap
from .tracing import graph_code


def keys_of(ring: RingAllReduce, variables, count: int) -> list[str]:
    """The plan's keys of `variables` (None: the plan's variables, in order), which
    must be `count` variables of the plan: what the ring's arrays are named by.
    Here, not in the ring: the executor knows the plan's keys, never TensorFlow's variables."""
    planned = dict.fromkeys(v.key for v in ring.analysis.variables)
    keys = [var_key(v) for v in variables] if variables is not None else \
        [v.key for v in ring.analysis.variables]
    missing = [k for k in keys if k not in planned]
    if missing or len(keys) != count:
        raise ValueError(f"gradients of {missing or count} do not match the plan's variables {list(planned)}")
    return keys


def allreduce(ring: RingAllReduce, grads, variables=None) -> list[tf.Tensor]:
    """Average gradients (tensors, eager) over the workers; `variables` name them
    (default: the plan's variables, in order)."""
    keys = keys_of(ring, variables, len(grads))
    host = [np.asarray(tf.convert_to_tensor(g)) for g in grads]    # no copy on CPU
    return [ingest.borrow(a, ring.meter.tally) for a in ring.allreduce_arrays(keys, host)]


def broadcast(ring: RingAllReduce, variables, root_rank: int = 0) -> None:
    """Every worker's variables take root_rank's values (once, before training)."""
    if root_rank != 0:
        raise ValueError("the plan broadcasts from rank 0")
    keys = keys_of(ring, variables, len(variables))
    with ring.meter.comm():
        for key, var in zip(keys, variables, strict=False):
            if ring.size == 1 or 0 in var.shape:
                continue
            if ring.rank == 0:
                value = np.asarray(tf.convert_to_tensor(var))
                for dst in range(1, ring.size):
                    ring.session.send(bcast_name(key, dst), value)
            else:
                with ring.session.recv(bcast_name(key, ring.rank)) as value:
                    var.assign(value)                 # into the variable's own memory
                    ring.meter.tally["copied"] += 1


class RingGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients averaged over the
    workers of an analyzed ring. Eager: the ring runs right there. Inside
    tf.function: one launch op per bucket as soon as its gradients exist, the
    rings on the communication thread while backprop goes on, one wait op per
    bucket (overlap.py). For a plan grown from the step instead, see
    tf_plugin.horovod.gradient_tape.DistributedGradientTape."""

    def __init__(self, tape: tf.GradientTape, ring: RingAllReduce):
        self._tape, self._ring = tape, ring

    def __getattr__(self, name):
        return getattr(self._tape, name)

    @graph_code
    def gradient(self, target, sources, output_gradients=None, **kw):
        ring = self._ring
        grads = self._tape.gradient(target, sources, output_gradients, **kw)
        grads = [tf.convert_to_tensor(g) for g in grads]          # sparse as dense
        if tf.executing_eagerly():
            return allreduce(ring, grads, sources)
        position = {k: p for p, k in enumerate(keys_of(ring, sources, len(grads)))}
        layouts = [[(position[key], offset, ring.shapes[key]) for key, offset, _ in b.members]
                   for b in ring.analysis.buckets]
        return overlap.bucketed(grads, layouts, ring.launch, ring.collect, "rdmatensor_allreduce")
