"""The members of a fused all-reduce's flat result, two ways, paired in one process.

    python -m bench.members_split                      # 50 and 400 members, 12 pairs
    python -m bench.members_split --sizes 200 --pairs 20

A tf.function takes a flat float32 tensor of N x 256 elements and gives it back
as N members, each then used to update a variable of its shape (v -= 0.01 * m),
by:

- `split`: a `Split` and a `Reshape` per member (the Python twin's way, and the
  native path's before `RdtMembers`);
- `members`: one `RdtMembers` op (tf_plugin/native/kernels.cc): a view of the
  flat buffer per aligned member, no op per member.

Members of shape (256,) and (16, 16). The process is bound to one core; the two
ways alternate (A B, then B A) for --pairs pairs of --steps steps. Prints per
shape and N the median µs per step of each way and the median (range) of the
paired ratios members / split. Needs the op library (RDMATENSOR_TF_OPS=native).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ELEMENTS = 256
SHAPES = ((256,), (16, 16))


def _timed(step, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e6


def measure(n: int, shape: tuple, pairs: int, steps: int) -> dict:
    """µs per step of each way, and the paired ratios, for N members of `shape`."""
    import numpy as np
    import tensorflow as tf

    from tf_plugin.native import ops
    lib = ops.native_library()
    variables = [tf.Variable(np.random.default_rng(i).random(shape, np.float32)) for i in range(n)]
    flat = tf.Variable(np.random.default_rng(n).random(n * ELEMENTS, np.float32))

    def make(way: str):
        @tf.function
        def step():
            f = flat * 1.0
            if way == "split":
                parts = [tf.reshape(p, shape) for p in tf.split(f, [ELEMENTS] * n)]
            else:
                parts = lib.module.rdt_members(f, N=n, shapes=[shape] * n)
            for v, p in zip(variables, parts, strict=True):
                v.assign_sub(0.01 * p)
        for _ in range(30):
            step()
        return step

    split, members = make("split"), make("members")
    a, b, ratios = [], [], []
    for i in range(pairs):
        first, second = (split, members) if i % 2 == 0 else (members, split)
        t1, t2 = _timed(first, steps), _timed(second, steps)
        ts, tm = (t1, t2) if i % 2 == 0 else (t2, t1)
        a.append(ts)
        b.append(tm)
        ratios.append(tm / ts)
    return {"split_us": statistics.median(a), "members_us": statistics.median(b),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.members_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="50,400", help="members per step, comma-separated")
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--steps", type=int, default=200, help="steps timed together")
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.pairs < 1 or args.steps < 1 or min(sizes) < 2:
        p.error("--pairs and --steps must be at least 1, every size at least 2")
    os.environ.setdefault("RDMATENSOR_TF_OPS", "native")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print("| members | shape | split µs | RdtMembers µs | RdtMembers / split: median (range) | saved µs per member |")
    print("| ---: | --- | ---: | ---: | --- | ---: |")
    for shape in SHAPES:
        for n in sizes:
            r = measure(n, shape, args.pairs, args.steps)
            print(f"| {n} | {shape} | {r['split_us']:.0f} | {r['members_us']:.0f} | {r['ratio']:.3f} "
                  f"({r['ratio_min']:.3f}–{r['ratio_max']:.3f}) | {(r['split_us'] - r['members_us']) / n:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
