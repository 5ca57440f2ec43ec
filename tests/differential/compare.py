"""The differential run: the same seeded sequences of collectives under real
Horovod (horovodrun --gloo, built by `make horovod-reference`) and under
tf_plugin (rdmatensor-run), every outcome compared, and both against the numpy
model of Horovod's semantics (model.py).

    python -m tests.differential.compare --ranks 2 --providers shm,tcp --seeds 1-20 --calls 500 [--out DIR]
    python -m tests.differential.compare ... --no-horovod     (the model alone judges)
    python -m tests.differential.compare ... --recorded DIR   (Horovod's recordings of an earlier run)
    python -m tests.differential.compare ... --graph 0.4      (40% of the calls each in a tf.function)

Judged, per call and member rank:
- an agreeing call returns on every member, and its values equal the model's
  and Horovod's bit for bit, or within model.tolerance where the order of the
  reduction may differ (3 ranks and more);
- a changed call (sequence.JUDGED or OURS) raises on every member; where
  Horovod judged it too, as the same TensorFlow error class;
- real Horovod matches the model the same way (the model's own check).
Exit status 1 on any wrong value or a changed call that returned normally.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from .model import expected, tolerance
from .sequence import OURS, as_seen_by, call, in_graph, inputs, seeds_of

ROOT = Path(__file__).resolve().parents[2]


def launch(impl: str, ranks: int, provider: str, out: Path, seeds: str, calls: int, timeout: float,
           graph: float = 0.0) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", RDMATENSOR_TIMEOUT=os.environ.get("RDMATENSOR_TIMEOUT", "20"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    worker = ["-m", "tests.differential.worker", str(out), impl, seeds, str(calls), f"{graph:g}"]
    if impl == "horovod":
        venv = ROOT / ".venv-horovod" / "bin"
        cmd = [str(venv / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               str(venv / "python"), *worker]
    else:
        cmd = [sys.executable, "-m", "rdmatensor.runner.cli", "-np", str(ranks), "--provider", provider,
               "--timeout", f"{timeout:g}", sys.executable, *worker]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 120)
    tail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                     if "calls" in line or "Error" in line or "rdmatensor-run" in line)[-3000:]
    print(f"  {impl} {provider if impl != 'horovod' else 'gloo'} seeds {seeds}: exit {proc.returncode} in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{tail}\n{(proc.stdout + proc.stderr)[-4000:]}")


def load(out: Path, impl: str, ranks: int) -> dict[int, dict] | None:
    """Every rank's recorded outcomes, merged over the jobs that wrote them (None if none did)."""
    found = {r: sorted(out.glob(f"{impl}-s*-rank{r}.pkl")) for r in range(ranks)}
    if not all(found.values()):
        return None
    return {r: {k: v for p in paths for k, v in pickle.loads(p.read_bytes()).items()} for r, paths in found.items()}


def same(got: np.ndarray, want: np.ndarray, tol) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if np.all(np.asarray(tol) == 0) or want.dtype.kind != "f":
        return np.array_equal(got, want, equal_nan=True) and (
            want.dtype.kind != "f" or np.array_equal(np.signbit(got), np.signbit(want)) or not got.size)
    return bool(np.all(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tol))


def judge(ranks: int, seeds: list[int], calls: int, ours: dict, horovod: dict | None, graph: float = 0.0) -> dict:
    counts = Counter()
    problems: list[str] = []
    for seed in seeds:
        for index in range(calls):
            c = call(seed, index, ranks)
            views = {r: as_seen_by(c, r, seed) for r in range(ranks)}
            members = list(c.members)
            if any((ours[r].get((seed, index)) or ("",))[0] == "skipped" for r in members):
                counts["skipped"] += 1
                continue
            if in_graph(seed, index, graph):
                counts["calls in a graph"] += 1
            if c.mismatch:
                counts[f"changed:{c.change}"] += 1
                outcomes = [ours[r].get((seed, index)) for r in members]
                returned = [r for r, o in zip(members, outcomes, strict=True) if o is None or o[0] != "error"]
                counts["changed calls"] += 1
                if returned:
                    counts["changed but returned"] += 1
                    problems.append(f"seed {seed} call {index}: {c.kind} changed ({c.change} on rank {c.victim}) "
                                    f"returned normally on ranks {returned}")
                    continue
                if horovod is not None and c.change not in OURS and all(
                        (seed, index) in horovod[r] for r in members):
                    theirs = [horovod[r][(seed, index)] for r in members]
                    if all(t[0] == "error" for t in theirs):
                        counts["changed, judged by Horovod too"] += 1
                        classes = {t[1] for t in theirs}, {o[1] for o in outcomes}
                        if classes[0] != classes[1]:
                            counts["error class differs"] += 1
                            problems.append(f"seed {seed} call {index}: {c.change}: Horovod raised {classes[0]}, "
                                            f"rdmatensor {classes[1]}")
                    elif all(t[0] == "ok" for t in theirs):
                        counts["changed, Horovod returned"] += 1     # what Horovod does not see: noted, not judged
                continue
            by_rank = {r: inputs(views[r], r, seed) for r in members}
            counts["agreeing calls"] += 1
            for r in members:
                want = expected(views, by_rank, r)
                tols = [tolerance(views[r], by_rank, j, r) for j in range(len(views[r].dtypes))]
                tols += [0.0] * (len(want) - len(tols))
                mine = ours[r].get((seed, index))
                if mine is None or mine[0] != "ok":
                    counts["agreeing call raised"] += 1
                    problems.append(f"seed {seed} call {index} rank {r}: {c.kind} raised {mine}")
                    continue
                if len(mine[1]) != len(want) or not all(same(g, w, t) for g, w, t in
                                                        zip(mine[1], want, tols, strict=False)):
                    counts["wrong values"] += 1
                    problems.append(f"seed {seed} call {index} rank {r}: {c.kind} {c.op} {views[r].dtypes} "
                                    f"{views[r].shapes}: got {[g.tolist() for g in mine[1]]!s:.300} want "
                                    f"{[w.tolist() for w in want]!s:.300}")
                    continue
                counts["values checked"] += 1
                theirs = None if horovod is None else horovod[r].get((seed, index))
                if theirs is None or theirs[0] == "skipped":
                    continue
                if theirs[0] != "ok" or not all(same(h, w, t) for h, w, t in zip(theirs[1], want, tols, strict=False)):
                    counts["Horovod differs from the model"] += 1
                    problems.append(f"seed {seed} call {index} rank {r}: the model is not Horovod: {c.kind} {c.op} "
                                    f"{views[r].dtypes}: Horovod {theirs[0]} {str(theirs[1])[:200]}")
                    continue
                exact = all(same(g, h, t) for g, h, t in zip(mine[1], theirs[1], tols, strict=False))
                counts["equal to Horovod" if exact else "differs from Horovod"] += 1
                if exact and not all(same(g, h, 0.0) for g, h in zip(mine[1], theirs[1], strict=False)):
                    counts["equal to Horovod within the tolerance, not bit for bit"] += 1
                if not exact:
                    problems.append(f"seed {seed} call {index} rank {r}: differs from Horovod")
    return {"counts": dict(counts), "problems": problems[:50]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--providers", default="shm,tcp")
    ap.add_argument("--seeds", default="1-20")
    ap.add_argument("--calls", type=int, default=500, help="calls per seed")
    ap.add_argument("--out", help="where the recordings go (default: a temporary directory)")
    ap.add_argument("--recorded", help="a directory holding Horovod's recordings for these ranks, seeds and calls")
    ap.add_argument("--no-horovod", action="store_true", help="judge against the numpy model alone")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--graph", type=float, default=0.0,
                    help="the share of calls made inside a tf.function of their own (0: every call eager)")
    args = ap.parse_args(argv)
    seeds = seeds_of(args.seeds)
    out = Path(args.out or tempfile.mkdtemp(prefix="rdmatensor-diff-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"differential run: {args.ranks} ranks, seeds {args.seeds}, {args.calls} calls each, in {out}", flush=True)
    horovod = None
    if not args.no_horovod:
        source = Path(args.recorded) if args.recorded else out
        horovod = load(source, "horovod", args.ranks)
        if horovod is None:
            launch("horovod", args.ranks, "gloo", source, args.seeds, args.calls, args.timeout, args.graph)
            horovod = load(source, "horovod", args.ranks)
        print(f"  Horovod against the model: {judge_horovod(args.ranks, seeds, args.calls, horovod, args.graph)}",
              flush=True)
    report, failed = {}, False
    for provider in [p for p in args.providers.split(",") if p]:      # none: Horovod's recordings alone
        sub = out / provider
        sub.mkdir(exist_ok=True)
        for seed in seeds:    # a job per seed: a job's plan keeps every tensor set it ever called (see docs)
            launch("rdmatensor", args.ranks, provider, sub, str(seed), args.calls, args.timeout, args.graph)
        result = judge(args.ranks, seeds, args.calls, load(sub, "rdmatensor", args.ranks), horovod, args.graph)
        report[provider] = result
        counts = result["counts"]
        print(f"  {provider}: {json.dumps(counts, sort_keys=True)}", flush=True)
        for p in result["problems"][:10]:
            print(f"    {p}", flush=True)
        failed |= bool(counts.get("wrong values") or counts.get("changed but returned")
                       or counts.get("agreeing call raised") or counts.get("differs from Horovod")
                       or counts.get("error class differs"))
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "seeds": args.seeds, "calls": args.calls,
                                               "graph": args.graph, "providers": report}, indent=1))
    return 1 if failed else 0


def judge_horovod(ranks: int, seeds: list[int], calls: int, horovod: dict, graph: float = 0.0) -> dict:
    """Horovod's own outcomes against the model: the model's check."""
    result = judge(ranks, seeds, calls, horovod, None, graph)
    counts = result["counts"]
    skipped = sum(1 for r in horovod for o in horovod[r].values() if o[0] == "skipped")
    return {"agreeing calls": counts.get("agreeing calls", 0), "values equal to the model":
            counts.get("values checked", 0), "differ": counts.get("wrong values", 0),
            "raised on agreeing": counts.get("agreeing call raised", 0), "skipped (per rank)": skipped,
            "first problems": [p for p in result["problems"] if "skipped" not in p][:3]}


if __name__ == "__main__":
    sys.exit(main())
