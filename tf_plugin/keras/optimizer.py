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
collectives. As in Horovod, `iterations` counts every backward pass.
"""
from __future__ import annotations

import types

import tensorflow as tf

from ..core.world import group_of
from ..horovod.compression import Compression
from ..horovod.gradient_tape import local_variables, reduce_shared
from ..core.world import Average


class _DistributedOptimizer:
    """Mixed in before a Keras optimizer class. The class attributes are the
    defaults of an optimizer made by deserialization (load_model)."""
    _hvd_compression, _hvd_sparse_as_dense, _hvd_op = Compression.none, False, Average
    _hvd_passes, _hvd_average_aggregated = 1, False
    _hvd_predivide, _hvd_scale_local, _hvd_process_set = 1.0, True, None
    _hvd_reduced = False          # set by _compute_gradients: apply() must not combine the gradients again

    @property
    def _hvd_local(self) -> set:
        if "_hvd_local_ids" not in self.__dict__:
            self.__dict__["_hvd_local_ids"] = set()
        return self.__dict__["_hvd_local_ids"]

    def register_local_var(self, var) -> None:
        """Keep this variable's gradient local: it is not combined over the ranks
        (divided by the number of ranks, with scale_local_gradients)."""
        self._hvd_local.add(id(var))

    def _hvd_reduce(self, grads, variables):
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        return reduce_shared(grads, variables, self._hvd_local, self._hvd_compression, self._hvd_sparse_as_dense,
                             self._hvd_op, self._hvd_predivide, self._hvd_scale_local, self._hvd_process_set)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """[(gradient, variable)] of `loss` (a tensor with `tape`, or a callable),
        combined over the ranks when every backward pass is applied (Horovod's
        and TF-Keras 2's method; Keras 3 optimizers have none)."""
        var_list = list(var_list)
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            with tape:
                for v in var_list:
                    tape.watch(v)
                loss = loss()
        grads = tape.gradient(loss, var_list, grad_loss)
        if self._hvd_passes == 1:
            grads = self._hvd_reduce(grads, var_list)
            self._hvd_reduced = True
        return list(zip(grads, var_list, strict=True))

    def apply_gradients(self, grads_and_vars, **kwargs):
        """Keras 3's apply_gradients; TF-Keras 2's keyword arguments
        (experimental_aggregate_gradients, name) are accepted and ignored."""
        return super().apply_gradients(grads_and_vars)

    @property
    def _agg_helper(self):
        """Horovod's view of local aggregation: `counter`, the backward passes since the last update."""
        return types.SimpleNamespace(counter=self._hvd_count)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if self._hvd_passes > 1:
            self._hvd_index = {id(v): i for i, v in enumerate(variables)}
            self._hvd_sums = [self.add_variable_from_reference(v, "hvd_gradient_sum") for v in variables]
            self._hvd_count = self.add_variable((), initializer="zeros", dtype="int64", name="hvd_backward_passes")

    def apply(self, grads, trainable_variables=None):
        reduced, self._hvd_reduced = self._hvd_reduced, False
        if self._hvd_passes == 1:
            if not reduced:
                grads = self._hvd_reduce(grads, trainable_variables)
            return super().apply(grads, trainable_variables)
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
            self._hvd_count.assign(0)
            return tf.constant(True)

        def skip():            # as Horovod: every backward pass counts as an iteration
            self.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(self._hvd_count >= self._hvd_passes, update, skip)


def distributed_class(base: type, **defaults) -> type:
    """`base` (a Keras optimizer class) with its updates combined over the ranks,
    under base's own name and module (so what it saves loads as a plain `base`)."""
    attrs = {f"_hvd_{k}": v for k, v in defaults.items()}
    return type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__, **attrs})


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op=Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                         process_set=None, scale_local_gradients: bool = True):
    """A new optimizer of `optimizer`'s class and config whose updates use the
    gradients combined over the ranks (op Average: their mean). Horovod's
    signature; `groups` and `num_groups` are accepted (rdmatensor fuses by its
    own threshold). `process_set`: the ranks the gradients are combined over."""
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    group_of(process_set)               # a set that is not registered: ValueError now, not at the first step
    cls = distributed_class(type(optimizer))
    config = optimizer.get_config()
    if name:
        config["name"] = name
    distributed = cls.from_config(config)
    distributed._hvd_compression, distributed._hvd_sparse_as_dense, distributed._hvd_op = \
        compression, sparse_as_dense, op
    distributed._hvd_passes = int(backward_passes_per_step)
    distributed._hvd_average_aggregated = bool(average_aggregated_gradients)
    distributed._hvd_predivide, distributed._hvd_scale_local = gradient_predivide_factor, scale_local_gradients
    distributed._hvd_process_set = process_set
    return distributed


def PartialDistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op=Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups=None, process_set=None, local_layers=None, scale_local_gradients: bool = True):
    """A DistributedOptimizer whose `local_layers`' trainable variables keep their local gradients."""
    local = local_variables(local_layers)
    distributed = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                       gradient_predivide_factor, op, backward_passes_per_step,
                                       average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for v in local:
        distributed.register_local_var(v)
    return distributed
