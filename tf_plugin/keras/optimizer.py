"""DistributedOptimizer for Keras 3: gradients are combined over the ranks
before the wrapped optimizer applies them, in `model.fit` (inside its
tf.function) as in a custom loop.

Keras 3 optimizers funnel every update through `apply(grads, variables)`
(`apply_gradients` calls it), so the wrapper is a subclass of the
optimizer's own class with `apply` overridden, made from the optimizer's
config as Horovod does. Its `__module__` and name are the original's, so a
saved model or checkpoint loads as the plain optimizer.

With `backward_passes_per_step` k > 1, gradients are summed locally in
optimizer variables for k calls (averaged when `average_aggregated_gradients`)
and combined over the ranks and applied on the k-th only: k times fewer
collectives, and `iterations` counts applied updates.
"""
from __future__ import annotations

import tensorflow as tf

from ..horovod import Compression, reduce_gradients
from ..world import Average


class _DistributedOptimizer:
    """Mixed in before a Keras optimizer class. The class attributes are the
    defaults of an optimizer made by deserialization (load_model)."""
    _hvd_compression, _hvd_sparse_as_dense, _hvd_op = Compression.none, False, Average
    _hvd_passes, _hvd_average_aggregated = 1, False

    def _hvd_reduce(self, grads, variables):
        sources = list(variables) if variables is not None else [None] * len(grads)
        return reduce_gradients(list(grads), sources, self._hvd_compression, self._hvd_sparse_as_dense,
                                self._hvd_op)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if self._hvd_passes > 1:
            self._hvd_index = {id(v): i for i, v in enumerate(variables)}
            self._hvd_sums = [self.add_variable_from_reference(v, "hvd_gradient_sum") for v in variables]
            self._hvd_count = self.add_variable((), initializer="zeros", dtype="int64", name="hvd_backward_passes")

    def apply(self, grads, trainable_variables=None):
        if self._hvd_passes == 1:
            return super().apply(self._hvd_reduce(grads, trainable_variables), trainable_variables)
        if trainable_variables is None:
            raise ValueError("backward_passes_per_step > 1 needs the variables passed with the gradients")
        variables = list(trainable_variables)
        if not self.built:
            self.build(variables)
        sums = [self._hvd_sums[self._hvd_index[id(v)]] for v in variables]
        for total, g in zip(sums, grads, strict=True):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        self._hvd_count.assign_add(1)
        apply = super().apply

        def update():
            scale = 1.0 / self._hvd_passes if self._hvd_average_aggregated else 1.0
            local = [tf.convert_to_tensor(t) * tf.cast(scale, t.dtype) for t in sums]
            apply(self._hvd_reduce(local, variables), variables)
            for total in sums:
                total.assign(tf.zeros_like(total))
            return tf.constant(True)

        return tf.cond(self._hvd_count % self._hvd_passes == 0, update, lambda: tf.constant(False))


def distributed_class(base: type, **defaults) -> type:
    """`base` (a Keras optimizer class) with its updates combined over the ranks,
    under base's own name and module (so what it saves loads as a plain `base`)."""
    attrs = {f"_hvd_{k}": v for k, v in defaults.items()}
    return type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__, **attrs})


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False):
    """A new optimizer of `optimizer`'s class and config whose updates use the
    gradients combined over the ranks (op Average: their mean)."""
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
    cls = distributed_class(type(optimizer))
    config = optimizer.get_config()
    if name:
        config["name"] = name
    distributed = cls.from_config(config)
    distributed._hvd_compression, distributed._hvd_sparse_as_dense, distributed._hvd_op = \
        compression, sparse_as_dense, op
    distributed._hvd_passes = int(backward_passes_per_step)
    distributed._hvd_average_aggregated = bool(average_aggregated_gradients)
    return distributed
