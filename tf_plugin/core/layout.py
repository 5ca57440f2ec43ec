"""How the tensors a job moves are laid out as a Plan, with no TensorFlow: their
names, the fusion buckets, the chunks of a ring (flat or hierarchical, as the
executor's schedule cuts and names them), and the Analysis that holds it all
(printed by `explain()`).

graph/analyzer.py fills one in from a traced step; the collective engine
(collectives.py) grows one from what the job calls.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from rdmatensor import Plan, PlanError, TensorSpec

from ..executor.schedule import ring_bounds, ring_chunk, ring_name
from . import settings
from .buffers import TF_ALIGN    # fused members stay zero-copy



# ------------------------------------------------------------------ naming
def var_key(variable) -> str:
    """A variable's name as it appears in tensor names ("hidden/kernel")."""
    raw = getattr(variable, "path", None) or variable.name.split(":")[0]
    return re.sub(r"[^A-Za-z0-9_.:/\-]", "_", raw)


def ps_rank(index: int, workers: int, ps: int) -> int:
    """The parameter server holding variable `index`: round-robin over the shards."""
    return workers + index % ps


def grad_name(worker: int, var: str, part: str = "") -> str:
    return f"grad/w{worker}/{var}" + (f"/{part}" if part else "")


def param_name(worker: int, var: str) -> str:
    return f"param/w{worker}/{var}"


def bcast_name(var: str, dst: int) -> str:
    return f"bcast/{var}/r{dst}"


def fusion_threshold(threshold: int | None = None) -> int:
    """Bytes per fused bucket: `threshold` if given, else RDMATENSOR_FUSION_THRESHOLD
    or Horovod's HOROVOD_FUSION_THRESHOLD, else 64 MiB (settings.py says why). 0: no fusion."""
    if threshold is None:
        raw, var = settings.FUSION_THRESHOLD.raw()
        try:
            threshold = int(raw)
        except ValueError:
            raise PlanError(f"{var}={raw!r}: expected a number of bytes") from None
    if threshold < 0:
        raise PlanError(f"fusion threshold {threshold}: expected bytes >= 0")
    return int(threshold)


def buckets_of(infos, fusion: bool, threshold: int | None = None) -> list["Bucket"]:
    """The all-reduce buckets, in the order backprop produces their gradients:
    the variables taken last to first (the last layer's gradient exists first).
    A gradient of `threshold` bytes or more (see fusion_threshold) is a bucket
    of its own: the ring sends it from TensorFlow's buffer, no copy. Smaller
    ones are gathered per dtype, each at a 64-byte aligned offset, into a
    bucket closed as soon as it holds `threshold` bytes (so it exceeds the
    threshold by less than its last gradient). The last gradients backprop
    makes, up to threshold / TAIL_SHARE bytes, start buckets of their own (the
    tail): a bucket launched as backprop ends runs wholly after it, so it is
    kept small. Buckets are ordered by their last member, so bucket k is
    complete no later than bucket k + 1 in a backward pass. Without fusion (or
    with threshold 0): one bucket per variable."""
    threshold = fusion_threshold(threshold) if fusion else 0
    filling: dict = {}            # dtype -> (members so far, aligned elements used)
    closed = []                   # (position of the last member, dtype, members)
    tail = _tail_start(infos, threshold // TAIL_SHARE) if threshold else len(infos)
    for position, v in enumerate(reversed(infos)):
        if position == tail:      # what is filling closes: the tail starts its own buckets
            closed += [(members[-1][3], dtype, members) for dtype, (members, _) in filling.items()]
            filling = {}
        n = int(np.prod(v.shape))
        if not n:
            continue
        if n * v.dtype.itemsize >= threshold:
            closed.append((position, v.dtype, [(v.key, 0, n, position)]))
            continue
        members, used = filling.pop(v.dtype, ([], 0))
        members.append((v.key, used, n, position))
        if (used + n) * v.dtype.itemsize >= threshold:
            closed.append((position, v.dtype, members))
        else:
            step = max(1, TF_ALIGN // v.dtype.itemsize)      # the next member starts 64-byte aligned
            filling[v.dtype] = (members, used + -(-n // step) * step)
    closed += [(members[-1][3], dtype, members) for dtype, (members, _) in filling.items()]
    buckets = []
    for k, (_, dtype, members) in enumerate(sorted(closed, key=lambda c: c[0])):
        members = tuple(m[:3] for m in members)
        end = members[-1][1] + members[-1][2]            # no padding after the last member
        key = members[0][0] if not fusion else f"fused{k}/{dtype.name}"
        buckets.append(Bucket(key, dtype, members, end))
    return buckets


TAIL_SHARE = 8     # the tail holds at most threshold / 8 bytes


def _tail_start(infos, most: int) -> int:
    """The position (in backprop's order) of the first gradient of the tail: the
    last gradients made, as many as fit in `most` bytes; len(infos): no tail."""
    start, held = len(infos), 0
    for position in range(len(infos) - 1, -1, -1):       # infos[0]'s gradient is made last
        v = infos[len(infos) - 1 - position]
        held += int(np.prod(v.shape)) * v.dtype.itemsize
        if held > most:
            break
        start = position
    return start


def ring_specs(buckets, ranks: int) -> list[tuple[TensorSpec, str]]:
    """Every chunk the ring all-reduce of `buckets` writes over `ranks` ranks, with
    what it is: per bucket, phase (reduce-scatter, all-gather), step and rank."""
    out = []
    for b in buckets:
        what = f"{len(b.members)} gradients" if len(b.members) > 1 else "gradient"
        out += group_specs(b.key, b.size, b.dtype, tuple(range(ranks)), f"ring chunk, {what}")
    return out


@dataclass(frozen=True)
class Hierarchy:
    """Ranks grouped by host, for the hierarchical all-reduce (as Horovod's
    HOROVOD_HIERARCHICAL_ALLREDUCE): reduce-scatter among the ranks of each host,
    all-reduce of each rank's chunk among the ranks at the same local position on
    every host, all-gather among the ranks of each host. Only 2(H-1) of its
    steps cross hosts, against 2(N-1) for the flat ring."""
    hosts: tuple[tuple[int, ...], ...]      # per host (in order of its first rank), its ranks in order

    @classmethod
    def of(cls, hosts: list[str]) -> "Hierarchy | None":
        """The hierarchy of ranks on `hosts` (one host per rank), or None when it is
        the flat ring: one host, one rank per host, or hosts with different counts."""
        groups: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            groups.setdefault(host, []).append(rank)
        sizes = {len(g) for g in groups.values()}
        if len(groups) < 2 or len(sizes) != 1 or sizes == {1}:
            return None
        return cls(tuple(tuple(g) for g in groups.values()))

    def local(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.hosts if rank in g)

    def cross(self, rank: int) -> tuple[int, ...]:
        position = self.local(rank).index(rank)
        return tuple(g[position] for g in self.hosts)


def hierarchical_specs(buckets, hierarchy: Hierarchy) -> list[tuple[TensorSpec, str]]:
    """Every chunk the hierarchical all-reduce of `buckets` writes: each host's
    ring (its own names, /local) over the whole bucket, then the ring of the ranks
    at each local position (/cross) over the chunk that position holds."""
    out = []
    local_size = len(hierarchy.hosts[0])
    for b in buckets:
        what = f"{len(b.members)} gradients" if len(b.members) > 1 else "gradient"
        for host in hierarchy.hosts:
            out += group_specs(f"{b.key}/local", b.size, b.dtype, host, f"host ring, {what}")
        for position in range(local_size):
            lo, hi = ring_bounds(b.size, local_size)[(position + 1) % local_size]
            out += group_specs(f"{b.key}/cross", hi - lo, b.dtype, tuple(g[position] for g in hierarchy.hosts),
                               f"cross-host ring, {what}")
    return out


def group_specs(key: str, size: int, dtype, group, what: str) -> list[tuple[TensorSpec, str]]:
    """The chunks of one ring over `group` (global ranks in ring order) reducing
    `size` elements: named by the sending rank, as ring_specs names them."""
    n, out = len(group), []
    bounds = ring_bounds(size, n)
    for phase in ("rs", "ag"):
        for s in range(n - 1):
            for p, r in enumerate(group):
                lo, hi = bounds[ring_chunk(phase, s, p, n)]
                out.append((TensorSpec(ring_name(key, phase, s, r), (hi - lo,), dtype, r, group[(p + 1) % n]),
                            f"{what} ({'reduce-scatter' if phase == 'rs' else 'all-gather'})"))
    return out


# ------------------------------------------------------------------ result
@dataclass(frozen=True)
class VarInfo:
    key: str
    shape: tuple
    dtype: np.dtype
    sparse: bool                 # gradient crosses as (values, indices), rows dynamic
    parts: dict                  # gradient part ("" if dense, else values/indices) -> (shape, dtype)


@dataclass(frozen=True)
class Bucket:
    """What one all-reduce moves: members (variable key, offset, elements) laid
    end to end in `size` elements of `dtype`."""
    key: str
    dtype: np.dtype
    members: tuple
    size: int

    def split(self, flat: np.ndarray, shapes) -> list[np.ndarray]:
        """Each member's view of the bucket's flat array, in order, in its shape
        (shapes: member key -> shape)."""
        return [flat[offset:offset + n].reshape(shapes[key]) for key, offset, n in self.members]


@dataclass
class Analysis:
    plan: Plan
    mode: str
    workers: int
    ps: int = 0
    variables: list = field(default_factory=list)
    kinds: dict = field(default_factory=dict)        # tensor name -> what it is
    once: set = field(default_factory=set)            # names moved once at setup, not every step
    optimizer_bytes: int = 0
    buckets: list = field(default_factory=list)      # allreduce: what each ring reduces
    hierarchy: Hierarchy | None = None               # allreduce: hierarchical (hierarchical_specs), else flat

    def static_bytes_per_step(self, rank: int | None = None, direction: str = "src") -> int:
        return sum(s.nbytes for s in self.plan.specs.values()
                   if s.is_static and s.name not in self.once
                   and (rank is None or getattr(s, direction) == rank))

    def rows(self) -> list[dict]:
        out = []
        for s in self.plan.specs.values():
            out.append({"tensor": s.name, "kind": self.kinds.get(s.name, ""),
                        "shape": "x".join("?" if d is None else str(d) for d in s.shape) or "scalar",
                        "dtype": s.dtype.name, "bytes": s.nbytes,
                        "static": s.is_static, "src": s.src, "dst": s.dst,
                        "per_step": s.name not in self.once,
                        "slot_bytes": self.plan.slots[s.name].size})
        return out

    def explain(self, file=None) -> str:
        """A table of every tensor, then slots and arenas per peer, then totals; printed
        to `file` when given, and returned."""
        lines = [f"{self.plan!r}: mode {self.mode}, {self.workers} worker(s)"
                 + (f", {self.ps} ps" if self.ps else "")]
        hdr = ("tensor", "what", "shape", "dtype", "bytes", "shape kind", "src->dst", "moved")
        rows = [(r["tensor"], r["kind"], r["shape"], r["dtype"],
                 str(r["bytes"]) if r["static"] else f"<={r['slot_bytes']}*",
                 "static" if r["static"] else "dynamic", f"{r['src']}->{r['dst']}",
                 "every step" if r["per_step"] else "once") for r in self.rows()]
        lines += _table(hdr, rows)
        if any(not r[5] == "static" for r in rows):
            lines.append("* dynamic: initial slot room; grows on demand (counted as fallbacks)")
        lines.append("")
        prow = []
        for (src, dst), pair in sorted(self.plan.pairs.items()):
            step = sum(sl.spec.nbytes for sl in pair.slots
                       if sl.spec.is_static and sl.spec.name not in self.once)
            dyn = sum(1 for sl in pair.slots if not sl.spec.is_static)
            prow.append((f"{src}->{dst}", str(len(pair.slots)), str(len(pair.arena_sizes)),
                         str(sum(pair.arena_sizes)), str(step), str(dyn)))
        lines += _table(("pair", "slots", "arenas", "arena bytes", "static bytes/step", "dynamic"), prow)
        lines.append("")
        ranks = sorted(self.plan.ranks())
        lines += _table(("rank", "sends bytes/step", "receives bytes/step"),
                        [(str(r), str(self.static_bytes_per_step(r, "src")),
                          str(self.static_bytes_per_step(r, "dst"))) for r in ranks])
        n_dyn = sum(1 for s in self.plan.specs.values() if not s.is_static)
        lines.append(f"total static bytes per step: {self.static_bytes_per_step()}"
                     + (f" (+ {n_dyn} dynamic tensor(s))" if n_dyn else ""))
        if self.optimizer_bytes:
            where = "on the ps shards" if self.mode == "ps" else "on every worker"
            lines.append(f"optimizer state: {self.optimizer_bytes} bytes, {where}; never crosses")
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file)
        return text


def _table(header, rows) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*header)] + [fmt.format(*r) for r in rows]
