"""horovod.tensorflow.elastic over rdmatensor: training that survives a lost rank.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                step()
                if state.batch % 10 == 0:
                    state.commit()

    train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0))

Started by `rdmatensor-run --min-np/--max-np --host-discovery-script`, each
worker joins the job through the launcher's rendezvous. When a rank is lost,
every collective of the others fails (the job fails as a whole, see
engine/failure.py); `run` sees that the job lost a rank, restores the last
commit, closes every session and joins the next round with the workers left:
a new plan, new arenas, new rings. When the launcher has new workers waiting,
the next `commit()` raises HostsUpdatedInterrupt on every rank alike and the
job re-forms with them, rank 0 handing its state to all (`sync`).

As in Horovod: HorovodInternalError means roll back to the last commit,
HostsUpdatedInterrupt keeps the current state. This module imports TensorFlow.
"""
from __future__ import annotations

import copy
import functools

import tensorflow as tf

from rdmatensor import PeerLost, PlanMismatch

from rdmatensor.runner import rendezvous_client as rendezvous
from . import world as _world
from .tensors import broadcast_variables


class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a rank: roll back to the last commit and re-form."""


class HostsUpdatedInterrupt(RuntimeError):
    """The job's workers changed: re-form, keeping the current state (skip_sync: no new worker needs it)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync


def _lost_rank() -> PeerLost | None:
    w = _world._world
    return w.failure.first if w is not None and w.failure is not None else None


def _updated() -> bool:
    """Whether the launcher has a different set of workers than this round's, decided by
    rank 0 and broadcast, so that every rank raises at the same commit."""
    w = _world.world()
    changed = w.rank == 0 and w.round >= 0 and rendezvous.configured() and rendezvous.updated(w.round)
    return bool(_world.broadcast_object(changed, 0, name="elastic:updated")) if w.size > 1 else changed


class State:
    """What a worker keeps across resets (Horovod's State): commit() saves it and checks
    for new workers, restore() goes back to the last commit, sync() takes rank 0's."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or (lambda obj: _world.broadcast_object(obj, 0, name="elastic:state"))
        self._rank = get_rank or _world.rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Call each of `callbacks` after every reset (a worker lost or added), e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state; raise HostsUpdatedInterrupt (on every rank) when workers wait to join."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        if _updated():
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before sync: override to rebuild what depends on the job's size."""


class ObjectState(State):
    """Python values, given as keyword arguments and kept as attributes."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))


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


def _reset() -> None:
    _world.shutdown()
    _world.init()


def run(func):
    """Run `func(state, ...)` until it returns, re-forming the job whenever a rank is
    lost (state restored to its last commit) or workers are added (state kept)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync, resets, sync_failed = False, 0, False
        while True:
            try:
                if not skip_sync:
                    _sync(state, resets > 0 and not sync_failed)
                    sync_failed = False
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except (HorovodInternalError, PeerLost, tf.errors.OpError) as exc:
                sync_failed = isinstance(exc, _SyncFailed)
                if not isinstance(exc, HorovodInternalError) and _lost_rank() is None:
                    raise                           # not a lost rank: the script's own error
                if not rendezvous.configured():
                    raise                           # no launcher to re-form the job with
                state.restore()
                skip_sync = False
            _reset()
            resets += 1
            state.on_reset()

    return wrapper


def _sync(state, after_reset: bool) -> None:
    """state.sync(). After a reset every rank that went through it syncs
    alike: a rank calling another collective is a worker that just joined and runs one
    before run() (a warm-up step at the top of the script). It fails there and exits; the
    job forms again without it (the launcher does not refill its slot), so the others go
    on. Raised as it is on a first sync, and when the sync after that re-forming fails
    too (then the ranks that went through the reset differ: the script's own error)."""
    try:
        state.sync()
    except (PlanMismatch, tf.errors.FailedPreconditionError) as exc:
        if not after_reset or not rendezvous.configured():
            raise
        raise _SyncFailed(f"the state's sync after a reset failed: a worker that joined calls "
                          f"another collective before hvd.elastic.run ({exc})") from exc


class _SyncFailed(HorovodInternalError):
    """The state's sync after a reset failed: re-form once more, then raise."""


__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
