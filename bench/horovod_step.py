"""bench/native_step.py's tape step under real Horovod, to read beside it.

    python -m bench.horovod_step                           # after make horovod-reference
    python -m bench.horovod_step --cycle-time 0 --json hvd0.json
    make bench-native-vs-horovod                           # both benches in turn, paired

Two ranks of real Horovod 0.28.1 (TensorFlow ops, gloo, CPU: .venv-horovod,
built by `make horovod-reference`) started by its own `horovodrun --gloo`, with
native_step's settings (TF_NUM_INTRAOP_THREADS=1, --bind, the same variables,
interleaved rounds, steps and warm-up, native_step.timed_rounds), three paths:

- `tape-none`: the plain tape's step, as native_step's;
- `tape-sync`: its sync floor: once every gradient exists, one `hvd.allreduce`
  of one float (the ranks meet once, on Horovod's own op) before any update;
- `tape-hvd`: `horovod.tensorflow.DistributedGradientTape` (average), Horovod's
  fusion and background thread as a user gets them.

--cycle-time sets HOROVOD_CYCLE_TIME (milliseconds; unset: Horovod's default).
Rank 0 prints native_step's table; --json writes its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import native_step

PATHS = ("tape-none", "tape-sync", "tape-hvd")
ROOT = Path(__file__).resolve().parents[1]


def rank_main(sizes: list[int], paths: list[str], rounds: int, steps: int, warmup: int,
              first_warmup: int, elements: int = native_step.ELEMENTS) -> dict:
    from rdmatensor.runner.cores import bind_cores
    bind_cores()             # by HOROVOD_LOCAL_RANK, before Horovod's and TensorFlow's threads exist
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    rank, most = hvd.rank(), max(sizes)
    rng = np.random.default_rng(rank)
    variables = [tf.Variable(rng.standard_normal(elements).astype(np.float32)) for _ in range(most)]
    one = tf.zeros(1)

    def meet():
        hvd.allreduce(one, op=hvd.Sum, name="meet").numpy()

    def make(path: str, n: int):
        vs = variables[:n]

        @tf.function
        def tape_step():
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * v) for v in vs])
            if path == "tape-hvd":
                tape = hvd.DistributedGradientTape(tape)
            grads, met = tape.gradient(loss, vs), []
            if path == "tape-sync":            # no op per tensor: the updates wait for the meeting
                with tf.control_dependencies(grads):
                    met = [hvd.allreduce(tf.zeros(1), op=hvd.Sum, name=f"sync{n}")]
            with tf.control_dependencies(met):
                for v, g in zip(vs, grads, strict=True):
                    v.assign_sub(0.01 * g)
        tape_step.get_concrete_function()
        return tape_step

    times = native_step.timed_rounds(make, meet, rank, sizes, paths, rounds, steps, warmup, first_warmup)
    meet()
    return {f"{p}:{n}": t for (p, n), t in times.items()}


def launch(args) -> int:
    """horovodrun starting this module on 2 ranks; rank 0's table."""
    venv = Path(os.environ.get("RDMATENSOR_HOROVOD_VENV") or ROOT / ".venv-horovod")
    horovodrun = venv / "bin" / "horovodrun"
    if not horovodrun.exists():
        print(f"real Horovod is not built: {horovodrun} is missing (make horovod-reference builds it; "
              f"RDMATENSOR_HOROVOD_VENV names another virtualenv)", file=sys.stderr)
        return 2
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS="1", RDMATENSOR_BIND_TO=args.bind,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if args.cycle_time is not None:
        env["HOROVOD_CYCLE_TIME"] = str(args.cycle_time)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo", str(venv / "bin" / "python"), "-m",
               f"{__package__}.horovod_step", "--sizes", args.sizes, "--paths", args.paths, "--rounds",
               str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--first-warmup", str(args.first_warmup), "--elements", str(args.elements), "--out", str(out)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not out.exists():
            print(proc.stdout[-3000:], file=sys.stderr)
            print(f"horovodrun failed: exit status {proc.returncode}", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    cycle = "Horovod's default" if args.cycle_time is None else f"{args.cycle_time} ms"
    native_step.report(args, result, f"real Horovod, 2 ranks, cycle time {cycle}", cycle_time_ms=args.cycle_time)
    return 0


def main(argv=None) -> int:
    p = native_step.parser("python -m bench.horovod_step", __doc__, PATHS, PATHS)
    p.add_argument("--cycle-time", type=float, help="HOROVOD_CYCLE_TIME in ms (default: Horovod's)")
    p.add_argument("--out", help=argparse.SUPPRESS)          # a rank: where rank 0 writes its times
    args, paths = native_step.parsed(p, argv, PATHS)
    if args.out is None:
        return launch(args)
    sizes = [int(n) for n in args.sizes.split(",")]
    result = rank_main(sizes, paths, args.rounds, args.steps, args.warmup, args.first_warmup, args.elements)
    if int(os.environ.get("HOROVOD_RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
