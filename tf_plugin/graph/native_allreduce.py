"""The all-reduce of a tensor set inside a tf.function on the native ops, when
every rank of the set is on one host (tf_plugin/native, docs/native-ops.md).

Same structure as overlap.bucketed, other ops: per bucket of the plan, its
members (prescaled as Horovod scales) in ONE request, reduced in place, by
RdtShmAllreduceLaunchFused as soon as they exist (the launches chained in
bucket order, the first after the previous collective of the graph:
overlap.in_program_order); after the last launch, an asynchronous
RdtShmAllreduceDoneFused per bucket (holding no inter-op thread while it
waits), after which one RdtShmAllreduceMembers hands the members' results on
(ops.complete_fused). The op and the postscale are the
executor's (an average divides by the number of ranks there, as the ring
does); no Python runs in the step.

The group (a memfd segment per rank, sized by the set's buckets, and the C
executor's thread) is made when the graph is traced and the set is new to the
plan: its segments' descriptors go between the ranks as the shm provider's
arenas do (locators over the set's authenticated bootstrap channel, each
descriptor from its owner's process to the peer with the nonce:
native.ops.local_group). It lives as long as the plan (Collectives.attached):
an elastic reset, a shutdown or removing the process set closes it, and a
graph traced over it then fails with FailedPrecondition naming the group
(trace the step again: a new plan makes a new group).

The default (RDMATENSOR_TF_OPS unset or `native`; `python` turns it off), for
static shapes, a reduction the executor has (average, sum, min, max,
product: not Adasum), its dtypes (float16/32/64, int32/64: not bfloat16),
more than one rank, all on one host, the job's provider shm or
auto (RDMATENSOR_PROVIDER=verbs or tcp keeps that provider), outside elastic
jobs, not a reducescatter, without RDMATENSOR_CHECK_FINITE (the executor does
not look for NaN and Inf), no time line recording when the graph is traced
(RDMATENSOR_TIMELINE, hvd.start_timeline: it records the Python path's
buckets and rings); anything else takes overlap.bucketed as before.
"""
from __future__ import annotations

import functools
import os
import sys
import weakref

import numpy as np
import tensorflow as tf

from ..core import scaling
from ..core.tensor_sets import entries_of
from ..native import build, contract, ops
from . import overlap, tf_errors

DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def chosen() -> bool:
    """RDMATENSOR_TF_OPS chooses the native ops: unset (the default) or `native`
    (a bad value raises SettingError)."""
    return build.choice() == "native"


def insisted() -> bool:
    """RDMATENSOR_TF_OPS=native set explicitly: where the ops cannot serve, an error, not the Python path."""
    return chosen() and os.environ.get(build.ENV, "").strip().lower() == "native"


def applies(collectives, tensors, op: str, scatter: bool = False, elastic: bool = False) -> bool:
    """Whether a graph's all-reduce of `tensors` (static shapes, several ranks) in
    this plan runs on the native ops. Not in an elastic job: its step, traced
    once, runs again after a reset, and a group does not outlive its plan."""
    return (chosen() and not scatter and not elastic and op in contract.OPS and collectives.size > 1
            and not getattr(collectives, "check_finite", False)          # RDMATENSOR_CHECK_FINITE: Python's check
            and len(set(collectives.hosts)) == 1 and all(t.dtype in DTYPES for t in tensors)
            and getattr(collectives, "provider", "auto") in ("auto", "shm")   # RDMATENSOR_PROVIDER=verbs: verbs
            and getattr(getattr(collectives, "comm", None), "timeline", None) is None)   # it records the ring


class _Unavailable:
    """In place of a group that could not be made (on every rank alike): why."""

    def __init__(self, why: str):
        self.why = why

    def close(self) -> None:
        pass


def group_for(collectives, buckets, layouts, tensors, failure=None):
    """The native group of this tensor set in this plan, made now (an exchange with
    every rank of the set) if the set is new; `failure` (core/failure.py's
    JobFailure) aborts it when the job loses a rank. When it cannot be made (on every rank
    alike): BuildError with RDMATENSOR_TF_OPS=native set explicitly, else one line
    on stderr and None (the Python path), for this set's every later graph too.
    Where the ranks' sets differ, or a rank makes another collective here, the
    plan's exchange raises the mismatch (FailedPreconditionError) on every rank,
    now, at trace time, and nothing is kept."""
    key = ("native", buckets.key)
    with collectives._lock:          # the bootstrap channel: one exchange at a time  # noqa: SLF001
        with tf_errors.as_horovod_errors():
            collectives.mend()       # a group broken by a failed all-reduce: made afresh first
        made = collectives.attached.get(key)
        if made is None:
            sizes = [sum(shape.num_elements() for _, _, shape in layout) * tensors[layout[0][0]].dtype.size
                     for layout in layouts]
            # A call of the plan's, its set agreed as any new set is (no slots of its own): a rank that
            # makes another collective here fails with this one as a mismatch, a rank that resets takes
            # this one into its reset, and every rank's next call still has one number.
            request = ("native", *buckets.request[1:])
            number = collectives.begin()
            with tf_errors.as_horovod_errors():
                collectives.attempt(number, lambda: collectives.ensure([request], number), entries_of(*request))
                group, why = ops.local_group(collectives.bootstrap.allgather, collectives.rank, collectives.size,
                                             sizes, collectives.timeout, agreed=repr(buckets.key))
            if why == ops.SETS_DIFFER:      # a mismatch: the Python path raises it, and nothing is kept
                return None
            made = collectives.attached[key] = group if group is not None else _Unavailable(why)
            if collectives.mender is None:
                collectives.mender = Mender(failure)
            collectives.mender.watch(group)
            if group is None and not insisted():
                print(f"rdmatensor: the native all-reduce cannot serve an all-reduce of {len(tensors)} tensors "
                      f"({why}); the Python path runs", file=sys.stderr)
    if isinstance(made, _Unavailable):
        if insisted():
            raise build.BuildError(f"rdmatensor: the native all-reduce cannot serve an all-reduce of "
                                   f"{len(tensors)} tensors ({made.why}); {build.ENV}=native was set")
        return None
    return made


def preload() -> None:
    """Load the op library now when it is chosen: XLA takes an op's XLA kernel only
    if its library was loaded before the process's first XLA compilation."""
    if chosen():
        ops.native_library()


class Mender:
    """How a plan's native groups come back after a failed all-reduce: a group
    that failed (a timeout, a mismatch, a peer's abort) stays broken, so the
    plan resets as after any failed call (core/collectives.py: every rank in one
    exchange) and then makes every group afresh under its own name: a graph
    traced over a group finds the new one when it runs next. A lost rank
    (`failure`, core/failure.py) aborts them all: every wait ends, naming it."""

    def __init__(self, failure):
        self.failure = failure

    def watch(self, group) -> None:
        if group is not None and self.failure is not None:
            self.failure.on_failure(functools.partial(_abort, weakref.ref(group)))

    @staticmethod
    def broken(attached: dict) -> str | None:
        """Why a group of the plan is broken, or None while every one is live."""
        for key, group in attached.items():
            status = group.status() if key[0] == "native" and not isinstance(group, _Unavailable) else 0
            if status not in (0, contract.CLOSED):
                return (f"the native all-reduce of group {group.name} failed on this rank "
                        f"({type(contract.error_for(status, '')).__name__})")
        return None

    @staticmethod
    def ahead(attached: dict) -> list:
        """(group, (peer, bucket, call)) for each group where a peer has begun a call
        this rank has not (checked_collectives.py judges how long that lasts)."""
        found = []
        for key, group in list(attached.items()):
            if key[0] == "native" and not isinstance(group, _Unavailable):
                peer = group.peer_ahead()
                if peer is not None:
                    found.append((group, peer))
        return found

    @staticmethod
    def diverged(group, why: str) -> None:
        """Abort `group` as a mismatch: a peer waiting in it fails now with
        FailedPreconditionError, as a mismatch does, not at its timeout."""
        group.abort(why, contract.MISMATCH)

    def remake(self, collectives) -> None:
        """Every group of the plan closed and made again (an exchange with every
        rank, which calls this at the same point, in the same order)."""
        for key, old in list(collectives.attached.items()):
            if key[0] != "native" or isinstance(old, _Unavailable):
                continue
            old.close()
            group, why = ops.local_group(collectives.bootstrap.allgather, collectives.rank, collectives.size,
                                         old.bucket_bytes, collectives.timeout, name=old.name, agreed=repr(key[1]))
            collectives.attached[key] = group if group is not None else _Unavailable(why)
            self.watch(group)


def _abort(group, error) -> None:
    g = group()
    if g is not None:
        g.abort(f"{type(error).__name__}: {error}")


in_xla = ops.in_xla       # whether the graph being built is compiled by XLA (for horovod/tensors.py)


def alone(t: tf.Tensor, prescale: float, postscale: float) -> tf.Tensor:
    """An all-reduce with nothing to move (one rank, or no element), in the graph:
    `t` scaled as core/scaling.py scales (the prescale, then the postscale), so
    that it compiles under XLA."""
    return _prescaled(_prescaled(t, prescale), postscale)


def _prescaled(t: tf.Tensor, prescale: float) -> tf.Tensor:
    """t times the prescale, as core/scaling.py multiplies (Horovod's ScaleBuffer)."""
    pre = scaling.factor(prescale)
    if pre == 1.0:
        return t
    if t.dtype == tf.float64:
        return t * tf.constant(pre, tf.float64)
    if t.dtype == tf.float32:
        return t * tf.constant(np.float32(pre))
    if t.dtype == tf.float16:
        return tf.cast(tf.cast(t, tf.float32) * tf.constant(np.float32(pre)), tf.float16)
    return tf.cast(tf.cast(t, tf.float64) * tf.constant(pre, tf.float64), t.dtype)      # truncates toward 0


def bucketed(tensors: list, layouts: list[list[tuple]], group, op: str, prescale: float, postscale: float,
             name: str) -> list:
    """The all-reduced tensors, in a graph: `layouts` as overlap.bucketed takes
    them (bucket j's members as (position, offset, shape); the offsets are the
    ring's and unused here: a bucket's request is its members back to back). A
    tensor in no bucket (zero elements) comes back as zeros."""
    launched, out = [], [None] * len(tensors)
    if ops.in_xla():            # one custom call per bucket, chained by a token (no async ops in XLA)
        for j, layout in enumerate(layouts):
            members = [_prescaled(tensors[p], prescale) for p, _, _ in layout]
            for (p, _, _), t in zip(layout, ops.allreduce_xla(members, group, j, op, postscale,
                                                              f"{name} bucket {j}"), strict=True):
                out[p] = t
        return [t if t is not None else tf.zeros_like(tensors[p]) for p, t in enumerate(out)]
    with overlap.in_program_order() as done:
        previous = []
        for j, layout in enumerate(layouts):
            members = [_prescaled(tensors[p], prescale) for p, _, _ in layout]
            with tf.control_dependencies(previous):
                x = ops.launch_fused(members, group, j, op, postscale, f"{name} bucket {j}")
            launched.append(x)
            previous = [x.handle]
    with tf.control_dependencies([x.handle for x in launched]):
        for layout, x in zip(layouts, launched, strict=True):
            reduced = ops.complete_fused(x)
            for (p, _, _), t in zip(layout, reduced, strict=True):
                out[p] = t
            done(reduced[0].op)
    return [t if t is not None else tf.zeros_like(tensors[p]) for p, t in enumerate(out)]
