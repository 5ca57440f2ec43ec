"""What each kind of tensor set is on the wire: the slots it is planned with
(lay_out) and what a rank writes and reads of them in one call.

The engine (collectives.py) numbers a call, agrees on its set and resets the
generation when it fails; the functions here only move the values, on the
session and under the tag it hands them:

- allreduce: the executor's ring (executor/ring.py) over fused buckets
  (layout.buckets_of: in the order backprop produces the gradients, up to
  the fusion threshold each), its chunks laid out by layout.ring_specs, or
  where several hosts hold several ranks each, by layout.hierarchical_specs:
  a ring per host, one across hosts (HOROVOD_HIERARCHICAL_ALLREDUCE=0: flat).
  Every bucket's ring runs on the communication thread (executor/comm_thread.py): a
  graph hands each bucket over as soon as its gradients exist (launch) and
  takes its result later (collect); eagerly, all are handed over, then
  collected. The fusion threshold is part of the set, so ranks that disagree
  on it fail with PlanMismatch. An all-reduce with nothing to reduce is a
  byte to and from every rank (present);
- broadcast: one tensor per (tensor, non-root rank), written by the root (a
  byte instead when every tensor is empty), one byte from every non-root
  rank to the root, and one byte per non-root rank, written once the root
  has every other rank's byte and every rank released the value: a rank
  returns only when every rank took part in the same call, so a broadcast
  that fails on one rank fails on all (as Horovod's does), and ranks that
  disagree on the root each write into a set the other is not in;
- allgather, alltoall: one dynamic-shape tensor (first dimension None) per
  (tensor, ordered pair of ranks), its first room the largest any rank
  proposed (an alltoall part is at most its whole tensor).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

from rdmatensor import Plan, TensorSpec

from .buffers import aligned_empty
from .layout import Analysis, Hierarchy, VarInfo, hierarchical_specs, ring_specs
from .reductions import Reduction, allreduce_buckets
from .tensor_sets import TensorSet

OK = np.ones(1, np.uint8)   # a broadcast's root to every other rank: every rank took the value


def contiguous(a) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def copy_out(view: np.ndarray, meter) -> np.ndarray:
    """A received value outlives its slot (and its generation): one copy."""
    out = aligned_empty(view.shape, view.dtype)
    np.copyto(out, view)
    meter.tally["copied"] += 1
    return out


def lay_out(ts: TensorSet, room: list[int], hosts: list[str], n: int) -> None:
    """The TensorSpecs of a new set among n ranks on `hosts` (and, for an allreduce,
    its ring's analysis); `room`: per tensor of a gathered set, the most bytes
    any rank proposed."""
    if ts.kind == "native":     # a native all-reduce's set (graph/native_allreduce.py): its group moves it
        ts.specs = []
        return
    prefix = f"s{ts.index}"
    shapes = [tuple(e["shape"]) for e in ts.entries]
    dtypes = [np.dtype(e["dtype"]) for e in ts.entries]
    if ts.kind == "allreduce":
        infos = [VarInfo(str(j), s, d, False, {}) for j, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
        reduction = Reduction.of(ts.op)
        buckets = [replace(b, key=f"{prefix}/{b.key}")
                   for b in allreduce_buckets(shapes, dtypes, reduction.threshold)]
        hierarchy = Hierarchy.of(hosts) if reduction.hierarchical else None
        ts.specs = [spec for spec, _ in (hierarchical_specs(buckets, hierarchy) if hierarchy else
                                         ring_specs(buckets, n))]
        if not buckets:       # nothing to reduce: one byte between every pair still makes it a call
            ts.specs = [TensorSpec(f"{prefix}/here/r{src}/r{dst}", (1,), np.uint8, src, dst)
                        for src in range(n) for dst in range(n) if src != dst]
        ts.analysis = Analysis(Plan(ts.specs), "allreduce", n, 0, infos, buckets=buckets, hierarchy=hierarchy)
    elif ts.kind == "broadcast":
        root = int(ts.op)
        ts.specs = [TensorSpec(f"{prefix}/b{j}/r{dst}", s, d, root, dst)
                    for j, (s, d) in enumerate(zip(shapes, dtypes, strict=True)) if 0 not in s
                    for dst in range(n) if dst != root]
        ts.specs += [TensorSpec(f"{prefix}/ok/r{dst}", (1,), np.uint8, root, dst)
                     for dst in range(n) if dst != root]
        ts.specs += [TensorSpec(f"{prefix}/here/r{src}", (1,), np.uint8, src, root)
                     for src in range(n) if src != root]
        if not any(0 not in s for s in shapes):      # nothing to write: a byte from the root instead
            ts.specs += [TensorSpec(f"{prefix}/go/r{dst}", (1,), np.uint8, root, dst)
                         for dst in range(n) if dst != root]
    else:
        ts.specs = [TensorSpec(f"{prefix}/g{j}/r{src}/r{dst}", s, d, src, dst, capacity=max(room[j], 64))
                    for j, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
                    for src in range(n) for dst in range(n) if src != dst]


def present(session, prefix: str, tag: int, rank: int, size: int) -> None:
    """An all-reduce with nothing to reduce: one byte to and from every rank
    proves that every rank made this same call."""
    session.send_many([(f"{prefix}/here/r{rank}/r{dst}", OK) for dst in range(size) if dst != rank], tag=tag)
    for src in range(size):
        if src != rank:
            session.recv(f"{prefix}/here/r{src}/r{rank}", tag=tag).release()


def broadcast(session, prefix: str, tag: int, rank: int, size: int, root: int, arrays, meter) -> list[np.ndarray]:
    """Root's arrays on every rank; the root's own come back as they are, once every rank took them."""
    empty = not any(a.size for a in arrays)     # alike on every rank: shapes are the set's
    if rank == root:
        # Writes first, so that two ranks that each take themselves for the root
        # each find the other's write in a set they are not in (checked_collectives.py); with no
        # value to write, a byte. Then every other rank's byte, which proves it makes
        # this call; the done bytes only after that: no rank returns from a call
        # another rank did not make.
        items = [(f"{prefix}/b{j}/r{dst}", contiguous(a)) for j, a in enumerate(arrays)
                 for dst in range(size) if dst != root and a.size]
        if empty:
            items = [(f"{prefix}/go/r{dst}", OK) for dst in range(size) if dst != root]
        session.send_many(items, tag=tag)
        for src in range(size):
            if src != root:
                session.recv(f"{prefix}/here/r{src}", tag=tag).release()
        session.wait_released([name for name, _ in items])   # every rank took it, in this call
        session.send_many([(f"{prefix}/ok/r{dst}", OK) for dst in range(size) if dst != root], tag=tag)
        return list(arrays)
    # A byte to the root it names, before it waits: two ranks that each take the
    # other for the root each find the other's byte in a set they are not in.
    session.send(f"{prefix}/here/r{rank}", OK, tag=tag)
    if empty:
        session.recv(f"{prefix}/go/r{rank}", tag=tag).release()
    out = []
    for j, a in enumerate(arrays):
        if not a.size:
            out.append(np.array(a))
            continue
        with session.recv(f"{prefix}/b{j}/r{rank}", tag=tag) as view:
            out.append(copy_out(view, meter))
    session.recv(f"{prefix}/ok/r{rank}", tag=tag).release()   # so did every other rank
    return out


def allgather(session, prefix: str, tag: int, rank: int, size: int, arrays, meter) -> list[np.ndarray]:
    """Every rank's arrays concatenated along the first dimension, in rank order."""
    session.send_many([(f"{prefix}/g{j}/r{rank}/r{dst}", contiguous(a))
                       for j, a in enumerate(arrays) for dst in range(size) if dst != rank], tag=tag)
    out = []
    for j, a in enumerate(arrays):
        with contextlib.ExitStack() as held:
            parts = [a if src == rank else held.enter_context(
                session.recv(f"{prefix}/g{j}/r{src}/r{rank}", tag=tag)) for src in range(size)]
            rows = sum(p.shape[0] for p in parts)
            result = aligned_empty((rows, *a.shape[1:]), a.dtype)
            np.concatenate(parts, out=result)
            meter.tally["copied"] += 1
        out.append(result)
    return out


def alltoall(session, prefix: str, tag: int, rank: int, size: int, parts: list, array: np.ndarray,
             meter) -> tuple[np.ndarray, np.ndarray]:
    """parts[d] to rank d; what every rank sent this one, concatenated in rank
    order (rows shaped as `array`'s), and how many rows came from each."""
    session.send_many([(f"{prefix}/g0/r{rank}/r{dst}", parts[dst]) for dst in range(size) if dst != rank], tag=tag)
    with contextlib.ExitStack() as held:
        got = [parts[src] if src == rank else held.enter_context(
            session.recv(f"{prefix}/g0/r{src}/r{rank}", tag=tag)) for src in range(size)]
        out = aligned_empty((sum(g.shape[0] for g in got), *array.shape[1:]), array.dtype)
        np.concatenate(got, out=out)
        meter.tally["copied"] += 1
        return out, np.array([g.shape[0] for g in got], np.int32)
