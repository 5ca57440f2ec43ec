"""Graph analyzer: every tensor a training job moves between processes, as a Plan.

It traces the step's concrete graph (tf.function over the input signature)
and reads off the gradients: their count, dtypes and static shapes (None
where only run time knows, e.g. the rows of a deduplicated sparse gradient).
From them and the cluster roles it lays out

- ps:        per worker and variable, the gradient (worker -> the variable's
             ps shard, round-robin by variable) and the variable's new value
             (ps -> worker);
- allreduce: per gradient bucket and ring step, the chunk each worker writes
             into its right neighbour (reduce-scatter then all-gather, N-1
             steps each), plus a one-time broadcast of the variables from
             rank 0. A bucket is one gradient, or with fusion (the default,
             as Horovod's fusion buffer) gradients of a dtype laid end to end
             until a threshold of bytes, each at a 64-byte aligned offset, in
             the order backprop produces them: few writes per step, and a
             bucket's ring can start while backprop still runs;
- pipeline:  whatever the stages' `ops.send` calls move (analyze_pipeline).

    python -m tf_plugin.training.explain --model mlp --mode ps --workers 2 --ps 1   (the plan, printed)
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np

from rdmatensor import Plan, PlanError, TensorSpec

MODES = ("ps", "allreduce", "pipeline")
TF_ALIGN = 64    # TensorFlow's buffer alignment: fused members stay zero-copy


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


def ring_name(var: str, phase: str, step: int, src: int) -> str:
    """Chunk written by `src` at ring step `step` of phase rs (reduce-scatter) or ag (all-gather)."""
    return f"ring/{var}/{phase}{step}/r{src}"


def bcast_name(var: str, dst: int) -> str:
    return f"bcast/{var}/r{dst}"


# Bytes per fused bucket, Horovod's default. Every bucket is one ring, and every
# ring a meeting point of all ranks: measured on ResNet50 (2 workers, shm),
# 64 MiB buckets gave 5.1 steps/s where 4 MiB gave 3.7, and DenseNet121 6.2
# where 4 MiB gave 5.0; large gradients still start their rings during backprop.
FUSION_THRESHOLD = 64 << 20


def fusion_threshold(threshold: int | None = None) -> int:
    """Bytes per fused bucket: `threshold` if given, else RDMATENSOR_FUSION_THRESHOLD
    (Horovod's HOROVOD_FUSION_THRESHOLD), else FUSION_THRESHOLD. 0: no fusion."""
    if threshold is None:
        raw = os.environ.get("RDMATENSOR_FUSION_THRESHOLD")
        try:
            threshold = FUSION_THRESHOLD if raw is None else int(raw)
        except ValueError:
            raise PlanError(f"RDMATENSOR_FUSION_THRESHOLD={raw!r}: expected a number of bytes") from None
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
    threshold by less than its last gradient). Buckets are ordered by their
    last member, so bucket k is complete no later than bucket k + 1 in a
    backward pass. Without fusion (or with threshold 0): one bucket per
    variable."""
    threshold = fusion_threshold(threshold) if fusion else 0
    filling: dict = {}            # dtype -> (members so far, aligned elements used)
    closed = []                   # (position of the last member, dtype, members)
    for position, v in enumerate(reversed(infos)):
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


def ring_bounds(n: int, ranks: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `ranks` chunks of a flat gradient of n elements."""
    sizes = [n // ranks + (1 if i < n % ranks else 0) for i in range(ranks)]
    starts = np.cumsum([0] + sizes)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(ranks)]


def ring_chunk(phase: str, step: int, rank: int, ranks: int, receiving: bool = False) -> int:
    """Which chunk `rank` sends (or receives) at a ring step. Reduce-scatter:
    send (r - s), receive (r - s - 1) and add; after N-1 steps rank r holds
    chunk r + 1 fully reduced. All-gather: send (r + 1 - s), receive (r - s)."""
    src = rank - 1 if receiving else rank
    return (src - step) % ranks if phase == "rs" else (src + 1 - step) % ranks


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


# ------------------------------------------------------------------ analysis
def _step_for(target, mode: str, input_signature, loss, sparse):
    from .step import Step
    sparse = sparse or ("dense" if mode == "allreduce" else "dedupe")
    if isinstance(target, Step):
        return target
    if hasattr(target, "stateless_call"):            # a Keras model
        import tensorflow as tf
        if input_signature is None:
            x = target.inputs[0]
            input_signature = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec((None,), tf.int32))
        loss = loss or (lambda y, out: tf.reduce_sum(out))   # gradient shapes do not depend on it
        return Step.for_model(target, loss, input_signature, sparse=sparse)
    signature = input_signature or getattr(target, "input_signature", None)
    if signature is None:
        raise PlanError("a tf.function needs an input signature to be traced")
    return Step.for_function(target, signature, sparse=sparse)


def variables_of(step) -> list[VarInfo]:
    """Trace the step's gradients: one VarInfo per trainable variable."""
    import tensorflow as tf
    infos, seen = [], set()
    for v, g in zip(step.variables, step.traced_gradients(), strict=False):
        key = var_key(v)
        while key in seen:
            key += "_"
        seen.add(key)
        if g is None:
            raise PlanError(f"variable {key!r} gets no gradient from the traced step")
        dtype = np.dtype(v.dtype.as_numpy_dtype if hasattr(v.dtype, "as_numpy_dtype") else v.dtype)
        shape = tuple(v.shape)
        if isinstance(g, tf.IndexedSlices):
            parts = {"values": (tuple(g.values.shape.as_list()), dtype),
                     "indices": (tuple(g.indices.shape.as_list()), np.dtype(g.indices.dtype.as_numpy_dtype))}
            infos.append(VarInfo(key, shape, dtype, True, parts))
        else:
            infos.append(VarInfo(key, shape, dtype, False, {"": (tuple(g.shape.as_list()), dtype)}))
    return infos


def analyze(target, mode: str = "allreduce", workers: int = 2, ps: int = 0, input_signature=None,
            loss=None, sparse: str | None = None, optimizer=None, fusion: bool = True,
            threshold: int | None = None) -> Analysis:
    """The plan of a training job.

    `target`: a built Keras model, a tf.function with an input signature, or
    a `Step`. The optimizer (`optimizer`, else the model's), once built, is
    only reported: it stays where the updates are applied. `fusion`
    (allreduce): gradients of a dtype laid end to end in buckets of about
    `threshold` bytes (see buckets_of) instead of one ring per gradient. Ranks:
    workers 0..N-1, ps N..N+M-1."""
    if mode not in ("ps", "allreduce"):
        raise PlanError(f"mode {mode!r}: expected ps or allreduce (pipelines: analyze_pipeline)")
    if workers < 1 or (mode == "ps" and ps < 1):
        raise PlanError(f"{mode} needs at least one worker" + (" and one ps" if mode == "ps" else ""))
    step = _step_for(target, mode, input_signature, loss, sparse)
    infos = variables_of(step)
    specs, kinds, once, buckets = [], {}, set(), []

    def add(spec, kind, per_step=True):
        specs.append(spec)
        kinds[spec.name] = kind
        if not per_step:
            once.add(spec.name)

    if mode == "ps":
        for i, v in enumerate(infos):
            server = ps_rank(i, workers, ps)
            for w in range(workers):
                for part, (shape, dtype) in v.parts.items():
                    # A dynamic part never holds more rows than the variable has.
                    cap = None if None not in shape else int(
                        v.shape[0] * np.prod(shape[1:], dtype=np.int64) * dtype.itemsize) or None
                    add(TensorSpec(grad_name(w, v.key, part), shape, dtype, w, server, capacity=cap),
                        "sparse gradient " + part if part else "gradient")
                add(TensorSpec(param_name(w, v.key), v.shape, v.dtype, server, w), "variable")
    else:
        n = workers
        for v in infos:
            if v.sparse:
                raise PlanError(f"{v.key}: allreduce needs dense gradients (sparse='dense')")
        buckets = buckets_of(infos, fusion, threshold)
        for spec, kind in ring_specs(buckets, n):
            add(spec, kind)
        for v in infos:
            if 0 in v.shape:
                continue
            for dst in range(1, n):
                add(TensorSpec(bcast_name(v.key, dst), v.shape, v.dtype, 0, dst), "broadcast", per_step=False)
    optimizer = optimizer or getattr(target, "optimizer", None)
    opt_bytes = sum(int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize
                    for o in getattr(optimizer, "variables", None) or [] if len(o.shape))
    return Analysis(Plan(specs), mode, workers, ps, infos, kinds, once, opt_bytes, buckets)


def analyze_pipeline(stages: dict, capacity: int | None = None) -> Analysis:
    """The plan of a pipeline: `stages` maps rank -> (tf.function or function,
    input signature). Each stage is traced afresh; its `ops.send` calls give the
    specs (src = the stage's rank) and its `ops.recv` calls must match them."""
    import tensorflow as tf
    from . import ops
    sends, recvs = [], []
    for rank, (fn, signature) in sorted(stages.items()):
        fresh = tf.function(getattr(fn, "python_function", fn))
        with ops.recording(rank) as rec:
            fresh.get_concrete_function(*signature)
        sends += rec.sends
        recvs += rec.recvs
    specs = [s if s.is_static or capacity is None else
             TensorSpec(s.name, s.shape, s.dtype, s.src, s.dst, capacity) for s in sends]
    plan = Plan(specs)
    for r in recvs:
        s = plan.specs.get(r.name)
        if s is None or s.src != r.src or s.dst != r.dst or s.dtype != r.dtype or len(s.shape) != len(r.shape) \
                or any(a is not None and b is not None and a != b for a, b in zip(s.shape, r.shape, strict=False)):
            raise PlanError(f"recv {r.canonical()} matches no send (sent: {s.canonical() if s else 'nothing'})")
    workers = len(plan.ranks())
    return Analysis(plan, "pipeline", workers, 0, [], {s.name: "activation" for s in specs}, set())
