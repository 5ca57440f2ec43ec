"""Training that survives a lost rank, with no framework: Horovod's elastic
State, ObjectState and run (horovod/elastic.py adds TensorFlow's states and
TensorFlow's errors).

Started by `rdmatensor-run --min-np/--max-np --host-discovery-script`, each
worker joins the job through the launcher's rendezvous. When a rank is lost,
every collective of the others fails (the job fails as a whole, see
failure.py); `run` sees that the job lost a rank, restores the last
commit, closes every session and joins the next round with the workers left:
a new plan, new arenas, new rings. When the launcher has new workers waiting,
the next `commit()` raises HostsUpdatedInterrupt on every rank alike and the
job re-forms with them, rank 0 handing its state to all (`sync`).

As in Horovod: HorovodInternalError means roll back to the last commit,
HostsUpdatedInterrupt keeps the current state.
"""
from __future__ import annotations

import copy
import functools

from rdmatensor import PeerLost, PlanMismatch

from rdmatensor.runner import rendezvous_client as rendezvous
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from . import world as _world


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


def _reset() -> None:
    _world.shutdown()
    _world.init()


def run(func, failures: tuple = (), mismatches: tuple = ()):
    """Run `func(state, ...)` until it returns, re-forming the job whenever a rank is
    lost (state restored to its last commit) or workers are added (state kept).
    `failures`: a framework's error types that may stand for a lost rank (as PeerLost
    does); `mismatches`: those that may stand for ranks calling different collectives."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync, resets, sync_failed = False, 0, False
        while True:
            try:
                if not skip_sync:
                    _sync(state, resets > 0 and not sync_failed, mismatches)
                    sync_failed = False
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except (HorovodInternalError, PeerLost, *failures) as exc:
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


def _sync(state, after_reset: bool, mismatches: tuple = ()) -> None:
    """state.sync(). After a reset every rank that went through it syncs
    alike: a rank calling another collective is a worker that just joined and runs one
    before run() (a warm-up step at the top of the script). It fails there and exits; the
    job forms again without it (the launcher does not refill its slot), so the others go
    on. Raised as it is on a first sync, and when the sync after that re-forming fails
    too (then the ranks that went through the reset differ: the script's own error)."""
    try:
        state.sync()
    except (PlanMismatch, *mismatches) as exc:
        if not after_reset or not rendezvous.configured():
            raise
        raise _SyncFailed(f"the state's sync after a reset failed: a worker that joined calls "
                          f"another collective before hvd.elastic.run ({exc})") from exc


class _SyncFailed(HorovodInternalError):
    """The state's sync after a reset failed: re-form once more, then raise."""


__all__ = ["run", "State", "ObjectState"]
