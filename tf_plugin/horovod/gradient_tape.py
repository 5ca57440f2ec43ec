"""horovod.tensorflow's gradient tapes: DistributedGradientTape and
PartialDistributedGradientTape (`import tf_plugin as hvd`).

What the tapes decide beside the all-reduce itself (tensors.reduce_gradients)
is which sources stay local: a local source keeps this rank's gradient, a rank
outside the process set keeps all of its gradients. The optimizers follow the
same rules (tf1_optimizer, tf_plugin.keras.optimizer), so reduce_shared and
local_variables live here, beside the tapes that define them.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from ..core.world import group_of
from ..core.world import Average, ReduceOp, Sum
from ..graph.tracing import graph_code
from .compression import Compression
from .tensors import _reduction, reduce_gradients

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "local_variables", "reduce_shared"]


class DistributedGradientTape:
    """A tf.GradientTape whose gradient() combines the gradients over the ranks
    (Average: the mean, as if one process had seen every rank's batch). Sources
    registered with register_local_source() keep their own rank's gradient
    (divided by the number of ranks with scale_local_gradients, as Horovod)."""

    def __init__(self, gradtape, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set=None, scale_local_gradients: bool = True):
        op = ReduceOp(op)
        _reduction(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if groups is not None and not (isinstance(groups, list) or groups > 0):
            raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
        group_of(process_set)      # registered (ValueError); a rank outside it keeps its gradients
        self._tape, self._compression, self._sparse_as_dense = gradtape, compression, sparse_as_dense
        self._process_set = process_set
        self._op, self._predivide, self._scale_local = op, gradient_predivide_factor, scale_local_gradients
        self._local_sources: set[int] = set()

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def register_local_source(self, source) -> None:
        """Keep this source's gradient local: it is not combined over the ranks."""
        self._local_sources.add(id(source))

    @graph_code
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        out = reduce_shared(tf.nest.flatten(grads), tf.nest.flatten(sources), self._local_sources,
                            self._compression, self._sparse_as_dense, self._op, self._predivide, self._scale_local,
                            self._process_set)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """([(local source, gradient)], [(shared source, gradient)])."""
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, grads, strict=True))
        return ([p for p in pairs if id(p[0]) in self._local_sources],
                [p for p in pairs if id(p[0]) not in self._local_sources])


def PartialDistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",
                                   compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set=None, local_layers=None, scale_local_gradients: bool = True):
    """A DistributedGradientTape whose `local_layers`' trainable variables keep
    their local gradients (model parallel parts, per-rank heads)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for v in local_variables(local_layers):
        tape.register_local_source(v)
    return tape


def local_variables(local_layers) -> list:
    """The trainable variables of `local_layers` (a layer, a list of them, or None)."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]


def reduce_shared(grads: list, sources: list, local: set, compression, sparse_as_dense: bool, op,
                  predivide: float = 1.0, scale_local: bool = True, process_set=None) -> list:
    """Gradients combined over the ranks but those of the sources whose id() is in
    `local`, which stay this rank's (divided by the number of ranks with
    `scale_local`), as Horovod's tape and optimizer treat local sources; on a rank
    outside `process_set`, every gradient stays this rank's, as in Horovod. With
    `predivide`, an average is split around the sum as Horovod does."""
    group = group_of(process_set)
    if not group.included:         # as Horovod's tape and optimizer: a rank outside the set keeps its gradients
        return list(grads)
    shared = [j for j, s in enumerate(sources) if id(s) not in local]
    n = group.size
    pre, post = 1.0, 1.0
    if predivide != 1.0:
        op, pre, post = Sum, 1.0 / predivide, predivide / n
    reduced = reduce_gradients([grads[j] for j in shared], [sources[j] for j in shared], compression,
                               sparse_as_dense, op, pre, post, process_set)
    out = list(grads)
    for j, g in zip(shared, reduced, strict=True):
        out[j] = g
    if scale_local:
        for j, s in enumerate(sources):
            if id(s) in local and out[j] is not None:
                g = out[j]
                out[j] = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                          if isinstance(g, tf.IndexedSlices) else g / n)
    return out
