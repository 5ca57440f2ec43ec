"""Autograph leaves the plugin's graph-building code alone (graph/tracing.py):
rewriting it bought nothing and cost most of a trace."""
import json
import subprocess
import sys
from pathlib import Path

from .processes import ROOT


def test_autograph_rewrites_the_users_step_but_none_of_the_plugin():
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "autograph_script.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=180,
                          env={"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "__main__" in modules, modules                   # the recording sees what autograph rewrites
    assert not [m for m in modules if m.startswith("tf_plugin")], modules
