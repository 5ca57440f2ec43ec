"""A rank SIGKILLed mid-training: every other rank leaves its blocked collective
with PeerLost naming the dead rank within the peer timeout, rdmatensor-run
names the rank that died first and how, exits with its status right after the
others ended, and leaves no process and no shared-memory segment behind; no
rank reports a step whose all-reduce is not the same on every rank. Here:
the Horovod API's ring (tape in tf.function) over tcp, the
parameter-server mode over the grpc baseline; Keras fit over shm is
tests/tf/test_checkpoint_resume.py's killed run. The ring over grpc and the
parameter servers over tcp and shm fail the same way (rank_death_script.py
runs any of them: its MODE and rdmatensor-run's --provider)."""
import glob
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .processes import ROOT, gone, lines_of

SCRIPT = Path(__file__).parent / "rank_death_script.py"
PEER_TIMEOUT = 10.0


@pytest.mark.parametrize("provider,mode,workers,ps",
                         [("tcp", "ring", 2, 0), ("shm", "ring", 2, 0), ("grpc", "ps", 2, 1)])
def test_a_rank_killed_mid_training_fails_the_job_fast_and_clean(tmp_path, provider, mode, workers, ps):
    victim = 1
    cmd = [sys.executable, "-m", "rdmatensor.runner.cli", "-np", str(workers), "--ps", str(ps), "--provider", provider,
           "--timeout", "150", sys.executable, str(SCRIPT), str(tmp_path), mode, str(victim), "12"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)})
    ended = time.time()
    err, out = proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 128 + 9, err[-4000:]
    assert f"rank {victim} (worker {victim} on localhost) was killed by signal 9 (SIGKILL): the first rank to fail" \
        in err, err[-4000:]
    assert "stopping" not in err, "a rank had to be stopped: it did not see the loss by itself"
    killed = float((tmp_path / "killed").read_text())
    print(f"{provider} {mode}: the launcher exited {ended - killed:.2f} s after the kill")
    assert ended - killed < PEER_TIMEOUT + 5
    survivors = [r for r in range(workers + ps) if r != victim]
    steps = {r: [line.split() for line in lines_of(out, r) if line.startswith("step ")] for r in range(workers)}
    for r in survivors:
        mine = lines_of(out, r)
        assert re.search(rf"rank {r} \((worker|ps) \d+ on localhost\) exited with status 1", err), err[-3000:]
        failed = [line for line in mine if line.startswith("failed ")]
        assert failed, f"rank {r} did not report a failure:\n" + "\n".join(mine[-20:])
        seconds = float(failed[0].split()[1])
        print(f"  rank {r}: {failed[0][:160]}")
        assert seconds < PEER_TIMEOUT
        assert f"PeerLost: rank {victim} was lost" in failed[0], failed[0][:2000]
        pid, job = re.search(r"pid (\d+) job ([0-9a-f]+)", "\n".join(mine)).groups()
        assert gone(int(pid))
        assert not glob.glob(f"/dev/shm/rdmatensor-{job}-*"), "the job left shared memory behind"
    if mode == "ring":
        # the dead rank completed step d at most; the others complete at most one step more, and
        # a step anyone reports all-reduced to the same gradients on every rank that reports it
        last = {r: int(s[-1][1]) if s else -1 for r, s in steps.items()}
        assert last[victim] >= 11 and all(last[r] <= last[victim] + 1 for r in survivors), last
        by_step = {}
        for lines in steps.values():
            for _, k, digest in lines:
                by_step.setdefault(int(k), set()).add(digest)
        assert all(len(d) == 1 for d in by_step.values()), "ranks reported different all-reduced gradients"
