"""Real Horovod on the same model and data: what users would pick instead.

Horovod 0.28.1 (TensorFlow ops, gloo, CPU), built by `make horovod-reference`
into .venv-horovod against this project's TensorFlow, started by its own
`horovodrun --gloo` (launch.run_processes), one process per rank. The step is
Horovod's TF2 tape example: DistributedGradientTape (Average) inside one
tf.function, the initial variables broadcast from rank 0. Same model, seed,
data shards, optimizer and loss as runner.run_rank, so the losses agree and
steps/s compare as a ratio (`rdmatensor-train --provider shm,horovod`).
Sparse gradients are all-reduced dense, as rdmatensor's all-reduce mode does.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import JobError
from .job import JobConfig, RankResult
from .tf_baseline import timed_steps

ROOT = Path(__file__).resolve().parents[2]


def horovod_venv() -> Path:
    """The virtualenv real Horovod is built in: RDMATENSOR_HOROVOD_VENV, else .venv-horovod."""
    return Path(os.environ.get("RDMATENSOR_HOROVOD_VENV") or ROOT / ".venv-horovod")


def horovodrun() -> Path:
    """horovodrun of the built Horovod; JobError saying how to build it when it is missing."""
    path = horovod_venv() / "bin" / "horovodrun"
    if not path.exists():
        raise JobError(f"provider horovod needs real Horovod: {path} is missing (make horovod-reference "
                       f"builds it; RDMATENSOR_HOROVOD_VENV names another virtualenv)")
    return path


def command(config_json: str, out: str, workers: int) -> list[str]:
    """horovodrun starting runner.main on `workers` ranks of this host."""
    venv = horovod_venv()
    return [str(horovodrun()), "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
            str(venv / "bin" / "python"), "-m", "tf_plugin.training.runner", "--config", config_json, "--out", out]


def run_rank(cluster, config: JobConfig, token: str | None = None) -> RankResult:
    """One rank under horovodrun (`cluster` from HOROVOD_RANK/SIZE; `token` unused:
    Horovod's gloo rendezvous takes none)."""
    cfg = config
    if cfg.mode != "allreduce":
        raise ValueError("the horovod baseline is Horovod's all-reduce: use --mode allreduce")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from . import models
    t_setup = time.perf_counter()
    hvd.init()
    n = hvd.size()
    model = models.build(cfg.model, cfg.seed, cfg.image_size)
    opt = models.optimizer(cfg.lr)
    data = models.dataset(cfg.model, cfg.seed, image_size=cfg.image_size)
    # Keras 3 variables wrap a tf.Variable; Horovod's tape calls .ref() on what it is given.
    trainable = [v.value for v in model.trainable_variables]

    @tf.function(input_signature=list(models.input_specs(cfg.model, cfg.image_size)))
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = models.loss_fn(y, model(x))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=True)
        grads = tape.gradient(loss, trainable)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    return timed_steps("horovod", cluster, cfg, model, data, train_step, n, t_setup, barrier=hvd.join)
