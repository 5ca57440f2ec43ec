"""`rdmatensor-bench fit`: the step-time model's constants (bench/step_model.py)
from rdmatensor-bench's own micro-benchmarks, in one command.

    rdmatensor-bench fit --providers shm,tcp --json docs/step-model/constants-host.json

Runs `rdmatensor-bench lat`, `bw` and `step` (send_many, as the ring writes)
over each provider, every point --rounds times (medians), then times
rdmatensor.streaming's add and copy alone; fits per provider (α, β, c) by least
squares on the relative error of every point (a 64 MiB point and an 8-byte
one weigh the same), and (γ, δ) likewise; prints every point's residual and
writes the constants as JSON. The tensor counts and sizes here are the fit's:
the validation (bench/step_validate.py) uses others.
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
REDUCE_SIZES = (64 << 10, 1 << 20, 8 << 20, 32 << 20)


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
    """The point's coefficients of (α, β, c): see step_model's docstring."""
    return {"lat": [1.0, size, 2.0], "bw": [0.0, size, 1.0], "step": [2.0, size, tensors + 3.0]}[kind]


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


def fit_link(points: list[dict]) -> tuple[dict, list[dict]]:
    """(α, β, c) minimising the relative error over `points`; rows with residuals."""
    a = np.array([design_row(p["kind"], p["bytes"], p["tensors"]) for p in points])
    y = np.array([p["seconds"] for p in points])
    w = 1 / y
    alpha, beta, c = nonnegative_lstsq(a * w[:, None], y * w)
    fitted = a @ np.array([alpha, beta, c])
    rows = [{**p, "fitted": float(f), "residual": float(f / p["seconds"] - 1)} for p, f in zip(points, fitted,
                                                                                                strict=True)]
    lat = min((p for p in points if p["kind"] == "lat"), key=lambda p: p["bytes"])
    bw = max((p for p in points if p["kind"] == "bw"), key=lambda p: p["bytes"])
    return ({"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "per_tensor_s": float(c),
             "bandwidth_gbit_s": 8 / beta / 1e9 if beta else None,
             # what a team would read straight off the same benchmarks: the smallest write's
             # half round trip, the largest one's bandwidth
             "naive": {"alpha_s": lat["seconds"], "beta_s_per_byte": bw["seconds"] / bw["bytes"]},
             "rms_relative_residual": float(np.sqrt(np.mean([r["residual"] ** 2 for r in rows])))}, rows)


def measure_reduction(rounds: int) -> list[dict]:
    """Seconds per call of streaming.add (a + b times 1/N, into out) and of
    streaming.copy, float32, as the ring calls them; median of `rounds` timings."""
    from rdmatensor import streaming
    out = []
    rng = np.random.default_rng(0)
    for size in REDUCE_SIZES:
        n = size // 4
        a, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
        dst = np.empty_like(a)
        for kind, call in (("add", lambda: streaming.add(dst, a, b, np.float32(0.5))),
                           ("copy", lambda: streaming.copy(dst, a))):
            call()
            reps = max(3, int((64 << 20) // size))
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(reps):
                    call()
                times.append((time.perf_counter() - t) / reps)
            out.append({"kind": kind, "bytes": size, "seconds": statistics.median(times)})
    return out


def fit_reduction(points: list[dict]) -> tuple[dict, list[dict]]:
    result, rows = {}, []
    for kind in ("add", "copy"):
        mine = [p for p in points if p["kind"] == kind]
        a = np.array([[1.0, p["bytes"]] for p in mine])
        y = np.array([p["seconds"] for p in mine])
        w = 1 / y
        fixed, per_byte = nonnegative_lstsq(a * w[:, None], y * w)
        result[f"{kind}_s_per_byte"] = float(per_byte)
        result[f"{kind}_call_s"] = float(fixed)
        result[f"{kind}_gb_s"] = 1 / per_byte / 1e9 if per_byte else None
        rows += [{**p, "fitted": fixed + per_byte * p["bytes"],
                  "residual": (fixed + per_byte * p["bytes"]) / p["seconds"] - 1} for p in mine]
    return result, rows


def _residual_table(name: str, rows: list[dict]) -> str:
    lines = [f"{name}: point, measured, fitted, fitted/measured - 1"]
    for r in rows:
        what = f"{r['kind']:4} {r.get('tensors', 1):4} x {r['bytes'] / r.get('tensors', 1):>11,.0f} B"
        lines.append(f"  {what}  {r['seconds'] * 1e6:12.1f} us  {r['fitted'] * 1e6:12.1f} us  "
                     f"{r['residual']:+7.1%}")
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
    points = measure_links(providers, a.rounds, a.seconds)
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
              f"({c['bandwidth_gbit_s']:.2f} Gbit/s), per tensor {c['per_tensor_s'] * 1e6:.2f} us; "
              f"rms residual {c['rms_relative_residual']:.1%}\n")
    red_points = measure_reduction(max(a.rounds, 3))
    reduction, red_rows = fit_reduction(red_points)
    reduction["points"] = red_rows
    print(_residual_table("reduction (streaming add, copy)", red_rows))
    print(f"  => add {reduction['add_gb_s']:.2f} GB/s of output, copy {reduction['copy_gb_s']:.2f} GB/s")
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
