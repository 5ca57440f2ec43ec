"""One rank of a differential run: the seeded sequences of sequence.py, called
through a Horovod API (real Horovod or tf_plugin), every outcome recorded.

    python -m tests.differential.worker OUT_DIR IMPL SEEDS CALLS [GRAPH]
        IMPL: horovod | rdmatensor;  SEEDS: "1-20" or "3,5";
        GRAPH: the share of calls made inside a tf.function (sequence.in_graph), 0 by default

Writes OUT_DIR/IMPL-s{SEEDS}-rank{R}.pkl: {(seed, index): ("ok", [arrays]) | ("error",
TensorFlow error class, message) | ("skipped", why)}. Prints progress every
500 calls.
"""
from __future__ import annotations

import os
import pickle
import sys
import time

import numpy as np
import tensorflow as tf

from .sequence import as_seen_by, call, in_graph, inputs, judged_by_horovod, process_sets, seeds_of


def tf_class(exc: BaseException) -> str:
    """The TensorFlow error class a script would catch, or the exception's own class."""
    for cls in type(exc).__mro__:
        if cls.__module__.startswith("tensorflow") and issubclass(cls, tf.errors.OpError) \
                and cls is not tf.errors.OpError:
            return cls.__name__
    return type(exc).__name__


def run(hvd, c, t, ps):
    """Call c on tensors t: its outputs."""
    kw = {} if ps is None else {"process_set": ps}
    op = getattr(hvd, c.op)
    if c.kind == "allreduce":
        return [hvd.allreduce(t[0], op=op, prescale_factor=c.prescale, postscale_factor=c.postscale, name=c.name,
                              **kw)]
    if c.kind == "grouped_allreduce":
        return hvd.grouped_allreduce(t, op=op, prescale_factor=c.prescale, postscale_factor=c.postscale,
                                     name=c.name, **kw)
    if c.kind == "reducescatter":
        return [hvd.reducescatter(t[0], op=op, prescale_factor=c.prescale, postscale_factor=c.postscale,
                                  name=c.name, **kw)]
    if c.kind == "allgather":
        return [hvd.allgather(t[0], name=c.name, **kw)]
    if c.kind == "broadcast":
        return [hvd.broadcast(t[0], root_rank=c.root, name=c.name, **kw)]
    if c.kind == "alltoall":
        if c.splits is None:
            return [hvd.alltoall(t[0], name=c.name, **kw)]
        return list(hvd.alltoall(t[0], splits=tf.constant(c.splits, tf.int32), name=c.name, **kw))
    raise ValueError(c.kind)


def made(hvd, c, arrays, ps, graph: bool) -> list:
    """Call c eagerly, or traced into a tf.function of its own (static shapes) and run once."""
    tensors = [tf.constant(a) for a in arrays]
    if not graph:
        return run(hvd, c, tensors, ps)
    return list(tf.function(lambda *ts: run(hvd, c, list(ts), ps))(*tensors))


def main(out_dir: str, impl: str, seeds: str, calls: int, graph: float = 0.0) -> None:
    if impl == "horovod":
        import horovod.tensorflow as hvd
    else:
        import tf_plugin as hvd
    if impl == "horovod":        # horovodrun says the size; sets are registered at init, as Horovod needs
        objs = [hvd.ProcessSet(list(s)) for s in process_sets(int(os.environ["HOROVOD_SIZE"]))[1:]]
        hvd.init(process_sets=objs)
    else:
        hvd.init()
        objs = [hvd.add_process_set(hvd.ProcessSet(list(s))) for s in process_sets(hvd.size())[1:]]
    size, sets = hvd.size(), [None] + objs
    rank = hvd.rank()
    record, t0, done = {}, time.monotonic(), 0
    for seed in seeds_of(seeds):
        for index in range(calls):
            c = call(seed, index, size)
            views = {r: as_seen_by(c, r, seed) for r in range(size)}
            mine = views[rank]
            if rank not in c.members:
                continue
            traced = in_graph(seed, index, graph)
            if impl == "horovod" and not all(judged_by_horovod(v, traced) for v in views.values()):
                record[(seed, index)] = ("skipped", "Horovod waits for ever on it, or refuses it")
                continue
            try:
                out = made(hvd, mine, inputs(mine, rank, seed), sets[c.process_set], traced)
                record[(seed, index)] = ("ok", [np.array(o) for o in out])
            except Exception as exc:  # noqa: BLE001 - every outcome is recorded
                record[(seed, index)] = ("error", tf_class(exc), str(exc)[:300])
                if os.environ.get("RDMATENSOR_DIFF_VERBOSE"):
                    print(f"seed {seed} call {index}: {tf_class(exc)}: {str(exc)[:400]}", flush=True)
            done += 1
            if rank == 0 and done % 500 == 0:
                print(f"{impl}: {done} calls, seed {seed}, {time.monotonic() - t0:.0f} s", flush=True)
    with open(f"{out_dir}/{impl}-s{seeds}-rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
    if rank == 0:
        plan = {k: v for k, v in hvd.stats().items() if k in ("tensor_sets", "generations")} \
            if impl == "rdmatensor" else {}
        print(f"{impl}: {done} calls on rank 0 in {time.monotonic() - t0:.1f} s {plan}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
