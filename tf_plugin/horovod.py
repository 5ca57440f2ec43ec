"""horovod.tensorflow's tensor API over rdmatensor (`import tf_plugin as hvd`).

Every collective takes TensorFlow tensors, eagerly or inside tf.function:
eagerly it runs right there on numpy aliases of the tensors; in a graph it
is one stateful tf.numpy_function, so it runs in program order and blocks
one of TensorFlow's inter-op threads while it waits; an all-reduce of tensors
with static shapes is one launch op and one wait op per bucket instead, its
rings overlapping backprop (tf_plugin.overlap). What moves and where it lands
is tf_plugin.collectives' business: the first call of a tensor set extends
the plan once, later calls cost no control call.

Outputs reach TensorFlow with no copy where they are 64-byte aligned (the
ring's outputs are): see ingest.borrow.
"""
from __future__ import annotations

import functools
import types

import numpy as np
import tensorflow as tf

from . import ingest, overlap
from .analyzer import var_key
from .collectives import allreduce_op
from .tf_errors import as_horovod_errors
from .world import Average, ReduceOp, Sum, world

__all__ = ["Compression", "DistributedGradientTape", "allreduce", "grouped_allreduce", "allgather", "broadcast",
           "broadcast_variables", "Average", "Sum"]


# ------------------------------------------------------------- compression
class NoneCompressor:
    """Tensors travel as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 (half the bytes) and come back in their dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# ---------------------------------------------------------------- plumbing
def _average(op) -> bool:
    if op not in (Average, Sum):
        raise ValueError(f"op {op!r}: only hvd.Average and hvd.Sum are supported")
    return op == Average


def _op(average, op):
    if average is not None and op is not None:
        raise ValueError("give either average or op, not both")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else ReduceOp(op)


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
    """fn(list of ndarrays) -> ndarrays of the same dtypes. Eager: called now, its
    outputs borrowed by TensorFlow; in a graph: one stateful tf.numpy_function."""
    if tf.executing_eagerly():
        with as_horovod_errors():
            outs = fn([np.asarray(t) for t in tensors])   # CPU tensors: aliases, no copy
        tally = world().collectives.meter.tally
        return [ingest.borrow(o, tally) for o in outs]
    outs = tf.numpy_function(lambda *arrays: fn(list(arrays)), tensors, [t.dtype for t in tensors],
                             stateful=True, name=name)
    for o, shape in zip(outs, shapes, strict=True):
        o.set_shape(shape)
    return list(outs)


def _allreduce_many(tensors, names, average: bool, compression) -> list:
    """Eagerly: every bucket handed to the communication thread, then collected.
    In a graph, with static shapes: one launch op per bucket, fed only by that
    bucket's tensors, and one wait op per bucket (tf_plugin.overlap), so rings run
    while backprop still computes later buckets; otherwise one numpy_function."""
    packed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    sent = [p[0] for p in packed]
    collectives = world().collectives
    if tf.executing_eagerly() or not overlap.static(sent) or world().size == 1:
        reduced = _through_numpy(lambda arrays: world().collectives.allreduce(names, arrays, average),
                                 sent, [t.shape for t in sent], "rdmatensor_allreduce")
    else:
        group = collectives.allreduce_group(names, [tuple(t.shape) for t in sent],
                                            [t.dtype.as_numpy_dtype for t in sent], average)
        members = [[int(key) for key, _, _ in b.members] for b in group.buckets]
        reduced = overlap.bucketed(sent, members, functools.partial(collectives.launch, group),
                                   functools.partial(collectives.collect, group), "rdmatensor_allreduce")
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


def _allgather_many(tensors, names) -> list:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for n, t in zip(names, tensors, strict=True):
        if t.shape.rank == 0:
            raise ValueError(f"allgather of {n!r}: a scalar has no first dimension to concatenate")
    return _through_numpy(lambda arrays: world().collectives.allgather(names, arrays), tensors,
                          [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors], "rdmatensor_allgather")


def _allgather_slices(slices: list, names: list, average: bool) -> list:
    """Sparse gradients, as Horovod: every rank's rows and indices, concatenated;
    averaging divides the values by the number of ranks."""
    parts = [t for s in slices for t in (s.values, s.indices)]
    part_names = [f"{n}/{p}" for n in names for p in ("values", "indices")]
    gathered = _allgather_many(parts, part_names)
    out = []
    for k, s in enumerate(slices):
        values, indices = gathered[2 * k], gathered[2 * k + 1]
        if average:
            values = values / tf.cast(world().size, values.dtype)
        out.append(tf.IndexedSlices(values, indices, s.dense_shape))
    return out


def reduce_gradients(grads, sources, compression=NoneCompressor, sparse_as_dense: bool = False, op=Average):
    """Gradients (any nest matching `sources`, None kept) combined over the ranks:
    dense ones by one all-reduce, sparse ones (tf.IndexedSlices) by allgather unless
    `sparse_as_dense`. Shared by DistributedGradientTape and the Keras optimizer."""
    average = _average(op)
    flat = tf.nest.flatten(grads)
    names = _names(tf.nest.flatten(sources))
    if len(names) != len(flat):
        names = [f"tensor{j}" for j in range(len(flat))]
    if sparse_as_dense:
        flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in flat]
    out = list(flat)
    dense = [j for j, g in enumerate(flat) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [j for j, g in enumerate(flat) if isinstance(g, tf.IndexedSlices)]
    if dense:
        reduced = _allreduce_many([flat[j] for j in dense], [names[j] for j in dense], average, compression)
        for j, r in zip(dense, reduced, strict=True):
            out[j] = r
    if sparse:
        gathered = _allgather_slices([flat[j] for j in sparse], [names[j] for j in sparse], average)
        for j, r in zip(sparse, gathered, strict=True):
            out[j] = r
    return tf.nest.pack_sequence_as(grads, out)


def plan_ahead(model) -> None:
    """Plan a built Keras model's first step now: the all-reduce of its trainable
    variables' gradients and the broadcast of all its variables from rank 0."""
    def described(variables):
        return [types.SimpleNamespace(shape=tuple(v.shape), dtype=np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype))
                for v in variables]
    trainable, every = list(model.trainable_variables), list(model.variables)
    threshold = world().collectives.threshold
    requests = [("allreduce", allreduce_op(True, threshold), _names(trainable), described(trainable)),
                ("broadcast", "0", _names(every), described(every))]
    world().collectives.ensure([r for r in requests if r[2]])


# --------------------------------------------------------------- public API
class DistributedGradientTape:
    """A tf.GradientTape whose gradient() combines the gradients over the ranks
    (Average: the mean, as if one process had seen every rank's batch)."""

    def __init__(self, gradtape, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False, op=Average):
        _average(op)
        self._tape, self._compression, self._sparse_as_dense, self._op = gradtape, compression, sparse_as_dense, op

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        return reduce_gradients(grads, sources, self._compression, self._sparse_as_dense, self._op)


def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None):
    """The tensor combined over the ranks (op Average, the default, or Sum); a
    tf.IndexedSlices is allgathered instead, as Horovod does."""
    (out,) = grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                               postscale_factor, name)
    return out


def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None) -> list:
    """allreduce of several tensors in one collective (one ring over fused buckets)."""
    op = _op(average, op)
    tensors = list(tensors)
    base = name or "allreduce"
    names = [base if len(tensors) == 1 else f"{base}/{j}" for j in range(len(tensors))]
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("pre/postscale_factor are not supported with tf.IndexedSlices "
                                      "(as in Horovod): pass sparse_as_dense, or scale the values yourself")
        return reduce_gradients(tensors, [types.SimpleNamespace(name=n) for n in names], compression, False, op)
    tensors = [_scaled(tf.convert_to_tensor(t), prescale_factor) for t in tensors]
    out = _allreduce_many(tensors, names, _average(op), compression)
    return [_scaled(t, postscale_factor) for t in out]


def _scaled(tensor, factor: float):
    """tensor * factor as Horovod computes it on CPU: integers in float64, truncated
    back toward zero; float16 in float32; other floats in their own precision."""
    if factor == 1.0:
        return tensor
    wide = {tf.float16: tf.float32, tf.float32: tf.float32, tf.float64: tf.float64}.get(tensor.dtype, tf.float64)
    return tf.cast(tf.cast(tensor, wide) * tf.constant(factor, wide), tensor.dtype)


def allgather(tensor, device_dense: str = "", device_sparse: str = "", name: str | None = None):
    """Every rank's tensor concatenated along the first dimension, in rank order;
    the first dimension may differ between ranks."""
    (out,) = _allgather_many([tensor], [name or "allgather"])
    return out


def broadcast(tensor, root_rank: int, device: str = "", name: str | None = None):
    """root_rank's value of the tensor, on every rank."""
    tensor = tf.convert_to_tensor(tensor)
    names = [name or "broadcast"]
    (out,) = _through_numpy(lambda arrays: world().collectives.broadcast(names, arrays, root_rank), [tensor],
                            [tensor.shape], "rdmatensor_broadcast")
    return out


def broadcast_variables(variables, root_rank: int):
    """Assign root_rank's values to the variables on every rank: any variables
    (trainable, non-trainable such as BatchNorm statistics, optimizer slots),
    eagerly or inside tf.function (returns the assignments as one op there)."""
    variables = list(tf.nest.flatten(variables))
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    names = _names(variables)
    values = [tf.convert_to_tensor(v) for v in variables]
    outs = _through_numpy(lambda arrays: world().collectives.broadcast(names, arrays, root_rank), values,
                          [v.shape for v in values], "rdmatensor_broadcast_variables")
    if world().rank == root_rank:
        return None if tf.executing_eagerly() else tf.group(*outs)
    assigns = [v.assign(o) for v, o in zip(variables, outs, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)
