"""A TF1 optimizer (tf.compat.v1.train.Optimizer) whose compute_gradients()
combines the gradients over the ranks, as horovod.tensorflow's
_DistributedOptimizer: what `hvd.DistributedOptimizer(tf1_optimizer)` returns
(tf_plugin.keras.any_optimizer chooses)."""
from __future__ import annotations

import tensorflow as tf

from ..core.world import group_of
from .compression import Compression
from .gradient_tape import reduce_shared
from ..core.world import Average


class TF1DistributedOptimizer(tf.compat.v1.train.Optimizer):
    def __init__(self, optimizer, name: str | None = None, use_locking: bool = False,
                 compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                 gradient_predivide_factor: float = 1.0, process_set=None, scale_local_gradients: bool = True):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        group_of(process_set)          # registered (ValueError now); a rank outside it keeps its gradients
        self._optimizer, self._compression, self._sparse_as_dense = optimizer, compression, sparse_as_dense
        self._op, self._predivide, self._scale_local = op, gradient_predivide_factor, scale_local_gradients
        self.process_set = process_set
        self._local_vars: set[int] = set()

    def register_local_var(self, var) -> None:
        """Keep this variable's gradient local: it is not combined over the ranks."""
        self._local_vars.add(id(var))

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, combined over the ranks (of the process set)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        reduced = reduce_shared(grads, variables, self._local_vars, self._compression, self._sparse_as_dense,
                                self._op, self._predivide, self._scale_local, self.process_set)
        return list(zip(reduced, variables, strict=True))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
