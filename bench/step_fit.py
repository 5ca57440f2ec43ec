"""`rdmatensor-bench fit`: the step-time model's constants (bench/step_model.py)
from rdmatensor-bench's own micro-benchmarks, in one command.

    rdmatensor-bench fit --providers shm,tcp --json docs/step-model/constants-host.json

Runs `rdmatensor-bench lat`, `bw` and `step` (send_many, as the ring writes)
over each provider, every point --rounds times (medians), and a duplex point
of its own (both ranks writing to each other at once, as every step of a ring
does); then times rdmatensor.streaming's add and copy, on one core and on
every core at once. Each constant comes from the point that determines it
(step_model's docstring): α from the 8-byte half round trip, β from the
step of 4 x 4 MiB, c from the step of 32 x 16 KiB (the most tensors within
the 128 a receiver takes in flight), β₂ from the largest duplex point, the
four equations solved together; a per-byte
reduction rate from the largest size, its per-call cost from the smallest;
the ring's own bookkeeping per bucket and step from a ring of 96 tiny
buckets (what the other terms leave of its time).
A joint least squares over every point would let the constants trade off (a
per-tensor cost of 0 paid for by a larger α) and follow whichever points are
most numerous. Every other point is a check: its residual is printed and
kept with the constants in the JSON. The tensor counts and sizes here are the
fit's: the validation (bench/step_validate.py) uses others.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

LAT_SIZES = "8,4K,64K,1M"
BW_SIZES = "4K,64K,1M,8M"
STEP_SETS = ("256x64", "32x16K", "4x4M")       # many tiny writes; a middle; a few large
DUPLEX_SIZES = (64 << 10, 1 << 20, 8 << 20)
RING_SET = "96x64"                             # the ring point: 96 single-gradient buckets of 64 B
REDUCE_SIZES = (256, 64 << 10, 1 << 20, 8 << 20, 32 << 20)
UNKNOWNS = ("alpha_s", "beta_s_per_byte", "per_tensor_s", "duplex_beta_s_per_byte")


def _bench(args: list[str], out: str) -> list[dict]:
    cmd = [sys.executable, "-m", f"{__package__}.cli", *args, "--no-references", "--json", out]
    print("  $ rdmatensor-bench " + " ".join(args), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode:
        raise SystemExit(f"rdmatensor-bench {' '.join(args)} failed ({done.returncode})")
    with open(out) as f:
        return json.load(f)["rows"]


def measure_links(providers: list[str], rounds: int, seconds: float) -> list[dict]:
    """Points: {provider, kind (lat/bw/step), bytes, tensors, seconds (the median)}."""
    common = ["--providers", ",".join(providers), "--rounds", str(rounds), "--seconds", str(seconds)]
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in _bench(["lat", "--lat-sizes", LAT_SIZES, *common], f"{tmp}/lat.json"):
            points.append({"provider": r["provider"], "kind": "lat", "bytes": r["size"], "tensors": 1,
                           "seconds": r["lat_us"]["median"] * 1e-6})
        for r in _bench(["bw", "--sizes", BW_SIZES, *common], f"{tmp}/bw.json"):
            points.append({"provider": r["provider"], "kind": "bw", "bytes": r["size"], "tensors": 1,
                           "seconds": 1 / r["msg_per_s"]})
        for i, step in enumerate(STEP_SETS):
            for r in _bench(["step", "--step-tensors", step, "--send-many", "on", *common], f"{tmp}/s{i}.json"):
                points.append({"provider": r["provider"].removesuffix("+many"), "kind": "step", "bytes": r["size"],
                               "tensors": r["extra"]["tensors"], "seconds": r["lat_us"]["median"] * 1e-6})
    return points


def design_row(kind: str, size: float, tensors: int) -> list[float]:
    """The point's coefficients of (α, β, c, β₂): see step_model's docstring."""
    return {"lat": [1.0, size, 2.0, 0.0], "bw": [0.0, size, 1.0, 0.0], "step": [2.0, size, tensors + 3.0, 0.0],
            "duplex": [1.0, 0.0, 2.0, size]}[kind]


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every constant >= 0: a constant the data would make
    negative is held at 0 and the rest refitted (no constant here is negative)."""
    free = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
        negative = [i for i in free if x[i] < 0]
        if not negative:
            return x
        free.remove(min(negative, key=lambda i: x[i]))


IN_FLIGHT = 128      # completions a receiver takes at once (shm's and verbs' max_incoming): more wait for credits


def determining(points: list[dict]) -> list[dict]:
    """The points that fix the constants, one each: the smallest latency point (α);
    the step of the most bytes (β: large writes issued with send_many, as the ring
    and a broadcast issue them); the step of the most tensors that fit in flight at
    once, IN_FLIGHT (c: past that, the sender waits for credits, a cost of its own);
    the largest duplex point (β₂; absent: β₂ is not fitted). Without step points,
    β from the largest bandwidth point."""
    def pick(kind, key, keep=lambda p: True):
        mine = [p for p in points if p["kind"] == kind and keep(p)]
        return [key(mine)] if mine else []
    steps = [p for p in points if p["kind"] == "step"]
    beta = (pick("step", lambda m: max(m, key=lambda p: p["bytes"])) if len(steps) >= 2
            else pick("bw", lambda m: max(m, key=lambda p: p["bytes"])))
    per_tensor = pick("step", lambda m: max(m, key=lambda p: (p["tensors"], -p["bytes"])),
                      lambda p: p["tensors"] <= IN_FLIGHT and p not in beta)
    return (pick("lat", lambda m: min(m, key=lambda p: p["bytes"])) + beta + per_tensor
            + pick("duplex", lambda m: max(m, key=lambda p: p["bytes"])))


def fit_link(points: list[dict]) -> tuple[dict, list[dict]]:
    """(α, β, c, β₂) from the points that determine them (`determining`), solved
    exactly (a constant that would come out negative held at 0); every point's
    residual, the determining ones marked."""
    fix = determining(points)
    if len([p for p in fix if p["kind"] != "duplex"]) < 3:
        raise ValueError("the fit needs a lat point and two step points (or a bw and a step point)")
    unknowns = 4 if any(p["kind"] == "duplex" for p in fix) else 3
    a = np.array([design_row(p["kind"], p["bytes"], p["tensors"])[:unknowns] for p in fix])
    y = np.array([p["seconds"] for p in fix])
    w = 1 / y                                 # exact when solvable; relative error otherwise
    x = nonnegative_lstsq(a * w[:, None], y * w)
    alpha, beta, c = x[:3]
    duplex = float(x[3]) if unknowns == 4 else None
    full = np.array([alpha, beta, c, duplex or 0.0])
    rows = []
    for p in points:
        f = float(np.dot(design_row(p["kind"], p["bytes"], p["tensors"]), full))
        rows.append({**p, "fitted": f, "residual": f / p["seconds"] - 1, "determines": p in fix})
    checks = [r["residual"] for r in rows if not r["determines"]]
    lat = min((p for p in points if p["kind"] == "lat"), key=lambda p: p["bytes"])
    bw = max((p for p in points if p["kind"] == "bw"), key=lambda p: p["bytes"])
    return ({"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "per_tensor_s": float(c),
             "duplex_beta_s_per_byte": duplex,
             "bandwidth_gbit_s": 8 / beta / 1e9 if beta else None,
             "duplex_gbit_s": 8 / duplex / 1e9 if duplex else None,
             "determined_by": {k: f"{p['kind']} {p['tensors']} x {p['bytes'] // p['tensors']} B"
                               for k, p in zip(UNKNOWNS, fix, strict=False)},
             # what a team would read straight off the same benchmarks: the smallest write's
             # half round trip, the largest one's bandwidth
             "naive": {"alpha_s": lat["seconds"], "beta_s_per_byte": bw["seconds"] / bw["bytes"]},
             "rms_relative_residual": float(np.sqrt(np.mean(checks ** 2))) if (checks := np.array(checks)).size
             else 0.0}, rows)


def _duplex_rank(rank: int, ports: list, provider: str, sizes: tuple, rounds: int, seconds: float, out) -> None:
    """One rank of the duplex point: per size and round, a fresh session; both ranks
    write s bytes to each other, then wait for the other's, `iters` times after a
    warm-up; rank 0 reports the median of its iterations."""
    from rdmatensor import Plan, TensorSpec, connect
    from rdmatensor.runner.cores import pin_threads
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        pin_threads({cpus[rank]})
    at = 0
    for size in sizes:
        # the same count on both sides, from the size alone
        iters = int(min(2000, max(20, seconds / (size * 2e-9 + 30e-6))))
        for round_ in range(rounds):
            peers = {0: f"127.0.0.1:{ports[at]}", 1: f"127.0.0.1:{ports[at + 1]}"}
            at += 2
            plan = Plan([TensorSpec("x0", (size,), np.uint8, 0, 1), TensorSpec("x1", (size,), np.uint8, 1, 0)])
            mine, theirs = ("x0", "x1") if rank == 0 else ("x1", "x0")
            with connect(rank, peers, plan, provider=provider, token="rdmatensor-bench-fit") as s:
                buf = s.buffer(mine)
                buf[:] = rank + 1
                times = []
                for i in range(5 + iters):
                    t = time.perf_counter()
                    s.send(mine, buf)
                    s.recv(theirs).release()
                    if i >= 5:
                        times.append(time.perf_counter() - t)
                s.barrier("duplex-done")
            if rank == 0:
                out.put({"provider": provider, "bytes": size, "round": round_, "seconds": statistics.median(times)})
    out.put({"done": rank})


def measure_duplex(providers: list[str], rounds: int, seconds: float) -> list[dict]:
    """Duplex points per provider: {provider, kind "duplex", bytes, tensors 1, seconds (median of rounds)}."""
    import multiprocessing
    import queue

    from rdmatensor.runner.cluster import free_ports
    ctx = multiprocessing.get_context("spawn")
    points = []
    for provider in providers:
        print(f"  duplex {provider}: {', '.join(str(x) for x in DUPLEX_SIZES)} B", file=sys.stderr, flush=True)
        out = ctx.Queue()
        ports = free_ports(2 * len(DUPLEX_SIZES) * rounds)
        procs = [ctx.Process(target=_duplex_rank, args=(r, ports, provider, DUPLEX_SIZES, rounds, seconds, out))
                 for r in (0, 1)]
        for p in procs:
            p.start()
        got, done, deadline = [], set(), time.monotonic() + 600
        try:
            while len(done) < 2:
                try:
                    item = out.get(timeout=1)
                except queue.Empty:
                    if any(p.exitcode for p in procs) or time.monotonic() > deadline:
                        raise SystemExit(f"rdmatensor-bench fit: the duplex point over {provider} failed") from None
                    continue
                if "done" in item:
                    done.add(item["done"])
                else:
                    got.append(item)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        for size in DUPLEX_SIZES:
            mine = [g["seconds"] for g in got if g["bytes"] == size]
            points.append({"provider": provider, "kind": "duplex", "bytes": size, "tensors": 1,
                           "seconds": statistics.median(mine), "rounds": mine})
    return points


def _time_reduction(rounds: int, sync=None) -> list[dict]:
    """Seconds per call of streaming.add (a + b times 1/N, into out) and of
    streaming.copy, float32, as the ring calls them (streaming stores from
    STREAM_BYTES up); median of `rounds` timings. `sync`: a barrier every
    process of the measurement passes before each timing."""
    from rdmatensor import streaming
    out = []
    rng = np.random.default_rng(0)
    for size in REDUCE_SIZES:
        n = size // 4
        a, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
        dst = np.empty_like(a)
        for kind, call in (("add", lambda dst=dst, a=a, b=b: streaming.add(dst, a, b, np.float32(0.5))),
                           ("copy", lambda dst=dst, a=a: streaming.copy(dst, a))):
            call()
            reps = max(3, min(20000, int((64 << 20) // size)))
            times = []
            for _ in range(rounds):
                if sync is not None:
                    sync.wait()
                t = time.perf_counter()
                for _ in range(reps):
                    call()
                times.append((time.perf_counter() - t) / reps)
            out.append({"kind": kind, "bytes": size, "seconds": statistics.median(times)})
    return out


def _shared_worker(cpu: int, rounds: int, sync, out) -> None:
    from rdmatensor.runner.cores import pin_threads
    pin_threads({cpu})
    out.put((cpu, _time_reduction(rounds, sync)))


def measure_reduction(rounds: int, shared: bool = False) -> list[dict]:
    """The reduction's points: one core alone, or (`shared`) one process per
    core (up to 8) all timing at once, each point the mean over the processes."""
    if not shared:
        return _time_reduction(rounds)
    import multiprocessing
    cpus = sorted(os.sched_getaffinity(0))[:8]
    ctx = multiprocessing.get_context("spawn")
    sync, out = ctx.Barrier(len(cpus)), ctx.Queue()
    procs = [ctx.Process(target=_shared_worker, args=(cpu, rounds, sync, out)) for cpu in cpus]
    for p in procs:
        p.start()
    results = [out.get(timeout=600)[1] for _ in procs]
    for p in procs:
        p.join(30)
    return [{**first, "seconds": float(np.mean([r[i]["seconds"] for r in results])), "processes": len(cpus)}
            for i, first in enumerate(results[0])]


def fit_reduction(points: list[dict]) -> tuple[dict, list[dict]]:
    """Per kind (add, copy): the per-byte cost from the largest size and the per-call
    cost from the smallest, solved together; every point's residual."""
    result, rows = {}, []
    for kind in ("add", "copy"):
        mine = [p for p in points if p["kind"] == kind]
        fix = [min(mine, key=lambda p: p["bytes"]), max(mine, key=lambda p: p["bytes"])]
        a = np.array([[1.0, p["bytes"]] for p in fix])
        y = np.array([p["seconds"] for p in fix])
        w = 1 / y
        fixed, per_byte = nonnegative_lstsq(a * w[:, None], y * w)
        result[f"{kind}_s_per_byte"] = float(per_byte)
        result[f"{kind}_call_s"] = float(fixed)
        result[f"{kind}_gb_s"] = 1 / per_byte / 1e9 if per_byte else None
        rows += [{**p, "fitted": fixed + per_byte * p["bytes"],
                  "residual": (fixed + per_byte * p["bytes"]) / p["seconds"] - 1, "determines": p in fix}
                 for p in mine]
    return result, rows


def measure_ring(providers: list[str], rounds: int) -> list[dict]:
    """The ring point per provider: tf_plugin's ring over 2 ranks, RING_SET unfused, timed as
    `rdmatensor-bench validate` times its ring cases: {provider, kind "ring", ..., seconds (median)}."""
    from .step_validate import measure_cases
    print(f"  ring {RING_SET} over {', '.join(providers)}", file=sys.stderr, flush=True)
    cases = [{"provider": p, "case": f"ring {RING_SET}", "kind": "ring", "spec": RING_SET, "fusion_threshold": 0,
              "predicted_ms": 5.0} for p in providers]
    got = measure_cases(cases, rounds)
    from . import step_model as sm
    sizes = sm.parse_tensors(RING_SET)
    return [{"provider": p, "kind": "ring", "bytes": sum(sizes), "tensors": len(sizes), "buckets": len(sizes),
             "seconds": statistics.median(g["seconds"] for g in got if g["provider"] == p),
             "rounds": [g["seconds"] for g in got if g["provider"] == p]} for p in providers]


def fit_ring_step(point: dict, link: dict, reduction: dict) -> float:
    """r: what the ring point's time leaves, per bucket and step, past the model's other terms
    (2 ranks: 2 steps), with the link's fitted constants and the reduction's shared rates."""
    from . import step_model as sm
    lk = sm.link_of({"links": {"x": {**link, "ring_step_s": 0.0}}}, "x")
    red = sm.reduce_of({"reduction": reduction}, shared=True)
    b = point["buckets"]
    rest = sm.ring_allreduce([point["bytes"] // b] * b, 2, lk, red, lockstep=True).total
    return max(0.0, (point["seconds"] - rest) / (2 * b))


def _residual_table(name: str, rows: list[dict]) -> str:
    lines = [f"{name}: point, measured, fitted, fitted/measured - 1"]
    for r in rows:
        what = f"{r['kind']:6} {r.get('tensors', 1):4} x {r['bytes'] / r.get('tensors', 1):>11,.0f} B"
        lines.append(f"  {what}  {r['seconds'] * 1e6:12.1f} us  {r['fitted'] * 1e6:12.1f} us  "
                     f"{r['residual']:+7.1%}{'  (determines)' if r.get('determines') else ''}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="rdmatensor-bench fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--providers", default="shm,tcp", help="comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per point, medians (default %(default)s)")
    p.add_argument("--seconds", type=float, default=0.3, help="time budget per point (default %(default)s)")
    p.add_argument("--json", default="docs/step-model/constants-host.json", help="where to write (default %(default)s)")
    a = p.parse_args(argv)
    providers = [x for x in a.providers.split(",") if x]
    t0, load = time.monotonic(), os.getloadavg()[0]
    points = measure_links(providers, a.rounds, a.seconds) + measure_duplex(providers, a.rounds, a.seconds)
    links = {}
    for provider in providers:
        mine = [q for q in points if q["provider"] == provider]
        if not mine:
            print(f"rdmatensor-bench fit: no points for {provider} (not viable here?)", file=sys.stderr)
            continue
        links[provider], rows = fit_link(mine)
        links[provider]["points"] = rows
        c = links[provider]
        print(_residual_table(provider, rows))
        print(f"  => alpha {c['alpha_s'] * 1e6:.2f} us, beta {c['beta_s_per_byte'] * 1e9:.4f} ns/B "
              f"({c['bandwidth_gbit_s'] or 0:.2f} Gbit/s), per tensor {c['per_tensor_s'] * 1e6:.2f} us, "
              f"duplex beta {(c['duplex_beta_s_per_byte'] or 0) * 1e9:.4f} ns/B; "
              f"rms residual of the other points {c['rms_relative_residual']:.1%}\n")
    reduction, red_rows = fit_reduction(measure_reduction(max(a.rounds, 3)))
    reduction["points"] = red_rows
    print(_residual_table("reduction, one core (streaming add, copy)", red_rows))
    print(f"  => add {reduction['add_gb_s']:.2f} GB/s of output + {reduction['add_call_s'] * 1e6:.2f} us a call, "
          f"copy {reduction['copy_gb_s']:.2f} GB/s + {reduction['copy_call_s'] * 1e6:.2f} us a call")
    shared, shared_rows = fit_reduction(measure_reduction(max(a.rounds, 3), shared=True))
    reduction["shared"] = {**shared, "processes": shared_rows[0]["processes"], "points": shared_rows}
    print(_residual_table("reduction, every core at once", shared_rows))
    print(f"  => add {shared['add_gb_s']:.2f} GB/s of output, copy {shared['copy_gb_s']:.2f} GB/s per core")
    for point in measure_ring(list(links), a.rounds):
        c = links[point["provider"]]
        c["ring_step_s"] = fit_ring_step(point, c, reduction)
        c["ring_point"] = point
        print(f"{point['provider']}: ring {RING_SET} {point['seconds'] * 1e3:.3f} ms (rounds "
              f"{', '.join(f'{x * 1e3:.3f}' for x in point['rounds'])}) => ring bookkeeping "
              f"{c['ring_step_s'] * 1e6:.2f} us per bucket and step")
    doc = {"command": "rdmatensor-bench fit " + " ".join(argv),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(terse=True),
                       "load_before": load},
           "seconds": round(time.monotonic() - t0, 1), "rounds": a.rounds,
           "links": links, "reduction": reduction}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {a.json}")
    return 0
