"""rdmatensor-train: launch a training job on this machine and report it.

    rdmatensor-train --mode ps|allreduce --workers N [--ps M] --provider P \\
                     --model mlp|cnn|embed --steps K [--json FILE] [--seed S]

One process per rank (TF_CONFIG set per rank, as TensorFlow expects; a
random token shared through RDMATENSOR_TOKEN), or threads of one process
with --threads. Prints steps/s, bytes moved per step, copies per step, time
in communication and the final loss; --json writes them with every rank's
result.

--provider takes auto, verbs, shm, tcp, grpc (rdmatensor's gRPC baseline) or
tf-grpc (TensorFlow's own MultiWorkerMirroredStrategy, tf_baseline.py), or a
comma-separated list of them: the jobs run one after the other and a table
compares their steps/s (as ratios to tf-grpc or grpc when in the list).

--softroce-vm re-runs the command inside `rdmatensor softroce vm` (all ranks
in one VM, real SoftRoCE); that happens by itself when verbs is asked for and
this host has no ACTIVE RDMA port.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rdmatensor.providers import REGISTRY

from .cluster import Cluster

PROVIDERS = ("auto", *REGISTRY, "tf-grpc")
IN_VM = "TF_PLUGIN_IN_VM"     # set on the command re-run inside the VM: never re-run twice


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rdmatensor-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ps", "allreduce"), default="allreduce")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=1, help="parameter servers (ps mode)")
    p.add_argument("--provider", default="auto",
                   help=f"one of {', '.join(PROVIDERS)}, or several separated by commas")
    p.add_argument("--model", choices=("mlp", "cnn", "embed"), default="mlp")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=64, help="global batch size (split over the workers)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--no-fusion", action="store_true", help="allreduce: one ring per gradient")
    p.add_argument("--threads", action="store_true",
                   help="ranks as threads of this process (one TensorFlow import; tf-grpc excepted)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    p.add_argument("--softroce-vm", action="store_true", help="run inside a SoftRoCE VM")
    p.add_argument("--vm-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    args.providers = [x.strip() for x in args.provider.split(",") if x.strip()]
    bad = [x for x in args.providers if x not in PROVIDERS]
    if bad or not args.providers:
        p.error(f"unknown provider(s) {bad}: choose from {', '.join(PROVIDERS)}")
    if args.workers < 1 or (args.mode == "ps" and args.ps < 1):
        p.error("need at least one worker (and one ps in ps mode)")
    if args.batch % args.workers:
        p.error(f"--batch {args.batch} must split evenly over {args.workers} workers")
    return args


# ------------------------------------------------------------------ the VM
def _needs_vm(args) -> bool:
    if os.environ.get(IN_VM):
        return False
    if args.softroce_vm:
        return True
    if "verbs" in args.providers:
        from rdmatensor.devices import active_port
        if not active_port():
            print("rdmatensor-train: no ACTIVE RDMA port here: running inside a SoftRoCE VM",
                  file=sys.stderr)
            return True
    return False


def _run_in_vm(argv: list[str], args) -> int:
    inner = [a for a in argv if a != "--softroce-vm"]
    cmd = [sys.executable, "-m", "rdmatensor", "softroce", "vm", "--timeout", str(args.vm_timeout)]
    if args.json:
        out = Path(args.json).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--share", str(out.parent)]
        inner = _replace_json(inner, str(out))
    cmd += ["--", "env", f"{IN_VM}=1", sys.executable, "-m", "tf_plugin.launch", *inner]
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode


def _replace_json(argv: list[str], path: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--json":
            skip = True
            continue
        if a.startswith("--json="):
            continue
        out.append(a)
    return out + ["--json", path]


# ------------------------------------------------------------------ processes
def run_processes(config: dict, workers: int, ps: int, timeout: float) -> list[dict]:
    """One process per rank, TF_CONFIG each; their results in rank order."""
    cluster = Cluster.local(workers, ps)
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="tf_plugin-") as tmp:
        procs = []
        for task in cluster.tasks():
            env = dict(os.environ, TF_CONFIG=task.to_tf_config(), RDMATENSOR_TOKEN=token)
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            out, log = Path(tmp, f"rank{task.rank}.json"), Path(tmp, f"rank{task.rank}.log")
            with open(log, "wb") as logf:
                procs.append((task, out, log, subprocess.Popen(
                    [sys.executable, "-m", "tf_plugin.runner", "--config", json.dumps(config),
                     "--out", str(out)], env=env, stdout=logf, stderr=subprocess.STDOUT)))
        deadline = time.monotonic() + timeout
        failed = None
        while failed is None and any(p.poll() is None for *_, p in procs):
            failed = next(((t, p.returncode, log) for t, _, log, p in procs
                           if p.returncode not in (None, 0)), None)
            if failed is None and time.monotonic() > deadline:
                failed = (procs[0][0], f"no result within {timeout:.0f} s", procs[0][2])
            time.sleep(0.05)
        failed = failed or next(((t, p.returncode, log) for t, _, log, p in procs if p.returncode), None)
        for *_, p in procs:                   # the others would wait for the failed one forever
            if p.poll() is None:
                p.kill()
                p.wait()
        if failed:
            task, rc, log = failed
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"rank {task.rank} ({task.task_type} {task.task_index}) "
                               f"exited with {rc}:\n{tail}")
        return [json.loads(out.read_text()) for _, out, _, _ in procs]


def run_job(args, provider: str) -> dict:
    from . import runner
    threads = args.threads and provider != "tf-grpc"
    config = dict(mode=args.mode, model=args.model, provider=provider, steps=args.steps, seed=args.seed,
                  batch=args.batch, lr=args.lr, in_graph=not threads, fusion=not args.no_fusion)
    ps = args.ps if args.mode == "ps" else 0
    t0 = time.monotonic()
    if threads:
        results = runner.run_threads(config, args.workers, ps, join_timeout=args.timeout)
    else:
        results = run_processes(config, args.workers, ps, args.timeout)
    summary = runner.summarize(results)
    summary["wall_seconds"] = time.monotonic() - t0
    return {"config": config, "summary": summary, "ranks": results}


# ------------------------------------------------------------------ report
def _fmt(v, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def report(s: dict, out=sys.stdout) -> None:
    roles = f"{s['workers']} worker(s)" + (f" + {s['ps']} ps" if s["ps"] else "")
    print(f"{s['mode']} / {s['model']} / {roles} / provider {s['provider']} / {s['steps']} steps", file=out)
    print(f"  steps/s             {s['steps_per_s']:.1f}", file=out)
    print(f"  bytes moved/step    {_fmt(s['bytes_per_step'], '.0f')}"
          f"  ({_fmt(s['writes_per_step'], '.0f')} writes)", file=out)
    print(f"  copies/step         {_fmt(s['copies_per_step'], '.1f')}; "
          f"zero-copy receives into TF {_fmt(s['zero_copy_ingest_per_step'], '.0f')}", file=out)
    frac = "" if s["comm_fraction"] is None else f" ({100 * s['comm_fraction']:.0f}% of a step)"
    print(f"  communication       {_fmt(s['comm_ms_per_step'], '.2f')} ms/step per worker{frac}", file=out)
    if s["dynamic"]:
        print(f"  dynamic tensors     {s['dynamic']} sends, {s['fallbacks']} fallbacks, "
              f"{s['grows']} grows", file=out)
    print(f"  final loss          {_fmt(s['final_loss'], '.6f')}", file=out, flush=True)


def compare(summaries: list[dict], out=sys.stdout) -> dict:
    by = {s["provider_asked"]: s for s in summaries}
    base = next((b for b in ("tf-grpc", "grpc") if b in by), None)
    print(f"\n{'provider':10} {'steps/s':>9} {'ratio':>8} {'MB/step':>9} {'copies/step':>12} "
          f"{'comm ms/step':>13}  final loss", file=out)
    ratios = {}
    for name, s in by.items():
        ratio = s["steps_per_s"] / by[base]["steps_per_s"] if base else None
        ratios[name] = ratio
        mb = None if s.get("bytes_per_step") is None else s["bytes_per_step"] / 1e6
        print(f"{name:10} {s['steps_per_s']:9.1f} {_fmt(ratio, '.2f') + 'x':>8} {_fmt(mb, '.3f'):>9} "
              f"{_fmt(s.get('copies_per_step'), '.1f'):>12} {_fmt(s.get('comm_ms_per_step'), '.2f'):>13}  "
              f"{_fmt(s['final_loss'], '.6f')}", file=out)
    if base:
        print(f"(ratio: steps/s over {base}'s; comm: time per worker in communication)", file=out, flush=True)
    return {"baseline": base, "ratios": ratios}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if _needs_vm(args):
        return _run_in_vm(argv, args)
    jobs = []
    for provider in args.providers:
        job = run_job(args, provider)
        job["summary"]["provider_asked"] = provider
        report(job["summary"])
        jobs.append(job)
    doc = {"jobs": jobs}
    if len(jobs) > 1:
        doc["comparison"] = compare([j["summary"] for j in jobs])
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
