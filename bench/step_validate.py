"""`rdmatensor-bench validate`: the step-time model against measurement, on
cases the fit never saw (other tensor counts, sizes, fusion thresholds, and the
ring all-reduce, which the fit has no point of).

    rdmatensor-bench validate --predict-only --json docs/step-model/predictions.json   # first, committed
    rdmatensor-bench validate --json docs/step-model/validation.json                   # then measured

Two ranks on this host (one core each), per provider:

- `p2p`: rdmatensor-bench's step (bench/points.py), one rank writing a tensor
  set with send_many and the other acking: what a broadcast from rank 0 is
  on 2 ranks;
- `ring`: tf_plugin's RingAllReduce averaging a gradient set eagerly
  (allreduce_arrays: every bucket in lockstep), its buckets made by
  layout.buckets_of at the case's fusion threshold.

Every case runs once per round, the cases in turn, in reverse order every
other round, so that each sees the same machine as its neighbours; a fresh
session per case and round. The error of a round is predicted / measured - 1
(above 0: the model is slow); the table gives the median over the rounds and
their range, beside the naive model's (α + s·β per tensor, α the smallest
write's half round trip and β the largest one's bandwidth, read off the same
micro-benchmarks; no per-tensor or reduction cost).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import queue
import secrets
import statistics
import sys
import time

from . import step_model as sm

# (name, kind, gradient set: "COUNTxSIZE,..." or a model of model_grads.json, fusion threshold)
CASES = (
    ("p2p 200x1K", "p2p", "200x1K", None),
    ("p2p 24x96K", "p2p", "24x96K", None),
    ("p2p 2x12M", "p2p", "2x12M", None),
    ("p2p densenet121", "p2p", "densenet121", None),
    ("ring 16x2M, no fusion", "ring", "16x2M", 0),
    ("ring mobilenetv2, no fusion", "ring", "mobilenetv2", 0),
    ("ring densenet121, fusion 1M", "ring", "densenet121", 1 << 20),
    ("ring resnet50, fusion 64M", "ring", "resnet50", 64 << 20),
)
BUDGET = 0.4          # seconds a case is timed for, per round


def grads_of(spec: str) -> list[dict]:
    if "x" in spec and spec[0].isdigit():
        return sm.synthetic_set(sm.parse_tensors(spec))
    return sm.gradient_set(spec)


def predictions(constants: dict, providers: list[str]) -> list[dict]:
    red = sm.reduce_of(constants, shared=True)        # both ranks sum and copy at once, on one memory bus
    out = []
    for provider in providers:
        link, plain = sm.link_of(constants, provider), sm.naive_link_of(constants, provider)
        for name, kind, spec, threshold in CASES:
            grads = grads_of(spec)
            if kind == "p2p":
                sizes = [b.bytes for b in sm.buckets(grads, 0)]
                terms, naive = sm.point_to_point(sizes, link), sm.naive(sizes, plain)
            else:
                bs = sm.buckets(grads, threshold)
                sizes = [b.bytes for b in bs]
                terms = sm.ring_allreduce(sizes, 2, link, red, lockstep=True, tensors=[b.tensors for b in bs])
                naive = sm.naive_ring(sizes, 2, plain)
            out.append({"provider": provider, "case": name, "kind": kind, "tensors": len(grads),
                        "writes_per_step": len(sizes), "bytes": sum(sizes), "fusion_threshold": threshold,
                        "predicted_ms": terms.total * 1e3, "terms_ms": {t: getattr(terms, t) * 1e3 for t in sm.TERMS},
                        "naive_ms": naive * 1e3})
    return out


def _ring_module():
    from tf_plugin.executor import ring
    return ring


def _time_ring(rank: int, peers: dict, provider: str, token: str, spec: str, threshold: int, calls: int) -> float:
    import numpy as np

    from rdmatensor import Plan, connect
    layout = sm._layout()
    infos = sm.var_infos(grads_of(spec))
    fusion = threshold != 0
    buckets = layout.buckets_of(infos, fusion, threshold if fusion else None)
    analysis = layout.Analysis(Plan([s for s, _ in layout.ring_specs(buckets, 2)]), "allreduce", 2, 0, infos,
                               buckets=buckets)
    rng = np.random.default_rng(rank)
    arrays = [rng.standard_normal(v.shape).astype(v.dtype) for v in infos]
    keys = [v.key for v in infos]
    with connect(rank, peers, analysis.plan, provider=provider, token=token) as session:
        ring = _ring_module().RingAllReduce(session, analysis)
        for _ in range(2):                     # outputs allocated, pages touched
            ring.allreduce_arrays(keys, arrays)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            ring.allreduce_arrays(keys, arrays)
            times.append(time.perf_counter() - t)
        session.barrier("validate-ring-done")
        ring.close()
    return statistics.median(times)


def _time_p2p(rank: int, peers: dict, provider: str, spec: str) -> float | None:
    from .points import Point, run_point
    sizes = tuple(b.bytes for b in sm.buckets(grads_of(spec), 0))
    result = run_point(rank, peers, Point("step", provider, sum(sizes), tensors=sizes, seconds=BUDGET, warmup=3,
                                          send_many=True))
    return result.lat_us["median"] * 1e-6 if result else None


def _rank(rank: int, ports: list, token: str, plan: list, out) -> None:
    from rdmatensor.runner.cores import pin_threads
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        pin_threads({cpus[rank]})
    for i, (round_, case) in enumerate(plan):
        peers = {0: f"127.0.0.1:{ports[2 * i]}", 1: f"127.0.0.1:{ports[2 * i + 1]}"}
        if case["kind"] == "p2p":
            seconds = _time_p2p(rank, peers, case["provider"], case["spec"])
        else:
            calls = int(min(100, max(3, BUDGET / max(case["predicted_ms"] / 1e3, 1e-5))))
            seconds = _time_ring(rank, peers, case["provider"], token, case["spec"], case["fusion_threshold"], calls)
        if rank == 0:
            out.put({"round": round_, "provider": case["provider"], "case": case["case"], "seconds": seconds})
    out.put({"done": rank})


def measure(preds: list[dict], rounds: int) -> list[dict]:
    specs = {name: (spec, threshold) for name, _, spec, threshold in CASES}
    return measure_cases([{**p, "spec": specs[p["case"]][0]} for p in preds], rounds)


def measure_cases(cases: list[dict], rounds: int) -> list[dict]:
    """Time `cases` ({provider, case, kind, spec, fusion_threshold, predicted_ms: sizes the
    number of calls}) on two ranks, `rounds` interleaved rounds: {round, provider, case, seconds}."""
    from rdmatensor.runner.cluster import free_ports
    plan = [(r, c) for r in range(rounds) for c in (cases if r % 2 == 0 else cases[::-1])]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ports = free_ports(2 * len(plan))
    token = secrets.token_hex(16)
    procs = [ctx.Process(target=_rank, args=(r, ports, token, plan, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got, done = [], set()
    deadline = time.monotonic() + 1800
    try:
        while len(done) < 2:
            try:
                item = out.get(timeout=1)
            except queue.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode and r not in done]
                if failed or time.monotonic() > deadline:
                    raise SystemExit(f"rdmatensor-bench validate: rank(s) {failed} failed" if failed
                                     else "rdmatensor-bench validate: no result within 30 minutes") from None
                continue
            if "done" in item:
                done.add(item["done"])
                continue
            got.append(item)
            print(f"  round {item['round']} {item['provider']:4} {item['case']:30} {item['seconds'] * 1e3:9.2f} ms",
                  file=sys.stderr, flush=True)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def summarize(preds: list[dict], measured: list[dict]) -> list[dict]:
    rows = []
    for p in preds:
        mine = sorted((m for m in measured if (m["provider"], m["case"]) == (p["provider"], p["case"])),
                      key=lambda m: m["round"])
        ms = [m["seconds"] * 1e3 for m in mine]
        err = [p["predicted_ms"] / x - 1 for x in ms]
        naive = [p["naive_ms"] / x - 1 for x in ms]
        rows.append({**p, "measured_ms": ms, "measured_median_ms": statistics.median(ms),
                     "error": {"median": statistics.median(err), "min": min(err), "max": max(err), "rounds": err},
                     "naive_error": {"median": statistics.median(naive), "min": min(naive), "max": max(naive),
                                     "rounds": naive}})
    return rows


def _pct(e: dict) -> str:
    return f"{e['median']:+.0%} ({e['min']:+.0%} to {e['max']:+.0%})"


def _n(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def prediction_table(preds: list[dict]) -> str:
    lines = ["| provider | case | writes per step | MB | predicted ms "
             "| latency / bandwidth / per-tensor / reduction ms | naive ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in preds:
        t = p["terms_ms"]
        lines.append(f"| {p['provider']} | {p['case']} | {p['writes_per_step']} | {p['bytes'] / 1e6:.2f} | "
                     f"{_n(p['predicted_ms'])} | {' / '.join(_n(t[k]) for k in sm.TERMS)} | {_n(p['naive_ms'])} |")
    return "\n".join(lines)


def validation_table(rows: list[dict]) -> str:
    lines = ["| provider | case | predicted ms | measured ms, median (range) | model error | naive ms | naive error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ms = r["measured_ms"]
        lines.append(f"| {r['provider']} | {r['case']} | {_n(r['predicted_ms'])} | {_n(r['measured_median_ms'])} "
                     f"({_n(min(ms))}–{_n(max(ms))}) | {_pct(r['error'])} | {_n(r['naive_ms'])} "
                     f"| {_pct(r['naive_error'])} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="rdmatensor-bench validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--constants", default="docs/step-model/constants-host.json")
    p.add_argument("--providers", default="shm,tcp")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    p.add_argument("--predict-only", action="store_true", help="write the predictions, measure nothing")
    p.add_argument("--predictions", default="docs/step-model/predictions.json",
                   help="predictions committed before measuring: checked equal to this run's")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    constants = sm.load_constants(a.constants)
    providers = [x for x in a.providers.split(",") if x]
    preds = predictions(constants, providers)
    command = "rdmatensor-bench validate " + " ".join(argv)
    if a.predict_only:
        print(prediction_table(preds))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"command": command, "constants": a.constants, "predictions": preds}, f, indent=1)
        return 0
    if a.predictions and os.path.exists(a.predictions):
        before = {(q["provider"], q["case"]): q["predicted_ms"] for q in json.load(open(a.predictions))["predictions"]}
        for q in preds:
            was = before.get((q["provider"], q["case"]))
            if was is None or abs(was - q["predicted_ms"]) > 1e-9 * max(1.0, was):
                print(f"rdmatensor-bench validate: {q['provider']} {q['case']}: predicted {q['predicted_ms']:.4g} ms, "
                      f"{a.predictions} says {was} (constants changed since?)", file=sys.stderr)
    if a.rounds < 3:
        print("rdmatensor-bench validate: fewer than 3 rounds give no range worth reading", file=sys.stderr)
    t0, load = time.monotonic(), os.getloadavg()[0]
    rows = summarize(preds, measure(preds, a.rounds))
    print(validation_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": command, "constants": a.constants, "rounds": a.rounds,
                       "seconds": round(time.monotonic() - t0, 1), "load_before": load, "rows": rows}, f, indent=1)
    return 0
