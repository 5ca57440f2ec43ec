"""Collectives over a plan that grows from what the job actually calls.

Without a model in hand, the tensors a step moves are only known when it
runs. Each collective call names a *tensor set*: its kind (allreduce with an
op, broadcast from a root, allgather) and, per tensor, a name, shape and
dtype. The first time a set is seen, every rank proposes it over the
bootstrap channel; the proposals are compared (a difference fails on every
rank with PlanMismatch naming the first differing tensor; names are not
compared, as Keras numbers layers per process), and the plan is
extended: a new *generation*, the union of every set so far, connected as a
fresh session on ports the ranks agreed on in the same exchange. Buffers are
registered and addresses swapped once per generation; a set already in the
plan costs no control call, whatever the step.

What each set becomes in the plan:

- allreduce: the ring of tf_plugin.ring over fused buckets
  (analyzer.buckets_of: in the order backprop produces the gradients, up to
  the fusion threshold each), its chunks laid out by analyzer.ring_specs.
  Every bucket's ring runs on the communication thread (background.py): a
  graph hands each bucket over as soon as its gradients exist (launch) and
  takes its result later (collect); eagerly, all are handed over, then
  collected. The fusion threshold is part of the set, so ranks that disagree
  on it fail with PlanMismatch;
- broadcast: one tensor per (tensor, non-root rank), written by the root;
- allgather: one dynamic-shape tensor (first dimension None) per (tensor,
  ordered pair of ranks), its first room the largest any rank proposed.

The previous generation is closed once the next one is connected and the
communication thread has finished every ring on it: the new setup barrier
means every rank finished every other collective of the old one. This
module does not import TensorFlow until a ring is built.
"""
from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field, replace

import numpy as np

from rdmatensor import Plan, PlanMismatch, TensorSpec, UsageError, connect

from .analyzer import Analysis, VarInfo, buckets_of, fusion_threshold, ring_specs
from .background import CommThread
from .bootstrap import Bootstrap, PortReservation
from .meter import Meter
from .timeline import Timeline

COUNTED = ("control_calls", "bytes_sent", "bytes_received", "writes", "recvs", "copies", "dynamic", "grows")


@dataclass
class TensorSet:
    """One collective's tensors, as every rank agreed on them."""
    index: int
    kind: str                      # allreduce | broadcast | allgather
    op: str                        # allreduce: average | sum; broadcast: root rank; allgather: ""
    entries: list                  # per tensor: {"name", "shape", "dtype"} (allgather: shape[0] None)
    specs: list = field(default_factory=list)
    analysis: Analysis | None = None


@dataclass
class AllreduceGroup:
    """An all-reduce as a graph builds it: its tensor set's request and key, and
    its buckets (the layout every rank derives from the agreed set)."""
    request: tuple
    key: tuple
    buckets: list


def allreduce_op(average: bool, threshold: int) -> str:
    """An all-reduce set's op: how it combines, and the fusion threshold that cut its buckets."""
    return f"{'average' if average else 'sum'}:{threshold}"


def allreduce_buckets(shapes, dtypes, threshold: int) -> list:
    """The buckets of an all-reduce set; member keys are positions in the set, as strings."""
    infos = [VarInfo(str(j), tuple(s), np.dtype(d), False, {}) for j, (s, d) in enumerate(zip(shapes, dtypes,
                                                                                           strict=True))]
    return buckets_of(infos, fusion=True, threshold=threshold)


def set_key(kind: str, op: str, names, arrays) -> tuple:
    """What identifies a tensor set in this process: kind, op, and each tensor's
    name, shape and dtype in order. Names make a set specific (a call that
    differs from any before is proposed to every rank, so a difference between
    ranks is seen there), though ranks need not agree on them."""
    dims = (lambda a: a.shape[1:]) if kind == "allgather" else (lambda a: a.shape)
    return (kind, op, tuple((n, tuple(dims(a)), np.dtype(a.dtype)) for n, a in zip(names, arrays, strict=True)))


def entries_of(kind: str, op: str, names, arrays) -> list[dict]:
    return [{"name": n, "op": f"{kind}:{op}" if op != "" else kind,
             "shape": ([None] if kind == "allgather" else []) + list(a.shape[1 if kind == "allgather" else 0:]),
             "dtype": np.dtype(a.dtype).name} for n, a in zip(names, arrays, strict=True)]


def first_difference(proposals: list[list[dict]]) -> str | None:
    """Where the ranks' proposed tensor lists first differ (None if they agree).
    Tensors match by position, op, shape and dtype; names only say which one it
    is (they may differ: Keras numbers layers per process)."""
    mine = proposals[0]
    for rank, theirs in enumerate(proposals[1:], 1):
        for a, b in zip(mine, theirs):  # noqa: B905 - lengths compared below
            diff = "; ".join(f"{k}: {a[k]} vs {b[k]}" for k in ("op", "shape", "dtype") if a[k] != b[k])
            if diff:
                also = f" (rank {rank} calls it {b['name']!r})" if b["name"] != a["name"] else ""
                return f"plan mismatch between rank 0 and rank {rank}: tensor {a['name']!r}{also} differs ({diff})"
        if len(mine) != len(theirs):
            owner, extra = (0, mine[len(theirs)]) if len(mine) > len(theirs) else (rank, theirs[len(mine)])
            return (f"plan mismatch between rank 0 and rank {rank}: tensor {extra['name']!r} is only in "
                    f"rank {owner}'s collective ({len(mine)} vs {len(theirs)} tensors)")
    return None


@dataclass(frozen=True)
class _Described:
    """A tensor's shape and dtype, standing for its array before it exists."""
    shape: tuple
    dtype: np.dtype


def _contiguous(a) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.array(a, order="C")


class Collectives:
    """This rank's view of the growing plan: tensor sets, the current generation's
    session, and allreduce / broadcast / allgather of numpy arrays through it."""

    def __init__(self, bootstrap: Bootstrap, hosts: list[str], provider: str, token: str, timeout: float,
                 threshold: int | None = None, watch=lambda session: None):
        self.bootstrap, self.hosts, self.watch = bootstrap, hosts, watch   # watch: each generation's session
        self.rank, self.size = bootstrap.rank, bootstrap.size
        self.provider, self.token, self.timeout = provider, token, timeout
        self.threshold = fusion_threshold(threshold)     # bytes per all-reduce bucket
        self.meter = Meter()
        self.comm = CommThread(self.rank, timeout, self.meter,
                               Timeline.from_env(self.rank) if self.size > 1 else None)
        self.session = None
        self.generations = 0
        self._sets: dict[tuple, TensorSet] = {}
        self._order: list[TensorSet] = []
        self._rings: dict[int, object] = {}       # set index -> RingAllReduce over the current session
        self._retired = dict.fromkeys(COUNTED, 0)  # counters of closed generations
        self._lock = threading.RLock()             # one collective at a time per process

    # ------------------------------------------------------------ the plan
    def ensure(self, requests: list[tuple[str, str, list, list]]) -> list[TensorSet]:
        """The tensor sets of `requests` (kind, op, names, arrays: arrays may be
        anything with .shape and .dtype), adding the missing ones to the plan in
        one exchange. Every rank must make the same call."""
        if self.size == 1:
            return []
        with self._lock:
            keys = [set_key(k, op, names, arrays) for k, op, names, arrays in requests]
            missing = {key: req for key, req in zip(keys, requests, strict=True) if key not in self._sets}
            if missing:
                self._extend(list(missing.items()))
            return [self._sets[key] for key in keys]

    def _extend(self, missing) -> None:
        proposal = [entries_of(k, op, names, arrays) for _, (k, op, names, arrays) in missing]
        hints = [[int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in arrays]
                 for _, (_, _, _, arrays) in missing]
        reservation = PortReservation(self.hosts[self.rank])
        try:
            payload = json.dumps({"sets": proposal, "hints": hints, "port": reservation.port}).encode()
            got = [json.loads(raw) for raw in self.bootstrap.allgather("plan", payload)]
            problem = first_difference([[e for s in g["sets"] for e in s] for g in got])
            if problem is None and any([len(s) for s in g["sets"]] != [len(s) for s in proposal] for g in got):
                problem = (f"plan mismatch: the ranks group their tensors into different collectives "
                           f"({[[len(s) for s in g['sets']] for g in got]} tensors per collective, by rank)")
            if problem:
                raise PlanMismatch(problem)
            new = []
            for j, (key, (kind, op, _, _)) in enumerate(missing):
                ts = TensorSet(len(self._order) + len(new), kind, op, proposal[j])
                self._lay_out(ts, [max(g["hints"][j][t] for g in got) for t in range(len(ts.entries))])
                new.append((key, ts))
            plan = Plan([s for ts in self._order + [t for _, t in new] for s in ts.specs])
            peers = {r: f"{self.hosts[r]}:{g['port']}" for r, g in enumerate(got)}
        finally:
            reservation.close()            # the new session's control server binds it now
        session = connect(self.rank, peers, plan, provider=self.provider, token=self.token, timeout=self.timeout)
        self.watch(session)
        self.comm.drain()                  # no ring still runs on the session being replaced
        for key, ts in new:
            self._sets[key] = ts
            self._order.append(ts)
        self._retire(self.session)
        self.session, self.generations = session, self.generations + 1
        self._rings.clear()

    def _lay_out(self, ts: TensorSet, room: list[int]) -> None:
        """The TensorSpecs of a new set (and, for an allreduce, its ring's analysis)."""
        n, prefix = self.size, f"s{ts.index}"
        shapes = [tuple(e["shape"]) for e in ts.entries]
        dtypes = [np.dtype(e["dtype"]) for e in ts.entries]
        if ts.kind == "allreduce":
            infos = [VarInfo(str(j), s, d, False, {}) for j, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
            threshold = int(ts.op.split(":")[1])
            buckets = [replace(b, key=f"{prefix}/{b.key}") for b in allreduce_buckets(shapes, dtypes, threshold)]
            ts.specs = [spec for spec, _ in ring_specs(buckets, n)]
            ts.analysis = Analysis(Plan(ts.specs), "allreduce", n, 0, infos, buckets=buckets)
        elif ts.kind == "broadcast":
            root = int(ts.op)
            ts.specs = [TensorSpec(f"{prefix}/b{j}/r{dst}", s, d, root, dst)
                        for j, (s, d) in enumerate(zip(shapes, dtypes, strict=True)) if 0 not in s
                        for dst in range(n) if dst != root]
        else:
            ts.specs = [TensorSpec(f"{prefix}/g{j}/r{src}/r{dst}", s, d, src, dst, capacity=max(room[j], 64))
                        for j, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
                        for src in range(n) for dst in range(n) if src != dst]

    def _retire(self, session) -> None:
        if session is None:
            return
        stats = session.stats()
        for k in COUNTED:
            self._retired[k] += stats.get(k, 0)
        session.close()

    # --------------------------------------------------------- collectives
    def allreduce_group(self, names, shapes, dtypes, average: bool = True) -> AllreduceGroup:
        """An all-reduce of tensors whose shapes are known ahead (a graph being
        built): its buckets, for launch() and collect()."""
        described = [_Described(tuple(s), np.dtype(d)) for s, d in zip(shapes, dtypes, strict=True)]
        request = ("allreduce", allreduce_op(average, self.threshold), list(names), described)
        return AllreduceGroup(request, set_key(*request), allreduce_buckets(shapes, dtypes, self.threshold))

    def launch(self, group: AllreduceGroup, j: int, arrays: list) -> None:
        """Hand bucket j of the group's all-reduce to the communication thread (the
        first launch of a new set plans it: every rank must make the same calls)."""
        with self._lock:
            ts = self._sets.get(group.key) or self.ensure([group.request])[0]
            ring = self._ring(ts)
            self.comm.launch(ts.index, j, arrays, len(ts.analysis.buckets), ring.reduce_bucket, ring.describe)

    def collect(self, group: AllreduceGroup, j: int) -> list[np.ndarray]:
        """Bucket j's results (its members, in order), once its ring is done."""
        ts = self._sets.get(group.key)
        if ts is None:
            raise UsageError(f"rank {self.rank}: bucket {j} of an all-reduce collected before any launch")
        return self.comm.collect(ts.index, j)

    def allreduce(self, names, arrays, average: bool = True) -> list[np.ndarray]:
        """Sum or average over the ranks; the outputs are 64-byte aligned arrays that
        stay untouched while anything refers to them."""
        if self.size == 1:
            return [_contiguous(a) for a in arrays]
        arrays = [_contiguous(a) for a in arrays]
        group = self.allreduce_group(names, [a.shape for a in arrays], [a.dtype for a in arrays], average)
        members = [[int(key) for key, _, _ in b.members] for b in group.buckets]
        for j, positions in enumerate(members):
            self.launch(group, j, [arrays[p] for p in positions])
        out = [None] * len(arrays)
        for j, positions in enumerate(members):
            for p, result in zip(positions, self.collect(group, j), strict=True):
                out[p] = result
        return [o if o is not None else np.zeros_like(a) for o, a in zip(out, arrays, strict=True)]

    def _ring(self, ts: TensorSet):
        ring = self._rings.get(ts.index)
        if ring is None:
            from .ring import RingAllReduce
            ring = self._rings[ts.index] = RingAllReduce(self.session, ts.analysis, self.meter,
                                                         average=ts.op.startswith("average"))
        return ring

    def broadcast(self, names, arrays, root: int) -> list[np.ndarray]:
        """Root's arrays on every rank (each rank passes arrays of the same shapes);
        on the root, its own arrays come back as they are."""
        if not 0 <= root < self.size:
            raise ValueError(f"root_rank {root} is not a rank of this job (size {self.size})")
        if self.size == 1:
            return list(arrays)
        (ts,) = self.ensure([("broadcast", str(root), names, arrays)])
        prefix = f"s{ts.index}"
        with self._lock, self.meter.comm():
            if self.rank == root:
                self.session.send_many([(f"{prefix}/b{j}/r{dst}", _contiguous(a)) for j, a in enumerate(arrays)
                                        for dst in range(self.size) if dst != root and a.size])
                return list(arrays)
            out = []
            for j, a in enumerate(arrays):
                if not a.size:
                    out.append(np.array(a))
                    continue
                with self.session.recv(f"{prefix}/b{j}/r{self.rank}") as view:
                    out.append(self._copy_out(view))
            return out

    def allgather(self, names, arrays) -> list[np.ndarray]:
        """Every rank's arrays concatenated along the first dimension, in rank order
        (the first dimension may differ between ranks, the others may not)."""
        scalars = [n for n, a in zip(names, arrays, strict=True) if np.ndim(a) == 0]
        if scalars:
            raise ValueError(f"allgather needs tensors of rank >= 1, not scalars: {scalars}")
        if self.size == 1:
            return [_contiguous(a) for a in arrays]
        (ts,) = self.ensure([("allgather", "", names, arrays)])
        prefix = f"s{ts.index}"
        with self._lock, self.meter.comm():
            self.session.send_many([(f"{prefix}/g{j}/r{self.rank}/r{dst}", _contiguous(a))
                                    for j, a in enumerate(arrays) for dst in range(self.size) if dst != self.rank])
            out = []
            for j, a in enumerate(arrays):
                with contextlib.ExitStack() as held:
                    parts = [a if src == self.rank else held.enter_context(
                        self.session.recv(f"{prefix}/g{j}/r{src}/r{self.rank}")) for src in range(self.size)]
                    rows = sum(p.shape[0] for p in parts)
                    from .ingest import aligned_empty
                    result = aligned_empty((rows, *a.shape[1:]), a.dtype)
                    np.concatenate(parts, out=result)
                    self.meter.tally["copied"] += 1
                out.append(result)
            return out

    def _copy_out(self, view: np.ndarray) -> np.ndarray:
        """A received value outlives its slot (and its generation): one copy."""
        from .ingest import aligned_empty
        out = aligned_empty(view.shape, view.dtype)
        np.copyto(out, view)
        self.meter.tally["copied"] += 1
        return out

    # ---------------------------------------------------------------- misc
    def stats(self) -> dict:
        with self._lock:
            current = self.session.stats() if self.session is not None else {}
            totals = {k: self._retired[k] + current.get(k, 0) for k in COUNTED}
            return dict(totals, provider=current.get("provider"), generations=self.generations,
                        extensions=max(0, self.generations - 1), tensor_sets=len(self._order),
                        tensors=len(self.session.plan) if self.session else 0,
                        plugin_copies=self.meter.copies, comm_seconds=self.meter.comm_seconds,
                        ring_seconds=self.meter.ring_seconds, overlapped_seconds=self.meter.overlapped_seconds,
                        overlap=self.meter.overlap, allreduces=self.meter.rounds,
                        output_buffers=self.meter.tally["allocated"])

    def close(self) -> None:
        self.comm.close()
        with self._lock:
            self._retire(self.session)
            self.session = None
            self._rings.clear()
