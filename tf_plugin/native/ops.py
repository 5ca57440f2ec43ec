"""The shared-memory all-reduce as TensorFlow ops, eagerly and inside tf.function.

    g = ops.group(fds, rank, ranks, bucket_bytes)      # fds: every rank's segment (segment.py)
    g, why = ops.local_group(bootstrap.allgather, rank, ranks, bucket_bytes, timeout)   # in a job
    y = ops.allreduce(x, g, bucket=0, op="average")
    ys = ops.allreduce_many(xs, g, buckets)             # one launch op and one completion op for all
    ys = ops.allreduce_fused(xs, g, bucket=0)           # xs back to back in one request (a fusion bucket)

With the op library (build.py builds it on first use; RDMATENSOR_TF_OPS=native,
the default when it builds) a group is registered in the library under its name
and an all-reduce is two stateful ops: RdtShmAllreduceLaunch (queues it on the
group's executor thread, returns a handle at once) and RdtShmAllreduceDone
(waits asynchronously, holding no inter-op thread). Inside a tf.function
stateful ops run in program order, so launches go before completions: the
executor works through its queue while the completions wait. allreduce_many is
RdtShmAllreduceLaunchMany and RdtShmAllreduceDoneMany, two ops however many
tensors (together=False: a launch and a completion per tensor). allreduce_fused
is RdtShmAllreduceLaunchFused, RdtShmAllreduceDoneFused and
RdtShmAllreduceMembers: the tensors (one dtype) as one request of one bucket,
which the executor copies into its segment part by part and reduces in place
(a member only the launch holds is its own result's buffer); the completion
waits and gives a token; the members op hands the results on once it exists
(synchronous: TensorFlow runs its consumers inline, where each output of an
asynchronous kernel becomes a task of the thread pool, which costs more). Errors are
TensorFlow's types: DeadlineExceeded (a peer did not arrive in time; the message
names it), Aborted (the group was aborted, or broken by an
earlier failure), Unavailable (a peer aborted), Cancelled (the step was
cancelled), FailedPrecondition (ranks that disagree, or a group no longer open
under a traced graph), InvalidArgument (a bad bucket or tensor, named).

With RDMATENSOR_TF_OPS=python, or without a compiler, a group is the Python twin
(shm_twin.py) and an all-reduce is one stateful tf.numpy_function calling it
(eagerly, a direct call raising the same TensorFlow types; in a graph,
TensorFlow turns its errors into UnknownError, the message kept).

Both paths are differentiable as Horovod's all-reduce is: the gradient is the
same all-reduce (same group, bucket, op and scale) of the upstream gradient.
The scale is rounded to float32 first, as Horovod's op attributes hold it.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import threading
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from rdmatensor.session.liveness import peer_timeout_from_env

from ..core import scaling, settings
from . import build, contract, segment, shm_c, shm_twin

log = logging.getLogger("rdmatensor")

_TF_ERRORS = {contract.INVALID: tf.errors.InvalidArgumentError, contract.TIMEOUT: tf.errors.DeadlineExceededError,
              contract.ABORTED: tf.errors.AbortedError, contract.PEER_ABORTED: tf.errors.UnavailableError,
              contract.CANCELLED: tf.errors.CancelledError, contract.MISMATCH: tf.errors.FailedPreconditionError,
              contract.CLOSED: tf.errors.AbortedError}


class NativeLibrary:
    """The loaded op library: its ops (`module`) and its C functions (`cdll`)."""

    def __init__(self, built: build.Built):
        if built.tensorflow != tf.__version__:
            raise build.BuildError(f"{built.path} was built for TensorFlow {built.tensorflow}, this is "
                                   f"{tf.__version__}")
        self.path = built.path
        try:     # first: TensorFlow collects the ops that register while it loads the library
            self.module = tf.load_op_library(str(built.path))
        except tf.errors.NotFoundError as exc:     # built for another TensorFlow: undefined symbols
            raise build.BuildError(f"{built.path} does not load: {exc.message[:300]}") from exc
        cdll = ctypes.CDLL(str(built.path))       # the same handle
        cdll.rdt_tf_version.restype = ctypes.c_char_p
        recorded = cdll.rdt_tf_version().decode()
        if recorded != tf.__version__:
            raise build.BuildError(f"{built.path} records TensorFlow {recorded}, this is {tf.__version__}")
        self.cdll = shm_c.bind(cdll)
        cdll.rdt_tf_group_add.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        cdll.rdt_tf_group_add.restype = ctypes.c_int
        cdll.rdt_tf_group_remove.argtypes = [ctypes.c_char_p]
        cdll.rdt_tf_group_remove.restype = ctypes.c_int
        cdll.rdt_tf_pending.restype = ctypes.c_long
        cdll.rdt_xla_register.restype = ctypes.c_char_p
        # the XLA handler (xla_ops.cc): why it is not registered, or "" when it is
        self.xla_refused = cdll.rdt_xla_register().decode()

    def pending(self) -> int:
        """Launched all-reduces whose completion has not run yet."""
        return self.cdll.rdt_tf_pending()


_loading = threading.Lock()
_library: list = []


def native_library() -> NativeLibrary | None:
    """The op library when RDMATENSOR_TF_OPS chooses it and it builds (once per
    process), else None (the Python twin). RDMATENSOR_TF_OPS=native explicitly
    and no library: an error."""
    if build.choice() == "python":
        return None
    with _loading:
        if not _library:
            built = build.library("ops")
            _library.append(NativeLibrary(built) if built is not None else None)
        lib = _library[0]
    if lib is None and os.environ.get(build.ENV, "").strip().lower() == "native":
        raise build.BuildError(f"{build.ENV}=native, but the op library is not built (see the line above)")
    return lib


# ------------------------------------------------------------------ groups
_names = itertools.count(1)
_twins: dict = {}          # name -> PythonGroup, found at run time by the numpy_function


class NativeGroup(shm_c.CGroup):
    """A group run by the C executor and registered for the ops under `name`."""
    kind = "native"

    def __init__(self, lib: NativeLibrary, name: str, fds, rank, ranks, bucket_bytes, timeout):
        nice = settings.executor_nice()             # a bad value raises before anything is made
        super().__init__(lib.cdll, fds, rank, ranks, bucket_bytes, timeout)
        self.native, self.name = lib, name
        if lib.cdll.rdt_tf_group_add(name.encode(), self.handle) != 0:
            super().close()
            raise contract.ShmInvalid(f"a group named {name!r} is open already")
        try:
            _prioritize(self, nice)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.native.cdll.rdt_tf_group_remove(self.name.encode())
        super().close()


_refused_nice: list = []    # logged once per process


def _prioritize(group: NativeGroup, nice: int) -> None:
    """The executor thread RDMATENSOR_EXECUTOR_NICE below this thread's nice: it shares the rank's core with
    TensorFlow's threads, and at their priority it got a third of the core while
    backprop ran, queueing its buckets behind it (docs/native-ops.md#overlap-with-backprop)."""
    if nice == 0:
        return
    own = os.getpriority(os.PRIO_PROCESS, 0)        # this thread's, as its executor inherited it
    target = min(19, max(-20, own + nice))
    if group.set_nice(target) or _refused_nice:
        return
    _refused_nice.append(target)
    log.info("the native all-reduce's executor thread keeps the process's priority: nice %d (%+d) is not "
             "permitted here (CAP_SYS_NICE or RLIMIT_NICE; %s)", target, nice, settings.EXECUTOR_NICE.name)


class PythonGroup(shm_twin.TwinGroup):
    """A group run by the Python twin, found by its `name` when its numpy_function runs."""
    kind = "python"

    def __init__(self, name: str, fds, rank, ranks, bucket_bytes, timeout):
        if name in _twins:
            raise contract.ShmInvalid(f"a group named {name!r} is open already")
        super().__init__(fds, rank, ranks, bucket_bytes, timeout)
        self.name = name
        _twins[name] = self

    def close(self) -> None:
        if _twins.get(self.name) is self:
            del _twins[self.name]
        super().close()


def group(fds, rank: int, ranks: int, bucket_bytes, timeout: float | None = None, name: str | None = None,
          kind: str | None = None) -> NativeGroup | PythonGroup:
    """This rank's group over every rank's segment (fds in rank order; they may be
    closed once this returns). `timeout`: seconds a wait may last (default
    RDMATENSOR_PEER_TIMEOUT, else 10). `kind`: 'native' or 'python' (default: as
    RDMATENSOR_TF_OPS chooses)."""
    timeout = peer_timeout_from_env() if timeout is None else float(timeout)
    name = name or f"shm-{os.getpid()}-{next(_names)}"
    if kind not in (None, "native", "python"):
        raise ValueError(f"kind {kind!r}: 'native' or 'python'")
    lib = None if kind == "python" else native_library()
    if kind == "native" and lib is None:
        raise build.BuildError("the op library is not built (see the line above)")
    if lib is not None:
        return NativeGroup(lib, name, fds, rank, ranks, bucket_bytes, timeout)
    return PythonGroup(name, fds, rank, ranks, bucket_bytes, timeout)


SETS_DIFFER = "the ranks' tensor sets differ"


def local_group(allgather, rank: int, ranks: int, bucket_bytes, timeout: float, name: str | None = None,
                agreed: str = "") -> tuple[NativeGroup | None, str | None]:
    """A native group among the ranks of one host, its segments handed over
    through `allgather(tag, bytes) -> every rank's bytes` (the job's
    authenticated channel: only locators travel there; each descriptor goes
    from its owner's process to the peer that presents its nonce, as the shm
    provider hands over its arenas: segment.Offer, segment.take). Every rank
    calls it with the same buckets, at the same point of its program: two
    exchanges. (group, None), or (None, why) on every rank when any rank
    could not make or take a segment, or the ranks' buckets differ: the
    caller then takes another path, on every rank alike. `agreed` names what
    this rank all-reduces (its tensor set): where the ranks' differ, or their
    buckets do, why is SETS_DIFFER: they called different collectives here, which
    the caller's other path reports as the mismatch it is."""
    bucket_bytes = [int(b) for b in bucket_bytes]
    fd, offers, fds, made, why = -1, {}, [], None, None
    try:
        try:
            native_library()        # built (or refused) before any segment is made
            fd = segment.create_segment(rank, ranks, bucket_bytes)
            for peer in range(ranks):
                if peer != rank:
                    offers[peer] = segment.Offer(fd)
            mine = {"locators": {str(p): o.locator for p, o in offers.items()}, "buckets": bucket_bytes,
                    "set": agreed}
        except Exception as exc:  # noqa: BLE001 - told to every rank, which then all take the other path
            mine = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
        got = [json.loads(raw) for raw in allgather("native_segments", json.dumps(mine).encode())]
        errors = [g["error"] for g in got if "error" in g]
        if errors:
            return None, errors[0]
        if any(g["buckets"] != bucket_bytes or g["set"] != agreed for g in got):
            return None, SETS_DIFFER
        try:
            fds = [fd if r == rank else segment.take(got[r]["locators"][str(rank)], r) for r in range(ranks)]
            made = group(fds, rank, ranks, bucket_bytes, timeout, name=name, kind="native")
        except Exception as exc:  # noqa: BLE001 - as above
            why = f"rank {rank}: {type(exc).__name__}: {exc}"
        verdicts = [json.loads(raw) for raw in allgather("native_group", json.dumps(why).encode())]
        why = next((v for v in verdicts if v), None)
        if why is not None and made is not None:
            made.close()
            made = None
        return made, why
    finally:
        for o in offers.values():
            o.withdraw()
        for f in {fd, *fds} - {-1}:
            os.close(f)


# ------------------------------------------------------------------ the ops
class Launched(NamedTuple):
    """A launched all-reduce: complete() gives its result."""
    handle: tf.Tensor | None       # None on the Python twin (its all-reduce runs at completion)
    tensor: tf.Tensor
    group: str
    native: NativeLibrary | None
    bucket: int
    op: str
    scale: float
    label: str
    members: tuple = ()            # launch_fused: the tensors `tensor` holds back to back
    pending: tuple = ()            # launch_fused, native: the members' results-to-be


def _attrs(launched: Launched) -> dict:
    return dict(group=launched.group, bucket=launched.bucket, reduce_op=launched.op, scale=launched.scale,
                label=launched.label)


def launch(tensor, group, bucket: int, op: str = "sum", scale: float = 1.0, label: str | None = None) -> Launched:
    """Queue the all-reduce of `tensor` on `group`'s bucket `bucket` (see allreduce)."""
    tensor = tf.convert_to_tensor(tensor)
    if op not in contract.OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(contract.OPS)}")
    native = group.native if isinstance(group, NativeGroup) else None
    launched = Launched(None, tensor, group.name, native, int(bucket), op, scaling.factor(scale), label or "")
    if native is not None:
        handle = native.module.rdt_shm_allreduce_launch(tensor, **_attrs(launched))
        launched = launched._replace(handle=handle)
    return launched


def complete(launched: Launched) -> tf.Tensor:
    """The result of a launched all-reduce (waits for it)."""
    if launched.native is not None:
        return launched.native.module.rdt_shm_allreduce_done(launched.handle, launched.tensor, **_attrs(launched))
    return _twin_allreduce(launched)


def allreduce(tensor, group, bucket: int, op: str = "sum", scale: float = 1.0, label: str | None = None
              ) -> tf.Tensor:
    """`tensor` combined over the group's ranks by `op` (sum, average, min, max,
    product), times `scale` (an average: times scale / ranks), through bucket
    `bucket`, which must hold its bytes. Every rank calls the same all-reduces in
    the same order."""
    return complete(launch(tensor, group, bucket, op, scale, label))


def launch_many(tensors, group, buckets, op: str = "sum", scale: float = 1.0, labels=None) -> list:
    """Several launches in one op on the native path (RdtShmAllreduceLaunchMany: one
    stateful op, however many tensors); it runs once all `tensors` exist."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    buckets = [int(b) for b in buckets]
    labels = [lab or "" for lab in (list(labels) if labels is not None else [None] * len(tensors))]
    if not (len(tensors) == len(buckets) == len(labels)):
        raise ValueError(f"{len(tensors)} tensors, {len(buckets)} buckets, {len(labels)} labels")
    native = group.native if isinstance(group, NativeGroup) else None
    if native is None or not tensors:
        return [launch(t, group, b, op, scale, lab) for t, b, lab in zip(tensors, buckets, labels, strict=True)]
    if op not in contract.OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(contract.OPS)}")
    scale = scaling.factor(scale)
    handles = native.module.rdt_shm_allreduce_launch_many(tensors, N=len(tensors), group=group.name,
                                                          buckets=buckets, reduce_op=op, scale=scale, labels=labels)
    return [Launched(h, t, group.name, native, b, op, scale, lab)
            for h, t, b, lab in zip(handles, tensors, buckets, labels, strict=True)]


def allreduce_many(tensors, group, buckets, op: str = "sum", scale: float = 1.0, labels=None,
                   together: bool = True) -> list:
    """Several all-reduces. `together`: one launch op for all, then one completion
    op for all (two stateful ops however many tensors: RdtShmAllreduceLaunchMany,
    RdtShmAllreduceDoneMany); else a launch per tensor, every one before the first
    completion, and a completion per tensor (each result usable as soon as it is
    there; a launch can start before the later tensors exist)."""
    tensors = list(tensors)
    labels = list(labels) if labels is not None else [None] * len(tensors)
    if together:
        return complete_many(launch_many(tensors, group, buckets, op, scale, labels))
    launched = [launch(t, group, b, op, scale, lab) for t, b, lab in zip(tensors, buckets, labels, strict=True)]
    return [complete(x) for x in launched]


def complete_many(launched: list) -> list:
    """The results of several launched all-reduces, waited for together (one op on
    the native path when they share a group, op and scale; else one by one)."""
    launched = list(launched)
    if not launched:
        return []
    first = launched[0]
    if first.native is None or any((x.native, x.group, x.op, x.scale) != (first.native, first.group, first.op,
                                                                          first.scale) for x in launched):
        return [complete(x) for x in launched]
    return first.native.module.rdt_shm_allreduce_done_many(
        [x.handle for x in launched], [x.tensor for x in launched], group=first.group,
        buckets=[x.bucket for x in launched], reduce_op=first.op, scale=first.scale,
        labels=[x.label for x in launched])


def launch_fused(tensors, group, bucket: int, op: str = "sum", scale: float = 1.0, label: str | None = None
                 ) -> Launched:
    """Queue the all-reduce of `tensors` (one dtype, static shapes) back to back as
    one request of bucket `bucket`, which must hold all their bytes (a fusion
    bucket): one launch op on the native path; on the twin, a concatenation."""
    members = tuple(tf.convert_to_tensor(t) for t in tensors)
    if not members:
        raise ValueError("launch_fused: no tensors")
    if len({t.dtype for t in members}) > 1:
        raise ValueError(f"launch_fused {label or ''}: one dtype per request, not "
                         f"{sorted({t.dtype.name for t in members})}")
    if op not in contract.OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(contract.OPS)}")
    native = group.native if isinstance(group, NativeGroup) else None
    if native is None:
        flat = [tf.reshape(t, [-1]) for t in members]
        return launch(flat[0] if len(flat) == 1 else tf.concat(flat, 0), group, bucket, op, scale,
                      label)._replace(members=members)
    return _launch_fused(native, members, group.name, int(bucket), op, scaling.factor(scale), label or "")


def _launch_fused(native: NativeLibrary, members: tuple, group: str, bucket: int, op: str, scale: float,
                  label: str) -> Launched:
    handle, pending = native.module.rdt_shm_allreduce_launch_fused(list(members), group=group, bucket=bucket,
                                                                   reduce_op=op, scale=scale, label=label)
    return Launched(handle, members[0], group, native, bucket, op, scale, label, members, tuple(pending))


def complete_fused(launched: Launched) -> list:
    """The results of launch_fused, one per member, shaped as the member."""
    if launched.native is not None:
        ready = launched.native.module.rdt_shm_allreduce_done_fused(launched.handle, **_attrs(launched))
        return list(launched.native.module.rdt_shm_allreduce_members(ready, list(launched.pending),
                                                                      **_attrs(launched)))
    flat, members = complete(launched), launched.members
    if len(members) == 1:
        return [tf.reshape(flat, members[0].shape)]
    parts = tf.split(flat, [t.shape.num_elements() for t in members])
    return [tf.reshape(part, t.shape) for part, t in zip(parts, members, strict=True)]


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA (tf.function(jit_compile=True))."""
    from tensorflow.python.ops import control_flow_util
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def allreduce_xla(tensors, group, bucket: int, op: str = "sum", scale: float = 1.0, label: str | None = None
                  ) -> list:
    """`tensors` all-reduced as one request of bucket `bucket` inside an XLA
    compilation: one RdtShmAllreduceXla op (a typed-FFI custom call), chained
    after the graph's previous one by a token, so every rank runs them in one
    order. The native group only: the twin has no XLA route."""
    members = [tf.convert_to_tensor(t) for t in tensors]
    if not isinstance(group, NativeGroup):
        raise build.BuildError("an all-reduce inside XLA needs the native ops (RDMATENSOR_TF_OPS is python, or "
                               "the op library is not built); compile with jit_compile=False")
    if group.native.xla_refused:
        raise build.BuildError(f"this TensorFlow's XLA refused the all-reduce's handler "
                               f"({group.native.xla_refused}); compile with jit_compile=False")
    graph = tf.compat.v1.get_default_graph()
    token = getattr(graph, "_rdmatensor_xla_token", None)
    if token is None:
        token = tf.constant(0, tf.int32)
    reduced, graph._rdmatensor_xla_token = group.native.module.rdt_shm_allreduce_xla(  # noqa: SLF001
        members, token, group=group.name, bucket=int(bucket), reduce_op=op, scale=scaling.factor(scale),
        label=label or "")
    return list(reduced)


def allreduce_fused(tensors, group, bucket: int, op: str = "sum", scale: float = 1.0, label: str | None = None
                    ) -> list:
    """`tensors` all-reduced as one request of bucket `bucket` (see launch_fused)."""
    return complete_fused(launch_fused(tensors, group, bucket, op, scale, label))


# ------------------------------------------------------------------ the Python twin
def _twin_call(name: str, bucket: int, op: str, scale: float, label: str, array: np.ndarray) -> np.ndarray:
    twin = _twins.get(name)
    if twin is None:
        raise contract.ShmClosed(f"rdmatensor: the shm all-reduce group {name!r} is not open in this process "
                                 f"(closed, or never made); all-reduce of {label or 'a tensor'} cannot run")
    return twin.allreduce(bucket, array, op, scale, label or None)


def _twin_allreduce(launched: Launched) -> tf.Tensor:
    x = launched.tensor
    args = (launched.group, launched.bucket, launched.op, launched.scale, launched.label)

    @tf.custom_gradient
    def reduced(t):
        if tf.executing_eagerly():
            try:
                out = tf.convert_to_tensor(_twin_call(*args, t.numpy()))
            except contract.ShmError as exc:
                cls = tf.errors.FailedPreconditionError if isinstance(exc, contract.ShmClosed) \
                    and launched.group not in _twins else _TF_ERRORS.get(exc.status, tf.errors.UnknownError)
                raise cls(None, None, str(exc)) from exc
        else:
            out = tf.numpy_function(lambda a: _twin_call(*args, a), [t], t.dtype, stateful=True,
                                    name="rdmatensor_shm_allreduce")
            out.set_shape(t.shape)

        def grad(upstream):
            return _twin_allreduce(launched._replace(tensor=tf.convert_to_tensor(upstream),
                                                     label=f"{launched.label or 'tensor'}/grad"))
        return out, grad

    return reduced(x)


@tf.RegisterGradient("RdtShmAllreduceDoneMany")
def _done_many_gradient(op, *grads):
    """Each tensor's gradient: the same all-reduce of its upstream gradient (all launched, then completed)."""
    group, reduce_op, scale = op.get_attr("group"), op.get_attr("reduce_op"), op.get_attr("scale")
    group = group.decode() if isinstance(group, bytes) else group
    reduce_op = reduce_op.decode() if isinstance(reduce_op, bytes) else reduce_op
    labels = [lab.decode() if isinstance(lab, bytes) else lab for lab in op.get_attr("labels")]
    lib = native_library()
    if lib is None:
        raise build.BuildError("the gradient of a native all-reduce needs the op library")
    n = len(grads)
    grads = [tf.zeros_like(op.inputs[n + i]) if g is None else tf.convert_to_tensor(g) for i, g in enumerate(grads)]
    labels = [f"{lab or 'tensor'}/grad" for lab in labels]
    handles = lib.module.rdt_shm_allreduce_launch_many(grads, N=n, group=group, buckets=op.get_attr("buckets"),
                                                       reduce_op=reduce_op, scale=scale, labels=labels)
    launched = [Launched(h, g, group, lib, b, reduce_op, scale, lab)
                for h, g, b, lab in zip(handles, grads, op.get_attr("buckets"), labels, strict=True)]
    return [None] * n + complete_many(launched)


def _for_gradient(op) -> tuple[NativeLibrary, dict]:
    """The op library and the attributes of a one-bucket all-reduce `op`, its label marked /grad."""
    lib = native_library()
    if lib is None:
        raise build.BuildError("the gradient of a native all-reduce needs the op library")
    attrs = {k: op.get_attr(k) for k in ("group", "bucket", "reduce_op", "scale", "label")}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    attrs["label"] = f"{attrs['label'] or getattr(op, 'name', 'allreduce')}/grad"
    return lib, attrs


@tf.RegisterGradient("RdtShmAllreduceMembers")
def _members_gradient(op, *grads):
    """The members' gradients: the same fused all-reduce of their upstream gradients
    (to the pending results, which the launch's gradient hands to its inputs)."""
    lib, attrs = _for_gradient(op)
    upstream = tuple(tf.zeros_like(t) if g is None else tf.convert_to_tensor(g)
                     for g, t in zip(grads, op.outputs, strict=True))
    launched = _launch_fused(lib, upstream, attrs["group"], attrs["bucket"], attrs["reduce_op"], attrs["scale"],
                             attrs["label"])
    return [None, *complete_fused(launched)]


@tf.RegisterGradient("RdtShmAllreduceLaunchFused")
def _launch_fused_gradient(op, *grads):
    """Each member's gradient is its pending result's (the all-reduce is in RdtShmAllreduceMembers')."""
    return list(grads[1:])


tf.no_gradient("RdtShmAllreduceDoneFused")


@tf.RegisterGradient("RdtShmAllreduceXla")
def _xla_gradient(op, *grads):
    """The members' gradients: the same all-reduce of their upstream gradients, inside XLA too."""
    lib, attrs = _for_gradient(op)
    n = len(op.inputs) - 1
    upstream = [tf.zeros_like(op.inputs[i]) if g is None else tf.convert_to_tensor(g)
                for i, g in enumerate(grads[:n])]
    graph = tf.compat.v1.get_default_graph()
    token = getattr(graph, "_rdmatensor_xla_token", None)
    if token is None:
        token = op.outputs[-1]
    reduced, graph._rdmatensor_xla_token = lib.module.rdt_shm_allreduce_xla(upstream, token, **attrs)  # noqa: SLF001
    return list(reduced) + [None]


@tf.RegisterGradient("RdtShmAllreduceDone")
def _done_gradient(op, grad):
    """Horovod's gradient of an all-reduce: the same all-reduce of the upstream gradient."""
    lib, attrs = _for_gradient(op)
    handle = lib.module.rdt_shm_allreduce_launch(grad, **attrs)
    return [None, lib.module.rdt_shm_allreduce_done(handle, grad, **attrs)]
