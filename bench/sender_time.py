"""Where a verbs bandwidth run's sending thread spends its time, beside
ib_write_bw's, on one RDMA device (the SoftRoCE VM's):

    python -m rdmatensor softroce vm -- .venv/bin/python -m bench.sender_time --size 64K --rounds 3

On SoftRoCE the NIC is the sender's kernel: a write is packetized in its
ibv_post_send call, so the sender can only send as fast as its thread runs.
For the middle of each run this reads, from /proc (schedstat), how much of
the time the sending thread ran, waited runnable for a CPU, or slept; its
system time per write; and the CPU of every other thread of both sides
(rdmatensor's background threads, the receiver's waits). Rounds alternate
rdmatensor and ib_write_bw; --bind none leaves the processes unbound.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from .cli import _device, parse_sizes
from .perftest import _on, parse_write_bw

CLK = os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[int, tuple[float, float, float]]:
    """tid -> (seconds run, seconds waited runnable, seconds of system time)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run, wait, _ = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
            stat = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(run) / 1e9, int(wait) / 1e9, int(stat[12]) / CLK)
        except (OSError, ValueError):     # a thread that ended meanwhile
            pass
    return out


def _sample(sender: subprocess.Popen, receiver: subprocess.Popen, skip: float, span: float) -> dict:
    time.sleep(skip)
    a = {p.pid: _threads(p.pid) for p in (sender, receiver)}
    t0 = time.monotonic()
    time.sleep(span)
    b = {p.pid: _threads(p.pid) for p in (sender, receiver)}
    dt = time.monotonic() - t0

    def delta(pid, tids):
        return [sum(b[pid][t][k] - a[pid][t][k] for t in tids if t in a[pid]) for k in range(3)]
    main = delta(sender.pid, [sender.pid])
    rest = delta(sender.pid, [t for t in b[sender.pid] if t != sender.pid])
    by_name: dict[str, float] = {}           # the sender's other threads, by name
    for t in b[sender.pid]:
        if t != sender.pid and t in a[sender.pid]:
            name = _name(sender.pid, t)
            by_name[name] = by_name.get(name, 0.0) + (b[sender.pid][t][0] - a[sender.pid][t][0]) / dt
    other = delta(receiver.pid, list(b[receiver.pid]))
    return {"run": main[0] / dt, "runnable": main[1] / dt, "asleep": max(0.0, 1 - (main[0] + main[1]) / dt),
            "system_s": main[2], "span": dt, "sender_rest": rest[0] / dt, "receiver": other[0] / dt,
            "rest_by_name": by_name}


def _name(pid: int, tid: int) -> str:
    try:
        return open(f"/proc/{pid}/task/{tid}/comm").read().strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sender_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64K", help="bytes per write (default 64K)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each rdmatensor then ib_write_bw (default 3)")
    p.add_argument("--bind", choices=("core", "none"), default="core",
                   help="sender on one CPU, receiver on another, as rdmatensor-bench binds them (default core)")
    a = p.parse_args(argv)
    size = parse_sizes(a.size)[0]
    found = _device()
    if found is None:
        raise SystemExit("bench.sender_time: no ACTIVE RDMA port here (run it inside `rdmatensor softroce vm`)")
    cpus = sorted(os.sched_getaffinity(0))[:2] if a.bind == "core" else []
    send_cpu, recv_cpu = (cpus[0], cpus[1]) if len(cpus) == 2 else (None, None)
    peers = "127.0.0.1:47500,127.0.0.1:47501"
    ours = [sys.executable, "-m", f"{__package__}.cli", "bw", "--providers", "verbs", "--sizes", str(size),
            "--no-references", "--peers", peers, "--seconds", "16"]
    iters = max(200, int(10 * 90e6 / size))      # about as long as ours at ib_write_bw's pace here
    perf = ["ib_write_bw", "-d", found[0], "-x", str(found[1]), "-s", str(size), "-F", "-n", str(iters)]
    rows = []
    for r in range(a.rounds):
        for name in ("rdmatensor", "ib_write_bw"):
            if name == "rdmatensor":
                receiver = subprocess.Popen([*ours, "--rank", "1"], stdout=subprocess.DEVNULL, preexec_fn=_on(recv_cpu))
                time.sleep(0.5)
                sender = subprocess.Popen([*ours, "--rank", "0"], stdout=subprocess.PIPE, text=True,
                                          preexec_fn=_on(send_cpu))
                skip = 8.0                       # start-up under emulation, and the warm-up
            else:
                receiver = subprocess.Popen(perf, stdout=subprocess.DEVNULL, preexec_fn=_on(recv_cpu))
                time.sleep(1.0)
                sender = subprocess.Popen([*perf, "127.0.0.1"], stdout=subprocess.PIPE, text=True,
                                          preexec_fn=_on(send_cpu))
                skip = 2.0
            s = _sample(sender, receiver, skip, 3.0)
            out, _ = sender.communicate(timeout=600)
            receiver.wait(timeout=60)
            if name == "rdmatensor":
                mbs = float(re.findall(r"^bw\s+verbs\s+\S+\s+\d+\s+([\d.]+)", out, re.M)[-1])
            else:
                mbs = parse_write_bw(out).mb_per_s
            writes = mbs * 1e6 * s["span"] / size
            rows.append((r + 1, name, mbs, s, s["system_s"] / writes * 1e6))
            print(f"round {r + 1} {name}: {mbs:.1f} MB/s", file=sys.stderr, flush=True)
    print(f"{size} B writes, {'bound' if send_cpu is not None else 'unbound'}; the sending thread over 3 s "
          "mid-run (schedstat), and the CPU of every other thread")
    print("| round | run | MB/s | sender ran | runnable, waiting for a CPU | asleep | sender system time per write "
          "| sender's other threads | receiver |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r, name, mbs, s, per_write in rows:
        print(f"| {r} | {name} | {mbs:.1f} | {100 * s['run']:.0f}% | {100 * s['runnable']:.0f}% | "
              f"{100 * s['asleep']:.0f}% | {per_write:.0f} us | {100 * s['sender_rest']:.0f}% | "
              f"{100 * s['receiver']:.0f}% |")
    for r, name, _, s, _ in rows:
        busy = sorted(s["rest_by_name"].items(), key=lambda kv: -kv[1])
        if busy:
            print(f"round {r} {name}, the sender's other threads: "
                  + ", ".join(f"{n} {100 * v:.1f}%" for n, v in busy if v >= 0.001))
    return 0


if __name__ == "__main__":
    sys.exit(main())
