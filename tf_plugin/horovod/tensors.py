"""horovod.tensorflow's tensor API over rdmatensor (`import tf_plugin as hvd`).

Every collective takes TensorFlow tensors, eagerly or inside tf.function:
eagerly it runs right there on numpy aliases of the tensors; in a graph it
is one stateful tf.numpy_function, so it runs in program order and blocks
one of TensorFlow's inter-op threads while it waits; an all-reduce of tensors
with static shapes is one launch op and one wait op per bucket instead, its
rings overlapping backprop (tf_plugin.graph.overlap), or, with
RDMATENSOR_TF_OPS=native and every rank of the set on one host, the native
ops' launch and completion per bucket (tf_plugin.graph.native_allreduce). What moves and where it lands
is tf_plugin.core.collectives' business: the first call of a tensor set extends
the plan once, later calls cost no control call.

Outputs reach TensorFlow with no copy where they are 64-byte aligned (the
ring's outputs are): see ingest.borrow.

The gradient tapes built on reduce_gradients are gradient_tape.py's (it
imports this module, never the other way); the compressors, compression.py's.
"""
from __future__ import annotations

import time
import types

import numpy as np
import tensorflow as tf

from ..core import adasum
from ..graph import ingest
from ..graph import native_allreduce
from ..graph import overlap
from ..core.layout import var_key
from ..core.reductions import allreduce_op
from ..errors import InvalidArgument, NotAMember
from ..graph.tf_errors import as_horovod_errors, numpy_function
from ..graph.tracing import graph_code
from ..core.process_sets import Group
from ..core.world import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather_object, group_of, member_of,
                          world)
from .compression import Compression, NoneCompressor

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "broadcast_variables", "broadcast_global_variables", "alltoall", "reducescatter", "grouped_reducescatter",
           "join", "rank_op", "local_rank_op", "size_op", "local_size_op"]


# ---------------------------------------------------------------- plumbing
REDUCTION = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product", Adasum: "adasum"}


def _op(average, op):
    """Horovod's `op` (or the deprecated `average`) as a ReduceOp; Average by default."""
    if average is not None and op is not None:
        raise ValueError("give either average or op, not both")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else ReduceOp(op)


def _reduction(op) -> str:
    """A dense all-reduce's reduction, as the collectives name it."""
    return REDUCTION[ReduceOp(op)]


def _adasum_fits(tensors, names, group: Group) -> None:
    """Adasum's conditions, as Horovod's: a power-of-two number of ranks (in the
    set: Horovod takes the global set only), float tensors."""
    if not adasum.is_power_of_two(group.size):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    for n, t in zip(names, tensors, strict=True):
        if t is not None and t.dtype.as_numpy_dtype not in adasum.DTYPES:
            raise InvalidArgument(f"allreduce of {n!r}: Adasum combines float16, float32 and float64 tensors, "
                                  f"not {t.dtype.name}")


def _sparse_op(op) -> None:
    if ReduceOp(op) not in (Average, Sum):
        raise NotImplementedError("only hvd.Sum and hvd.Average are supported with tf.IndexedSlices (as in "
                                  "Horovod): pass sparse_as_dense=True for other ops")


def _names(items) -> list[str]:
    """What a tensor set calls its tensors: variables by name, anything else by position."""
    out = []
    for j, v in enumerate(items):
        try:
            out.append(var_key(v))
        except (AttributeError, ValueError):
            out.append(f"tensor{j}")
    return out


def _through_numpy(fn, tensors: list, shapes: list, name: str) -> list:
    """fn(list of ndarrays) -> ndarrays, one per tensor and of its dtype. Eager:
    called now, its outputs borrowed by TensorFlow; in a graph: one stateful
    numpy_function (tf_errors.numpy_function: Horovod's error types there too)."""
    if tf.executing_eagerly():
        with as_horovod_errors():
            outs = fn([np.asarray(t) for t in tensors])   # CPU tensors: aliases, no copy
        tally = world().collectives.meter.tally
        return [ingest.borrow(o, tally) for o in outs]
    with overlap.in_program_order() as done:
        outs = numpy_function(lambda *arrays: fn(list(arrays)), tensors, [t.dtype for t in tensors], name,
                              lambda arrays: [np.zeros(0, a.dtype) for a in arrays])
        done(outs[0].op)
    for o, shape in zip(outs, shapes, strict=True):
        o.set_shape(shape)
    return list(outs)


def _allreduce_many(tensors, names, op: str, compression, group: Group, prescale: float = 1.0,
                    postscale: float = 1.0, scatter: bool = False) -> list:
    """Eagerly: every bucket handed to the communication thread, then collected.
    In a graph, with static shapes: one launch op per bucket, fed only by that
    bucket's tensors, and one wait op per bucket (tf_plugin.graph.overlap), so rings run
    while backprop still computes later buckets; otherwise one numpy_function.
    `op`: a reduction of reductions.REDUCTIONS; the factors scale as Horovod's
    (tf_plugin.core.scaling); `scatter`: the all-reduce of a reducescatter."""
    packed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    sent = [p[0] for p in packed]
    collectives = group.collectives
    empty = not any(t.shape.num_elements() for t in sent) if overlap.static(sent) else False
    if (group.size == 1 or empty) and op != "adasum" and native_allreduce.in_xla() and overlap.static(sent):
        reduced = [native_allreduce.alone(t, prescale, postscale) for t in sent]     # nothing to move
    elif tf.executing_eagerly() or not overlap.static(sent) or group.size == 1 or op == "adasum" or empty:
        reduced = _through_numpy(lambda arrays: group.collectives.allreduce(names, arrays, op, prescale, postscale,
                                                                             scatter),
                                 sent, [t.shape for t in sent], "rdmatensor_allreduce")
    else:
        buckets = collectives.allreduce_group(names, [tuple(t.shape) for t in sent],
                                              [t.dtype.as_numpy_dtype for t in sent], op, prescale, postscale,
                                              scatter)
        layouts = [[(int(key), offset, sent[int(key)].shape) for key, offset, _ in b.members]
                   for b in buckets.buckets]
        native = native_allreduce.group_for(collectives, buckets, layouts, sent, world().failure) \
            if native_allreduce.applies(collectives, sent, op, scatter, elastic=world().round >= 0) else None
        if native is not None:       # every rank on one host: the compiled ops, no Python in the step
            reduced = native_allreduce.bucketed(sent, layouts, native, op, prescale, postscale,
                                                "rdmatensor_allreduce")
        else:
            # looked up at run time: an elastic reset replaces the collectives under a traced graph
            reduced = overlap.bucketed(sent, layouts, lambda *a: group.collectives.launch(buckets, *a),
                                       lambda *a: group.collectives.collect(buckets, *a), "rdmatensor_allreduce")
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


def _allgather_many(tensors, names, group: Group) -> list:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for n, t in zip(names, tensors, strict=True):
        if t.shape.rank == 0:
            raise InvalidArgument(f"allgather of {n!r}: a scalar has no first dimension to concatenate")
    return _through_numpy(lambda arrays: group.collectives.allgather(names, arrays), tensors,
                          [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors], "rdmatensor_allgather")


def _allgather_slices(slices: list, names: list, average: bool, group: Group) -> list:
    """Sparse gradients, as Horovod: every rank's rows and indices, concatenated;
    averaging divides the values by the number of ranks."""
    parts = [t for s in slices for t in (s.values, s.indices)]
    part_names = [f"{n}/{p}" for n in names for p in ("values", "indices")]
    gathered = _allgather_many(parts, part_names, group)
    out = []
    for k, s in enumerate(slices):
        values, indices = gathered[2 * k], gathered[2 * k + 1]
        if average:
            values = values / tf.cast(group.size, values.dtype)
        out.append(tf.IndexedSlices(values, indices, s.dense_shape))
    return out


@graph_code
def reduce_gradients(grads, sources, compression=NoneCompressor, sparse_as_dense: bool = False, op=Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=None):
    """Gradients (any nest matching `sources`, None kept) combined over the ranks (of the set):
    dense ones by one all-reduce, sparse ones (tf.IndexedSlices) by allgather unless
    `sparse_as_dense`. Shared by the gradient tapes and optimizers (gradient_tape.reduce_shared) and by
    grouped_allreduce of tf.IndexedSlices."""
    reduction = _reduction(op)
    group = _group(process_set)
    flat = tf.nest.flatten(grads)
    names = _names(tf.nest.flatten(sources))
    if len(names) != len(flat):
        names = [f"tensor{j}" for j in range(len(flat))]
    if sparse_as_dense:
        flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in flat]
    out = list(flat)
    dense = [j for j, g in enumerate(flat) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [j for j, g in enumerate(flat) if isinstance(g, tf.IndexedSlices)]
    if sparse:
        _sparse_op(op)
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("pre/postscale_factor are not supported with tf.IndexedSlices "
                                      "(as in Horovod): pass sparse_as_dense=True, or scale the values yourself")
    if dense:
        tensors = [tf.convert_to_tensor(flat[j]) for j in dense]
        given = tf.nest.flatten(sources)
        if len(given) == len(flat):
            tensors = [_shaped_as(t, given[j]) for t, j in zip(tensors, dense, strict=True)]
        if op == Adasum:
            _adasum_fits(tensors, [names[j] for j in dense], group)
        reduced = _allreduce_many(tensors, [names[j] for j in dense], reduction, compression, group,
                                  prescale_factor, postscale_factor)
        for j, r in zip(dense, reduced, strict=True):
            out[j] = r
    if sparse:
        gathered = _allgather_slices([flat[j] for j in sparse], [names[j] for j in sparse], reduction == "average",
                                     group)
        for j, r in zip(sparse, gathered, strict=True):
            out[j] = r
    return tf.nest.pack_sequence_as(grads, out)


def _shaped_as(grad, source):
    """A dense gradient has its source's shape. Where the tape lost part of it (a
    Dense layer over a 3-D input gives (None, units)), the source's, checked when
    the step runs: the all-reduce then plans it as a static tensor (its bucket
    preallocated, the native ops on one host), not as a dynamic one."""
    shape = getattr(source, "shape", None)
    if grad.shape.is_fully_defined() or shape is None or tf.executing_eagerly():
        return grad
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined() or not grad.shape.is_compatible_with(shape):
        return grad
    return tf.ensure_shape(grad, shape)


def plan_ahead(model) -> None:
    """Plan a built Keras model's first step now: the all-reduce of its trainable
    variables' gradients and the broadcast of all its variables from rank 0."""
    def described(variables):
        return [types.SimpleNamespace(shape=tuple(v.shape), dtype=np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype))
                for v in variables]
    trainable, every = list(model.trainable_variables), list(model.variables)
    threshold = world().collectives.threshold
    requests = [("allreduce", allreduce_op("average", threshold), _names(trainable), described(trainable)),
                ("broadcast", "0", _names(every), described(every))]
    world().collectives.ensure([r for r in requests if r[2]])


def _with_gradient(forward, backward):
    """forward(*tensors) -> tensor(s), differentiable with backward(upstream, inputs,
    outputs) -> the inputs' gradients (Horovod's gradient of each collective)."""
    @tf.custom_gradient
    def op(*tensors):
        out = forward(*tensors)

        def grad(*upstream):
            return backward(upstream, tensors, out)
        return out, grad
    return op


# --------------------------------------------------------------- public API
@graph_code
def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set=None, ignore_name_scope: bool = False):
    """The tensor combined over the ranks by `op`: Average (the default), Sum, Min,
    Max or Product; a tf.IndexedSlices is allgathered instead, as Horovod does
    (Average and Sum only). Differentiable: the gradient is the same all-reduce of
    the upstream gradient."""
    op = _op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        (out,) = grouped_allreduce([tensor], None, device_dense, device_sparse, compression, op, prescale_factor,
                                   postscale_factor, process_set, name=name)
        return out
    (out,) = grouped_allreduce([tensor], None, device_dense, device_sparse, compression, op, prescale_factor,
                               postscale_factor, process_set, name=name or "allreduce")
    return out


@graph_code
def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=None, ignore_name_scope: bool = False,
                      name: str | None = None) -> list:
    """allreduce of several tensors in one collective (one ring over fused buckets)."""
    op = _op(average, op)
    group = _group(process_set)
    tensors = list(tensors)
    base = name or "allreduce"
    names = [base if len(tensors) == 1 else f"{base}/{j}" for j in range(len(tensors))]
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return reduce_gradients(tensors, [types.SimpleNamespace(name=n) for n in names], compression, False, op,
                                prescale_factor, postscale_factor, process_set)
    reduction = _reduction(op)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if op == Adasum:
        _adasum_fits(tensors, names, group)

    def forward(*xs):
        return _allreduce_many(list(xs), names, reduction, compression, group, prescale_factor, postscale_factor)

    def backward(upstream, inputs, outputs):     # as Horovod: the same all-reduce of the upstream gradients
        return _allreduce_many([tf.convert_to_tensor(g) for g in upstream], [f"{n}/grad" for n in names],
                               reduction, compression, group, prescale_factor, postscale_factor)

    return list(_with_gradient(forward, backward)(*tensors))


@graph_code
def allgather(tensor, device_dense: str = "", device_sparse: str = "", name: str | None = None,
              process_set=None, ignore_name_scope: bool = False):
    """Every rank's tensor concatenated along the first dimension, in rank order;
    the first dimension may differ between ranks. Differentiable (Horovod's
    gradient: the upstream gradient averaged over the ranks, this rank's rows)."""
    (out,) = grouped_allgather([tensor], name=name or "allgather", process_set=process_set)
    return out


@graph_code
def grouped_allgather(tensors, name: str | None = None, ignore_name_scope: bool = False, process_set=None) -> list:
    """allgather of several tensors in one collective."""
    group = _group(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    base = name or "allgather"
    names = [base if len(tensors) == 1 else f"{base}/{j}" for j in range(len(tensors))]

    def backward(upstream, inputs, outputs):
        averaged = _allreduce_many([tf.convert_to_tensor(g) for g in upstream], [f"{n}/grad" for n in names],
                                   "average", Compression.none, group)
        rows = _allgather_many([tf.reshape(tf.shape(x)[0], [1]) for x in inputs], [f"{n}/rows" for n in names],
                               group)
        return [tf.split(g, tf.reshape(r, [group.size]), axis=0)[group.rank]
                for g, r in zip(averaged, rows, strict=True)]

    return list(_with_gradient(lambda *xs: _allgather_many(list(xs), names, group), backward)(*tensors))


@graph_code
def broadcast(tensor, root_rank: int, device: str = "", name: str | None = None, process_set=None,
              ignore_name_scope: bool = False):
    """root_rank's value of the tensor, on every rank. Differentiable (Horovod's
    gradient: the upstream gradient averaged over the ranks, on the root; zero
    elsewhere)."""
    group = _group(process_set)
    root = _root(group, root_rank)
    tensor = tf.convert_to_tensor(tensor)
    names = [name or "broadcast"]

    def forward(x):
        (out,) = _through_numpy(lambda arrays: group.collectives.broadcast(names, arrays, root), [x],
                                [x.shape], "rdmatensor_broadcast")
        return out

    def backward(upstream, inputs, outputs):
        (g,) = _allreduce_many([tf.convert_to_tensor(upstream[0])], [f"{names[0]}/grad"], "average",
                               Compression.none, group)
        return g if world().rank == root_rank else g * 0

    return _with_gradient(forward, backward)(tensor)


@graph_code
def broadcast_(variables, root_rank: int, name: str | None = None, process_set=None):
    """Assign root_rank's values to `variables` in place; their new values."""
    variables = list(variables)
    op = broadcast_variables(variables, root_rank, process_set)
    if tf.executing_eagerly():
        return [v.read_value() for v in variables]
    with tf.control_dependencies([op]):
        return [v.read_value() for v in variables]


@graph_code
def broadcast_variables(variables, root_rank: int, process_set=None, inplace: bool = False):
    """Assign root_rank's values to the variables on every rank: any variables
    (trainable, non-trainable such as BatchNorm statistics, optimizer slots),
    eagerly or inside tf.function (returns the assignments as one op there)."""
    group = _group(process_set)
    root = _root(group, root_rank)
    variables = list(tf.nest.flatten(variables))
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    names = _names(variables)
    values = [tf.convert_to_tensor(v) for v in variables]
    outs = _through_numpy(lambda arrays: group.collectives.broadcast(names, arrays, root), values,
                          [v.shape for v in values], "rdmatensor_broadcast_variables")
    if world().rank == root_rank:
        return None if tf.executing_eagerly() else tf.group(*outs)
    assigns = [v.assign(o) for v, o in zip(variables, outs, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int):
    """TF1 graphs: broadcast every global variable from root_rank (an op). Eagerly
    there are no global variables: RuntimeError, as in Horovod."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@graph_code
def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False, process_set=None):
    """Rows splits[r] of `tensor` (along its first dimension, in rank order) go to
    rank r; returns the rows every rank sent this one, in rank order, and, when
    `splits` is given, how many came from each rank. Differentiable."""
    group = _group(process_set)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise InvalidArgument("alltoall: a scalar has no first dimension to split")
    given = splits is not None
    split_t = tf.cast(tf.convert_to_tensor(splits), tf.int32) if given else tf.constant([], tf.int32)
    base = name or "alltoall"

    def exchange(x, s, label):
        def fn(arrays):
            out, received = group.collectives.alltoall(label, arrays[0], arrays[1] if arrays[1].size else None)
            return [out, received]
        out, received = _through_numpy(fn, [x, s], [tf.TensorShape([None]).concatenate(x.shape[1:]),
                                                    tf.TensorShape([group.size])], "rdmatensor_alltoall")
        return out, received

    @tf.custom_gradient
    def op(x):
        out, received = exchange(x, split_t, base)

        def grad(upstream):
            back, _ = exchange(tf.convert_to_tensor(upstream), received, f"{base}/grad")
            return back
        return (out, tf.stop_gradient(received)), lambda g, _=None: grad(g)

    out, received = op(tensor)
    return (out, received) if given else out


@graph_code
def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=Average,
                  name: str | None = None, process_set=None, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """The tensor combined over the ranks by `op`, then split along the first
    dimension: this rank's rows (the first rows % size ranks get one more)."""
    (out,) = grouped_reducescatter([tensor], device_dense, compression, op, name, process_set, ignore_name_scope,
                                   prescale_factor, postscale_factor)
    return out


@graph_code
def grouped_reducescatter(tensors, device_dense: str = "", compression=Compression.none, op=Average,
                          name: str | None = None, process_set=None, ignore_name_scope: bool = False,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """reducescatter of several tensors in one collective."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        if t.shape.rank == 0:
            raise InvalidArgument("reducescatter: a scalar has no first dimension to scatter")
    group = _group(process_set)
    op, base = ReduceOp(op), name or "reducescatter"
    n, r = group.size, group.rank

    def forward(*xs):
        names = [base if len(xs) == 1 else f"{base}/{j}" for j in range(len(xs))]
        reduced = _allreduce_many(list(xs), names, _reduction(op), compression, group, prescale_factor,
                                  postscale_factor, scatter=True)
        out = []
        for t in reduced:            # this rank's rows: the first rows % size ranks get one more
            rows = tf.shape(t)[0]
            lo = r * (rows // n) + tf.minimum(r, rows % n)
            out.append(t[lo:lo + rows // n + tf.cast(r < rows % n, rows.dtype)])
        return out

    def backward(upstream, inputs, outputs):     # as Horovod: every rank's gradient rows, gathered
        factor = (n if op == Sum else 1) * prescale_factor * postscale_factor
        grads = [tf.convert_to_tensor(g) * tf.cast(factor, g.dtype) for g in upstream]
        return _allgather_many(grads, [f"{base}/grad/{j}" for j in range(len(grads))], group)

    return list(_with_gradient(forward, backward)(*tensors))


def join() -> int:
    """Wait until every rank joined; the rank that joined last (the same on every rank)."""
    arrivals = allgather_object(time.time(), name="join")
    return int(np.argmax(arrivals))


def rank_op(name: str | None = None):
    return tf.constant(world().rank, tf.int32, name=name)


def local_rank_op(name: str | None = None):
    return tf.constant(world().local_rank, tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None):
    return tf.constant(_group_by_id(process_set_id).size, tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None):
    """1 if this rank is in the process set, else 0."""
    return tf.constant(int(_group_by_id(process_set_id).included), tf.int32, name=name)


def local_size_op(name: str | None = None):
    return tf.constant(world().local_size, tf.int32, name=name)


def _group(process_set) -> Group:
    """The registered set a collective runs in (ValueError if it is not registered);
    this rank must be in it (InvalidArgumentError, as Horovod)."""
    try:
        return member_of(process_set)
    except NotAMember as exc:
        raise InvalidArgument(str(exc)) from None


def _group_by_id(process_set_id: int) -> Group:
    ps = types.SimpleNamespace(process_set_id=process_set_id)
    return group_of(ps)


def _root(group: Group, root_rank: int) -> int:
    """root_rank (a rank of the job, as Horovod takes it) as a position in the set."""
    try:
        return group.local(root_rank)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
