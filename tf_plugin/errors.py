"""The errors tf_plugin raises of its own, in one place (rdmatensor's, such as
PlanMismatch, are rdmatensor.errors').

Most are plain Python classes and load nothing: tf_plugin.core raises them
and stays framework-free. Two are TensorFlow's types as well, so that a
script written for Horovod catches them (graph/tf_errors.py raises them):
CollectiveMismatch and InvalidArgument. They are built on first access, once
per process, and only then is TensorFlow imported.
"""
from __future__ import annotations

import threading

from rdmatensor import PlanMismatch, RdmaTensorError, UsageError


class NonFiniteValue(RdmaTensorError):
    """A NaN or Inf in an all-reduce (RDMATENSOR_CHECK_FINITE): `tensor` names it,
    `peer` is this rank when its own value held it, else None."""


class SettingError(UsageError, ValueError):
    """An environment variable whose value cannot be used."""


class NotAMember(ValueError):
    """This rank called a collective of a process set it is not in."""


class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a rank: roll back to the last commit and re-form."""


class HostsUpdatedInterrupt(RuntimeError):
    """The job's workers changed: re-form, keeping the current state (skip_sync: no new worker needs it)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync


class JobError(ValueError):
    """A job description that cannot run, saying which field is wrong."""


TENSORFLOW_TYPED = ("CollectiveMismatch", "InvalidArgument")
_building = threading.Lock()       # two threads' first use must get the same classes, or `except` misses


def _tensorflow_typed() -> dict:
    import tensorflow as tf

    class CollectiveMismatch(PlanMismatch, tf.errors.FailedPreconditionError):
        """The ranks called different collectives (or tensors of different shapes or dtypes)."""
        __qualname__ = "CollectiveMismatch"

        # (node_def, op, message) as TensorFlow's own errors take them, so that autograph re-raises
        # this type (not a StagingError) when it surfaces through a traced function; or (message).
        def __init__(self, node_def=None, op=None, message=None, *payloads, peer: int | None = None,
                     tensor: str | None = None):
            if message is None:
                node_def, message = None, node_def
            tf.errors.FailedPreconditionError.__init__(self, None, None, message)
            self.peer, self.tensor = peer, tensor

        def __str__(self) -> str:
            return self.message

    class InvalidArgument(ValueError, tf.errors.InvalidArgumentError):
        """A collective's arguments are wrong on this rank (splits that do not add up, a scalar to gather)."""
        __qualname__ = "InvalidArgument"

        def __init__(self, node_def=None, op=None, message=None, *payloads):    # as CollectiveMismatch's
            if message is None:
                node_def, message = None, node_def
            tf.errors.InvalidArgumentError.__init__(self, None, None, message)

        def __str__(self) -> str:
            return self.message

    return {"CollectiveMismatch": CollectiveMismatch, "InvalidArgument": InvalidArgument}


def __getattr__(name: str):
    if name not in TENSORFLOW_TYPED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _building:
        if name not in globals():
            globals().update(_tensorflow_typed())
    return globals()[name]


def __dir__():
    return sorted(set(globals()) | set(TENSORFLOW_TYPED))
