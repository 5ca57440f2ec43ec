"""Where a verbs bandwidth run spends its CPU, sender and receiver apart, beside
ib_write_bw's, on one RDMA device (the SoftRoCE VM's):

    python -m rdmatensor softroce vm -- .venv/bin/python -m bench.cpu_split --size 64K --seconds 6

Each side runs as its own process (rdmatensor-bench bw --rank 0/1; ib_write_bw
client and server), and its user and system CPU seconds are read when it
exits (RUSAGE_CHILDREN), with the bandwidth it reported. On SoftRoCE the
NIC is the kernel: a write is packetized in the sender's own ibv_post_send
call, so the sender's user time per write is time its NIC does not send.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

from .cli import _device, parse_sizes
from .perftest import parse_write_bw, wait_listening

PERF_PORT = 18515        # ib_write_bw's own default, given so that its client can wait for it
PERF_ATTEMPTS = 3


def _timed(command: list[str], started: list, after: float = 0.0) -> subprocess.Popen:
    """Start `command` in a child that reports its CPU seconds on its last line, in a
    session of its own (added to `started`), so that a failure ends it whole."""
    wrapper = ("import resource, subprocess, sys, time; time.sleep(float(sys.argv[1])); "
               "p = subprocess.run(sys.argv[2:], capture_output=True, text=True); "
               "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "print(p.stdout + p.stderr); print(f'CPU {r.ru_utime:.2f} {r.ru_stime:.2f} {p.returncode}')")
    proc = subprocess.Popen([sys.executable, "-c", wrapper, str(after), *command], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    started.append(proc)
    return proc


def _end(started: list) -> None:
    """Kill what still runs of each child's session: a side that failed leaves its peer
    waiting for it (an ib_write_bw server waits for its client forever)."""
    for proc in started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[float, float, str]:
    out, _ = proc.communicate(timeout=timeout)
    user, system, code = re.findall(r"^CPU (\S+) (\S+) (\S+)$", out, re.M)[-1]
    if int(code):
        raise SystemExit(f"a side failed (exit {code}):\n{out[-3000:]}")
    return float(user), float(system), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64K", help="bytes per write (default 64K)")
    p.add_argument("--seconds", type=float, default=6.0, help="measured seconds per run (default 6)")
    a = p.parse_args(argv)
    size = parse_sizes(a.size)[0]
    found = _device()
    if found is None:
        raise SystemExit("bench.cpu_split: no ACTIVE RDMA port here (run it inside `rdmatensor softroce vm`)")
    device, gid = found[0], str(found[1])
    peers = "127.0.0.1:47500,127.0.0.1:47501"
    bench = [sys.executable, "-m", f"{__package__}.cli", "bw", "--providers", "verbs", "--sizes", str(size),
             "--no-references", "--peers", peers]
    perf = ["ib_write_bw", "-d", device, "-x", gid, "-s", str(size), "-F", "-p", str(PERF_PORT)]
    t0 = time.monotonic()
    started: list = []
    try:
        return _measure(a, size, bench, perf, started, t0)
    finally:
        _end(started)


def _measure(a, size: int, bench: list[str], perf: list[str], started: list, t0: float) -> int:
    def ours(seconds: float) -> tuple[int, float, list[float]]:
        """(writes, MB/s, [sender user, sender system, receiver user, receiver system])"""
        cmd = [*bench, "--seconds", str(seconds)]
        receiver = _timed([*cmd, "--rank", "1"], started)
        sender = _timed([*cmd, "--rank", "0"], started, after=0.5)     # connect() retries until rank 1 listens
        (su, ss, out), (ru, rs, _) = _finish(sender, 600), _finish(receiver, 600)
        writes, mbs = re.findall(r"^bw\s+verbs\s+\S+\s+(\d+)\s+([\d.]+)", out, re.M)[-1]
        return int(writes), float(mbs), [su, ss, ru, rs]

    # start-up (Python, imports, connecting) costs seconds of CPU under emulation: a short run's
    # CPU taken from a long one's leaves what the extra writes cost
    short, long = ours(0.5), ours(a.seconds)
    extra = long[0] - short[0]
    per_write = [(b - s) / extra * 1e6 for s, b in zip(short[2], long[2], strict=True)]
    iters = max(100, int(long[1] * 1e6 * a.seconds / size))       # about as long, an exact count
    if long[1] <= 0:
        raise SystemExit(f"bench.cpu_split: rdmatensor's bw run reported {long[1]} MB/s over {long[0]} writes")
    for attempt in range(1, PERF_ATTEMPTS + 1):
        server = _timed([*perf, "-n", str(iters)], started)
        # perftest's client does not retry a refused connection (under load in the VM, 1 s
        # was once not enough for the server to listen): it starts once the server listens
        wait_listening(PERF_PORT, server, within=60.0)
        client = _timed([*perf, "-n", str(iters), "127.0.0.1"], started)
        (cu, cs, out), (pu, ps, _) = _finish(client, 600), _finish(server, 600)
        perf_rate = parse_write_bw(out).mb_per_s
        if perf_rate > 0:
            break
        # it once reported 0.00 MB/s under load in the VM (its rate comes from the CPU's cycle counter)
        print(f"bench.cpu_split: ib_write_bw reported 0 MB/s (attempt {attempt} of {PERF_ATTEMPTS}):\n"
              f"{out[-1500:]}", file=sys.stderr)
    else:
        raise SystemExit(f"bench.cpu_split: ib_write_bw reported 0 MB/s {PERF_ATTEMPTS} times")
    perf_write = [c / iters * 1e6 for c in (cu, cs, pu, ps)]
    print(f"{size} B writes; CPU microseconds per write, each side's process (rdmatensor: a {a.seconds:g} s run "
          f"less a 0.5 s one, {extra} writes apart; ib_write_bw: -n {iters}); {time.monotonic() - t0:.0f} s")
    print("| run | MB/s | us per write | sender user | sender system | sender busy | receiver user | "
          "receiver system |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rate, cpu in (("rdmatensor verbs", long[1], per_write), ("ib_write_bw", perf_rate, perf_write)):
        interval = size / rate                   # microseconds between writes, at MB/s
        print(f"| {name} | {rate:.1f} | {interval:.0f} | {cpu[0]:.0f} | {cpu[1]:.0f} | "
              f"{100 * (cpu[0] + cpu[1]) / interval:.0f}% | {cpu[2]:.0f} | {cpu[3]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
