"""horovod.tensorflow.keras.elastic for Keras 3: `fit` that survives a lost rank.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(data, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state)])

    train(state)

The callbacks are Horovod's, with its semantics: commit every
`batches_per_commit` batches and at each epoch's end; `state.batch` and
`state.epoch` follow training (the epoch counted across resets).
"""
from __future__ import annotations

import keras

from ..horovod.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                               TensorFlowKerasState, run)


class KerasState(TensorFlowKerasState):
    """A built Keras model, its optimizer (default: the compiled one) and keyword values."""


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the state every `batches_per_commit` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit     # alike on every rank after a reset

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """`state.batch`: the last batch done in this epoch (0 after an epoch ends)."""

    def __init__(self, state):
        super().__init__()
        self.state, self.steps_per_epoch = state, None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """`state.epoch`: epochs done, counted across resets (fit's own count restarts at 0)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt"]
