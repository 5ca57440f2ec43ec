"""horovod.tensorflow.DistributedOptimizer (`hvd.DistributedOptimizer` with
`import tf_plugin as hvd`), with its signature: a TF1 optimizer is wrapped by
horovod/tf1_optimizer.py, a Keras one by tf_plugin.keras' DistributedOptimizer,
as Horovod chooses."""
from __future__ import annotations

import tensorflow as tf

from ..horovod.compression import Compression
from ..horovod.tf1_optimizer import TF1DistributedOptimizer
from ..core.world import Adasum, Average
from .optimizer import DistributedOptimizer as KerasDistributedOptimizer


def DistributedOptimizer(optimizer, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                         process_set=None, scale_local_gradients: bool = True):
    """An optimizer whose gradients are combined over the ranks (of `process_set`).
    op=Adasum: Horovod's own refusals (with Keras; with average_aggregated_gradients);
    a TF1 optimizer's Adasum (Horovod's delta optimizer, MPI builds only) is not here:
    tf_plugin.keras.DistributedOptimizer or DistributedGradientTape combine gradients by Adasum."""
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if op == Adasum:
            raise NotImplementedError("op=hvd.Adasum with a TF1 optimizer (Horovod's delta optimizer) is not "
                                      "supported: combine the gradients with DistributedGradientTape(op=hvd.Adasum)")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if backward_passes_per_step != 1:
            raise NotImplementedError("backward_passes_per_step > 1 with a TF1 optimizer: use a Keras optimizer, "
                                      "or aggregate the gradients before apply_gradients()")
        return TF1DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                       gradient_predivide_factor, process_set, scale_local_gradients)
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    return KerasDistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                     gradient_predivide_factor, op, backward_passes_per_step,
                                     average_aggregated_gradients, num_groups, groups, process_set,
                                     scale_local_gradients)
