"""Horovod's semantics on CPU, in numpy: what every member of an agreeing call
must get. Written from Horovod 0.28.1's sources (operations.cc, gloo_operations.cc,
collective_operations.h) and checked against real Horovod by the differential
run (compare.py), not taken from this project's code.

- Scale factors are float32 op attributes, used as doubles. An Average is a Sum
  whose postscale is divided by the set's size, in double.
- Scaling (ScaleBufferCPUImpl): float64 in double; float32 by the factor cast to
  float, in float; float16 in float then rounded to half; integers in double,
  converted back (truncated toward zero).
- The prescale scales each rank's input, the reduction combines them, the
  postscale scales the result.
- reducescatter: the all-reduce, then rows split along the first dimension, the
  first rows % size members one more.
"""
from __future__ import annotations

import numpy as np

from .sequence import Call

COMBINE = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def _scale(a: np.ndarray, factor: float) -> np.ndarray:
    if a.dtype == np.float64:
        return a * np.float64(factor)
    if a.dtype == np.float32:
        return a * np.float32(factor)
    if a.dtype == np.float16:
        return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return np.trunc(a.astype(np.float64) * np.float64(factor)).astype(a.dtype)


def _reduce(c: Call, arrays: list[np.ndarray]) -> np.ndarray:
    pre = float(np.float32(c.prescale))
    post = float(np.float32(c.postscale))
    if c.op == "Average":
        post /= len(arrays)
    parts = [_scale(a, pre) if pre != 1.0 else a for a in arrays]
    out = parts[0]
    for p in parts[1:]:
        out = COMBINE[c.op](out, p)
    return _scale(out, post) if post != 1.0 else out


def rows_of(rows: int, n: int, position: int) -> slice:
    """A reducescatter member's rows: the first rows % n members get one more."""
    base, extra = divmod(rows, n)
    lo = position * base + min(position, extra)
    return slice(lo, lo + base + (position < extra))


def expected(views: dict[int, Call], by_rank: dict[int, list[np.ndarray]], rank: int) -> list[np.ndarray]:
    """What `rank` gets from an agreeing call, given every member's view of it
    (alltoall's splits differ by rank) and every member's inputs."""
    c = views[rank]
    members = list(c.members)
    n, me = len(members), members.index(rank)
    if c.kind in ("allreduce", "grouped_allreduce"):
        return [_reduce(c, [by_rank[r][j] for r in members]) for j in range(len(c.dtypes))]
    if c.kind == "reducescatter":
        whole = _reduce(c, [by_rank[r][0] for r in members])
        return [whole[rows_of(whole.shape[0], n, me)]]
    if c.kind == "allgather":
        return [np.concatenate([by_rank[r][0] for r in members])]
    if c.kind == "broadcast":
        return [by_rank[c.root][0]]
    if c.kind == "alltoall":
        parts, received = [], []
        for r in members:
            a = by_rank[r][0]
            splits = list(views[r].splits) if views[r].splits is not None else [a.shape[0] // n] * n
            bounds = np.concatenate([[0], np.cumsum(splits)]).astype(int)
            parts.append(a[bounds[me]:bounds[me + 1]])
            received.append(splits[me])
        return [np.concatenate(parts)] + ([np.array(received, np.int32)] if c.splits is not None else [])
    raise ValueError(c.kind)


def tolerance(c: Call, by_rank: dict[int, list[np.ndarray]], j: int, rank: int):
    """How far a float result may be from the model's where the reduction's
    order may differ (3 ranks and more: the ring adds in another order than
    gloo): 4 units in the last place of the sum of the magnitudes (of their
    product, for Product), scaled as the result is; 0 where the order cannot
    change the result."""
    dtype = np.dtype(c.dtypes[j])
    if dtype.kind != "f" or len(c.members) <= 2 or c.op in ("Min", "Max") or c.kind not in (
            "allreduce", "grouped_allreduce", "reducescatter"):
        return 0.0
    pre = abs(float(np.float32(c.prescale)))
    post = abs(float(np.float32(c.postscale))) / (len(c.members) if c.op == "Average" else 1)
    values = [np.abs(by_rank[r][j].astype(np.float64)) * pre for r in c.members]
    magnitude = np.prod(values, axis=0) if c.op == "Product" else np.sum(values, axis=0)
    if c.kind == "reducescatter":
        magnitude = magnitude[rows_of(magnitude.shape[0], len(c.members), list(c.members).index(rank))]
    return 4 * float(np.finfo(dtype).eps) * magnitude * post
