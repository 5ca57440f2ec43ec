"""horovod.tensorflow.keras.callbacks for Keras 3's `fit`."""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ..horovod import tensors as horovod
from ..core.world import rank, size


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every variable of the model and its optimizer (BatchNorm statistics and
    optimizer slots too) takes root_rank's value before the first step, so ranks
    that initialized differently start alike. The optimizer is built first where
    Keras would only build it in the first step (its slots must be broadcast
    too); a model still unbuilt when training begins is broadcast after its first
    batch. `local_variables` keep this rank's values."""

    def __init__(self, root_rank: int, device: str = "", local_variables=None):
        super().__init__()
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (tf.Variable, keras.Variable)):
            local_variables = [local_variables]
        elif not all(isinstance(v, (tf.Variable, keras.Variable)) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        self.root_rank = root_rank
        self.local_variables = {id(v) for v in local_variables}     # kept as this rank has them
        self.broadcast_done = False

    def _broadcast(self):
        # An unbuilt model may already hold variables (a Dropout layer's seed
        # state), but not yet its weights: building the optimizer now would tie
        # it to none of them.
        if self.broadcast_done or not self.model.variables or not getattr(self.model, "built", True):
            return
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        variables = list(self.model.variables) + list(getattr(optimizer, "variables", None) or [])
        variables = [v for v in variables if id(v) not in self.local_variables]
        horovod.broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, every metric in the logs becomes its average over the
    ranks (one all-reduce of them all). Put it before the callbacks that read
    metrics (checkpoints, schedules, TensorBoard); History sees the averages."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in names], np.float64)
        averaged = np.asarray(horovod.allreduce(values, name="metrics/" + ",".join(names)))
        for k, v in zip(names, averaged, strict=True):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to initial_lr * multiplier(epoch) between start_epoch
    and end_epoch (end excluded): at each epoch's first batch (staircase), or at
    every batch with fractional epochs. A number as `multiplier` decays
    exponentially: multiplier ** (epoch - start_epoch). Momentum correction as
    in LearningRateWarmupCallback."""

    def __init__(self, initial_lr: float, multiplier, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = float(initial_lr), start_epoch, end_epoch
        self.staircase, self.momentum_correction, self.steps_per_epoch = staircase, momentum_correction, \
            steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else \
            (lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch = 0
        self._restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError("Could not autodetect the number of steps per epoch: pass steps_per_epoch to "
                                 f"{type(self).__name__}()")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and
                                                     self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(optimizer.learning_rate)
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old > 0:
            self._restore_momentum = float(momentum)
            momentum.assign(self._restore_momentum * new / old)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over the first
    warmup_epochs, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD"):
    lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1), epoch
    counting fractions of an epoch. With momentum_correction, a momentum held in
    a variable is scaled by new_lr / old_lr for the batch where the lr changes
    (Keras 3's SGD keeps momentum as a constant: nothing to correct there)."""

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        super().__init__(initial_lr, self._warmup, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def _warmup(self, epoch: float) -> float:
        epoch += 1.0 / self.steps_per_epoch       # the last batch of an epoch reaches a round number
        return 1.0 / size() * (epoch * (size() - 1) / self.warmup_epochs + 1)

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") or 1

    def on_epoch_end(self, epoch, logs=None):
        if epoch == int(np.ceil(self.warmup_epochs)) - 1 and self.verbose and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate):g}.")
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate)
