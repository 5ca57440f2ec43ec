"""rdmatensor's errors raised as the TensorFlow error types Horovod raises for the same misuse.

A script written for Horovod catches TensorFlow's types: a collective whose
tensors differ between ranks raises tf.errors.FailedPreconditionError there.
The errors raised here (CollectiveMismatch, InvalidArgument: tf_plugin.errors
defines them with the others) are both: rdmatensor's class (with its `peer`
and `tensor`, and the message naming the call and both ranks' tensors) and
TensorFlow's, so either `except` clause catches them.

Eagerly, the collective raises them itself. Inside a graph (tf.function, or a
TF1 session), TensorFlow turns any exception of a numpy_function into
tf.errors.UnknownError; so a graph's collective returns a status with its
outputs, and a status that says "mismatch" makes an op raise
FailedPreconditionError (a read of a variable that never exists: the one
stock op that raises that type on demand). Its message can only be fixed
when the graph is built, so the collective's own message is logged.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import tensorflow as tf

from rdmatensor import PlanMismatch

from ..errors import CollectiveMismatch, InvalidArgument

log = logging.getLogger("rdmatensor")
MISMATCH = ("rdmatensor: the ranks called different collectives; this rank logged which (the "
            "'rdmatensor' logger)")


@contextlib.contextmanager
def as_horovod_errors():
    """Raise rdmatensor's errors as the TensorFlow types Horovod raises: a
    mismatch as FailedPreconditionError, a bad argument (ValueError) as
    InvalidArgumentError. (In a graph, numpy_function already turns a ValueError
    into InvalidArgumentError.)"""
    try:
        yield
    except tf.errors.OpError:
        raise
    except PlanMismatch as exc:
        raise CollectiveMismatch(str(exc), peer=exc.peer, tensor=exc.tensor) from exc
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def refuse_in_xla(what: str) -> None:
    """Raise InvalidArgument now, at trace time, when the graph being built is
    compiled by XLA (tf.function(jit_compile=True)): `what` runs in Python
    there, which XLA cannot compile; without this, XLA fails later, deep
    inside the compilation, naming PyFunc."""
    from tensorflow.python.ops import control_flow_util
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise InvalidArgument(
            f"{what} runs in Python, which XLA cannot compile: compile this function with jit_compile=False. "
            f"Under XLA only the all-reduce (hvd.allreduce, grouped_allreduce, DistributedGradientTape, "
            f"DistributedOptimizer) of ranks on one host over shm, with static shapes and Sum, Average, Min, "
            f"Max or Product, runs (docs/native-ops.md)")


def numpy_function(fn, inputs: list, Tout, name: str, fallback):
    """tf.numpy_function(fn, inputs, Tout), stateful, for a collective in a graph:
    a PlanMismatch that fn raises reaches TensorFlow as FailedPreconditionError.
    `fallback(arrays)` gives outputs of the right dtypes for that case (never
    read: the op that follows raises first). Refused under XLA (refuse_in_xla)."""
    refuse_in_xla(f"the collective {name!r}")
    single = not isinstance(Tout, (list, tuple))
    touts = [Tout] if single else list(Tout)

    def run(*arrays):
        try:
            out, status = fn(*arrays), 0
        except PlanMismatch as exc:
            log.error("a collective failed on this rank: %s", exc)
            out, status = fallback(arrays), 1
        return ([out] if single else list(out)) + [np.int32(status)]

    outs = tf.numpy_function(run, inputs, touts + [tf.int32], stateful=True, name=name)
    failed = tf.cond(outs[-1] > 0, _failed_precondition, lambda: tf.constant(0, tf.int32))
    with tf.control_dependencies([failed]):
        results = [tf.identity(o) for o in outs[:-1]]
    return results[0] if single else results


def _failed_precondition():
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=MISMATCH)
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)
