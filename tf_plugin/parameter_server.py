"""Parameter-server training of your own Keras model, synchronous, over rdmatensor.

    import tf_plugin.parameter_server as ps
    model = build_my_model()                       # the same model on every rank
    result = ps.run(model, loss, keras.optimizers.SGD(0.1), my_shard_batches, steps=100)

Start it with `rdmatensor-run -np 2 --ps 1 python train.py`: every task runs
the same script, and `run` plays the role TF_CONFIG gives it. Parameter
servers own the variables (shared round-robin between them) and the
optimizer; every step each worker takes the current values, computes its
loss and gradients on its next batch, and sends the gradients back; the
servers average them over the workers and apply them. The analyzer plans
every tensor before step 1, so each crosses as one write into a slot the
receiver preallocated; sparse gradients (embeddings) cross as deduplicated
rows. See ps.py for the protocol.

At the end the servers send the trained values once more and every worker
assigns them to its model, so each worker ends with the same trained model.

Limits: non-trainable state (BatchNorm moving statistics) stays each
worker's own and is not updated (workers call the model statelessly with the
received weights); every worker runs the same number of steps; the batch
shape may vary only in its first dimension.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass
class Result:
    rank: int
    role: str                         # worker | ps
    losses: list[float] = field(default_factory=list)       # a worker's loss, one per step
    seconds: float = 0.0              # the training steps, setup excluded
    stats: dict = field(default_factory=dict)               # the session's counters


def run(model, loss: Callable, optimizer, dataset: Iterable | None, steps: int, *, cluster=None,
        provider: str | None = None, token: str | None = None, timeout: float = 120.0,
        input_signature=None) -> Result:
    """Train `model` for `steps` synchronous steps as this task (worker or parameter server).

    model: a built Keras model, the same on every task (the servers' initial values win).
    loss: loss(y, outputs) -> scalar tensor, the mean over the batch.
    optimizer: a Keras optimizer, used by the parameter servers.
    dataset: this worker's batches, (x, y) pairs (a tf.data.Dataset or any iterable). A
             parameter server only reads the first batch's shapes: pass the same dataset, or
             None with input_signature.
    cluster: default from TF_CONFIG (or Slurm); provider: default RDMATENSOR_PROVIDER, else auto;
    token: default RDMATENSOR_TOKEN. input_signature: (x spec, y spec), default from the first batch.
    """
    from rdmatensor import connect, environment

    from .graph.analyzer import analyze
    from rdmatensor.runner.cluster import Cluster
    from .core.failure import JobFailure
    from .graph.ps_step import ParameterServer, PSWorker
    from .graph.step import Step

    cluster = cluster or Cluster.from_env()
    if not cluster.num_ps:
        raise ValueError("parameter-server training needs ps tasks in the cluster (rdmatensor-run --ps M)")
    if steps < 1:
        raise ValueError(f"steps {steps}: need at least one")
    batches = None
    if dataset is None and (cluster.is_worker or input_signature is None):
        raise ValueError(f"{cluster.task_type} {cluster.task_index} got no dataset"
                         + ("" if cluster.is_worker else " and no input_signature"))
    if dataset is not None:
        batches = iter(dataset)
        first = next(batches, None)
        if first is None:
            raise ValueError(f"{cluster.task_type} {cluster.task_index}: the dataset is empty")
        batches = _chain(first, batches)
        input_signature = input_signature or [_spec(t) for t in first]
    step = Step.for_model(model, loss, input_signature, sparse="dedupe")
    analysis = analyze(step, "ps", cluster.num_workers, cluster.num_ps)
    provider = provider or environment.get("RDMATENSOR_PROVIDER", "auto")
    result = Result(cluster.rank, cluster.task_type)
    with connect(cluster.rank, cluster.peers(), analysis.plan, provider=provider,
                 token=token or environment.get("RDMATENSOR_TOKEN"), timeout=timeout) as session:
        JobFailure(cluster.rank).watch(session)     # a lost rank fails every call of this one
        t0 = time.perf_counter()
        if cluster.is_worker:
            worker = PSWorker(session, analysis, step)
            for k in range(steps):
                batch = next(batches, None)
                if batch is None:
                    raise ValueError(f"worker {cluster.task_index}: the dataset ran out after {k} of {steps} steps")
                result.losses.append(worker.train_step(*batch))
            for var, value in zip(step.variables, worker.pull(), strict=True):
                var.assign(value)                           # the trained values, into the model
        else:
            server = ParameterServer(session, analysis, step.variables, optimizer)
            for _ in range(steps):
                server.train_step()
            server.push()                                   # its own model holds its shard's values
        result.seconds = time.perf_counter() - t0
        session.barrier("parameter_server-done")
        result.stats = session.stats()
    return result


def _chain(first, rest):
    yield first
    yield from rest


def _spec(t):
    import tensorflow as tf
    t = tf.convert_to_tensor(t)
    return tf.TensorSpec((None, *t.shape[1:]), t.dtype)

