"""horovod.tensorflow.keras over rdmatensor: `import tf_plugin.keras as hvd`.

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(loss=..., optimizer=opt)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

The module functions are tf_plugin's (init, rank, size, ...); allreduce,
allgather and broadcast take Keras' argument order (the name second).

    optimizer.py      DistributedOptimizer for Keras 3 (and PartialDistributedOptimizer)
    any_optimizer.py  horovod.tensorflow's DistributedOptimizer: a TF1 or a Keras optimizer
    callbacks.py      the callbacks, for Keras 3's fit
    elastic.py        hvd.elastic for Keras: fit that survives a lost rank
    saving.py         hvd.load_model
"""
from __future__ import annotations

from ..horovod import tensors as _tf
from ..horovod.compression import Compression
from ..horovod.tensors import broadcast_variables
from ..horovod.world import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather_object, broadcast_object,
                     ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
                     is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                     nccl_built, rank, rocm_built, shutdown, size, start_timeline, stats, stop_timeline)
from ..core.world import ProcessSet, add_process_set, global_process_set, remove_process_set
from . import callbacks, elastic
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .saving import load_model

__all__ = ["elastic", "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "callbacks", "Compression",
           "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_variables", "broadcast_global_variables",
           "broadcast_object", "allgather_object", "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
           "local_size", "stats", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "mpi_built",
           "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
           "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "cross_rank", "cross_size", "start_timeline", "stop_timeline"]


def allreduce(value, name: str | None = None, average=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op=None, compression=Compression.none):
    """`value` (a tensor, array or number) combined over the ranks: Average by default, or op=Sum."""
    return _tf.allreduce(value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, name=name)


def allgather(value, name: str | None = None):
    """Every rank's `value` concatenated along the first dimension, in rank order."""
    return _tf.allgather(value, name=name)


def broadcast(value, root_rank: int, name: str | None = None):
    """root_rank's `value` on every rank."""
    return _tf.broadcast(value, root_rank, name=name)


def reducescatter(value, name: str | None = None, op=Average):
    """`value` combined over the ranks by `op`, this rank's rows of it."""
    return _tf.reducescatter(value, name=name, op=op)


def broadcast_global_variables(root_rank: int):
    """TF1 graphs only (RuntimeError eagerly, as Horovod): see tf_plugin.broadcast_global_variables."""
    return _tf.broadcast_global_variables(root_rank)
