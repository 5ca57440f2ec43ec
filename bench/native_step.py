"""The toy step of the native all-reduce: what a tensor and a step cost.

    python -m bench.native_step                      # make bench-native
    python -m bench.native_step --sizes 10,50 --rounds 3 --paths native,twin

Two ranks on this host, each a process: a tf.function step whose N variables of
256 float32 each are "gradients" (v * 0.5) all-reduced (average) and assigned
back, four ways:

- `none`: the same step without the all-reduce (TensorFlow's own cost);
- `native`: tf_plugin.native's ops, every launch then one completion for all
  (allreduce_many), the C executor over shared memory (no GIL, no Python in the step);
- `native-each`: the same with one completion op per tensor (together=False);
- `twin`: the same protocol through its Python twin, one tf.numpy_function per tensor;
- `hvd`: today's path inside tf.function, as DistributedGradientTape runs it:
  `hvd.grouped_allreduce` of the N tensors (fused into buckets, a launch and a wait
  numpy_function per bucket, the ring on the plugin's communication thread, over shm);
- `hvd-each` (not run by default: slow): `hvd.allreduce` per tensor, N collectives;
- `hvd-native`: `hvd`'s step traced with RDMATENSOR_TF_OPS=native: the same
  buckets, each one fused launch op and one completion op of the native ops
  (tf_plugin/graph/native_allreduce.py);
- `tape-none`, `tape`, `tape-native` (not run by default): a training step
  proper, loss = sum(v * v) over the N variables, its gradients by a plain
  tf.GradientTape, by hvd.DistributedGradientTape on today's path, and by
  hvd.DistributedGradientTape on the native ops; then v -= 0.01 * gradient;
- `tape-sync` (not run by default): the sync floor of the tape step: the plain
  tape, and once every gradient exists, one native all-reduce of one float (the
  ranks meet once), before any update. What an all-reduce costs above it is
  what moving and reducing the gradients costs; below it, waiting for the slower
  rank and the step's one join, which every synchronous all-reduce pays;
- `tape-xla-none`, `tape-xla` (not run by default): `tape-none` and
  `tape-native` compiled by XLA (tf.function(jit_compile=True)): the
  all-reduce is one custom call per bucket, which copies the members in and
  out of XLA's buffers and waits on XLA's thread.

The `hvd*` and `tape*` steps are traced with RDMATENSOR_TF_OPS set for their path
(`python` for today's), so one run pairs them.

Rounds are interleaved (every N and path in each round, the order of N rotating),
each measurement --steps steps after --warmup; ranks meet at a barrier before
each. Each step runs --first-warmup times before its first measurement:
TensorFlow's executor learns which of a graph's ops are cheap over its first
runs of it (every op starts at an estimate of 10^8 cycles, which each run brings a
tenth of the way to what it measured: about 90 runs to fall under its threshold of
8,000), and until then runs the ops that an op's completion makes ready, all but
one, as tasks of their own on its thread pool; a training job is past that
after its first hundred steps. Rank 0 prints per path and N the median microseconds per step over the
rounds with their range, and the least-squares fit of the medians: fixed
microseconds per step + microseconds per tensor. --json writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

PATHS = ("none", "native", "native-each", "twin", "hvd", "hvd-each", "hvd-native", "tape-none", "tape-sync",
         "tape", "tape-native", "tape-xla-none", "tape-xla")
DEFAULT_PATHS = ("none", "native", "native-each", "twin", "hvd")
ELEMENTS = 256


def fit(ns: list[int], us: list[float]) -> tuple[float, float]:
    """Least squares us = fixed + per_tensor * n."""
    import numpy as np
    a = np.stack([np.ones(len(ns)), np.asarray(ns, float)], axis=1)
    (fixed, per), *_ = np.linalg.lstsq(a, np.asarray(us, float), rcond=None)
    return float(fixed), float(per)


def rank_main(rank: int, sock_fd: int, sizes: list[int], paths: list[str], rounds: int, steps: int,
              warmup: int, first_warmup: int, elements: int = ELEMENTS) -> dict:
    from rdmatensor.runner.cores import bind_cores
    bind_cores()             # before TensorFlow's threads and the executor's exist: they inherit it
    import numpy as np
    import tensorflow as tf

    from tf_plugin.native import ops, segment
    sock = socket.socket(fileno=sock_fd)
    most = max(sizes)
    bucket_bytes = [elements * 4] * most + [64]              # the last bucket: the barrier's
    groups = {}
    for kind in ("native", "python"):
        fd = segment.create_segment(rank, 2, bucket_bytes)
        fds = segment.exchange(sock, rank, 2, fd)
        groups[kind] = ops.group(fds, rank, 2, bucket_bytes, kind=kind, name=f"bench-{kind}")
        for f in [fd, *fds]:
            os.close(f)
    barrier_group, barrier = groups["native"], np.zeros(1, np.float32)

    def meet():
        barrier_group.allreduce(most, barrier)

    hvd = None
    if {"hvd", "hvd-each", "hvd-native", "tape", "tape-native", "tape-xla"} & set(paths):
        import tf_plugin as hvd
        hvd.init()
    rng = np.random.default_rng(rank)
    variables = [tf.Variable(rng.standard_normal(elements).astype(np.float32)) for _ in range(most)]

    def make(path: str, n: int):
        vs = variables[:n]

        if path.startswith("tape"):
            @tf.function(jit_compile=path.startswith("tape-xla"))
            def tape_step():
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * v) for v in vs])
                if path not in ("tape-none", "tape-sync", "tape-xla-none"):
                    tape = hvd.DistributedGradientTape(tape)
                grads, met = tape.gradient(loss, vs), []
                if path == "tape-sync":        # no op per tensor: the updates wait for the meeting
                    with tf.control_dependencies(grads):
                        met = [ops.allreduce(tf.zeros(1), barrier_group, most)]
                with tf.control_dependencies(met):
                    for v, g in zip(vs, grads, strict=True):
                        v.assign_sub(0.01 * g)
            return traced(tape_step, path)

        @tf.function
        def step():
            grads = [v * 0.5 for v in vs]
            if path == "none":
                reduced = grads
            elif path in ("native", "native-each"):
                reduced = ops.allreduce_many(grads, groups["native"], range(n), "average",
                                             together=path == "native")
            elif path == "twin":
                reduced = ops.allreduce_many(grads, groups["python"], range(n), "average")
            elif path in ("hvd", "hvd-native"):
                reduced = hvd.grouped_allreduce(grads, op=hvd.Average, name=f"grouped{n}")
            else:
                reduced = [hvd.allreduce(g, op=hvd.Average, name=f"g{j}") for j, g in enumerate(grads)]
            for v, r in zip(vs, reduced, strict=True):
                v.assign(r * 2.0)
        return traced(step, path)

    def traced(fn, path: str):
        """fn traced now, with RDMATENSOR_TF_OPS chosen for its path (read when a graph is built)."""
        before = os.environ.get("RDMATENSOR_TF_OPS")
        if path.startswith(("hvd", "tape")):
            os.environ["RDMATENSOR_TF_OPS"] = "native" if path.endswith(("native", "xla")) else "python"
        try:
            fn.get_concrete_function()
        finally:
            if before is None:
                os.environ.pop("RDMATENSOR_TF_OPS", None)      # the native/twin paths set nothing
            else:
                os.environ["RDMATENSOR_TF_OPS"] = before
        return fn

    times = timed_rounds(make, meet, rank, sizes, paths, rounds, steps, warmup, first_warmup)
    meet()
    for g in groups.values():
        g.close()
    if hvd is not None:
        hvd.shutdown()
    return {f"{p}:{n}": t for (p, n), t in times.items()}


def timed_rounds(make, meet, rank: int, sizes: list[int], paths: list[str], rounds: int, steps: int,
                 warmup: int, first_warmup: int) -> dict:
    """µs per step of make(path, n)'s step, per (path, n), one figure per round:
    rounds interleaved (every N and path in each, the order of N rotating), the
    ranks meeting before the warm-up and before the timed steps."""
    times: dict = {(p, n): [] for p in paths for n in sizes}
    functions = {}
    for r in range(rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        for n in order:
            for p in paths:
                f = functions.get((p, n)) or functions.setdefault((p, n), make(p, n))
                meet()
                for _ in range(warmup if r else warmup + first_warmup):
                    f()
                meet()
                t0 = time.perf_counter()
                for _ in range(steps):
                    f()
                times[(p, n)].append((time.perf_counter() - t0) / steps * 1e6)
        if rank == 0:
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return times


def table(result: dict, sizes: list[int], paths: list[str]) -> tuple[str, dict]:
    """The markdown table and the figures: per path and N, median and range over the rounds (us per step)."""
    lines = ["| path | " + " | ".join(f"{n} tensors" for n in sizes) + " | fixed µs/step | µs/tensor |",
             "| --- | " + " | ".join("---:" for _ in sizes) + " | ---: | ---: |"]
    figures = {}
    for p in paths:
        meds = [statistics.median(result[f"{p}:{n}"]) for n in sizes]
        fixed, per = fit(sizes, meds)
        cells = [f"{m:.0f} ({min(result[f'{p}:{n}']):.0f}–{max(result[f'{p}:{n}']):.0f})"
                 for m, n in zip(meds, sizes, strict=True)]
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {fixed:.0f} | {per:.2f} |")
        figures[p] = {"median_us": dict(zip(map(str, sizes), [round(m, 1) for m in meds], strict=True)),
                      "rounds_us": {str(n): [round(t, 1) for t in result[f"{p}:{n}"]] for n in sizes},
                      "fixed_us": round(fixed, 1), "per_tensor_us": round(per, 3)}
    return "\n".join(lines), figures


def launch(args) -> int:
    """Start the two ranks (hvd.init's TF_CONFIG, shm), relay their segments, print rank 0's table."""
    from rdmatensor.runner.cluster import free_ports
    from tf_plugin.native import segment
    ports = free_ports(2)
    workers = [f"127.0.0.1:{p}" for p in ports]
    token = secrets.token_hex(16)
    procs, socks = [], []
    for r in range(2):
        mine, theirs = socket.socketpair()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", RDMATENSOR_TOKEN=token, RDMATENSOR_PROVIDER="shm",
                   TF_NUM_INTRAOP_THREADS="1", RDMATENSOR_BIND_TO=args.bind, RDMATENSOR_HOST_SLOT=f"{r}/2",
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}}))
        cmd = [sys.executable, "-m", f"{__package__}.native_step", "--rank", str(r), "--sock", str(theirs.fileno()),
               "--sizes", args.sizes, "--paths", args.paths, "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--first-warmup", str(args.first_warmup),
               "--elements", str(args.elements)]
        procs.append(subprocess.Popen(cmd, env=env, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True))
        theirs.close()
        socks.append(mine)
    for _ in range(2):                      # a native and a twin group, a segment each per rank
        segment.relay(socks)
    outs = [p.communicate()[0] for p in procs]
    for s in socks:
        s.close()
    if any(p.returncode for p in procs):
        print(f"a rank failed: exit codes {[p.returncode for p in procs]}", file=sys.stderr)
        return 1
    report(args, json.loads(outs[0].strip().splitlines()[-1]), "2 ranks")
    return 0


def report(args, result: dict, who: str, **recorded) -> None:
    """Rank 0's times as the table, and as JSON in --json with `recorded` beside them."""
    text, figures = table(result, [int(n) for n in args.sizes.split(",")], args.paths.split(","))
    bound = "each bound to its own core" if args.bind == "core" else "not bound"
    print(f"{who} ({bound}), {args.elements} float32 per tensor, {args.rounds} rounds of {args.steps} steps "
          f"(after {args.warmup}; {args.first_warmup} before a step's first); rank 0's µs per step: median "
          "(range over the rounds)\n")
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": 2, "elements": args.elements, "rounds": args.rounds, "steps": args.steps,
                       "warmup": args.warmup, "first_warmup": args.first_warmup, "bind": args.bind, **recorded,
                       "paths": figures}, f, indent=1)
            f.write("\n")


def parser(prog: str, doc: str, paths, default_paths) -> argparse.ArgumentParser:
    """The options this bench and bench.horovod_step share."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--sizes", default="10,50,200,400", help="tensors per step, comma-separated")
    p.add_argument("--paths", default=",".join(default_paths), help=f"some of {','.join(paths)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="steps timed together")
    p.add_argument("--warmup", type=int, default=3, help="steps before each measurement")
    p.add_argument("--first-warmup", type=int, default=200,
                   help="steps before a step's first measurement (TensorFlow's executor learns its ops' costs)")
    p.add_argument("--elements", type=int, default=ELEMENTS, help="float32 per tensor")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--bind", choices=("core", "none"), default="core",
                   help="core (the default, as rdmatensor-run's --bind-to): each rank on a core of its own; "
                        "none: both left to the scheduler")
    return p


def parsed(p: argparse.ArgumentParser, argv, known) -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the paths asked for, every one of `known` (else p.error)."""
    args = p.parse_args(argv)
    paths = args.paths.split(",")
    if not set(paths) <= set(known) or args.rounds < 3 or args.elements < 1:
        p.error(f"--paths: some of {','.join(known)}; --rounds: 3 or more; --elements: 1 or more")
    return args, paths


def main(argv=None) -> int:
    p = parser("python -m bench.native_step", __doc__, PATHS, DEFAULT_PATHS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sock", type=int, help=argparse.SUPPRESS)
    args, paths = parsed(p, argv, PATHS)
    if args.rank is None:
        return launch(args)
    sizes = [int(n) for n in args.sizes.split(",")]
    result = rank_main(args.rank, args.sock, sizes, paths, args.rounds, args.steps, args.warmup,
                       args.first_warmup, args.elements)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
