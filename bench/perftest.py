"""perftest (ib_write_bw, ib_write_lat) as the reference for verbs: run it on
this host's device (server and client over loopback) and parse its figures."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from rdmatensor.errors import RdmaTensorError

_NUM = r"([\d.]+)"


MIB = 1 << 20         # perftest's "MB/sec" is MiB/s: 84.48 of them at 0.001352 Mpps of 64 KiB


@dataclass
class BwResult:
    size: int
    iterations: int
    peak_mib_s: float
    avg_mib_s: float
    msg_rate_mpps: float

    @property
    def mb_per_s(self) -> float:
        return self.avg_mib_s * MIB / 1e6


@dataclass
class LatResult:
    size: int
    iterations: int
    min_us: float
    max_us: float
    typical_us: float
    avg_us: float
    p99_us: float


def _rows(output: str, ncols: int) -> list[list[str]]:
    pattern = re.compile(r"^\s*(\d+)\s+(\d+)" + r"\s+" + r"\s+".join([_NUM] * ncols), re.M)
    return [list(m) for m in pattern.findall(output)]


def parse_write_bw(output: str) -> BwResult:
    """The result row of `ib_write_bw` (bytes, iterations, peak and average MiB/s, Mpps).
    Its MiB/s have two decimals; --report_gbits would round the rate to about 1%
    (0.71 or 0.72 Gb/s here), more than the differences the bench reports."""
    rows = _rows(output, 3)
    if not rows:
        raise RdmaTensorError(f"no result row in ib_write_bw output:\n{output[-2000:]}")
    size, iters, peak, avg, rate = rows[-1]
    return BwResult(int(size), int(iters), float(peak), float(avg), float(rate))


def parse_write_lat(output: str) -> LatResult:
    """The result row of `ib_write_lat`: bytes, iterations, t_min, t_max, t_typical,
    t_avg, t_stdev, 99% and 99.9% percentiles (µs)."""
    rows = _rows(output, 7)
    if not rows:
        raise RdmaTensorError(f"no result row in ib_write_lat output:\n{output[-2000:]}")
    size, iters, tmin, tmax, typ, avg, _std, p99, _p999 = rows[-1]
    return LatResult(int(size), int(iters), float(tmin), float(tmax), float(typ), float(avg), float(p99))


def _on(cpu: int | None):
    """A child's preexec_fn that binds it to `cpu` (None: unbound)."""
    return None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))


def _run_pair(tool: str, args: list[str], timeout: float, cpus: tuple[int, int] | None = None) -> str:
    """Server and client of `tool`; `cpus`: (client's, server's) CPU, bound as the bench's ranks are."""
    if not shutil.which(tool):
        raise RdmaTensorError(f"{tool} not found: install perftest (make setup does)")
    client_cpu, server_cpu = cpus or (None, None)
    server = subprocess.Popen([tool, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=_on(server_cpu))
    try:
        # perftest's client does not retry a refused connection: start it once
        # the server listens (seconds, on a loaded machine under emulation).
        wait_listening(int(args[args.index("-p") + 1]), server, within=60.0)
        client = subprocess.run([tool, *args, "127.0.0.1"], capture_output=True, text=True, timeout=timeout,
                                preexec_fn=_on(client_cpu))
        try:
            server.communicate(timeout=10)   # the client has the figures; the server may linger
        except subprocess.TimeoutExpired:
            pass
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if client.returncode != 0:
        raise RdmaTensorError(f"{tool} client failed ({client.returncode}):\n"
                              f"{client.stdout[-1500:]}{client.stderr[-1500:]}")
    return client.stdout


def wait_listening(port: int, server: subprocess.Popen, within: float) -> None:
    want = f":{port:04X} "
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and server.poll() is None:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(table).read().splitlines()[1:]
            except OSError:
                continue
            # local address column ends with the port; state 0A is LISTEN
            if any(want in line.split(None, 3)[1] + " " and line.split()[3] == "0A" for line in lines):
                return
        time.sleep(0.05)


def run_write_bw(device: str, gid_index: int, size: int, iterations: int = 200,
                 port: int = 18600, timeout: float = 300.0, cpus: tuple[int, int] | None = None) -> BwResult:
    """ib_write_bw server and client on this host, over one device (loopback)."""
    return parse_write_bw(_run_pair("ib_write_bw", [
        "-d", device, "-x", str(gid_index), "-s", str(size), "-n", str(iterations),
        "-p", str(port), "-F"], timeout, cpus))


def run_write_lat(device: str, gid_index: int, size: int, iterations: int = 1000,
                  port: int = 18601, timeout: float = 300.0, cpus: tuple[int, int] | None = None) -> LatResult:
    """ib_write_lat server and client on this host, over one device (loopback)."""
    return parse_write_lat(_run_pair("ib_write_lat", [
        "-d", device, "-x", str(gid_index), "-s", str(size), "-n", str(iterations),
        "-p", str(port), "-F"], timeout, cpus))
