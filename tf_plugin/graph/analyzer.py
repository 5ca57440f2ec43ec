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

import numpy as np

from rdmatensor import Plan, PlanError, TensorSpec

from ..core.layout import Analysis, VarInfo, bcast_name, buckets_of, grad_name, param_name, ps_rank, ring_specs, var_key


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
