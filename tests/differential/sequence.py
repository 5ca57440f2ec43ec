"""Seeded random sequences of collectives, the same on every rank and under
every implementation, with now and then one rank calling something else; a
share of them (in_graph) each inside a tf.function of its own.

A call is drawn from (seed, index) alone, so any rank (and the comparison) can
rebuild it, and its inputs from (seed, index, rank, tensor). Each seed draws
small pools of names, shapes, dtypes and scale factors, so that most calls
reuse a tensor set already planned while names recur across dtypes, shapes and
ops. What is drawn stays within Horovod's CPU build: the dtypes each op takes,
Sum and Average for reducescatter, int32 splits, no Adasum, and values where no
integer overflows.

A *change* is made on one rank (the victim) only:

- Horovod judges these (it raises FailedPreconditionError on every rank):
  dtype, shape, op, root, scale, empty (an empty tensor against a non-empty one);
- only this project's promise judges these, as Horovod waits for ever on them:
  kind (another collective), count (a grouped call of another size);
- name (another name, the same call) is no change at all: eager Horovod ignores
  names, and so must the result. In a graph Horovod waits for ever on it (its
  ranks meet on the op's name): there only this project's promise judges it.

A grouped all-reduce of mixed dtypes is this project's extension (Horovod
refuses it before it communicates): only the numpy model judges it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

INTS = ["uint8", "int8", "int32", "int64"]
FLOATS = ["float16", "float32", "float64"]
DTYPES = {                                           # per kind, as Horovod's TensorFlow ops register them
    "allreduce": INTS + FLOATS,
    "grouped_allreduce": INTS + FLOATS,
    "reducescatter": ["int32", "int64"] + FLOATS,
    "allgather": INTS + ["uint16", "int16"] + FLOATS + ["bool"],
    "broadcast": INTS + ["uint16", "int16"] + FLOATS + ["bool"],
    "alltoall": INTS + ["uint16", "int16"] + FLOATS + ["bool"],
}
KINDS = list(DTYPES)
OPS = {"allreduce": ["Sum", "Average", "Min", "Max", "Product"], "grouped_allreduce": ["Sum", "Average", "Min",
       "Max", "Product"], "reducescatter": ["Sum", "Average"]}
JUDGED = ("dtype", "shape", "op", "root", "scale", "empty")      # Horovod raises on these
OURS = ("kind", "count")                                        # Horovod waits for ever on these
CHANGES = {"allreduce": JUDGED[:3] + ("scale", "empty", "kind", "name"), "grouped_allreduce": ("dtype", "shape",
           "op", "scale", "count", "name"), "reducescatter": ("dtype", "shape", "op", "scale", "kind", "name"),
           "allgather": ("dtype", "shape", "kind", "name"), "broadcast": ("dtype", "shape", "root", "kind", "name"),
           "alltoall": ("dtype", "kind", "name")}


@dataclass(frozen=True)
class Call:
    """One rank's view of a collective call."""
    index: int
    kind: str
    name: str
    dtypes: tuple                     # one per tensor
    shapes: tuple                     # one per tensor (allgather, alltoall: this rank's rows)
    op: str = "Sum"
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = 0
    splits: tuple | None = None       # alltoall: rows to each member, or None for equal parts
    members: tuple = ()               # the process set's ranks; the global set is every rank
    process_set: int = 0              # its index in the job's registered sets
    change: str | None = None         # what the victim changed, on every rank's view
    victim: int | None = None

    @property
    def mismatch(self) -> bool:
        return self.change is not None and self.change != "name"


@dataclass
class Pools:
    names: list
    shapes: list
    dtypes: dict
    factors: list = field(default_factory=list)


def pools(seed: int) -> Pools:
    rng = np.random.default_rng([seed, 1 << 30])
    shapes = [tuple(int(d) for d in rng.integers(1, 6, int(rng.integers(1, 4)))) for _ in range(3)]
    shapes.append((0,) if rng.random() < 0.5 else (2, 0))              # zero-size dimensions
    return Pools(names=[f"t{k}" for k in rng.choice(9, 2, replace=False)], shapes=shapes,
                 dtypes={k: list(rng.choice(v, 2, replace=False)) for k, v in DTYPES.items()},
                 factors=[(1.0, 1.0), (1.0, 1.0), (round(float(rng.uniform(0.1, 2)), 3), 1.0),
                          (1.0, round(float(rng.uniform(0.1, 1.3)), 3)), (0.5, 1.25)])


def process_sets(size: int) -> list[tuple]:
    """The sets every run registers at init: the global set, and with 3 ranks and
    more, every pair of neighbours."""
    return [tuple(range(size))] + ([tuple(sorted((r, (r + 1) % size))) for r in range(size)] if size >= 3 else [])


def call(seed: int, index: int, size: int, change_rate: float = 0.06) -> Call:
    """Call `index` of seed `seed`, as every rank sees it before any change."""
    rng = np.random.default_rng([seed, index])
    p = pools(seed)
    sets = process_sets(size)
    kind = KINDS[int(rng.integers(len(KINDS)))]
    ps = int(rng.integers(1, len(sets))) if len(sets) > 1 and rng.random() < 0.2 else 0
    members = sets[ps]
    dtype = str(p.dtypes[kind][int(rng.integers(2))])
    shape = p.shapes[int(rng.integers(len(p.shapes)))]
    c = Call(index, kind, str(rng.choice(p.names)), (dtype,), (shape,), members=members, process_set=ps)
    if kind in OPS:
        pre, post = p.factors[int(rng.integers(len(p.factors)))]
        if dtype in ("uint8", "int8"):
            pre, post = min(pre, 1.0), min(post, 1.0)
        c = replace(c, op=OPS[kind][int(rng.integers(len(OPS[kind])))], prescale=pre, postscale=post)
    if kind == "grouped_allreduce":
        count = int(rng.integers(2, 4))
        mixed = rng.random() < 0.3
        dtypes = tuple(str(rng.choice(DTYPES[kind])) if mixed else dtype for _ in range(count))
        c = replace(c, dtypes=dtypes, shapes=tuple(p.shapes[int(rng.integers(len(p.shapes)))] for _ in range(count)))
    if kind == "reducescatter":
        n = len(members)
        c = replace(c, shapes=((int(rng.integers(n, 2 * n + 2)), *shape[1:]),))
    if kind == "broadcast":
        c = replace(c, root=int(rng.choice(members)))
    if kind == "alltoall":
        n = len(members)
        if rng.random() < 0.5:
            c = replace(c, shapes=((n * int(rng.integers(0, 3)), *shape[1:]),))
        else:
            splits = tuple(int(x) for x in rng.integers(0, 3, n))
            c = replace(c, splits=splits, shapes=((sum(splits), *shape[1:]),))
    if rng.random() < change_rate:
        c = replace(c, change=str(rng.choice(CHANGES[kind])), victim=int(rng.choice(members)))
    return c


def as_seen_by(c: Call, rank: int, seed: int) -> Call:
    """The call as `rank` makes it: the victim's changed, allgather's rows per rank."""
    if c.kind == "allgather":
        rows = int(np.random.default_rng([seed, c.index, rank, 7]).integers(0, 4))
        c = replace(c, shapes=tuple((rows, *s[1:]) for s in c.shapes))
    if c.kind == "alltoall" and c.splits is not None and rank in c.members:
        splits = tuple(int(x) for x in np.random.default_rng([seed, c.index, rank, 8]).integers(0, 3, len(c.members)))
        c = replace(c, splits=splits, shapes=((sum(splits), *c.shapes[0][1:]),))
    if rank != c.victim or c.change is None:
        return c
    first = c.shapes[0]
    if c.change == "dtype":
        others = [d for d in DTYPES[c.kind] if d != c.dtypes[0] and not (c.op == "Product" and d == "bool")]
        other = others[c.index % len(others)]
        return replace(c, dtypes=(other,) + c.dtypes[1:])
    if c.change == "shape":
        if c.kind == "allgather":                     # rows may differ: the trailing dimensions may not
            return replace(c, shapes=((first[0], *first[1:], 2),) + c.shapes[1:])
        return replace(c, shapes=((first[0] + 1, *first[1:]),) + c.shapes[1:])
    if c.change == "op":
        ops = OPS[c.kind]
        return replace(c, op=ops[(ops.index(c.op) + 1) % len(ops)])
    if c.change == "root":
        return replace(c, root=c.members[(c.members.index(c.root) + 1) % len(c.members)])
    if c.change == "scale":
        return replace(c, prescale=c.prescale * 0.5)
    if c.change == "empty":
        return replace(c, shapes=((0, *first[1:]) if first[0] else (3, *first[1:]),))
    if c.change == "kind":
        other = {"allreduce": "reducescatter", "reducescatter": "allreduce", "allgather": "broadcast",
                 "broadcast": "allgather", "alltoall": "allgather"}[c.kind]
        rows = max(first[0], len(c.members)) if other == "reducescatter" else first[0]
        return replace(c, kind=other, shapes=((rows, *first[1:]),), splits=None, root=c.members[0],
                       op="Sum" if other in OPS else c.op, prescale=1.0, postscale=1.0)
    if c.change == "count":
        return replace(c, dtypes=c.dtypes + c.dtypes[:1], shapes=c.shapes + c.shapes[:1])
    if c.change == "name":
        return replace(c, name=c.name + "_other")
    raise ValueError(c.change)


def judged_by_horovod(c: Call, graph: bool = False) -> bool:
    """Whether real Horovod makes this call (it waits for ever on OURS, and on
    another name in a graph, where a name is what its ranks meet on; it refuses a
    grouped all-reduce of mixed dtypes)."""
    return c.change not in OURS and not (graph and c.change == "name") and len(set(c.dtypes)) == 1


def in_graph(seed: int, index: int, share: float) -> bool:
    """Whether call `index` of seed `seed` is made inside a tf.function (on every
    rank alike), for a run that makes `share` of its calls there."""
    return share > 0 and np.random.default_rng([seed, index, 11]).random() < share


def inputs(c: Call, rank: int, seed: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors for call c (as it sees it), within ranges where no
    integer overflows whatever the op, factors and number of ranks."""
    out = []
    for j, (dtype, shape) in enumerate(zip(c.dtypes, c.shapes, strict=True)):
        rng = np.random.default_rng([seed, c.index, rank, j])
        if dtype == "bool":
            out.append(rng.random(shape) < 0.5)
            continue
        if c.op == "Product":
            v = rng.choice([1, 2] if dtype == "uint8" else [-2, -1, 1, 2], shape)
        elif dtype == "uint8":
            v = rng.integers(0, 20, shape)
        elif dtype in ("int8", "uint16", "int16"):
            v = rng.integers(0 if dtype == "uint16" else -12, 12, shape)
        else:
            v = rng.integers(-60, 60, shape)
        v = v.astype(np.float64) / (4 if dtype in FLOATS and c.op != "Product" else 1)
        out.append(v.astype(dtype))
    return out


def seeds_of(text: str) -> list[int]:
    """"1-20" or "3,5" as a list of seeds."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]
