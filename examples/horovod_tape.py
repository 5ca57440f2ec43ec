"""Horovod's TF2 tape example on the demo models, with only the import changed;
rank 0 prints one JSON line (steps/s, bytes and control calls per step).

Run it as every worker of a job (TF_CONFIG, RDMATENSOR_TOKEN and
RDMATENSOR_PROVIDER set per process, as a launcher does), or all workers on
this host as processes:

    python examples/horovod_tape.py local --workers 2 --provider tcp --model mlp --steps 200
"""
import argparse
import json
import os
import secrets
import subprocess
import sys
import time


def train(args) -> None:
    import tensorflow as tf

    import tf_plugin as hvd            # was: import horovod.tensorflow as hvd
    from tf_plugin import models

    hvd.init()
    model = models.build(args.model, seed=hvd.rank())        # different on purpose: the broadcast fixes it
    opt = models.optimizer(args.lr)
    data = models.dataset(args.model, args.seed)

    @tf.function
    def training_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = models.loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    def step(k):
        return training_step(*models.batch(data, k, args.batch, hvd.rank(), hvd.size()), k == 0)

    step(0)
    step(1)                                  # the second trace (first_batch False) is not timed either
    before, t0 = hvd.stats(), time.perf_counter()
    for k in range(2, args.steps):
        loss = step(k)
    seconds, after = time.perf_counter() - t0, hvd.stats()
    timed = args.steps - 2
    if hvd.rank() == 0:
        print(json.dumps({"provider": after["provider"], "workers": hvd.size(), "model": args.model,
                          "steps_per_s": timed / seconds, "final_loss": float(loss),
                          "bytes_sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) / timed,
                          "control_calls_per_step": (after["control_calls"] - before["control_calls"]) / timed,
                          "plan_generations": after["generations"]}))
    hvd.shutdown()


def local(args) -> int:
    """Every worker as a process of this host, on free ports below the ephemeral range."""
    from tf_plugin.bootstrap import PortReservation
    held = [PortReservation("127.0.0.1") for _ in range(args.workers)]
    workers = [f"127.0.0.1:{r.port}" for r in held]
    for r in held:
        r.close()
    token = secrets.token_hex(16)
    procs = []
    for rank in range(args.workers):
        env = dict(os.environ, RDMATENSOR_TOKEN=token, RDMATENSOR_PROVIDER=args.provider,
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}))
        procs.append(subprocess.Popen([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                       "--batch", str(args.batch)], env=env))
    return max(p.wait() for p in procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("where", nargs="?", choices=("local",), help="start every worker on this host")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--provider", default="auto")
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
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
