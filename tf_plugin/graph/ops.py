"""`send` and `recv` as TensorFlow ops, for pipeline splits inside tf.function.

    with ops.use(session):                       # module-level: the ops find it by rank
        @tf.function
        def stage0(x):
            ops.send(hidden(x), "act", dst=1)
        @tf.function
        def stage1():
            return head(ops.recv("act", src=0, dtype=tf.float32, shape=(32, 64)))

- send is a tf.numpy_function: TensorFlow hands it a numpy alias of the
  tensor (measured: no copy), and the session writes from it (tcp, shm) or
  copies it once into registered staging memory (verbs).
- recv is a tf.py_function returning the received slot through DLPack with no
  copy; the slot goes back to the sender when TensorFlow frees the tensor
  (see ingest.py for the rule, and `copy=True` to copy on ingest instead).
- Both are stateful, so tf.function runs them in program order.

Sessions are registered by rank, not per thread: TensorFlow runs py_function
bodies on its own threads, and several ranks may share a process (tests).

While `recording(rank)` is active, every send/recv traced records what it
moves: that is how the analyzer builds a pipeline's plan from the stages.
"""
from __future__ import annotations

import contextlib
import threading
import time
from functools import partial

import numpy as np
import tensorflow as tf

from rdmatensor import TensorSpec, UnknownTensor, UsageError

from . import ingest
from .tf_errors import refuse_in_xla

_sessions: dict[int, object] = {}
_held: dict[tuple[int, str], object] = {}     # (rank, name) -> Received TensorFlow may still hold
_lock = threading.Lock()
_recorder = None
comm_seconds = 0.0                              # time spent inside send/recv bodies, all ranks


def register(session) -> None:
    with _lock:
        _sessions[session.rank] = session


def unregister(session) -> None:
    with _lock:
        if _sessions.get(session.rank) is session:
            del _sessions[session.rank]


@contextlib.contextmanager
def use(session):
    """Make `session` the one the ops use for its rank's tensors."""
    register(session)
    try:
        yield session
    finally:
        unregister(session)


class Recorder:
    def __init__(self, rank: int):
        self.rank, self.sends, self.recvs = rank, [], []


@contextlib.contextmanager
def recording(rank: int):
    """Record the sends and recvs traced meanwhile as stage `rank`'s."""
    global _recorder
    if _recorder is not None:
        raise UsageError("already recording a stage")
    _recorder = Recorder(rank)
    try:
        yield _recorder
    finally:
        _recorder = None


def _session(name: str, role: str):
    """The registered session that sends (role src) or receives (role dst) `name`."""
    with _lock:
        sessions = list(_sessions.values())
    for s in sessions:
        spec = s.plan.specs.get(name)
        if spec is not None and getattr(spec, role) == s.rank:
            return s, spec
    raise UnknownTensor(f"no registered session {'sends' if role == 'src' else 'receives'} {name!r} "
                        f"(ranks registered: {sorted(_sessions)}; use tf_plugin.graph.ops.use(session))")


def _timed(fn):
    global comm_seconds
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        with _lock:
            comm_seconds += time.perf_counter() - t0


def _send_np(name: str, dst: int, array: np.ndarray) -> None:
    session, spec = _session(name, "src")
    if spec.dst != dst:
        raise UsageError(f"{name!r} goes to rank {spec.dst} in the plan, not {dst}")
    _timed(lambda: session.send(name, np.ascontiguousarray(array)))


def send(tensor, name: str, dst: int) -> None:
    """Write `tensor` into rank `dst`'s slot for `name`."""
    tensor = tf.convert_to_tensor(tensor)
    if _recorder is not None:
        _recorder.sends.append(TensorSpec(name, tuple(tensor.shape.as_list()), tensor.dtype.as_numpy_dtype,
                                          src=_recorder.rank, dst=dst))
    refuse_in_xla(f"send of {name!r}")
    tf.numpy_function(partial(_send_np, name, dst), [tensor], Tout=[], stateful=True, name="rdmatensor_send")


def _wait_released(key, timeout: float) -> None:
    """The previous value of this tensor must be gone before the next can come."""
    prev = _held.get(key)
    deadline = time.monotonic() + timeout
    while prev is not None and not prev.released:
        if time.monotonic() > deadline:
            raise UsageError(f"{key[1]!r}: the previous received tensor is still alive after "
                             f"{timeout:.0f} s; received tensors must not outlive their step")
        time.sleep(0.0005)


def _recv_tf(name: str, src: int, copy: bool) -> tf.Tensor:
    session, spec = _session(name, "dst")
    if spec.src != src:
        raise UsageError(f"{name!r} comes from rank {spec.src} in the plan, not {src}")
    key = (session.rank, name)

    def get():
        _wait_released(key, session.timeout)
        received = session.recv(name)
        _held[key] = received
        return received

    return ingest.to_tensor(_timed(get), copy=copy)


def recv(name: str, src: int, dtype, shape, copy: bool = False) -> tf.Tensor:
    """The next value of `name` from rank `src` (dtype and shape as in the plan; None
    dimensions are dynamic)."""
    dtype = tf.as_dtype(dtype)
    shape = tf.TensorShape(shape)
    if _recorder is not None:
        _recorder.recvs.append(TensorSpec(name, tuple(shape.as_list()), dtype.as_numpy_dtype,
                                          src=src, dst=_recorder.rank))
    refuse_in_xla(f"recv of {name!r}")
    out = tf.py_function(partial(_recv_tf, name, src, copy), [], Tout=dtype, name="rdmatensor_recv")
    out.set_shape(shape)
    return out
