"""Soak: a training job run for many steps, its ranks' resources sampled all along.

    python -m bench.soak --providers shm,tcp --steps 100000 --every 5000 --json docs/soak.json
    make soak                      # the same, with SOAK_STEPS / SOAK_EVERY / SOAK_PROVIDERS

Each provider runs one job through rdmatensor-run: two workers train a small
Keras model with the Horovod API (DistributedGradientTape inside
tf.function, the all-reduce over rdmatensor) for --steps steps. Every
--every steps each rank samples itself: RSS, open file descriptors, threads,
rdmatensor shared-memory mappings and its control calls. After the warm-up (the first --warmup samples: tracing,
the plan's extensions, allocator pools filling) every count must stay
exactly flat and RSS within --rss-bound MiB; the report says so per
provider, with the first and last figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SAMPLE = "soak-sample "                # how a rank's sample line starts
COUNTS = ("fds", "threads", "shm_maps", "control_calls")


def sample(step: int, stats: dict) -> dict:
    """This process's resources now."""
    from rdmatensor.memory import mapped_segments
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"step": step, "rss_kib": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")), "shm_maps": len(mapped_segments()),
            "control_calls": stats["control_calls"], "time": time.monotonic()}


# ------------------------------------------------------------------ a rank
def worker(steps: int, every: int) -> None:
    """One rank of the soak job (run by rdmatensor-run): train, sample, print samples."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_plugin as hvd
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(8)])
    opt = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(hvd.rank())
    xs = tf.constant(rng.standard_normal((64, 16, 32)).astype(np.float32))
    ys = tf.constant(rng.integers(0, 8, (64, 16)).astype(np.int32))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    hvd.broadcast_variables(model.variables, root_rank=0)
    for step in range(1, steps + 1):
        train_step(xs[step % 64], ys[step % 64])
        if step % every == 0:
            print(SAMPLE + json.dumps({"rank": hvd.rank(), **sample(step, hvd.stats())}), flush=True)
    hvd.shutdown()


# ----------------------------------------------------------------- the job
def run_job(provider: str, steps: int, every: int, timeout: float) -> list[dict]:
    """One soak job over `provider`; every rank's samples."""
    cmd = [sys.executable, "-m", "rdmatensor.runner.cli", "-np", "2", "--provider", provider,
           "--timeout", f"{timeout:g}",
           sys.executable, "-m", __spec__.name, "worker", "--steps", str(steps), "--every", str(every)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    samples = [json.loads(line.split(SAMPLE, 1)[1]) for line in proc.stdout.splitlines() if SAMPLE in line]
    if proc.returncode != 0:
        raise RuntimeError(f"the {provider} soak job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return samples


def verdict(samples: list[dict], warmup: int, rss_bound_mib: float) -> dict:
    """Per rank: first (after warm-up) and last figures, and whether they stayed flat."""
    out = {"flat": True, "ranks": {}}
    for rank in sorted({s["rank"] for s in samples}):
        mine = [s for s in samples if s["rank"] == rank][warmup:]
        if len(mine) < 2:
            raise ValueError(f"rank {rank}: {len(mine)} samples after the warm-up; lower --every or --warmup")
        first, last = mine[0], mine[-1]
        # what stays: the least of the later half (a descriptor open during one sample is not a leak)
        later = mine[len(mine) // 2:]
        grew = {k: max(0, min(s[k] for s in later) - first[k]) for k in COUNTS}
        rss_growth = (max(s["rss_kib"] for s in mine) - first["rss_kib"]) / 1024
        flat = all(v == 0 for v in grew.values()) and rss_growth <= rss_bound_mib
        out["ranks"][rank] = {"first": first, "last": last, "grew": grew, "rss_growth_mib": round(rss_growth, 2),
                              "steps_per_s": (last["step"] - first["step"]) / (last["time"] - first["time"]),
                              "flat": flat}
        out["flat"] = out["flat"] and flat
    return out


def table(results: dict) -> str:
    lines = [f"{'provider':9} {'rank':>4} {'steps':>9} {'steps/s':>8} {'RSS MiB':>16} {'fds':>9} {'threads':>9} "
             f"{'shm maps':>9} {'ctl calls':>9}  flat"]
    for provider, res in results.items():
        for rank, r in res["ranks"].items():
            f, la = r["first"], r["last"]
            pair = {k: f"{f[k]}->{la[k]}" for k in COUNTS}
            lines.append(f"{provider:9} {rank:>4} {la['step']:>9} {r['steps_per_s']:>8.0f} "
                         f"{f['rss_kib'] / 1024:>7.1f}->{la['rss_kib'] / 1024:<7.1f} {pair['fds']:>9} "
                         f"{pair['threads']:>9} {pair['shm_maps']:>9} "
                         f"{pair['control_calls']:>9}  {'yes' if r['flat'] else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rdmatensor-soak", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role")
    w = sub.add_parser("worker", help="one rank (started by rdmatensor-run)")
    for q in (p, w):
        q.add_argument("--steps", type=int, default=100_000)
        q.add_argument("--every", type=int, default=1000, help="sample every this many steps")
    p.add_argument("--providers", default="shm,tcp")
    p.add_argument("--warmup", type=int, default=2, help="samples left out before the flatness check")
    p.add_argument("--rss-bound", type=float, default=8.0, help="MiB RSS may grow after the warm-up")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per job")
    p.add_argument("--json", help="write the samples and verdicts here")
    args = p.parse_args(argv)
    if args.role == "worker":
        worker(args.steps, args.every)
        return 0
    results, raw = {}, {}
    for provider in args.providers.split(","):
        t0 = time.monotonic()
        raw[provider] = run_job(provider, args.steps, args.every, args.timeout)
        results[provider] = verdict(raw[provider], args.warmup, args.rss_bound)
        results[provider]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"{provider}: {args.steps} steps in {results[provider]['seconds']} s", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "rdmatensor-soak/1", "steps": args.steps, "every": args.every,
                       "warmup": args.warmup, "rss_bound_mib": args.rss_bound, "results": results,
                       "samples": raw}, f, indent=1)
    return 0 if all(r["flat"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
