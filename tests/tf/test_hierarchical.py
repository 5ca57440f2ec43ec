"""The hierarchical all-reduce through the Horovod API: 4 rank processes on two
"hosts" (loopback addresses 127.0.0.1 and 127.0.0.2, every pair over real shm);
the flat ring and the hierarchy, one set each in the same plan, give the exact
sum on every rank (bench.hierarchical checks every call), and the hierarchy
formed from the addresses. The ring itself, on 4 and 6 ranks: test_ring.py."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hierarchical_and_flat_all_reduce_agree_in_one_job():
    proc = subprocess.run([sys.executable, "-m", "bench.hierarchical", "local", "--sizes", "1K,300001",
                           "--rounds", "1", "--calls", "2", "--provider", "shm"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert report["hierarchy"] == [[0, 1], [2, 3]] and report["providers"] == ["shm"]
    assert [row["bytes"] for row in report["rows"]] == [4096, 1200004]
