"""The deprecated tf_plugin.launcher shims: each still forwards to
rdmatensor.runner, and says so once, as a DeprecationWarning naming what to use
instead, whether it is imported or run with -m."""
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# default warning filters: what someone running the old command sees
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}


def python(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**ENV, **(env or {})})


def test_importing_a_shim_warns_once_at_the_importer_and_forwards():
    code = ("import json, warnings\n"
            "import rdmatensor.runner.cli, rdmatensor.runner.cluster\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import tf_plugin.launcher.run as run\n"
            "    from tf_plugin.launcher import cluster\n"
            "    import tf_plugin.launcher.run\n"
            "    from tf_plugin.launcher.cluster import Cluster\n"
            "assert run.main is rdmatensor.runner.cli.main\n"
            "assert cluster.main is rdmatensor.runner.cluster.main and Cluster is rdmatensor.runner.cluster.Cluster\n"
            "print(json.dumps([[w.category.__name__, str(w.message), w.filename] for w in caught]))\n")
    proc = python("-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    caught = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [c[0] for c in caught] == ["DeprecationWarning", "DeprecationWarning"], caught
    (run_category, run_message, run_at), (_, cluster_message, cluster_at) = caught
    assert "`tf_plugin.launcher.run` is deprecated" in run_message and "`rdmatensor-run`" in run_message
    assert "`tf_plugin.launcher.cluster` is deprecated" in cluster_message
    assert "`rdmatensor.runner.cluster`" in cluster_message
    assert run_at == cluster_at == "<string>", "the warning should point at the import, not at the shim"


def test_the_old_commands_run_and_warn_once_by_default():
    run = python("-m", "tf_plugin.launcher.run", "-np", "2", sys.executable, "-c",
                 "import os; print('rank', os.environ['RDMATENSOR_RANK'])")
    assert run.returncode == 0 and "[0] rank 0" in run.stdout and "[1] rank 1" in run.stdout, run.stderr
    assert run.stderr.count("DeprecationWarning") == 1, run.stderr
    assert "`python -m tf_plugin.launcher.run` is deprecated: use `rdmatensor-run`" in run.stderr
    config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})
    cluster = python("-m", "tf_plugin.launcher.cluster", env={"TF_CONFIG": config})
    assert cluster.returncode == 0 and json.loads(cluster.stdout)["task"] == {"type": "worker", "index": 1}, \
        cluster.stderr
    assert cluster.stderr.count("DeprecationWarning") == 1, cluster.stderr
    assert "`python -m tf_plugin.launcher.cluster` is deprecated: use `rdmatensor.runner.cluster`" in cluster.stderr


def test_the_replacements_warn_nothing():
    proc = python("-W", "error::DeprecationWarning", "-c",
                  "import rdmatensor.runner.cli, rdmatensor.runner.cluster; print('ok')")
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]
