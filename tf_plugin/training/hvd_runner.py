"""rdmatensor's Horovod API on the same model and data: Horovod's TF2 tape
example with only the import changed (`import tf_plugin as hvd`), one process
per rank started by rdmatensor-run. What a user of the Horovod API gets:

    hvd           the all-reduce as it runs by default: on one host over shm,
                  the native ops (tf_plugin/native: a launch and a completion per
                  bucket, the C executor; no Python in the step)
    hvd-python    the same step traced with RDMATENSOR_TF_OPS=python: the Python
                  path (a numpy_function per bucket, the ring on a Python thread)

Same model, seed, shards, optimizer and loss as runner.run_rank and the
horovod baseline, so the losses agree and steps/s compare.

A paired job (JobConfig.paired) traces, over the one model and optimizer, the
floor (each rank applies its own gradients), the sync floor (the floor plus one
native all-reduce of one float once every gradient exists: the ranks meet once
a step, nothing of the model moves) and the provider's step, and for `hvd` the
Python path's step too, and times them in turn (runner.turns): each kind's
share of the floors, and the native step against the Python path's, from
steps a few steps apart.

The overlap with backprop is the native executor's own (contract.busy): the
share of its time on the gradients' buckets spent before the step's last
bucket was launched, over the timed steps. The Python path's is not measured.
"""
from __future__ import annotations

import contextlib
import os
import time

from .job import JobConfig, RankResult

NATIVE, PYTHON = "hvd", "hvd-python"


def run_rank(cluster, config: JobConfig, token: str | None = None) -> RankResult:
    """One rank under rdmatensor-run (hvd.init() reads TF_CONFIG and RDMATENSOR_TOKEN
    as a user's script does; `cluster` names this rank)."""
    cfg = config
    if cfg.mode != "allreduce":
        raise ValueError(f"provider {cfg.provider} is the Horovod API's all-reduce: use --mode allreduce")
    import tensorflow as tf

    import tf_plugin as hvd
    from ..core.world import world
    from ..native import build
    from . import models
    from .runner import turns

    t_setup = time.perf_counter()
    hvd.init()
    n = hvd.size()
    model = models.build(cfg.model, cfg.seed, cfg.image_size)
    opt = models.optimizer(cfg.lr)
    opt.build(model.trainable_variables)            # one optimizer state for every kind of step
    data = models.dataset(cfg.model, cfg.seed, image_size=cfg.image_size)
    hvd.broadcast_variables(model.variables, root_rank=0)
    attached = world().collectives.attached

    def step_of(kind: str):
        @tf.function(input_signature=list(models.input_specs(cfg.model, cfg.image_size)))
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = models.loss_fn(y, model(x))
            if kind in (NATIVE, PYTHON):
                tape = hvd.DistributedGradientTape(tape, sparse_as_dense=True)
            grads = tape.gradient(loss, model.trainable_variables)
            if kind != "sync":
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return loss
            with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
                met = hvd.allreduce(tf.zeros(1), op=hvd.Sum, name="sync floor")
            with tf.control_dependencies([met]):
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return tf.identity(loss)
        return train_step

    kinds = [cfg.provider]
    if cfg.paired:
        kinds = ["none", "sync", *([PYTHON] if cfg.provider == NATIVE else []), cfg.provider]
    steps, gradient_groups = {}, set()
    for kind in kinds:                  # each traced by its first step (not timed), RDMATENSOR_TF_OPS as its path
        before = set(attached)
        with _tf_ops("python" if kind == PYTHON else os.environ.get(build.ENV)):
            steps[kind] = step_of(kind)
            x, y = models.batch(data, 0, cfg.batch, cluster.task_index, n)
            loss = float(steps[kind](x, y))
        if kind == cfg.provider:
            losses = [loss]
        if kind == NATIVE:
            gradient_groups = {k for k in set(attached) - before if k[0] == "native"}
    setup = time.perf_counter() - t_setup
    hvd.join()                          # everyone traced: time steps, not tracing

    def groups():
        return [g for k, g in attached.items() if k in gradient_groups and hasattr(g, "busy")]

    busy0 = [g.busy() for g in groups()]
    counted0 = [g.counters() for g in groups()]
    seconds = {kind: [] for kind in kinds}
    for k, kind in enumerate(turns(kinds, cfg.steps - 1, cfg.seed), start=1):
        x, y = models.batch(data, k, cfg.batch, cluster.task_index, n)
        t0 = time.perf_counter()
        loss = float(steps[kind](x, y))
        seconds[kind].append(time.perf_counter() - t0)
        if kind == cfg.provider:
            losses.append(loss)
    hvd.join()
    step_seconds = seconds.pop(cfg.provider)
    result = RankResult(cluster.rank, "worker", cfg.provider, losses, step_seconds, setup,
                        paired_seconds=seconds or None)
    if busy0:                           # the native executor's figures over the provider's timed steps
        busy = sum(b for b, _ in (g.busy() for g in groups())) - sum(b for b, _ in busy0)
        overlapped = sum(o for _, o in (g.busy() for g in groups())) - sum(o for _, o in busy0)
        moved = sum(m for _, m in (g.counters() for g in groups())) - sum(m for _, m in counted0)
        timed = max(len(step_seconds), 1)
        result.comm_seconds = busy
        result.overlap = overlapped / busy if busy > 0 else None
        result.bytes_sent_per_step = moved / timed
        result.note = "comm and overlap: the native executor's time on the gradients' buckets"
    hvd.shutdown()
    return result


@contextlib.contextmanager
def _tf_ops(value: str | None):
    """RDMATENSOR_TF_OPS set to `value` (None: unset) while a step is traced (it is
    read when a graph is built), as it was afterwards."""
    from ..native import build

    def put(v):
        if v is None:
            os.environ.pop(build.ENV, None)
        else:
            os.environ[build.ENV] = v
    before = os.environ.get(build.ENV)
    put(value)
    try:
        yield
    finally:
        put(before)
