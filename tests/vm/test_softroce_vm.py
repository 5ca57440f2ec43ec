"""`rdmatensor softroce vm` boots real SoftRoCE: output and exit status come
back, a hung VM is killed at its timeout, and two VMs carry an RDMA write."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def softroce_vm(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rdmatensor", "softroce", "vm", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_vm_lists_rxe_and_returns_exit_status(vm_ready):
    res = softroce_vm("--", "sh", "-c", "ibv_devices; echo oops >&2; exit 7")
    assert res.returncode == 7, res.stderr
    assert re.search(r"^\s+rxe0\s", res.stdout, re.M), res.stdout
    assert "oops" in res.stderr
    boot = re.search(r"host0 up, rxe0 ACTIVE, in ([\d.]+) s", res.stderr)
    assert boot, res.stderr
    print(f"VM boot to ACTIVE rxe0: {boot.group(1)} s")


def test_vm_runs_project_venv_in_same_directory(vm_ready):
    res = softroce_vm("--", "python", "-c",
                      "import os, sys, pyverbs, rdmatensor; print(sys.executable); print(os.getcwd())")
    assert res.returncode == 0, res.stderr
    exe, cwd = res.stdout.split()
    assert exe == sys.executable
    assert cwd == str(ROOT)


def test_hung_vm_is_killed_at_timeout(vm_ready):
    t0 = time.monotonic()
    res = softroce_vm("--timeout", "30", "--", "sleep", "1000")
    assert res.returncode == 124
    assert "30 s timeout" in res.stderr and "killed" in res.stderr
    assert time.monotonic() - t0 < 60


def test_two_hosts_carry_an_rdma_write(vm_ready):
    res = softroce_vm("--hosts", "2", "--", "python", "examples/rdma_write.py", "vm",
                      "--size", str(8 << 20), "--seed", "42")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = dict(re.findall(r"^\[(host\d)\] (\{.*\})$", res.stdout, re.M))
    server, client = json.loads(lines["host0"]), json.loads(lines["host1"])
    assert server["side"] == "server" and client["side"] == "client"
    assert server["sha256"] == client["sha256"]
    assert server["imm"] == client["imm"] == 0x5EED0001
    assert server["bytes"] == 8 << 20
    print(f"two-VM RDMA write, 8 MiB: {client['MB_per_s']:.1f} MB/s")


def test_two_hosts_run_a_session_over_verbs(vm_ready):
    res = softroce_vm("--hosts", "2", "--", "python", "examples/two_ranks.py", "vm", "--provider", "verbs")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = dict(re.findall(r"^\[(host\d)\] (\{.*\})$", res.stdout, re.M))
    r0, r1 = json.loads(lines["host0"]), json.loads(lines["host1"])
    for r in (r0, r1):
        assert r["provider"] == "verbs" and r["ok"] and r["bad"] == 0, r
    assert r1["checked"] == 17
    assert r0["stats"]["grows"] >= 1 and r0["stats"]["dynamic"] == 4
    print(f"two-VM session over verbs: 64 MiB at {r0['MB_per_s_64MiB_incl_copy']} MB/s, "
          f"setup {r0['setup_s']} s")
