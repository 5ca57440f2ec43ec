"""Synchronous data parallelism: ring all-reduce of gradients, Horovod-like interface.

    import tf_plugin.allreduce as hvd
    hvd.init(model, provider="tcp")                 # analyze, connect (cluster from TF_CONFIG)
    hvd.broadcast_variables(model.variables, root_rank=0)
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over workers

The ring: each gradient, flattened, is cut into N chunks (analyzer.ring_bounds).
Reduce-scatter (N-1 steps): every rank writes one chunk into its right
neighbour's preallocated slot, which adds it to its own copy of that chunk
*directly into the registered staging buffer of its next write*; after N-1
steps each rank holds one chunk summed over all ranks. All-gather (N-1 steps)
passes the summed chunks around. Every chunk of every step is its own
TensorSpec, so each is one one-sided write, with no control message.

Copies: chunk 0 leaves from TensorFlow's gradient buffer (verbs: one copy
into staging); sums land in staging (no copy); all-gathered chunks are
scaled by 1/N into the output array (the averaging, not a copy) and, when
N > 2, copied once into staging to be forwarded. The output arrays are
64-byte aligned and reach TensorFlow through DLPack with no copy.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import ingest
from .analyzer import Analysis, bcast_name, ring_bounds, ring_chunk, ring_name, var_key
from .meter import Meter


class RingAllReduce:
    def __init__(self, session, analysis: Analysis, meter: Meter | None = None):
        self.session, self.analysis = session, analysis
        self.meter = meter or Meter()
        self.rank, self.size = session.rank, analysis.workers
        self.index = {v.key: i for i, v in enumerate(analysis.variables)}

    # ------------------------------------------------------------- all-reduce
    def _ring(self, key: str, grad: np.ndarray) -> np.ndarray:
        s, n, r = self.session, self.size, self.rank
        flat = grad.reshape(-1)
        out = ingest.aligned_empty(flat.shape, flat.dtype)
        if n == 1 or flat.size == 0:
            np.copyto(out, flat)
            return out.reshape(grad.shape)
        bounds = [slice(lo, hi) for lo, hi in ring_bounds(flat.size, n)]
        left, scale = (r - 1) % n, flat.dtype.type(1.0 / n)
        outgoing = flat[bounds[ring_chunk("rs", 0, r, n)]]
        for step in range(n - 1):                                   # reduce-scatter
            s.send(ring_name(key, "rs", step, r), outgoing)
            nxt = ring_name(key, "rs", step + 1, r) if step < n - 2 else ring_name(key, "ag", 0, r)
            dst = s.buffer(nxt)
            with s.recv(ring_name(key, "rs", step, left)) as chunk:
                np.add(flat[bounds[ring_chunk("rs", step, r, n, receiving=True)]], chunk, out=dst)
            outgoing = dst
        np.multiply(outgoing, scale, out=out[bounds[(r + 1) % n]])
        for step in range(n - 1):                                   # all-gather
            s.send(ring_name(key, "ag", step, r), outgoing)
            with s.recv(ring_name(key, "ag", step, left)) as chunk:
                np.multiply(chunk, scale, out=out[bounds[ring_chunk("ag", step, r, n, receiving=True)]])
                if step < n - 2:
                    outgoing = s.buffer(ring_name(key, "ag", step + 1, r))
                    np.copyto(outgoing, chunk)
                    self.meter.tally["forwarded"] += 1
        return out.reshape(grad.shape)

    def allreduce_arrays(self, keys, arrays) -> list[np.ndarray]:
        """Average numpy gradients over the workers (in plan order of `keys`)."""
        with self.meter.comm():
            return [self._ring(k, np.ascontiguousarray(a)) for k, a in zip(keys, arrays)]

    def allreduce(self, grads, variables=None) -> list[tf.Tensor]:
        """Average gradients (tensors, eager) over the workers; `variables` name them
        (default: the plan's variables, in order)."""
        keys = self._keys(variables, len(grads))
        host = [np.asarray(tf.convert_to_tensor(g)) for g in grads]    # no copy on CPU
        return [ingest.borrow(a) for a in self.allreduce_arrays(keys, host)]

    def _keys(self, variables, count: int) -> list[str]:
        keys = [var_key(v) for v in variables] if variables is not None else \
            [v.key for v in self.analysis.variables]
        missing = [k for k in keys if k not in self.index]
        if missing or len(keys) != count:
            raise ValueError(f"gradients of {missing or count} do not match the plan's variables "
                             f"{list(self.index)}")
        return keys

    # -------------------------------------------------------------- broadcast
    def broadcast(self, variables, root_rank: int = 0) -> None:
        """Every worker's variables take root_rank's values (once, before training)."""
        if root_rank != 0:
            raise ValueError("the plan broadcasts from rank 0")
        keys = self._keys(variables, len(variables))
        with self.meter.comm():
            for key, var in zip(keys, variables):
                if self.size == 1 or 0 in var.shape:
                    continue
                if self.rank == 0:
                    value = np.asarray(tf.convert_to_tensor(var))
                    for dst in range(1, self.size):
                        self.session.send(bcast_name(key, dst), value)
                else:
                    with self.session.recv(bcast_name(key, self.rank)) as value:
                        var.assign(value)                 # into the variable's own memory
                        self.meter.tally["copied"] += 1


class DistributedGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients averaged over the
    workers. Eager: the ring runs right there. Inside tf.function: it runs as a
    tf.numpy_function (inputs and outputs alias TensorFlow's buffers)."""

    def __init__(self, tape: tf.GradientTape, ring: RingAllReduce | None = None):
        self._tape, self._ring = tape, ring

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None, **kw):
        ring = self._ring or _default()
        grads = self._tape.gradient(target, sources, output_gradients, **kw)
        grads = [tf.convert_to_tensor(g) for g in grads]          # sparse as dense
        if tf.executing_eagerly():
            return ring.allreduce(grads, sources)
        keys = ring._keys(sources, len(grads))
        out = tf.numpy_function(lambda *a: ring.allreduce_arrays(keys, a), grads,
                                [g.dtype for g in grads], stateful=True, name="rdmatensor_allreduce")
        for o, g in zip(out, grads):
            o.set_shape(g.shape)
        return out


# ----------------------------------------------- Horovod-like module functions
_state: dict = {}


def init(model, provider: str = "auto", cluster=None, token: str | None = None, timeout: float = 120.0,
         input_signature=None) -> RingAllReduce:
    """Analyze `model` (a Keras model or Step), connect this worker (cluster from
    TF_CONFIG unless given; token from RDMATENSOR_TOKEN) and make the ring the
    default for DistributedGradientTape and broadcast_variables."""
    import os
    from rdmatensor import connect
    from .analyzer import analyze
    from .cluster import Cluster
    cluster = cluster or Cluster.from_tf_config()
    analysis = analyze(model, "allreduce", cluster.num_workers, input_signature=input_signature)
    session = connect(cluster.rank, cluster.peers(), analysis.plan, provider=provider,
                      token=token or os.environ.get("RDMATENSOR_TOKEN"), timeout=timeout)
    _state["ring"] = RingAllReduce(session, analysis)
    return _state["ring"]


def _default() -> RingAllReduce:
    if "ring" not in _state:
        raise RuntimeError("call tf_plugin.allreduce.init(model) first")
    return _state["ring"]


def rank() -> int:
    return _default().rank


def size() -> int:
    return _default().size


def broadcast_variables(variables, root_rank: int = 0) -> None:
    _default().broadcast(variables, root_rank)


def shutdown() -> None:
    ring = _state.pop("ring", None)
    if ring is not None:
        ring.session.close()
