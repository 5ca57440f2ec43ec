"""The shared-memory all-reduce executor alone: no TensorFlow, two ranks, paired ways.

    python -m bench.shm_executor                               # 4 B to 400 KiB, c against c-scalar
    python -m bench.shm_executor --ways c,twin --sizes 1024,409600
    python -m bench.shm_executor --ways c,c-always-yield --busy 2  # other processes on the cores

Two processes, each bound to a core of its own (as rdmatensor-run binds ranks),
all-reduce (sum) one float32 tensor --calls times in a row, synchronously
through the contract (contract.ShmGroup.allreduce), per size:

- `c`: the C executor as the package builds it (tf_plugin/native/build.py);
- `c-scalar`: the same source built with its reduction loops left scalar
  (-fno-tree-loop-vectorize): what the C executor was before they were vectorized;
- `c-always-yield`: the same source with its waits yielding the core however long
  a yield takes: what it was before it slept instead once another process holds the core;
- `c-whole`: the same source with every call run whole, step by step over the
  whole bucket: what it was before large calls were pipelined chunk by chunk;
- `twin`: the Python twin (shm_twin.py).

Each round runs every way (the order rotating from round to round); a way's
ranks are fresh processes. --busy N runs N processes that only spin beside
each measurement (unbound): a machine shared with other work. Prints per size the median µs per call of each way
over the rounds (range), and the median (range) of the paired ratios of each
way to the first. --json writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {         # the C executor built with flags more: what it was before a change
    "c-scalar": ["-fno-tree-loop-vectorize"],
    "c-always-yield": ["-DYIELD_SLOW_SECONDS=1e9"],
    "c-whole": ["-DRDT_SHM_PIPELINE_BYTES=0"],
}
WAYS = ("c", *VARIANTS, "twin")


def library(way: str, scratch: Path) -> str | None:
    """The C executor's library for `way` (None: the twin)."""
    from tf_plugin.native import build
    if way == "c":
        return str(build.build("c").path)
    if way in VARIANTS:
        step = build.plan("c")
        step["c_flags"] = [*step["c_flags"], *VARIANTS[way]]
        out = scratch / f"rdt_shm_{way}.so"
        if not out.exists():
            build.compile_step(step, build.HERE, out, scratch)
        return str(out)
    return None


def rank_main(rank: int, lib: str | None, fds: list[int], sizes: list[int], calls: int, pipe: int) -> None:
    import ctypes

    import numpy as np

    from tf_plugin.native import shm_c, shm_twin
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    capacity = [4 * max(sizes)]
    g = (shm_c.CGroup(shm_c.bind(ctypes.CDLL(lib)), fds, rank, 2, capacity, 60.0) if lib
         else shm_twin.TwinGroup(fds, rank, 2, capacity, 60.0))
    times = {}
    try:
        for n in sizes:
            x = np.ones(n, np.float32)
            for _ in range(max(5, calls // 10)):
                g.allreduce(0, x)
            t0 = time.perf_counter()
            for _ in range(calls):
                g.allreduce(0, x)
            times[n] = (time.perf_counter() - t0) / calls * 1e6
    finally:
        g.close()
    if pipe >= 0:                                      # rank 0's figures
        os.write(pipe, json.dumps(times).encode())


def run_way(lib: str | None, sizes: list[int], calls: int) -> dict[int, float]:
    """Rank 0's µs per call at each size (elements), two fresh processes."""
    from tf_plugin.native import segment
    fds = [segment.create_segment(r, 2, [4 * max(sizes)]) for r in range(2)]
    read, write = os.pipe()
    pids = []
    try:
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.close(read)
                    rank_main(rank, lib, fds, sizes, calls, write if rank == 0 else -1)
                    code = 0
                except BaseException as exc:           # noqa: BLE001 - said, then the child ends
                    print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                os._exit(code)
            pids.append(pid)
        os.close(write)
        data = b"".join(iter(lambda: os.read(read, 65536), b""))
        codes = [os.waitpid(pid, 0)[1] for pid in pids]
        if any(codes) or not data:
            raise SystemExit(f"a rank failed (wait statuses {codes})")
        return {int(k): v for k, v in json.loads(data).items()}
    finally:
        os.close(read)
        for fd in fds:
            os.close(fd)


def busy(count: int) -> list[int]:
    """`count` processes that only spin, unbound: other work on the ranks' cores."""
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            while True:
                pass
        pids.append(pid)
    return pids


def stop(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,1024,102400,409600", help="bytes per call (float32), comma-separated")
    parser.add_argument("--ways", default="c,c-scalar", help=f"some of {','.join(WAYS)}; ratios are to the first")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=400, help="calls timed together")
    parser.add_argument("--busy", type=int, default=0, help="processes that spin beside the ranks (default 0)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sizes_b = [int(s) for s in args.sizes.split(",")]
    ways = args.ways.split(",")
    if not sizes_b or any(s < 4 or s % 4 for s in sizes_b):
        parser.error("--sizes: bytes of float32 tensors, each a multiple of 4 and at least 4")
    if not ways or any(w not in WAYS for w in ways) or len(set(ways)) != len(ways):
        parser.error(f"--ways: some of {', '.join(WAYS)}, each once")
    if args.rounds < 1 or args.calls < 1 or args.busy < 0:
        parser.error("--rounds and --calls: at least 1; --busy: at least 0")
    sizes = [s // 4 for s in sizes_b]
    rounds = {w: {n: [] for n in sizes} for w in ways}
    with tempfile.TemporaryDirectory(prefix="rdt-bench-") as scratch:
        libs = {w: library(w, Path(scratch)) for w in ways}
        for r in range(args.rounds):
            for i in range(len(ways)):
                w = ways[(i + r) % len(ways)]
                spinning = busy(args.busy)
                try:
                    measured = run_way(libs[w], sizes, args.calls)
                finally:
                    stop(spinning)
                for n, us in measured.items():
                    rounds[w][n].append(us)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = ways[0]
    beside = f", {args.busy} spinning process{'es' * (args.busy > 1)} beside them" if args.busy else ""
    print(f"2 ranks, each bound to a core of its own{beside}; {args.calls} synchronous sum all-reduces of one "
          f"float32 tensor per measurement, {args.rounds} rounds; rank 0's µs per call: median (range over the "
          f"rounds)\n")
    head = " | ".join(ways) + "".join(f" | {w} / {base}" for w in ways[1:])
    print(f"| bytes | {head} |\n| ---: |" + " ---: |" * (2 * len(ways) - 1))
    table = []
    for n in sizes:
        cells, row = [], {"bytes": 4 * n}
        for w in ways:
            v = rounds[w][n]
            row[w] = {"median_us": statistics.median(v), "rounds_us": v}
            cells.append(f"{statistics.median(v):,.1f} ({min(v):,.1f}–{max(v):,.1f})")
        for w in ways[1:]:
            q = [a / b for a, b in zip(rounds[w][n], rounds[base][n], strict=True)]
            row[f"{w}/{base}"] = {"median": statistics.median(q), "range": [min(q), max(q)]}
            cells.append(f"{statistics.median(q):.3f} ({min(q):.3f}–{max(q):.3f})")
        print(f"| {4 * n:,} | " + " | ".join(cells) + " |")
        table.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"ways": ways, "calls": args.calls, "rounds": args.rounds,
                                               "sizes": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
