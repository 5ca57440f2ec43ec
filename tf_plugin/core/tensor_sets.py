"""Tensor sets: what a collective call is, as the ranks compare it.

Each collective call names a tensor set: its kind (allreduce with an op,
broadcast from a root, allgather, alltoall) and, per tensor, a name, shape
and dtype. A set is keyed without names (set_key), proposed to the other
ranks as entries (entries_of), compared (first_difference) and named in
messages (describe): everything the ranks must agree on before a value moves,
apart from the engine that moves it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layout import Analysis
from .reductions import Reduction


@dataclass
class TensorSet:
    """One collective's tensors, as every rank agreed on them."""
    index: int
    kind: str                      # allreduce | broadcast | allgather | alltoall
    op: str                        # allreduce: REDUCTIONS:threshold; broadcast: root rank; others: ""
    entries: list                  # per tensor: {"name", "shape", "dtype"} (ROWS_VARY kinds: shape[0] None)
    specs: list = field(default_factory=list)
    analysis: Analysis | None = None


@dataclass
class AllreduceGroup:
    """An all-reduce as a graph builds it: its tensor set's request and key, and
    its buckets (the layout every rank derives from the agreed set)."""
    request: tuple
    key: tuple
    buckets: list

    def members(self, j: int, flat: np.ndarray) -> list[np.ndarray]:
        """Bucket j's members, in order, as views of its flat output."""
        described = self.request[3]
        return self.buckets[j].split(flat, {key: described[int(key)].shape for key, _, _ in self.buckets[j].members})


@dataclass(frozen=True)
class Described:
    """A tensor's shape and dtype, standing for its array before it exists."""
    shape: tuple
    dtype: np.dtype


ROWS_VARY = ("allgather", "alltoall")    # kinds whose tensors' first dimension may differ between ranks and calls


def set_key(kind: str, op: str, names, arrays) -> tuple:
    """What identifies a tensor set: kind, op, and each tensor's shape and dtype in
    order; not names. Every rank must agree on it, and ranks need not agree on
    names (Keras numbers layers per process, and eager Horovod ignores them):
    two calls that differ only in names are the same collective, on one rank
    as between ranks, so a set keyed by names could be planned on one rank and
    new on another."""
    dims = (lambda a: a.shape[1:]) if kind in ROWS_VARY else (lambda a: a.shape)
    return (kind, op, tuple((tuple(dims(a)), np.dtype(a.dtype)) for a in arrays))


def entries_of(kind: str, op: str, names, arrays) -> list[dict]:
    varies = kind in ROWS_VARY
    return [{"name": n, "op": f"{kind}:{op}" if op != "" else kind,
             "shape": ([None] if varies else []) + list(a.shape[1 if varies else 0:]),
             "dtype": np.dtype(a.dtype).name} for n, a in zip(names, arrays, strict=True)]


def first_difference(proposals: list[list[dict]]) -> str | None:
    """Where the ranks' proposed tensor lists first differ (None if they agree).
    Tensors match by position, op, shape and dtype; names only say which one it
    is (they may differ: Keras numbers layers per process)."""
    mine = proposals[0]
    for rank, theirs in enumerate(proposals[1:], 1):
        for a, b in zip(mine, theirs):  # noqa: B905 - lengths compared below
            factors = _factors(a["op"]), _factors(b["op"])
            if factors[0] != factors[1] and _unscaled(a["op"]) == _unscaled(b["op"]):
                return (f"Mismatched prescale and/or postscale factors: rank 0 sent factors {factors[0]} for "
                        f"tensor {a['name']!r}, rank {rank} sent factors {factors[1]}")
            diff = "; ".join(f"{k}: {a[k]} vs {b[k]}" for k in ("op", "shape", "dtype") if a[k] != b[k])
            if diff:
                also = f" (rank {rank} calls it {b['name']!r})" if b["name"] != a["name"] else ""
                return f"plan mismatch between rank 0 and rank {rank}: tensor {a['name']!r}{also} differs ({diff})"
        if len(mine) != len(theirs):
            owner, extra = (0, mine[len(theirs)]) if len(mine) > len(theirs) else (rank, theirs[len(mine)])
            return (f"plan mismatch between rank 0 and rank {rank}: tensor {extra['name']!r} is only in "
                    f"rank {owner}'s collective ({len(mine)} vs {len(theirs)} tensors)")
    return None


def _factors(op: str) -> tuple[float, float] | None:
    """An entry's (prescale, postscale), for an all-reduce's."""
    kind, _, arg = op.partition(":")
    return (Reduction.of(arg).prescale, Reduction.of(arg).postscale) if kind == "allreduce" else None


def _unscaled(op: str) -> str:
    return ":".join(part for part in op.split(":") if not part.startswith(("pre=", "post=")))


def describe(entries: list[dict]) -> str:
    """A collective as a message shows it: its op and first tensors with dtype and shape."""
    if not entries:
        return "an empty collective"
    kind, _, arg = entries[0]["op"].partition(":")
    if kind in ("allreduce", "native"):
        reduction = Reduction.of(arg)
        op = f"{'reducescatter' if reduction.scatter else 'allreduce'} ({reduction.words()})" + \
            (" on the native ops" if kind == "native" else "")
    else:
        op = {"broadcast": f"broadcast from rank {arg}"}.get(kind, kind)
    shown = ", ".join(f"{e['name']!r} {e['dtype']} {list(e['shape'])}" for e in entries[:3])
    more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
    return f"{op} of {shown}{more}"
