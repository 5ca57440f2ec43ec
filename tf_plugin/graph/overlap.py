"""The all-reduce inside a tf.function, overlapped with backprop (as Horovod does).

Per bucket (layout.buckets_of: gradients in the order backprop produces
them), two small stateful ops:

- launch: its inputs are only that bucket's gradients, so TensorFlow's
  executor runs it as soon as they are computed, while the rest of backprop
  goes on. It hands the arrays (aliases of TensorFlow's buffers, kept alive by
  them) to the communication thread (executor/comm_thread.py) and returns at once.
- wait: returns the bucket's flat output once its ring is done (a 64-byte
  aligned, reused buffer: TensorFlow takes it with no copy), which the graph
  slices into the members, each a view. One output per bucket, not one per
  tensor: numpy_function converts each output on its own, about 9 us apiece
  here, on the step's critical path (3.3 ms for DenseNet121's 364 gradients,
  bench/graph_boundary.py).

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

from ..core.buffers import TF_ALIGN
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


def bucketed(tensors: list, layouts: list[list[tuple]], launch, collect, name: str) -> list:
    """The all-reduced tensors, in a graph. `layouts[j]`: bucket j's members, in
    order, as (position in `tensors`, offset in the bucket's flat output, shape:
    the plan's, which the tensor's static shape may only partly know, as a
    sparse gradient made dense); `launch(j, arrays)` hands bucket j over and
    returns its round's number, `collect(j, number)` returns that round's flat
    output (a step never takes an earlier step's result). A tensor in no bucket (zero elements)
    comes back as zeros."""
    tokens, out = [], [None] * len(tensors)
    with in_program_order() as done:
        previous = []
        for j, layout in enumerate(layouts):
            with tf.control_dependencies(previous):
                token = numpy_function(_launcher(launch, j), [tensors[p] for p, _, _ in layout], tf.int64,
                                       f"{name}_launch", lambda arrays: np.int64(-1))
            tokens.append(token)
            previous = [token]
    with tf.control_dependencies(tokens):
        for j, layout in enumerate(layouts):
            dtype = tensors[layout[0][0]].dtype
            members = [(p, offset, tuple(shape), int(np.prod(shape))) for p, offset, shape in layout]
            size = max(offset + n for _, offset, _, n in members)
            odd = [m for m in members if not _sliced_in_place(m[1], m[3], size, dtype.size)]
            results = numpy_function(_collector(collect, j, size, dtype.as_numpy_dtype,
                                                [(offset, n) for _, offset, _, n in odd]), [tokens[j]],
                                     [dtype] * (1 + len(odd)), f"{name}_wait",
                                     lambda _, dtype=dtype, odd=odd, size=size: [
                                         np.zeros(k, dtype.as_numpy_dtype) for k in (size, *(m[3] for m in odd))])
            flat, separate = results[0], dict(zip((m[0] for m in odd), results[1:], strict=True))
            flat.set_shape([size])
            for p, offset, shape, n in members:
                whole = separate.get(p)
                if whole is None:
                    whole = flat if n == size else tf.slice(flat, [offset], [n])
                out[p] = tf.reshape(whole, shape)
            done(flat.op)
    return [t if t is not None else tf.zeros_like(tensors[p]) for p, t in enumerate(out)]


def _sliced_in_place(offset: int, n: int, size: int, itemsize: int) -> bool:
    """Whether TensorFlow slices elements [offset, offset + n) of a flat tensor of
    `size` as a view, not a copy: the whole tensor, or a start and a length on its
    buffer alignment (its Slice kernel's test). A member that is not goes out of
    the wait op as its own output (a view TensorFlow takes with no copy)."""
    return n == size or (offset * itemsize % TF_ALIGN == 0 and n * itemsize % TF_ALIGN == 0)


def _launcher(launch, j: int):
    def run(*arrays):
        return np.int64(launch(j, list(arrays)))     # the round's number: its wait collects that round alone
    return run


def _collector(collect, j: int, size: int, dtype, odd: list):
    def run(token):
        flat = collect(j, int(token))
        if flat.shape != (size,) or flat.dtype != dtype:    # sliced by the graph's layout: never a wrong value
            raise RuntimeError(f"bucket {j}'s result is {flat.shape} {flat.dtype}; the graph lays out "
                               f"({size},) {np.dtype(dtype)}")
        return [flat, *(flat[offset:offset + n] for offset, n in odd)]
    return run
