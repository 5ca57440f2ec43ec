"""Run a script as the workers of a job: one process per rank, each with TF_CONFIG,
the job's token, its provider and its local rank in the environment (what a
launcher gives a user's script)."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from ..support.ranks import free_ports

ROOT = Path(__file__).resolve().parents[2]


def run_workers(script: Path, n: int, provider: str, out_dir: Path, args=(), timeout: float = 180.0) -> list[str]:
    """Run `script out_dir *args` on n ranks; return each rank's output. Fails (naming the
    rank and its output) when a rank exits non-zero or the job outlives `timeout`."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(n)]
    token = secrets.token_hex(16)
    procs, logs = [], []
    for rank in range(n):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                                     "task": {"type": "worker", "index": rank}}),
                   RDMATENSOR_TOKEN=token, RDMATENSOR_PROVIDER=provider, RDMATENSOR_LOCAL_RANK=str(rank),
                   RDMATENSOR_LOCAL_SIZE=str(n), TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), str(out_dir), *map(str, args)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        why = f"was killed: the job outlived {timeout:.0f} s" if timed_out and p.returncode < 0 else \
            f"exited with {p.returncode}"
        assert p.returncode == 0, f"rank {rank} {why}:\n{out[-6000:]}"
    return outputs
