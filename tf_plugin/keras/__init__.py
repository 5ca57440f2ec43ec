"""horovod.tensorflow.keras over rdmatensor: `import tf_plugin.keras as hvd`.

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(loss=..., optimizer=opt)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

The module functions are tf_plugin's (init, rank, size, ...); allreduce,
allgather and broadcast take Keras' argument order (the name second).
"""
from __future__ import annotations

from .. import horovod as _tf
from ..horovod import Compression, broadcast_variables
from ..world import (Average, ReduceOp, Sum, allgather_object, broadcast_object, init, is_initialized, local_rank,
                     local_size, rank, shutdown, size, stats)
from . import callbacks
from .optimizer import DistributedOptimizer
from .saving import load_model

__all__ = ["DistributedOptimizer", "load_model", "callbacks", "Compression", "allreduce", "allgather", "broadcast",
           "broadcast_variables", "broadcast_object", "allgather_object", "init", "shutdown", "is_initialized",
           "rank", "size", "local_rank", "local_size", "stats", "Average", "Sum", "ReduceOp"]


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
