"""What the ring all-reduce of a real model's gradients costs, side by side in one job.

    python -m bench.ring_cpu --models resnet50,densenet121 --providers shm,tcp

Two ranks on this host all-reduce (average) one training step's gradients of
each model (bench/model_grads.json, fused into buckets as training fuses
them), with no model computing beside: the ring alone. Each round times
--calls all-reduces of each way, in turn, so all see the same machine:

- `stream`: what training runs: a fused bucket read from the gradients where
  they are (gather writes), large payloads copied and added with streaming
  stores (rdmatensor.streaming);
- `gather`: the same with plain copies and numpy's add and multiply;
- `copy`: as before both: the gradients copied into one bucket buffer first
  (ring_variants.py, copy_fused=True), plain copies and numpy;
- `staged` (verbs only): `stream` with the outputs not registered, so the
  all-gather's writes are copied into staging first (ring_variants.py,
  register_outputs=False).

Beside them, `traffic`: the memory traffic a 2-rank ring of each bucket cannot
avoid, done locally with the same streaming copies and add and no peer, no
protocol and no waiting (half the bucket written out, the add into the output,
the sum written out, the peer's sum copied in), both ranks at once: the floor
under any 2-rank all-reduce in memory on this host. stream / traffic is what the
ring's protocol and synchronization add over its bytes.

Per model, provider and way: the median wall and CPU milliseconds (every
thread of the rank's process) per all-reduce, over both ranks, and copy /
stream (above 1: stream is cheaper). Every way's first result is checked bit
for bit against the mean numpy computes. Rank 0 prints one JSON line per
model and provider, then a table.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import queue
import secrets
import statistics
import sys
import time

WAYS = ("stream", "gather", "copy")
COLUMNS = (*WAYS, "traffic")
STAGED = "staged"          # measured where writes need registered memory (verbs)


def ways_of(provider: str) -> tuple:
    from rdmatensor.providers import REGISTRY
    return (*WAYS, STAGED) if REGISTRY[provider].load().capabilities.needs_registered_source else WAYS


def _traffic(buckets, mine: dict, theirs: dict):
    """A callable doing, locally, the memory traffic of a 2-rank ring of every
    bucket (`mine`, `theirs`: each rank's gradients by key)."""
    import numpy as np

    from rdmatensor import streaming

    def fused(b, arrays):
        flat = np.zeros(b.size, b.dtype)
        for key, offset, n in b.members:
            flat[offset:offset + n] = arrays[key].reshape(-1)
        return flat

    work = [(fused(b, mine), fused(b, theirs), np.empty(b.size, b.dtype), np.empty(b.size - b.size // 2, b.dtype),
             b.dtype.type(0.5)) for b in buckets]

    def run():
        for flat, peer, out, slot, scale in work:
            h = flat.size // 2
            streaming.copy(slot, flat[h:])                    # reduce-scatter: my other half, to the peer
            streaming.add(out[:h], flat[:h], peer[:h], scale)  # the add, into the output
            streaming.copy(slot[:h], out[:h])                 # all-gather: my sum, to the peer
            streaming.copy(out[h:], peer[h:])                 # the peer's sum, out of my slot
        return work
    return run


def _inputs(model: str, rank: int):
    import numpy as np

    from . import model_grads
    from tf_plugin.core.layout import VarInfo
    infos = [VarInfo(t["name"], tuple(t["shape"]), np.dtype(t["dtype"]), False, {})
             for t in model_grads.gradient_set(model)]
    rng = np.random.default_rng(rank)
    return infos, [rng.standard_normal(v.shape).astype(v.dtype) for v in infos]


def _rank(rank: int, peers: dict, token: str, model: str, provider: str, rounds: int, calls: int, out) -> None:
    import numpy as np

    from rdmatensor import Plan, connect, streaming
    from tf_plugin.core.layout import Analysis, buckets_of, ring_specs
    from tf_plugin.executor.ring import RingAllReduce

    from .ring_variants import VariantRing
    infos, mine = _inputs(model, rank)
    _, theirs = _inputs(model, 1 - rank)
    buckets = buckets_of(infos, fusion=True)
    analysis = Analysis(Plan([s for s, _ in ring_specs(buckets, 2)]), "allreduce", 2, 0, infos, buckets=buckets)
    keys = [v.key for v in infos]
    with connect(rank, peers, analysis.plan, provider=provider, token=token) as session:
        before = {"copy": {"copy_fused": True}, STAGED: {"register_outputs": False}}   # the ring before each saving
        rings = {way: VariantRing(session, analysis, **before[way]) if way in before
                 else RingAllReduce(session, analysis) for way in ways_of(provider)}
        calls_of = {way: functools.partial(ring.allreduce_arrays, keys, mine) for way, ring in rings.items()}
        calls_of["traffic"] = _traffic(buckets, dict(zip(keys, mine, strict=True)),
                                       dict(zip(keys, theirs, strict=True)))
        wall = {way: [] for way in calls_of}
        cpu = {way: [] for way in calls_of}
        for r in range(rounds + 1):               # round 0 warms up and checks
            for way, call in calls_of.items():
                streaming.enabled = way in ("stream", "traffic", STAGED) and streaming.BUILD_ERROR is None
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    got = call()
                w1, c1 = time.perf_counter(), time.process_time()
                if r == 0 and way == "traffic":      # its add is the ring's: the mean of its half
                    for flat, peer, res, _, scale in got:
                        h = flat.size // 2
                        if not np.array_equal(res[:h], (flat[:h] + peer[:h]) * scale):
                            raise SystemExit(f"rank {rank}: the traffic way's add is wrong")
                    continue
                if r == 0:
                    pairs = (mine, theirs) if rank == 0 else (theirs, mine)
                    for k, g, a, b in zip(keys, got, *pairs, strict=True):
                        if not np.array_equal(g, (a + b) * np.float32(0.5)):
                            raise SystemExit(f"rank {rank}: {way} all-reduce of {k} is wrong")
                    continue
                wall[way].append((w1 - w0) / calls * 1e3)
                cpu[way].append((c1 - c0) / calls * 1e3)
        session.barrier("ring-cpu-done")
    out.put({"rank": rank, "wall": wall, "cpu": cpu, "buckets": len(buckets),
             "fused": sum(len(b.members) > 1 for b in buckets),
             "bytes": sum(b.size * b.dtype.itemsize for b in buckets)})


def measure(model: str, provider: str, rounds: int, calls: int) -> dict:
    from rdmatensor.runner.cluster import free_ports
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(free_ports(2))}
    token = secrets.token_hex(16)
    procs = [ctx.Process(target=_rank, args=(r, peers, token, model, provider, rounds, calls, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 600
    try:
        while len(results) < 2:
            try:
                got = out.get(timeout=1)
            except queue.Empty:        # a rank that died says so now, not at the deadline
                failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode and r not in results}
                if failed or time.monotonic() > deadline:
                    raise SystemExit(f"{model} over {provider}: " + (
                        f"rank(s) {', '.join(map(str, failed))} failed (exit codes {list(failed.values())})"
                        if failed else "no result within 600 s")) from None
                continue
            results[got["rank"]] = got
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{model} over {provider}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    row = {"model": model, "provider": provider, "bytes": results[0]["bytes"], "buckets": results[0]["buckets"],
           "fused_buckets": results[0]["fused"], "rounds": rounds, "calls": calls}
    for way in results[0]["wall"]:       # both ranks' samples: a rank's CPU is what its neighbour's compute loses
        row[f"{way}_wall_ms"] = round(statistics.median(results[0]["wall"][way] + results[1]["wall"][way]), 2)
        row[f"{way}_cpu_ms"] = round(statistics.median(results[0]["cpu"][way] + results[1]["cpu"][way]), 2)
    row["cpu_copy_over_stream"] = round(row["copy_cpu_ms"] / row["stream_cpu_ms"], 3)
    row["wall_copy_over_stream"] = round(row["copy_wall_ms"] / row["stream_wall_ms"], 3)
    row["wall_stream_over_traffic"] = round(row["stream_wall_ms"] / row["traffic_wall_ms"], 3)
    if f"{STAGED}_wall_ms" in row:
        row["wall_staged_over_stream"] = round(row[f"{STAGED}_wall_ms"] / row["stream_wall_ms"], 3)
        row["cpu_staged_over_stream"] = round(row[f"{STAGED}_cpu_ms"] / row["stream_cpu_ms"], 3)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | provider | MB | stream: wall / CPU ms | gather: wall / CPU ms | copy first: wall / CPU ms "
             "| traffic alone: wall / CPU ms | CPU copy/stream | wall stream/traffic "
             "| outputs staged: wall / CPU ms | wall staged/stream |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        staged = (f"{r[f'{STAGED}_wall_ms']} / {r[f'{STAGED}_cpu_ms']} | {r['wall_staged_over_stream']}x"
                  if f"{STAGED}_wall_ms" in r else "- | -")
        lines.append(f"| {r['model']} | {r['provider']} | {r['bytes'] / 1e6:.1f} | "
                     + " | ".join(f"{r[f'{w}_wall_ms']} / {r[f'{w}_cpu_ms']}" for w in COLUMNS)
                     + f" | {r['cpu_copy_over_stream']}x | {r['wall_stream_over_traffic']}x | {staged} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ring_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,densenet121,mobilenetv2",
                   help="comma-separated gradient sets of bench/model_grads.json")
    p.add_argument("--providers", default="shm,tcp", help="comma-separated providers")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after one to warm up and check)")
    p.add_argument("--calls", type=int, default=4, help="all-reduces per way and round")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.calls < 1:
        p.error("--rounds and --calls must be at least 1")
    from . import model_grads
    from rdmatensor.providers import REGISTRY
    for what, given, known in (("model", a.models, model_grads.names()), ("provider", a.providers, REGISTRY)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            p.error(f"unknown {what} {', '.join(unknown)}: choose from {', '.join(known)}")
    rows = []
    for model in a.models.split(","):
        for provider in a.providers.split(","):
            t0 = time.monotonic()
            rows.append(measure(model, provider, a.rounds, a.calls))
            print(json.dumps({**rows[-1], "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
