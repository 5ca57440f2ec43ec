"""Ranks killed mid-transfer (SIGKILL: no close, no goodbye) leave no shared
memory behind: segments are memfds with no name in /dev/shm, even while a
dynamic tensor's growth makes new ones."""
from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support.ranks import free_ports

ROOT = Path(__file__).resolve().parents[2]


def _start(rank: int, ports, job: str) -> subprocess.Popen:
    env = dict(os.environ, RDMATENSOR_JOB=job, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "tests.reliability.shm_peer", str(rank), *map(str, ports)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen, timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line or proc.poll() is not None:
            return line.strip()
    raise AssertionError("no line from the rank")


@pytest.mark.parametrize("killed", ["one", "both"])
def test_ranks_killed_mid_transfer_leave_dev_shm_as_it_was(killed):
    job = secrets.token_hex(6)
    mine = f"/dev/shm/rdmatensor-{job}-*"
    ports = free_ports(2)
    procs = [_start(r, ports, job) for r in (0, 1)]
    try:
        assert [_line(p) for p in procs] == ["steady", "steady"]
        for p in procs:
            with open(f"/proc/{p.pid}/maps") as f:
                assert f"/memfd:rdmatensor-{job}-" in f.read(), "the ranks map no shm segment of the job"
        assert not glob.glob(mine), "segments have names in /dev/shm"
        os.kill(procs[1].pid, signal.SIGKILL)
        if killed == "both":
            os.kill(procs[0].pid, signal.SIGKILL)
        else:
            assert _line(procs[0], 20) == "PeerLost peer=1"
        for p in procs:
            p.wait(20)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not glob.glob(mine), f"left in /dev/shm: {glob.glob(mine)}"
