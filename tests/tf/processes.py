"""Run a script as the workers of a job, started by rdmatensor-run: one process per
rank, each with TF_CONFIG, the job's token, its provider and its local rank in the
environment (what the launcher gives a user's script)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (killed, waiting for whoever reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def lines_of(text: str, rank: int) -> list[str]:
    """What rank `rank` printed, in the launcher's output (its `[rank] ` prefix taken off)."""
    prefix = f"[{rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def run_workers(script: Path, n: int, provider: str, out_dir: Path, args=(), timeout: float = 180.0) -> list[str]:
    """Run `script out_dir *args` on n ranks with `rdmatensor-run -np n`; return each rank's
    output. Fails (naming the rank, as the launcher does, and the ranks' output) when a
    rank exits non-zero or the job outlives `timeout`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "rdmatensor.runner.cli", "-np", str(n), "--provider", provider,
                           "--timeout", f"{timeout:g}", sys.executable, str(script), str(out_dir), *map(str, args)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    lines = (proc.stdout + proc.stderr).splitlines()
    outputs = ["".join(line[len(f"[{r}] "):] + "\n" for line in lines if line.startswith(f"[{r}] "))
               for r in range(n)]
    launcher = "\n".join(line for line in lines if line.startswith("rdmatensor-run:"))
    assert proc.returncode == 0, launcher + "".join(f"\n--- rank {r}:\n{out[-6000:]}" for r, out in enumerate(outputs))
    return outputs
