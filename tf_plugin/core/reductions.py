"""How an all-reduce set combines, as one string every rank agrees on.

An all-reduce's op is part of its tensor set (tensor_sets.py): ranks that
disagree on the reduction, the fusion threshold, the hierarchy or Horovod's
scale factors call different collectives, so all of it is written into the
set's op (allreduce_op) and read back where the ring is built (Reduction).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import scaling, settings
from .layout import VarInfo, buckets_of

REDUCTIONS = ("average", "sum", "min", "max", "product")
COMBINE = {"average": np.add, "sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def allreduce_op(op: str, threshold: int, prescale: float = 1.0, postscale: float = 1.0,
                 scatter: bool = False) -> str:
    """An all-reduce set's op: how it combines (one of REDUCTIONS), the fusion
    threshold that cut its buckets, ":h" when the all-reduce is to be
    hierarchical wherever several hosts hold the same number (> 1) of ranks
    each: by default, unlike Horovod, as it measured faster there (bench.hierarchical);
    RDMATENSOR_HIERARCHICAL_ALLREDUCE=0 or HOROVOD_HIERARCHICAL_ALLREDUCE=0 keeps the flat ring. Then Horovod's pre- and
    postscale factors (rounded to float32, as its op attributes are) where they
    are not 1, and ":scatter" for a reducescatter (the same ring; each rank keeps
    its rows). Read at each new set; the ranks must agree on all of it: a set
    that differs in any part is another set, compared when it is proposed."""
    if op not in REDUCTIONS:
        raise ValueError(f"reduction {op!r} is not one of {REDUCTIONS}")
    hierarchical = settings.flag(settings.HIERARCHICAL_ALLREDUCE)
    pre, post = scaling.factor(prescale), scaling.factor(postscale)
    return (f"{op}:{threshold}" + (":h" if hierarchical else "")
            + (f":pre={pre!r}" if pre != 1.0 else "") + (f":post={post!r}" if post != 1.0 else "")
            + (":scatter" if scatter else ""))


@dataclass(frozen=True)
class Reduction:
    """An all-reduce set's op (allreduce_op), read back."""
    op: str
    threshold: int
    hierarchical: bool = False
    prescale: float = 1.0
    postscale: float = 1.0
    scatter: bool = False

    @classmethod
    def of(cls, text: str) -> "Reduction":
        op, threshold, *flags = text.split(":")
        named = dict(f.split("=") for f in flags if "=" in f)
        return cls(op, int(threshold), "h" in flags, float(named.get("pre", 1.0)), float(named.get("post", 1.0)),
                   "scatter" in flags)

    def after_sum(self, size: int) -> float | None:
        """What the combined values are multiplied by (an Average's 1/N folded into
        the postscale, in double, as Horovod does), or None for nothing."""
        scale = self.postscale / size if self.op == "average" else self.postscale
        return None if scale == 1.0 else scale

    def words(self) -> str:
        """As a message says it: "sum", "average, prescale 2.0"."""
        return ", ".join([self.op] + ([f"prescale {self.prescale!r}"] if self.prescale != 1.0 else [])
                         + ([f"postscale {self.postscale!r}"] if self.postscale != 1.0 else []))


def allreduce_buckets(shapes, dtypes, threshold: int) -> list:
    """The buckets of an all-reduce set; member keys are positions in the set, as strings."""
    infos = [VarInfo(str(j), tuple(s), np.dtype(d), False, {}) for j, (s, d) in enumerate(zip(shapes, dtypes,
                                                                                           strict=True))]
    return buckets_of(infos, fusion=True, threshold=threshold)
