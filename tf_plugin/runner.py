"""One rank of a training job: build, analyze, connect, train, measure.

`run_rank(cluster, config)` is what each launched process runs (cluster from
TF_CONFIG); `run_threads(config)` runs every rank as a thread of this process
instead, which costs one TensorFlow import in all (the SoftRoCE VM takes
~45 s per import) while every byte still goes through the real provider.

config keys: mode (ps|allreduce), model, provider, steps, seed, batch (global
batch size), lr, timeout, in_graph (allreduce: the ring inside the step's
tf.function; separate processes only, see in_graph_step), fusion (allreduce:
one ring over all gradients). A worker's result carries its losses, one per
step; a step's global loss is the mean over workers (equal shards).
"""
from __future__ import annotations

import os
import secrets
import threading
import time
import traceback

DEFAULTS = dict(mode="allreduce", model="mlp", provider="auto", steps=20, seed=0, batch=64,
                lr=0.05, timeout=120.0, in_graph=False, fusion=True)


def run_rank(cluster, config: dict, token: str | None = None) -> dict:
    from rdmatensor import connect
    from . import models
    from .ring import RingAllReduce
    from .analyzer import analyze
    from .meter import Meter
    from .ps import ParameterServer, PSWorker
    from .step import Step

    cfg = dict(DEFAULTS, **config)
    mode, name, steps = cfg["mode"], cfg["model"], int(cfg["steps"])
    token = token or os.environ.get("RDMATENSOR_TOKEN")
    model = models.build(name, cfg["seed"])
    step = Step.for_model(model, models.loss_fn, models.input_specs(name),
                          sparse="dense" if mode == "allreduce" else "dedupe")
    analysis = analyze(step, mode, cluster.num_workers, cluster.num_ps if mode == "ps" else 0,
                       fusion=cfg["fusion"])
    data = models.dataset(name, cfg["seed"])
    meter = Meter()
    result = {"rank": cluster.rank, "role": cluster.task_type, "mode": mode, "model": name,
              "steps": steps, "losses": []}

    def shard(k):
        return models.batch(data, k, cfg["batch"], cluster.task_index, cluster.num_workers)

    t_setup = time.perf_counter()
    with connect(cluster.rank, cluster.peers(), analysis.plan, provider=cfg["provider"], token=token,
                 timeout=cfg["timeout"]) as session:
        result["setup_seconds"] = time.perf_counter() - t_setup
        if mode == "ps" and not cluster.is_worker:
            server = ParameterServer(session, analysis, step.variables, models.optimizer(cfg["lr"]), meter)
            loop = lambda k: server.train_step()                          # noqa: E731
        elif mode == "ps":
            worker = PSWorker(session, analysis, step, meter)
            loop = lambda k: result["losses"].append(worker.train_step(*shard(k)))   # noqa: E731
        else:
            ring = RingAllReduce(session, analysis, meter)
            opt = models.optimizer(cfg["lr"])
            opt.build(step.variables)
            ring.broadcast(step.variables)
            if cfg["in_graph"]:
                train_step = in_graph_step(model, opt, ring, models.loss_fn, models.input_specs(name))
                loop = lambda k: result["losses"].append(float(train_step(*shard(k))))  # noqa: E731
            else:
                apply = tf_function(lambda grads: opt.apply_gradients(zip(grads, step.variables, strict=False)))

                def loop(k):
                    loss, grads = step.grads(*shard(k))
                    apply(ring.allreduce(grads))
                    result["losses"].append(float(loss))
        loop(0)                              # first step traces the functions: not timed
        session.barrier("tf_plugin-warm")    # everyone traced: time steps, not tracing
        meter.comm_seconds = 0.0
        before = session.stats()
        tally0 = dict(meter.tally)
        t0 = time.perf_counter()
        for k in range(1, steps):
            loop(k)
        seconds = time.perf_counter() - t0
        session.barrier("tf_plugin-done")
        after = session.stats()
    timed = max(steps - 1, 1)
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    plugin_copies = sum(meter.tally[k] - tally0[k] for k in ("copied", "forwarded", "fused"))
    result.update(
        provider=after["provider"], timed_steps=steps - 1, seconds=seconds,
        steps_per_s=(steps - 1) / seconds if seconds else 0.0,
        comm_seconds=meter.comm_seconds, comm_ms_per_step=1e3 * meter.comm_seconds / timed,
        bytes_sent_per_step=delta["bytes_sent"] / timed, writes_per_step=delta["writes"] / timed,
        session_copies_per_step=delta["copies"] / timed, plugin_copies_per_step=plugin_copies / timed,
        zero_copy_per_step=(meter.tally["zero_copy"] - tally0["zero_copy"]) / timed,
        stats=after, tally=dict(meter.tally))
    return result


def tf_function(fn):
    import tensorflow as tf
    return tf.function(fn)


def in_graph_step(model, opt, ring, loss_fn, signature):
    """One tf.function per step, Horovod style: the ring runs inside it as a
    numpy_function. Only for ranks in separate processes: a blocked
    numpy_function holds one of TensorFlow's inter-op threads, and ranks sharing
    a process (and its pool of as many threads as cores) can starve each other."""
    import tensorflow as tf
    from .ring import RingGradientTape

    @tf.function(input_signature=signature)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = RingGradientTape(tape, ring).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        return loss
    return train_step


def run_threads(config: dict, workers: int, ps: int = 0, join_timeout: float = 600.0) -> list[dict]:
    """Every rank of a local cluster as a thread of this process; results in rank order."""
    from .cluster import Cluster
    cluster = Cluster.local(workers, ps if config.get("mode") == "ps" else 0)
    token = secrets.token_hex(16)
    results: dict[int, object] = {}

    def one(task):
        try:
            results[task.rank] = run_rank(task, config, token)
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


def _sum(values):
    """Sum, or None when a figure was not measured (the tf-grpc baseline)."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def summarize(results: list[dict]) -> dict:
    """One job's figures from its ranks' results."""
    workers = [r for r in results if r["role"] == "worker"]
    steps = workers[0]["timed_steps"]
    seconds = max(r["seconds"] for r in workers)
    losses = [sum(w["losses"][k] for w in workers) / len(workers) for k in range(len(workers[0]["losses"]))]
    copies = _sum(r[k] for r in results for k in ("session_copies_per_step", "plugin_copies_per_step"))
    comm = _sum(r["comm_seconds"] for r in workers)
    provider = results[0]["provider"]
    writes = _sum(r["writes_per_step"] for r in results)
    return {
        "mode": results[0]["mode"], "model": results[0]["model"], "provider": provider,
        "workers": len(workers), "ps": len(results) - len(workers),
        "steps": workers[0]["steps"], "steps_per_s": steps / seconds if seconds else 0.0,
        "bytes_per_step": _sum(r["bytes_sent_per_step"] for r in results),
        "writes_per_step": writes,
        "copies_per_step": copies,   # includes the grpc baseline's (de)serialization copies
        "zero_copy_ingest_per_step": _sum(r["zero_copy_per_step"] for r in results),
        "comm_ms_per_step": None if comm is None else 1e3 * comm / len(workers) / steps,
        "comm_fraction": None if comm is None or not seconds else comm / len(workers) / seconds,
        "dynamic": sum(r["stats"]["dynamic"] for r in results),
        "fallbacks": sum(r["stats"]["fallbacks"] for r in results),
        "grows": sum(r["stats"]["grows"] for r in results),
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
    }


def main(argv=None) -> int:
    """One launched rank: cluster from TF_CONFIG, token from RDMATENSOR_TOKEN."""
    import argparse
    import json
    import logging
    from .cluster import Cluster
    parser = argparse.ArgumentParser(description="one rank of a tf_plugin training job")
    parser.add_argument("--config", required=True, help="JSON: mode, model, provider, steps, ...")
    parser.add_argument("--out", required=True, help="file to write this rank's result to (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    config = json.loads(args.config)
    if config.get("provider") == "tf-grpc":
        from .tf_baseline import run_rank as baseline
        result = baseline(Cluster.from_tf_config(), config)
    else:
        result = run_rank(Cluster.from_tf_config(), config)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
