"""horovod.tensorflow.elastic over rdmatensor: training that survives a lost rank.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                step()
                if state.batch % 10 == 0:
                    state.commit()

    train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0))

core/elastic.py says how a job re-forms; this module adds TensorFlow's states
(variables, a Keras model and its optimizer) and counts TensorFlow's errors
as a lost rank's or a diverged call's.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from ..core import elastic as _elastic
from ..core.elastic import ObjectState, State
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from .tensors import broadcast_variables


def run(func):
    """Run `func(state, ...)` until it returns, re-forming the job whenever a rank is
    lost (state restored to its last commit) or workers are added (state kept)."""
    return functools.wraps(func)(_elastic.run(func, failures=(tf.errors.OpError,),
                                              mismatches=(tf.errors.FailedPreconditionError,)))


class TensorFlowState(ObjectState):
    """A list of TensorFlow variables (eagerly), plus keyword values as in ObjectState."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState needs its variables (TF2 has no global variable collection)")
        self.variables = list(variables)
        self._values = [v.numpy() for v in self.variables]
        super().__init__(**kwargs)

    def save(self) -> None:
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self) -> None:
        for v, value in zip(self.variables, self._values, strict=True):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.variables, root_rank=0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """A built Keras model and its optimizer (Keras 3 or tf.keras), plus keyword values."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model, self.backend = model, backend
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self) -> list:
        optimizer = self.optimizer
        if optimizer is not None and not getattr(optimizer, "built", True):
            optimizer.build(self.model.trainable_variables)      # a new worker: slots as rank 0 has them
        return list(self.model.variables) + _optimizer_variables(optimizer)

    def _save_model(self) -> None:
        self._saved_values = [v.numpy() for v in self._variables()]

    def _load_model(self) -> None:
        for v, value in zip(self._variables(), self._saved_values, strict=True):
            v.assign(value)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().sync()


__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
