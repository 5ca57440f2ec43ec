"""rdmatensor-train: run a training job on this machine and report it.

    rdmatensor-train --mode ps|allreduce --workers N [--ps M] --provider P[,P...] \\
                     --model M [--image-size S] --steps K [--batch B] [--json FILE] [--seed S] \\
                     [--timeline FILE] [--rounds N] [--paired]

One process per rank, started by rdmatensor-run's launcher (TF_CONFIG and a
shared random token per rank; a failing rank is named and stops the job),
or threads of one process with --threads. Prints steps/s, the median step
time, bytes moved, copies and time in communication per step, and the final
loss; --json writes them with every rank's result. The all-reduce's overlap
with backprop is the share of the communication thread's ring time spent
before the step's last bucket was handed over; --timeline FILE writes each
rank's per-bucket time line as Chrome trace JSON (Perfetto), FILE's `{rank}`
and `{provider}` replaced (added before the suffix when absent).

--model: mlp, cnn, embed (tiny), resnet50, vgg16, densenet121, mobilenetv2
(keras.applications, weights=None, --image-size square inputs) or lm (a small
Transformer language model with a sparse embedding gradient). --batch is the
global batch, split evenly over the workers.

--provider takes auto, verbs, shm, tcp, grpc (rdmatensor's gRPC baseline),
hvd and hvd-python (rdmatensor's Horovod API, Horovod's tape example with
the import changed: as it runs by default, the native ops over shm on one host,
and on the Python path; hvd_runner.py), tf-grpc (TensorFlow's own
MultiWorkerMirroredStrategy, tf_baseline.py),
horovod (real Horovod, gloo, started by its horovodrun: horovod_baseline.py;
`make horovod-reference` builds it), none (the same ranks training with no
communication: the compute floor) or sync (that floor plus one meeting of the
workers per step: the floor of any synchronous all-reduce), or a
comma-separated list of them: the jobs run one after the other and a table
compares them: the scaling efficiency (the floor's median step time over each
one's, when none is in the list; the same against sync when it is) and
steps/s as a ratio to TensorFlow's own (when tf-grpc is in the list) and to
Horovod's (when horovod is). --rounds N runs the list N times, interleaved,
and shows each figure as the median over rounds (lowest-highest), each ratio
taken within its round.

--paired times the floor and the sync floor inside each provider's own job:
its timed steps run none, sync and the provider in turn, each cycle of three
in its own order, so all three see the same state of the host (whose cores
drift in speed over seconds), and reports the provider's share of each floor
as the median over cycles; with --provider hvd, the Python path's step is
timed in the same turns, and its share of the floors and its step over the
native one are reported too. Its losses are not a training run's: floor steps
apply each rank's own gradients.

--softroce-vm re-runs the command inside `rdmatensor softroce vm` (all ranks
in one VM, real SoftRoCE); that happens by itself when verbs is asked for and
this host has no ACTIVE RDMA port.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rdmatensor.runner.cores import BINDINGS
from ..errors import JobError
from .job import BACKENDS, JobConfig, RankResult, Summary, combine, compare, summarize
from .models import APPLICATIONS, MODELS

IN_VM = "TF_PLUGIN_IN_VM"     # set on the command re-run inside the VM: never re-run twice


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rdmatensor-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    p.add_argument("--mode", choices=("ps", "allreduce"), default="allreduce")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=1, help="parameter servers (ps mode)")
    p.add_argument("--provider", default="auto",
                   help=f"one of {', '.join(BACKENDS)}, or several separated by commas")
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--image-size", type=int, default=32, help="keras.applications models: input height and width")
    p.add_argument("--steps", type=int, default=50, help="steps per job; the first traces and is not timed")
    p.add_argument("--batch", type=int, default=64, help="global batch size (split over the workers)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the provider list this many times, interleaved; ratios as median (range)")
    p.add_argument("--paired", action="store_true",
                   help="time none and sync inside each provider's job, step by step in turn")
    p.add_argument("--no-fusion", action="store_true", help="allreduce: one ring per gradient")
    p.add_argument("--timeline", metavar="FILE",
                   help="per-rank Chrome trace of the all-reduce's buckets (RDMATENSOR_TIMELINE)")
    p.add_argument("--threads", action="store_true",
                   help="ranks as threads of this process (one TensorFlow import; tf-grpc excepted)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each job")
    p.add_argument("--bind-to", choices=BINDINGS, default="core",
                   help="rdmatensor-run's --bind-to for every backend's ranks, horovodrun's included")
    p.add_argument("--softroce-vm", action="store_true", help="run inside a SoftRoCE VM")
    p.add_argument("--vm-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    args.providers = [x.strip() for x in args.provider.split(",") if x.strip()]
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: need at least 1")
    if args.rounds > 1 and len(set(args.providers)) != len(args.providers):
        p.error(f"--rounds with --provider {args.provider}: name each provider once, the rounds repeat them")
    if not args.providers:
        p.error(f"--provider: choose from {', '.join(BACKENDS)}")
    try:
        args.configs = [config_of(args, provider) for provider in args.providers]
    except JobError as exc:
        p.error(str(exc))
    return args


def config_of(args, provider: str) -> JobConfig:
    threads = args.threads and provider in BACKENDS and BACKENDS[provider].threads
    if provider == "horovod":
        from .horovod_baseline import horovodrun
        horovodrun()                       # built, or a JobError saying how
    return JobConfig(mode=args.mode, model=args.model, provider=provider, workers=args.workers,
                     ps=args.ps if args.mode == "ps" else 0, steps=args.steps, seed=args.seed, batch=args.batch,
                     lr=args.lr, in_graph=not threads, fusion=not args.no_fusion, image_size=args.image_size,
                     bind_to=args.bind_to, paired=args.paired)


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
    cmd += ["--", "env", f"{IN_VM}=1", sys.executable, "-m", "tf_plugin.training.cli", *inner]
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
def run_processes(config: JobConfig, timeout: float) -> list[RankResult]:
    """One process per rank, started by rdmatensor-run's launcher; results in rank order.
    The ranks' output (each line prefixed with its rank) goes to a log, shown when the job fails."""
    from rdmatensor.runner.processes import launch
    with tempfile.TemporaryDirectory(prefix="tf_plugin-") as tmp:
        command = [sys.executable, "-m", "tf_plugin.training.runner", "--config", json.dumps(config.to_dict()),
                   "--out", tmp]
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        log = Path(tmp, "ranks.log")
        with open(log, "wb") as f:
            if config.backend.kind == "horovod":
                status = _horovodrun(config, tmp, timeout, f)
            else:
                status = launch(command, config.workers, ps=config.ps, timeout=timeout, stdout=f, stderr=f,
                                bind_to=config.bind_to)
        if status:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"the {config.provider} job failed (exit status {status}):\n{tail}")
        return [RankResult.from_dict(json.loads(Path(tmp, f"rank{r}.json").read_text()))
                for r in range(config.workers + config.ps)]


def _horovodrun(config: JobConfig, out: str, timeout: float, log) -> int:
    """Real Horovod's ranks, started by its own horovodrun, with the threads per rank
    rdmatensor-run gives (cores // ranks) and the project importable."""
    from rdmatensor.runner.cores import BIND_TO, INTRA_OP, usable_cores
    from .horovod_baseline import ROOT, command
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env[BIND_TO] = config.bind_to           # bound by HOROVOD_LOCAL_RANK when tf_plugin is imported
    env.setdefault(INTRA_OP, str(max(1, usable_cores() // config.workers)))
    try:
        return subprocess.run(command(json.dumps(config.to_dict()), out, config.workers), env=env, cwd=ROOT,
                              stdout=log, stderr=log, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def run_job(args, config: JobConfig) -> tuple[Summary, list[RankResult]]:
    from . import runner
    t0 = time.monotonic()
    if args.threads and config.backend.threads:
        results = runner.run_threads(config, join_timeout=args.timeout)
    else:
        results = run_processes(config, args.timeout)
    summary = summarize(config, results)
    summary.wall_seconds = time.monotonic() - t0
    return summary, results


# ------------------------------------------------------------------ report
def _fmt(v, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def report(s: Summary, out=None) -> None:
    out = out or sys.stdout
    c = s.config
    roles = f"{s.workers} worker(s)" + (f" + {s.ps} ps" if s.ps else "")
    size = f" {c.image_size}x{c.image_size}" if c.model in APPLICATIONS else ""
    print(f"{c.mode} / {c.model}{size} / {roles} / provider {c.provider} / {c.steps} steps, "
          f"global batch {c.batch}", file=out)
    print(f"  steps/s             {s.steps_per_s:.2f}  (median step {s.median_step_ms:.1f} ms)", file=out)
    print(f"  bytes moved/step    {_fmt(s.bytes_per_step, '.0f')}"
          f"  ({_fmt(s.writes_per_step, '.0f')} writes)", file=out)
    purposes = ", ".join(f"{k} {v:.1f}" for k, v in sorted((s.copies_by_purpose or {}).items()))
    copied = "" if not s.bytes_copied_per_step else f", {s.bytes_copied_per_step / 1e6:.2f} MB copied into staging"
    print(f"  copies/step         {_fmt(s.copies_per_step, '.1f')}{f' ({purposes}{copied})' if purposes else ''}; "
          f"zero-copy receives into TF {_fmt(s.zero_copy_ingest_per_step, '.0f')}", file=out)
    frac = "" if s.comm_fraction is None else f" ({100 * s.comm_fraction:.0f}% of a step)"
    print(f"  communication       {_fmt(s.comm_ms_per_step, '.2f')} ms/step per worker{frac}", file=out)
    if s.overlap is not None:
        cpu = "" if s.ring_cpu_ms_per_step is None else \
            f"; the rings used {_fmt(s.ring_cpu_ms_per_step)} ms of CPU per step per worker"
        print(f"  overlap             {100 * s.overlap:.0f}% of the all-reduce's time ran while backprop still "
              f"ran{cpu}", file=out)
    if s.paired is not None:
        p = s.paired
        print(f"  paired              {p['cycles']} cycles of floor, sync floor, {c.provider} in turn: "
              f"{p['none_ms']:.1f} / {p['sync_ms']:.1f} / {p['provider_ms']:.1f} ms; "
              f"{c.provider} at {100 * p['of_floor']:.0f}% of the floor, {100 * p['of_sync']:.0f}% of the sync "
              f"floor (the sync floor at {100 * p['sync_of_floor']:.0f}% of the floor)", file=out)
        for kind in sorted(k[3:] for k in p if k.startswith("of_") and k[3:] not in ("floor", "sync")):
            print(f"  paired, {kind:10s}  {p[kind + '_ms']:.1f} ms: at {100 * p[kind + '_of_floor']:.0f}% of the "
                  f"floor, {100 * p[kind + '_of_sync']:.0f}% of the sync floor; its step {p['of_' + kind]:.2f}x "
                  f"{c.provider}'s", file=out)
    if s.dynamic:
        print(f"  dynamic tensors     {s.dynamic} sends, {s.fallbacks} fallbacks, {s.grows} grows", file=out)
    print(f"  final loss          {_fmt(s.final_loss, '.6f')}", file=out, flush=True)


def comparison(summaries: list[Summary], rounds: int = 1, out=None) -> dict:
    """The side-by-side table; returns it for --json. With several rounds (the
    summaries in round order, each round the same providers), each ratio is
    taken within its round and shown as the median over rounds (lowest-highest)."""
    out = out or sys.stdout
    per = len(summaries) // rounds
    compared = [compare(summaries[k * per:(k + 1) * per]) for k in range(rounds)]
    baseline = compared[0][0]
    table = combine([rows for _, rows in compared])
    vs = f"vs {baseline}" if baseline else "ratio"
    sync = any(c.of_sync.median is not None for c in table)
    horovod = any(c.vs_horovod.median is not None for c in table)
    last = {r.provider: r.summary for r in compared[-1][1]}

    def cell(spread, fmt, width):
        text = fmt(spread.median)
        if rounds > 1 and spread.median is not None:
            text += f" ({fmt(spread.low)}-{fmt(spread.high)})"
        return f"{text:>{width}}"

    pct, times = _pct, (lambda v: "n/a" if v is None else f"{v:.2f}x")
    width = 10 if rounds == 1 else 18
    print(f"\n{'provider':10} {'steps/s':>{width}} {'median ms':>10} {'efficiency':>{width}} "
          + (f"{'of sync':>{width}} " if sync else "") + f"{vs:>{width}} "
          + (f"{'vs horovod':>{width}} " if horovod else "")
          + f"{'MB/step':>9} {'copies/step':>11} {'comm ms':>8} {'overlap':>7}  final loss", file=out)
    for c in table:
        s = last[c.provider]
        mb = None if s.bytes_per_step is None else s.bytes_per_step / 1e6
        print(f"{c.provider:10} {cell(c.steps_per_s, lambda v: f'{v:.2f}', width)} "
              f"{c.median_step_ms.median:10.1f} {cell(c.efficiency, pct, width)} "
              + (f"{cell(c.of_sync, pct, width)} " if sync else "") + f"{cell(c.ratio, times, width)} "
              + (f"{cell(c.vs_horovod, times, width)} " if horovod else "")
              + f"{_fmt(mb, '.2f'):>9} {_fmt(s.copies_per_step, '.1f'):>11} "
              f"{_fmt(s.comm_ms_per_step, '.1f'):>8} {_pct(s.overlap):>7}  {_fmt(s.final_loss, '.6f')}", file=out)
    print((f"({rounds} rounds, interleaved: each figure is the median over rounds (lowest-highest), each ratio "
           "taken within its round; MB, copies, comm, overlap and loss from the last round) " if rounds > 1 else "")
          + "(efficiency: the no-communication floor's median step time over this one's, when none ran; "
          + ("of sync: the sync floor's (one meeting per step, nothing moved) over this one's; " if sync else "")
          + f"{vs}: steps/s over {BASELINES.get(baseline, 'a baseline (tf-grpc or grpc) in the same run')}; "
          + ("vs horovod: steps/s over real Horovod's (gloo); " if horovod else "")
          + "comm: ms per step per worker; overlap: share of the rings' time while backprop still ran)",
          file=out, flush=True)
    doc = {"baseline": baseline, "rounds": rounds}
    for key in ("ratio", "vs_horovod", "efficiency", "of_sync"):
        name = "ratios" if key == "ratio" else key
        doc[name] = {c.provider: getattr(c, key).median for c in table}
        if rounds > 1:
            doc[name + "_range"] = {c.provider: [getattr(c, key).low, getattr(c, key).high] for c in table}
    if not horovod:
        doc["vs_horovod"] = None
    return doc


BASELINES = {"tf-grpc": "TensorFlow's own MultiWorkerMirroredStrategy", "grpc": "rdmatensor's gRPC baseline"}


def timeline_path(path: str, provider: str) -> str:
    """The RDMATENSOR_TIMELINE value for one job: every rank writes its own file."""
    stem, suffix = os.path.splitext(path)
    for key in ("{provider}", "{rank}"):
        if key not in path:
            stem += "-" + key
    return (stem + suffix).replace("{provider}", provider)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if _needs_vm(args):
        return _run_in_vm(argv, args)
    jobs, summaries = [], []
    for k in range(args.rounds):
        for config in args.configs:
            if args.rounds > 1:
                print(f"[round {k + 1}/{args.rounds}] {config.provider}", file=sys.stderr, flush=True)
            if args.timeline:
                os.environ["RDMATENSOR_TIMELINE"] = timeline_path(args.timeline, config.provider)
            summary, results = run_job(args, config)
            report(summary)
            summaries.append(summary)
            jobs.append({"config": config.to_dict(), "round": k, "summary": summary.to_dict(),
                         "ranks": [r.to_dict() for r in results]})
    doc = {"command": "rdmatensor-train " + shlex.join(argv), "rounds": args.rounds, "jobs": jobs}
    if len(jobs) > 1:
        doc["comparison"] = comparison(summaries, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
