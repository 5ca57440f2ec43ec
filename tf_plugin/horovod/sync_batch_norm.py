"""SyncBatchNormalization for Keras 3: batch statistics over every rank's batch.

Horovod's layer overrides the TF-Keras 2 `_moments(inputs, reduction_axes,
keep_dims)`; Keras 3 computes the moments in `_moments(inputs, mask)`, so
that is the one overridden here. As in Horovod, every rank's mean and mean of
squares count alike (equal batches per rank), combined by one all-reduce,
which is differentiable: training backpropagates through the statistics.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from .tensors import allreduce
from ..core.world import Sum, size


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Synchronous batch normalization: statistics are synchronized across all ranks during training."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)         # Keras names it sync_batch_normalization[_N]

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        if size() == 1:
            return mean, variance
        # Var[X] = E[X^2] - E[X]^2, both expectations averaged over the ranks.
        stack = tf.stack([mean, variance + tf.math.square(mean)])
        group = allreduce(stack, op=Sum, name=f"{self.name}/moments") / tf.cast(size(), stack.dtype)
        group_mean, group_mean_of_square = tf.unstack(group)
        return group_mean, group_mean_of_square - tf.math.square(group_mean)
