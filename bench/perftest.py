"""perftest (ib_write_bw, ib_write_lat) as a reference: run it, parse its figures."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from rdmatensor.errors import RdmaTensorError

_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.M)


@dataclass
class BwResult:
    size: int
    iterations: int
    peak_gbps: float
    avg_gbps: float
    msg_rate_mpps: float

    @property
    def mb_per_s(self) -> float:
        return self.avg_gbps * 1e9 / 8 / 1e6


def parse_write_bw(output: str) -> BwResult:
    """The result row of `ib_write_bw --report_gbits` (bytes, iterations, peak, average, rate)."""
    rows = _ROW.findall(output)
    if not rows:
        raise RdmaTensorError(f"no result row in ib_write_bw output:\n{output[-2000:]}")
    size, iters, peak, avg, rate = rows[-1]
    return BwResult(int(size), int(iters), float(peak), float(avg), float(rate))


def run_write_bw(device: str, gid_index: int, size: int, iterations: int = 200,
                 port: int = 18600, timeout: float = 120.0) -> BwResult:
    """ib_write_bw server and client on this host, over one device (loopback)."""
    if not shutil.which("ib_write_bw"):
        raise RdmaTensorError("ib_write_bw not found: install perftest (make setup does)")
    args = ["ib_write_bw", "-d", device, "-x", str(gid_index), "-s", str(size),
            "-n", str(iterations), "-p", str(port), "-F", "--report_gbits"]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)  # perftest's client does not retry a refused connection
        client = subprocess.run(args + ["127.0.0.1"], capture_output=True, text=True, timeout=timeout)
        server_out, _ = server.communicate(timeout=timeout)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if client.returncode != 0:
        raise RdmaTensorError(f"ib_write_bw client failed ({client.returncode}):\n"
                              f"{client.stdout[-1500:]}{client.stderr[-1500:]}")
    return parse_write_bw(client.stdout)
