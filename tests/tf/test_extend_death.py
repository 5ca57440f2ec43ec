"""A rank lost while the plan is being extended (the ranks agreed on a new
tensor set, one dies before the new session connects) is reported to every
other rank within the peer timeout, not at the setup timeout: the new
session's setup gives up as soon as the job's bootstrap session saw the loss."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .processes import ROOT, lines_of

SCRIPT = Path(__file__).parent / "extend_death_script.py"
PEER_TIMEOUT = 10.0


# The higher rank dies: the lower one waits in its Exchange call to it. The other wait of a setup
# (for a lower rank's Exchange) is tests/transport/test_setup.py's, through the same abort hook.
@pytest.mark.parametrize("victim", [1])
def test_a_rank_lost_while_the_plan_is_extended_is_reported_within_the_peer_timeout(tmp_path, victim):
    cmd = [sys.executable, "-m", "rdmatensor.runner.cli", "-np", "2", "--provider", "tcp", "--timeout", "100",
           "--failure-wait", "90", sys.executable, str(SCRIPT), str(tmp_path), str(victim)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    for r in (r for r in range(2) if r != victim):
        failed = [line for line in lines_of(out, r) if line.startswith("failed ")]
        assert failed, f"rank {r} reported no failure:\n{out[-4000:]}"
        seconds = float(failed[0].split()[1])
        print(f"rank {r}: {failed[0][:200]}")
        assert seconds < PEER_TIMEOUT, failed[0]
        assert f"rank {victim}" in failed[0] and "PeerLost" in failed[0], failed[0]
