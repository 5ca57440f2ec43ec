"""tf_plugin.parameter_server.run on a user's model: the example script, started by
rdmatensor-run with a parameter-server task, trains and leaves every worker with
the same weights."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ps_train.py"


def test_example_trains_through_rdmatensor_run_with_a_ps_task():
    steps = 50
    proc = subprocess.run([sys.executable, "-m", "rdmatensor.runner.cli", "-np", "2", "--ps", "1", "--provider", "tcp",
                           "--timeout", "240", sys.executable, str(EXAMPLE), "--steps", str(steps)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = {}
    for rank in (0, 1):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"[{rank}] worker {rank}:"))
        m = re.search(r"loss ([\d.]+) -> ([\d.]+) .*; (\d+) dynamic sends; weights (\w+)", line)
        first, last, dynamic, digest = float(m[1]), float(m[2]), int(m[3]), m[4]
        assert last < 0.5 * first, line                          # it learned
        assert dynamic == 2 * steps                               # embedding rows: values + indices each step
        workers[rank] = digest
    assert workers[0] == workers[1]                              # the same trained model on every worker
    assert "[2] ps 0: served 50 steps over tcp" in proc.stdout


def test_a_cluster_without_parameter_servers_is_refused():
    import keras
    import tf_plugin.parameter_server as ps
    from rdmatensor.runner.cluster import Cluster
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="needs ps tasks in the cluster"):
        ps.run(model, None, keras.optimizers.SGD(), [], 5, cluster=Cluster.local(2))
    with pytest.raises(ValueError, match="worker 0 got no dataset"):
        ps.run(model, None, keras.optimizers.SGD(), None, 5, cluster=Cluster.local(1, 1))
