"""One rank of a training job over rdmatensor (or over nothing: the `none` floor):
build, analyze, connect, train, measure.

`run_rank(cluster, config)` is what each launched process runs (cluster from
TF_CONFIG); `run_threads(config)` runs every rank as a thread of this process
instead, which costs one TensorFlow import in all (the SoftRoCE VM takes
~45 s per import) while every byte still goes through the real provider.
The job description and the result types are in job.py; a worker's result
carries its losses and step times, one per step.

The `none` backend trains the same ranks on the same shards with no
communication: each worker applies its own gradients. It still connects a
session with an empty plan, only for the barriers that start and stop the
timed steps together, so the ranks share the cores as they do on every other
backend.

The `sync` backend is that floor plus one meeting per step: once its gradients
exist, every worker sends every other one 4 bytes over shm and waits for
theirs. Nothing of the model moves, but each step waits for the slowest
worker's backprop, as every synchronous all-reduce must: the gap from `none`
to `sync` is the cost of synchronizing itself, the gap from `sync` to a
provider is what the provider adds.

A paired job (JobConfig.paired) times all three in the same processes: its
timed steps run the floor, the sync floor and the provider in turn, in an
order drawn anew for every cycle of three (the same on every rank). Jobs run
one after the other see a host whose cores drift in speed by 20% and more
over seconds; steps taken in turn see the same host. Its losses are not a
training run's (floor steps apply each rank's own gradients).
"""
from __future__ import annotations

import os
import random
import secrets
import threading
import time
import traceback

from .job import BACKENDS, JobConfig, RankResult


def run_rank(cluster, config: JobConfig, token: str | None = None) -> RankResult:
    from rdmatensor import Plan, connect
    from . import models
    from ..core.failure import JobFailure
    from ..core.meter import Meter
    from ..graph.step import Step

    cfg, name, mode = config, config.model, config.mode
    floor = cfg.provider in FLOORS
    token = token or os.environ.get("RDMATENSOR_TOKEN")
    model = models.build(name, cfg.seed, cfg.image_size)
    signature = models.input_specs(name, cfg.image_size)
    step = Step.for_model(model, models.loss_fn, signature, sparse="dense" if mode == "allreduce" else "dedupe")
    data = models.dataset(name, cfg.seed, image_size=cfg.image_size)
    meter = Meter()
    losses: list[float] = []

    def shard(k):
        return models.batch(data, k, cfg.batch, cluster.task_index, cluster.num_workers)

    if floor:
        plan, analysis = Plan(meeting_specs(cluster) if cfg.provider == "sync" else []), None
    else:
        from ..graph.analyzer import analyze
        analysis = analyze(step, mode, cluster.num_workers, cluster.num_ps if mode == "ps" else 0,
                           fusion=cfg.fusion)
        plan = analysis.plan
        if cfg.paired:                       # the analyzed plan, and the sync floor's meetings
            plan = Plan([*plan.specs.values(), *meeting_specs(cluster)], plan.max_arena_bytes, plan.checksum)
    t_setup = time.perf_counter()
    with connect(cluster.rank, cluster.peers(), plan, provider=FLOORS.get(cfg.provider, cfg.provider), token=token,
                 timeout=cfg.timeout) as session:
        JobFailure(cluster.rank).watch(session)     # a lost rank fails every call of this one
        setup_seconds = time.perf_counter() - t_setup
        loops = _loops(cfg, cluster, session, analysis, step, model, signature, meter, shard)
        for kind, loop in loops.items():     # first steps trace the functions: not timed
            loss = loop(0)
            if kind == cfg.provider:
                losses.append(loss)
        session.barrier("tf_plugin-warm")    # everyone traced: time steps, not tracing
        meter.restart()
        before, tally0 = session.stats(), dict(meter.tally)
        seconds = {kind: [] for kind in loops}
        for k, kind in enumerate(turns(list(loops), cfg.steps - 1, cfg.seed), start=1):
            t0 = time.perf_counter()
            loss = loops[kind](k)
            seconds[kind].append(time.perf_counter() - t0)
            if kind == cfg.provider:
                losses.append(loss)
        session.barrier("tf_plugin-done")
        after = session.stats()
    losses = [x for x in losses if x is not None]      # a parameter server has none
    step_seconds = seconds.pop(cfg.provider)
    if cfg.provider == "none":
        return RankResult(cluster.rank, cluster.task_type, "none", losses, step_seconds, setup_seconds,
                          comm_seconds=0.0, bytes_sent_per_step=0.0, writes_per_step=0.0,
                          session_copies_per_step=0.0, plugin_copies_per_step=0.0, zero_copy_per_step=0.0)
    result = RankResult.from_session(cluster, losses, step_seconds, setup_seconds, meter.comm_seconds,
                                     before, after, tally0, dict(meter.tally), overlap=meter.overlap,
                                     ring_cpu_seconds=meter.ring_cpu_seconds if meter.rounds else None)
    if seconds:                              # paired: the meetings' writes are not the provider's
        meetings = len(seconds["sync"]) * (cluster.num_workers - 1) / max(len(step_seconds), 1)
        result.writes_per_step -= meetings
        result.bytes_sent_per_step -= meetings * Meeting.BYTES
        result.paired_seconds = seconds
    return result


def turns(kinds: list[str], steps: int, seed: int) -> list[str]:
    """Which kind of step each timed step runs: with one kind, always it; with
    several, cycles holding each once, each cycle in its own order (drawn from
    `seed`, so every rank draws the same), so that no kind always follows the
    same other one (a step leaves its caches to the next). A last partial
    cycle is dropped."""
    if len(kinds) == 1:
        return kinds * steps
    rng, out = random.Random(seed), []
    for _ in range(steps // len(kinds)):
        cycle = list(kinds)
        rng.shuffle(cycle)
        out += cycle
    return out


def _loops(cfg: JobConfig, cluster, session, analysis, step, model, signature, meter, shard) -> dict:
    """The functions that run step k on this rank, returning a worker's loss (None
    elsewhere), by kind: the job's provider alone, or in a paired job also the
    floor (`none`) and the sync floor (`sync`), sharing the model and optimizer."""
    from ..graph import ring_tape
    from . import models
    if cfg.mode == "ps" and not cluster.is_worker:
        if cfg.provider in FLOORS:
            return {cfg.provider: lambda k: None}                         # a floor without servers
        from ..graph.ps_step import ParameterServer
        server = ParameterServer(session, analysis, step.variables, models.optimizer(cfg.lr), meter)
        return {cfg.provider: lambda k: server.train_step()}
    if cfg.mode == "ps" and cfg.provider not in FLOORS:
        from ..graph.ps_step import PSWorker
        worker = PSWorker(session, analysis, step, meter)
        return {cfg.provider: lambda k: worker.train_step(*shard(k))}
    ring = None
    if cfg.provider not in FLOORS:
        from ..executor.ring import RingAllReduce
        ring = RingAllReduce(session, analysis, meter)
    opt = models.optimizer(cfg.lr)
    opt.build(step.variables)
    if ring is not None:
        ring_tape.broadcast(ring, step.variables)
    meeting = Meeting(session, cluster) if cfg.provider == "sync" or cfg.paired else None
    kinds = {cfg.provider: (ring, meeting if cfg.provider == "sync" else None)}
    if cfg.paired:
        kinds = {"none": (None, None), "sync": (None, meeting), **kinds}
    return {kind: _step_fn(cfg, model, opt, r, m, step, signature, shard) for kind, (r, m) in kinds.items()}


def _step_fn(cfg: JobConfig, model, opt, ring, meet, step, signature, shard):
    """Step k: through `ring` (None: each rank applies its own gradients), after
    meeting the other workers where `meet` is given."""
    from ..graph import ring_tape
    from . import models
    if cfg.in_graph:
        train_step = in_graph_step(model, opt, ring, models.loss_fn, signature, meet)
        return lambda k: float(train_step(*shard(k)))
    apply = tf_function(lambda grads: opt.apply_gradients(zip(grads, step.variables, strict=True)))

    def loop(k):
        loss, grads = step.grads(*shard(k))
        if meet is not None:
            meet()
        apply(ring_tape.allreduce(ring, grads) if ring is not None else grads)
        return float(loss)
    return loop


# The floors, and the provider each connects over: `none` only for its barriers
# (tcp, which every host has), `sync` also for its meetings (shm: the cheapest).
FLOORS = {"none": "tcp", "sync": "shm"}


def meeting_specs(cluster) -> list:
    """The `sync` floor's plan: one float32 from every worker to every other."""
    from rdmatensor import TensorSpec
    workers = cluster.worker_ranks
    return [TensorSpec(f"meet/{a}-{b}", (1,), "float32", a, b) for a in workers for b in workers if a != b]


class Meeting:
    """One step's meeting of the `sync` floor: send to every other worker, then
    wait for each of theirs; returns when every worker has reached it."""
    BYTES = 4                                      # the float32 token, written to each other worker

    def __init__(self, session, cluster):
        import numpy as np
        self.session, self.me = session, cluster.rank
        self.others = [r for r in cluster.worker_ranks if r != self.me]
        self.token = np.ones(1, np.float32)

    def __call__(self, *_):
        for r in self.others:
            self.session.send(f"meet/{self.me}-{r}", self.token)
        for r in self.others:
            self.session.recv(f"meet/{r}-{self.me}").release()
        return self.token


def tf_function(fn):
    import tensorflow as tf
    return tf.function(fn)


def in_graph_step(model, opt, ring, loss_fn, signature, meet=None):
    """One tf.function per step, Horovod style: the ring runs inside it as a
    numpy_function (no ring: each rank applies its own gradients, the floor;
    with `meet`, the sync floor, after meeting the other workers once its
    gradients exist).
    Only for ranks in separate processes: a blocked numpy_function holds one of
    TensorFlow's inter-op threads, and ranks sharing a process (and its pool of
    as many threads as cores) can starve each other."""
    import tensorflow as tf
    from ..graph.ring_tape import RingGradientTape

    @tf.function(input_signature=signature)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        if ring is not None:
            tape = RingGradientTape(tape, ring)
        grads = tape.gradient(loss, model.trainable_variables)
        if meet is None:
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss
        with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
            met = tf.numpy_function(meet, [], tf.float32, stateful=True)
        with tf.control_dependencies([met]):
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return tf.identity(loss)
    return train_step


def run_threads(config: JobConfig, join_timeout: float = 600.0) -> list[RankResult]:
    """Every rank of a local cluster as a thread of this process; results in rank order."""
    from rdmatensor.runner.cluster import Cluster
    if not config.backend.threads:
        raise ValueError(f"provider {config.provider!r} runs its ranks in separate processes only")
    cluster = Cluster.local(config.workers, config.ps)
    token = secrets.token_hex(16)
    results: dict[int, object] = {}

    def one(task):
        try:
            results[task.rank] = config.backend.run_rank(task, config, token)
        except BaseException as exc:  # noqa: BLE001 - reported below
            exc.trace = traceback.format_exc()
            results[task.rank] = exc

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in cluster.tasks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank did not finish within {join_timeout:.0f} s")
    for r, res in sorted(results.items()):
        if isinstance(res, BaseException):
            raise RuntimeError(f"rank {r} failed:\n{res.trace}") from res
    return [results[r] for r in sorted(results)]


def main(argv=None) -> int:
    """One launched rank: cluster from TF_CONFIG (under horovodrun, HOROVOD_RANK/SIZE),
    token from RDMATENSOR_TOKEN;
    writes its RankResult as JSON to OUT/rank<rank>.json."""
    import argparse
    import json
    import logging
    from pathlib import Path

    from rdmatensor import environment
    from rdmatensor.runner.cluster import Cluster
    parser = argparse.ArgumentParser(description="one rank of a tf_plugin training job")
    parser.add_argument("--config", required=True, help="the JobConfig as JSON")
    parser.add_argument("--out", required=True, help="directory to write this rank's result to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    config = JobConfig.from_dict(json.loads(args.config))
    if environment.get("TF_CONFIG") or environment.get("HOROVOD_RANK") is None:
        cluster = Cluster.from_tf_config()
    else:                                   # started by horovodrun (the horovod baseline): no addresses needed
        cluster = Cluster(("-",) * int(os.environ["HOROVOD_SIZE"]), task_index=int(os.environ["HOROVOD_RANK"]))
    result = BACKENDS[config.provider].run_rank(cluster, config)
    Path(args.out, f"rank{cluster.rank}.json").write_text(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
