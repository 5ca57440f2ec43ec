"""Parameter-server training: workers push gradients, servers apply them and push
the variables back, every tensor written into a slot preallocated by the plan.

Variables are sharded round-robin over the servers (layout.ps_rank); each
server owns its shard's variables and the optimizer state for them. One step:

    server:  push its variables to every worker -> take every worker's
             gradients -> average them -> optimizer.apply_gradients
    worker:  take the variables -> loss and gradients -> push the gradients

A worker never copies the variables into tf.Variables: the received slots go
straight into the gradient function as tensors (Step.stateless_grads, via
DLPack) and return to the server when TensorFlow frees them. Gradients are
written from TensorFlow's own output buffers (tcp, shm; verbs copies them once
into registered staging). Sparse gradients go as deduplicated (values,
indices): dynamic tensors.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import ingest
from ..core.layout import Analysis, grad_name, param_name, ps_rank
from ..core.meter import Meter


def _host(tensor) -> np.ndarray:
    """A tensor's bytes as a read-only numpy array, with no copy (CPU)."""
    return np.asarray(tensor)


class PSWorker:
    def __init__(self, session, analysis: Analysis, step, meter: Meter | None = None):
        self.session, self.analysis, self.step = session, analysis, step
        self.meter = meter or Meter()
        self.rank = session.rank

    def pull(self) -> list:
        names = [param_name(self.rank, v.key) for v in self.analysis.variables]
        with self.meter.comm():
            received = [self.session.recv(n) for n in names]
        return [ingest.to_tensor(r, tally=self.meter.tally) for r in received]

    def push(self, grads) -> None:
        with self.meter.comm():
            items = []
            for v, g in zip(self.analysis.variables, grads, strict=True):
                if v.sparse:
                    items += [(grad_name(self.rank, v.key, "values"), _host(g.values)),
                              (grad_name(self.rank, v.key, "indices"), _host(g.indices))]
                else:
                    items.append((grad_name(self.rank, v.key), _host(g)))
            self.session.send_many(items)

    def train_step(self, x, y) -> float:
        weights = self.pull()
        loss, grads = self.step.stateless_grads(weights, x, y)
        del weights                 # the slots go back to the servers
        self.push(grads)
        return float(loss)


class ParameterServer:
    def __init__(self, session, analysis: Analysis, variables, optimizer, meter: Meter | None = None):
        self.session, self.analysis = session, analysis
        self.meter = meter or Meter()
        rank, n, m = session.rank, analysis.workers, analysis.ps
        self.mine = [i for i in range(len(analysis.variables)) if ps_rank(i, n, m) == rank]
        self.infos = [analysis.variables[i] for i in self.mine]
        self.variables = [variables[i] for i in self.mine]
        self.optimizer = optimizer
        optimizer.build(self.variables)
        sig = []
        for v in self.infos:
            for shape, dtype in v.parts.values():
                sig += [tf.TensorSpec(shape, dtype)] * n
        self._apply = tf.function(self._apply_fn, input_signature=sig)
        self._read = tf.function(lambda: [tf.convert_to_tensor(v) for v in self.variables])

    def _apply_fn(self, *flat):
        n, grads, it = self.analysis.workers, [], iter(flat)
        for v in self.infos:
            if v.sparse:
                values = [next(it) for _ in range(n)]
                indices = [next(it) for _ in range(n)]
                grads.append(tf.IndexedSlices(tf.concat(values, 0) / n, tf.concat(indices, 0),
                                              tf.constant(v.shape, tf.int64)))
            else:
                grads.append(tf.add_n([next(it) for _ in range(n)]) / n)
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))

    def push(self) -> None:
        values = [_host(t) for t in self._read()]
        with self.meter.comm():
            self.session.send_many([(param_name(w, v.key), value) for w in range(self.analysis.workers)
                                    for v, value in zip(self.infos, values, strict=True)])

    def pull(self) -> list:
        names = []
        for v in self.infos:
            for part in v.parts:
                names += [grad_name(w, v.key, part) for w in range(self.analysis.workers)]
        with self.meter.comm():
            received = [self.session.recv(n) for n in names]
        return [ingest.to_tensor(r, tally=self.meter.tally) for r in received]

    def train_step(self) -> None:
        self.push()
        grads = self.pull()
        self._apply(*grads)
        del grads
