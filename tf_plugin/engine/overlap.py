"""The all-reduce inside a tf.function, overlapped with backprop (as Horovod does).

Per bucket (analyzer.buckets_of: gradients in the order backprop produces
them), two small stateful ops:

- launch: its inputs are only that bucket's gradients, so TensorFlow's
  executor runs it as soon as they are computed, while the rest of backprop
  goes on. It hands the arrays (aliases of TensorFlow's buffers, kept alive by
  them) to the communication thread (background.py) and returns at once.
- wait: returns the bucket's results once its ring is done (64-byte aligned
  views of a reused buffer: TensorFlow takes them with no copy).

Every wait runs after every launch of its all-reduce (control dependencies):
a wait blocks one of TensorFlow's inter-op threads, and it must never hold
one that a launch, or the backprop feeding it, still needs. The launches are
chained in bucket order, so every rank hands its buckets over in the plan's
order (the communication thread runs them in that order anyway), and the
first launch of an all-reduce waits for the last op of the previous
collective built in the same graph (in_program_order): two all-reduces of
one tensor set never mix their buckets, and every rank runs a graph's
collectives in the order the script built them, whether or not
TensorFlow's automatic control dependencies order them.
"""
from __future__ import annotations

import contextlib
import weakref

import numpy as np
import tensorflow as tf

from .tf_errors import numpy_function

_last = weakref.WeakKeyDictionary()     # graph -> the last op of the latest collective built in it


@contextlib.contextmanager
def in_program_order():
    """Build a collective's ops to run after the previous collective built in the
    same graph: every rank then runs a graph's collectives in the order the
    script built them (TensorFlow alone may run independent ops in any order,
    and ranks would call different collectives), and when one fails, the later
    ones of the same run do not start (a collective still queued on one rank
    only would put the ranks out of step). Yields done(op), to call with the
    collective's last op.

    In a TF1 graph, a session.run that fetches a collective also runs the
    collectives built before it in the same graph, as control dependencies:
    build what runs once (a broadcast of the initial variables) after the
    training step, as Horovod's BroadcastGlobalVariablesHook does, or in a
    graph of its own."""
    graph = tf.compat.v1.get_default_graph()
    previous = _last.get(graph)

    def done(op) -> None:
        _last[graph] = op

    with tf.control_dependencies([previous] if previous is not None else []):
        yield done


def static(tensors) -> bool:
    """Whether every tensor's shape is known when the graph is built."""
    return all(t.shape.is_fully_defined() for t in tensors)


def bucketed(tensors: list, members: list[list[int]], launch, collect, name: str) -> list:
    """The all-reduced tensors, in a graph. `members[j]`: the positions in
    `tensors` of bucket j's members, in order; `launch(j, arrays)` hands bucket
    j over, `collect(j)` returns its members' results. A tensor in no bucket
    (zero elements) comes back as zeros."""
    tokens, out = [], [None] * len(tensors)
    with in_program_order() as done:
        previous = []
        for j, positions in enumerate(members):
            with tf.control_dependencies(previous):
                token = numpy_function(_launcher(launch, j), [tensors[p] for p in positions], tf.int64,
                                       f"{name}_launch", lambda arrays: np.int64(-1))
            tokens.append(token)
            previous = [token]
    with tf.control_dependencies(tokens):
        for j, positions in enumerate(members):
            dtypes = [tensors[p].dtype for p in positions]
            results = numpy_function(_collector(collect, j), [tokens[j]], dtypes, f"{name}_wait",
                                     lambda _, dtypes=dtypes: [np.zeros(0, d.as_numpy_dtype) for d in dtypes])
            for p, r in zip(positions, results, strict=True):
                r.set_shape(tensors[p].shape)
                out[p] = r
            done(results[0].op)
    return [t if t is not None else tf.zeros_like(tensors[p]) for p, t in enumerate(out)]


def _launcher(launch, j: int):
    def run(*arrays):
        launch(j, list(arrays))
        return np.int64(j)
    return run


def _collector(collect, j: int):
    def run(_token):
        return collect(j)
    return run
