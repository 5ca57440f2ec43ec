"""TensorFlow's own distributed training over gRPC, on the same model and data.

`tf.distribute.MultiWorkerMirroredStrategy` with TF_CONFIG on localhost
ports: every worker starts TensorFlow's gRPC server, variables are mirrored,
and gradients are summed by TensorFlow's collective ring all-reduce
(CommunicationImplementation.RING, over gRPC). Same model, seed, data shards,
optimizer and loss as runner.run_rank, so the losses agree and steps/s can be
compared as a ratio (`rdmatensor-train --provider tcp,tf-grpc`).

Only the all-reduce mode has a counterpart here. TensorFlow's
ParameterServerStrategy trains asynchronously (a coordinator dispatches
steps to whichever worker is free, each updates the variables on its own),
so its losses and steps would not mean the same thing as this plugin's
synchronous parameter servers; it is not used.
"""
from __future__ import annotations

import os
import time

from .job import JobConfig, RankResult


def run_rank(cluster, config: JobConfig, token: str | None = None) -> RankResult:
    """One worker of the strategy (`token` unused: TensorFlow's servers take none)."""
    cfg = config
    if cfg.mode != "allreduce":
        raise ValueError("the tf-grpc baseline is MultiWorkerMirroredStrategy: use --mode allreduce")
    os.environ["TF_CONFIG"] = cluster.to_tf_config()     # the strategy reads it
    import tensorflow as tf
    from . import models
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    t_setup = time.perf_counter()
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    name, n = cfg.model, cluster.num_workers
    with strategy.scope():
        model = models.build(name, cfg.seed, cfg.image_size)
        opt = models.optimizer(cfg.lr)
        opt.build(model.trainable_variables)
    data = models.dataset(name, cfg.seed, image_size=cfg.image_size)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = models.loss_fn(y, model(x))
            scaled = loss / n            # the optimizer sums gradients over replicas
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function(input_signature=list(models.input_specs(name, cfg.image_size)))
    def train_step(x, y):
        return strategy.run(replica_step, args=(x, y))

    return timed_steps("tf-grpc", cluster, cfg, model, data, train_step, n, t_setup)


def timed_steps(provider: str, cluster, cfg: JobConfig, model, data, train_step, n: int, t_setup: float,
                barrier=lambda: None) -> RankResult:
    """A baseline's steps, measured as runner.run_rank measures rdmatensor's: the
    first traces and counts in setup, the others are timed one by one. `barrier`
    (if the baseline has one) runs after the first step and after the last."""
    from . import models
    losses, step_seconds = [], []

    def loop(k):
        x, y = models.batch(data, k, cfg.batch, cluster.task_index, n)
        losses.append(float(train_step(x, y)))

    loop(0)
    setup = time.perf_counter() - t_setup
    barrier()                                      # everyone traced: time steps, not tracing
    for k in range(1, cfg.steps):
        t0 = time.perf_counter()
        loop(k)
        step_seconds.append(time.perf_counter() - t0)
    barrier()
    grad_bytes = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    ring = 2 * (n - 1) / n * grad_bytes           # what a ring all-reduce sends per rank, in theory
    return RankResult(cluster.rank, "worker", provider, losses, step_seconds, setup,
                      bytes_sent_per_step=ring, note="bytes: theoretical ring volume; setup includes the first step")
