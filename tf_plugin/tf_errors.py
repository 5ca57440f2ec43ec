"""rdmatensor's errors as the TensorFlow error types Horovod raises for the same misuse.

A script written for Horovod catches TensorFlow's types: a collective whose
tensors differ between ranks raises tf.errors.FailedPreconditionError there.
The errors raised here are both: rdmatensor's class (with its `peer` and
`tensor`, and the message naming the call and both ranks' tensors) and
TensorFlow's, so either `except` clause catches them.

Eagerly, the collective raises them itself. Inside a graph, TensorFlow turns
any exception of a numpy_function into tf.errors.UnknownError, whose message
still names rdmatensor's class and the call.
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

from rdmatensor import PlanMismatch


class CollectiveMismatch(PlanMismatch, tf.errors.FailedPreconditionError):
    """The ranks called different collectives (or tensors of different shapes or dtypes)."""

    def __init__(self, message: str, *, peer: int | None = None, tensor: str | None = None):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.peer, self.tensor = peer, tensor

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def as_horovod_errors():
    """Raise rdmatensor's errors as the TensorFlow types Horovod raises."""
    try:
        yield
    except PlanMismatch as exc:
        if isinstance(exc, tf.errors.OpError):
            raise
        raise CollectiveMismatch(str(exc), peer=exc.peer, tensor=exc.tensor) from exc
