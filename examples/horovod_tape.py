"""Horovod's TF2 tape example, with only the import changed, on the demo models or
a keras.applications CNN (weights=None, 32x32 inputs, 10 classes, random data);
rank 0 prints one JSON line: median step time, steps/s, bytes and control calls
per step, how much of the all-reduce overlapped backprop, and whether every
rank ended with bit-identical weights.

Run it as every worker of a job (TF_CONFIG, RDMATENSOR_TOKEN and
RDMATENSOR_PROVIDER set per process, as a launcher does), or all workers on
this host as processes, one provider after the other (`none`: the same
processes training with no communication at all, the floor):

    python examples/horovod_tape.py local --workers 2 --provider tcp --model mlp --steps 200
    python examples/horovod_tape.py local --model resnet50 --batch 16 --steps 30 --provider none,shm,tcp
"""
import argparse
import hashlib
import json
import os
import secrets
import subprocess
import sys
import time

APPLICATIONS = {"resnet50": "ResNet50", "vgg16": "VGG16", "densenet121": "DenseNet121", "mobilenetv2": "MobileNetV2"}


def build(name: str, seed: int):
    import keras

    from tf_plugin.training import models
    if name not in APPLICATIONS:
        return models.build(name, seed)
    keras.utils.set_random_seed(seed)
    return getattr(keras.applications, APPLICATIONS[name])(weights=None, input_shape=(32, 32, 3), classes=10)


def batches(name: str, seed: int, batch: int, rank: int, size: int, steps: int):
    """batch k of this rank's shard, for k in range(steps)."""
    import numpy as np

    from tf_plugin.training import models
    if name not in APPLICATIONS:
        data = models.dataset(name, seed)
        return [models.batch(data, k, batch, rank, size) for k in range(steps)]
    rng = np.random.default_rng(seed)
    per = batch // size
    x = rng.standard_normal((steps, batch, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, (steps, batch)).astype(np.int32)
    return [(x[k, rank * per:(rank + 1) * per], y[k, rank * per:(rank + 1) * per]) for k in range(steps)]


def train(args) -> None:
    import numpy as np
    import tensorflow as tf

    import tf_plugin as hvd            # was: import horovod.tensorflow as hvd
    from tf_plugin.training import models

    floor = args.provider == "none"    # the same ranks, each applying its own gradients
    hvd.init()
    model = build(args.model, seed=hvd.rank())        # different on purpose: the broadcast fixes it
    opt = models.optimizer(args.lr)
    data = batches(args.model, args.seed, args.batch, hvd.rank(), hvd.size(), args.steps)

    @tf.function
    def training_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = models.loss_fn(y, model(x, training=True))
        if not floor:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch and not floor:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    def step(k):
        return training_step(*data[k], k == 0)

    step(0)
    step(1)                                  # the second trace (first_batch False) is not timed either
    hvd.allgather_object(None)               # every rank traced: time steps, not tracing
    before, times = hvd.stats(), []
    for k in range(2, args.steps):
        t0 = time.perf_counter()
        loss = float(step(k))
        times.append(time.perf_counter() - t0)
    after = hvd.stats()
    weights = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes() for v in model.variables))
    digests = hvd.allgather_object(weights.hexdigest())
    timed = args.steps - 2
    if hvd.rank() == 0:
        ring = after.get("ring_seconds", 0.0) - before.get("ring_seconds", 0.0)
        overlapped = after.get("overlapped_seconds", 0.0) - before.get("overlapped_seconds", 0.0)
        used = args.provider if floor else after.get("provider") or args.provider
        print(json.dumps({"provider": used, "workers": hvd.size(), "model": args.model,
                          "batch_per_worker": args.batch // hvd.size(),
                          "median_step_ms": 1e3 * float(np.median(times)), "steps_per_s": timed / sum(times),
                          "final_loss": loss, "weights_sha256": digests[0],
                          "ranks_bit_identical": len(set(digests)) == 1,
                          "comm_ms_per_step": 1e3 * (after["comm_seconds"] - before["comm_seconds"]) / timed,
                          "overlap": overlapped / ring if ring else None,
                          "bytes_sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) / timed,
                          "control_calls_per_step": (after["control_calls"] - before["control_calls"]) / timed,
                          "plan_generations": after["generations"],
                          "allreduce": "hierarchical" if after["hierarchy"] else "flat ring"}), flush=True)
    hvd.shutdown()


def local(args) -> int:
    """Every worker as a process of this host, on free ports below the ephemeral range;
    one provider after the other, then a table against the floor when it ran."""
    from tf_plugin.core.bootstrap import PortReservation
    rows = []
    for provider in args.provider.split(","):
        held = [PortReservation("127.0.0.1") for _ in range(args.workers)]
        workers = [f"127.0.0.1:{r.port}" for r in held]
        for r in held:
            r.close()
        token = secrets.token_hex(16)
        procs = []
        for rank in range(args.workers):
            env = dict(os.environ, RDMATENSOR_TOKEN=token,
                       RDMATENSOR_PROVIDER="tcp" if provider == "none" else provider,
                       TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                             "task": {"type": "worker", "index": rank}}))
            procs.append(subprocess.Popen([sys.executable, __file__, "--model", args.model, "--steps",
                                           str(args.steps), "--batch", str(args.batch), "--provider", provider],
                                          env=env, stdout=subprocess.PIPE if rank == 0 else None, text=True))
        out = procs[0].communicate()[0]
        if max(p.wait() for p in procs):
            return 1
        print(out, end="", flush=True)
        rows.append(json.loads(out.strip().splitlines()[-1]))
    floor = {r["provider"]: r for r in rows}.get("none")
    if len(rows) > 1:
        print(f"{'provider':<10}{'median ms/step':>16}{'vs floor':>10}{'overlap':>9}")
        for r in rows:
            ratio = f"{r['median_step_ms'] / floor['median_step_ms']:.2f}x" if floor else "n/a"
            ov = "n/a" if r["overlap"] is None else f"{r['overlap']:.0%}"
            print(f"{r['provider']:<10}{r['median_step_ms']:>16.1f}{ratio:>10}{ov:>9}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("where", nargs="?", choices=("local",), help="start every worker on this host")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--provider", default="auto", help="local: several, comma-separated; none: no communication")
    p.add_argument("--model", choices=("mlp", "cnn", *APPLICATIONS), default="mlp")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="global batch size (split over the workers)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.where == "local":
        return local(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
