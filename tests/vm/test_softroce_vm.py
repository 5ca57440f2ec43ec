"""`rdmatensor softroce vm` boots real SoftRoCE: output and exit status come
back, a hung VM is killed at its timeout, and two VMs, reached over ssh,
carry an RDMA write and a job."""
import json
import re
import shlex
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


def clock_offsets(stderr: str, hosts: int) -> list[float]:
    """Each guest's clock less the host's at its boot and at its command's end, as the run
    reports them: well within the 300 s a proof of the job token is good for."""
    found = re.findall(r"host(\d) ([+-][\d.]+) s / ([+-][\d.]+) s", stderr.split("guest clocks", 1)[-1])
    assert [int(h) for h, _, _ in found] == list(range(hosts)), stderr[-2000:]
    offsets = [float(x) for _, boot, end in found for x in (boot, end)]
    assert all(abs(x) < 150 for x in offsets), stderr[-2000:]
    return offsets


def test_vm_lists_rxe_runs_project_venv_in_same_directory_and_a_hung_one_is_killed(vm_ready):
    """Output comes back as it is written, and a command still running at the
    timeout has its VM killed, with exit status 124 (the ssh test below checks
    that a command's own status comes back)."""
    t0 = time.monotonic()
    # The timeout counts from the VM's start: the command before the sleep must end well within
    # it on a busy host. It once imported pyverbs and rdmatensor too, which under TCG beside the
    # rdma suite's VM took more than the 30 s left after boot (every rdma test imports them).
    res = softroce_vm("--timeout", "40", "--", "sh", "-c", "ibv_devices; python -c 'import os, sys; "
                      "print(sys.executable); print(os.getcwd())'; echo oops >&2; sleep 1000")
    assert res.returncode == 124, res.stderr
    assert "40 s timeout" in res.stderr and "killed" in res.stderr
    assert time.monotonic() - t0 < 70
    assert re.search(r"^\s+rxe0\s", res.stdout, re.M), res.stdout
    assert "oops" in res.stderr
    exe, cwd = res.stdout.split()[-2:]
    assert exe == sys.executable
    assert cwd == str(ROOT)
    boot = re.search(r"host0 up, rxe0 ACTIVE, in ([\d.]+) s", res.stderr)
    assert boot, res.stderr
    print(f"VM boot to ACTIVE rxe0: {boot.group(1)} s")


def test_a_terminated_run_leaves_no_vm_behind(vm_ready):
    """The VMs run in sessions of their own, so a SIGTERM to `softroce vm` never reaches
    them: it once left them running (four emulated hosts eating the cores). Now the
    run ends through its cleanup, which kills them, and its status says why."""
    proc = subprocess.Popen([sys.executable, "-m", "rdmatensor", "softroce", "vm", "--hosts", "2", "--",
                             "sleep", "600"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline, vms = time.monotonic() + 60, []
    while len(vms) < 2 and time.monotonic() < deadline:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        vms = [int(p) for p in children.read_text().split()] if children.exists() else []
        vms = [p for p in vms if "qemu" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        time.sleep(0.1)
    assert len(vms) == 2, f"expected two qemu processes, saw {vms}"
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15, proc.stderr.read()[-2000:]
    left = [p for p in vms if Path(f"/proc/{p}").exists()
            and Path(f"/proc/{p}/stat").read_text().split(") ")[-1][0] != "Z"]
    assert not left, f"qemu processes {left} outlived their run"


def test_two_hosts_over_ssh_pick_shm_or_verbs_per_pair_and_name_a_killed_remote_rank(vm_ready):
    """rdmatensor-run in host0 starts two ranks in the other VM over real ssh
    (sshd in each, keys made for this boot, host keys checked) and two there, the
    command's `python` being the launcher's interpreter on both (the VMs' PATH
    is Debian's). With auto, every rank uses shm with the rank on its host and
    verbs with the two on the other, and every tensor arrives intact: the
    remote ranks reached host0's at the address its route to them leaves from
    (this host's name resolves nowhere). Meanwhile every process's command line
    on both VMs is read over and over: the job's token is on none of them. Then
    rank 1, on host1, is killed: the launcher names it and how, and stops rank 0
    (which waits to be stopped) by ending its ssh client; no rank is left on
    either host.
    First, the raw verbs example writes 8 MiB from host1 into host0's memory,
    its client started over ssh."""
    py, size = sys.executable, str(8 << 20)
    # each side's report into a file of its own, shown once both ended: written at once to the one
    # console, the two lines were once interleaved mid-line
    write = (shlex.join([py, "examples/rdma_write.py", "server", "--size", size]) + " > /tmp/rw-server & rw=$!; "
             + shlex.join(["ssh", "192.0.2.2", shlex.join(["cd", str(ROOT)]) + " && " + shlex.join(
                 [py, "examples/rdma_write.py", "client", "192.0.2.1", "--size", size, "--seed", "42"])])
             + " > /tmp/rw-client; wait $rw; cat /tmp/rw-server /tmp/rw-client; ")
    # every command line on both hosts, read while the job runs (a command line does not change:
    # the job's ssh clients and remote scripts live as long as it does), then the ranks left
    # (only their own command lines: the shells around them name the script too); the remote
    # side notices the closed connection and stops a rank: 10 s for that
    watch = shlex.join([py, "-S", str(ROOT / "tests" / "vm" / "cmdline_watch.py"), "/tmp/watch-stop",
                        "^[^ ]*python[^ ]* examples/all_pairs[.]py"])
    watching = f"{watch} > /tmp/watch-0 & ssh 192.0.2.2 {shlex.quote(watch)} > /tmp/watch-1 & "
    watched = ("touch /tmp/watch-stop; ssh 192.0.2.2 touch /tmp/watch-stop; wait; "
               "sed 's/^/watch: /' /tmp/watch-0 /tmp/watch-1; ")
    job = [sys.executable, "-m", "rdmatensor.runner.cli", "-np", "4", "-H", "192.0.2.2:2,localhost:2",
           "--failure-wait", "1", "--grace", "1", "python", "examples/all_pairs.py", "--die", "1"]
    script = write + watching + shlex.join(job) + "; echo status=$?; " + watched + "exit 7"
    t0 = time.monotonic()
    res = softroce_vm("--hosts", "2", "--ssh", "--", "sh", "-c", script)
    out, err = res.stdout, res.stderr
    assert res.returncode == 7, out + err          # the command's own status comes back
    sides = {d["side"]: d for d in map(json.loads, re.findall(r"^\[host0\] (\{.*\"side\".*\})$", out, re.M))}
    server, client = sides["server"], sides["client"]
    assert server["sha256"] == client["sha256"] and server["imm"] == client["imm"] == 0x5EED0001, sides
    assert server["bytes"] == 8 << 20
    reports = {int(r): json.loads(line) for r, line in re.findall(r"^\[host0\] \[(\d)\] (\{.*\})$", out, re.M)}
    assert sorted(reports) == [0, 1, 2, 3], out + err
    same_host = {0: 1, 1: 0, 2: 3, 3: 2}
    for rank, rep in reports.items():
        assert rep["ok"], rep
        assert rep["providers"] == {str(p): "shm" if p == same_host[rank] else "verbs"
                                    for p in range(4) if p != rank}, rep
    assert ("rank 1 (worker 1 on 192.0.2.2) was killed by signal 9 (SIGKILL) on its host: "
            "the first rank to fail") in err, err
    assert "status=137" in out, out + err
    offsets = clock_offsets(err, 2)
    watches = [json.loads(w) for w in re.findall(r"^\[host0\] watch: (\{.*\})$", out, re.M)]
    assert len(watches) == 2, out + err
    for w in watches:
        assert not w["leaks"], w["leaks"]
        assert w["rounds"] >= 10 and w["left"] == 0, (w["host"], w["rounds"], w["left"])
        assert any("examples/all_pairs.py" in c for c in w["cmdlines"]), w      # read while the ranks ran
    host0, host1 = watches
    assert len(host0["tokens"]) == 1 and host0["tokens"] == host1["tokens"], watches
    assert any(c.startswith("ssh ") and "192.0.2.2" in c for c in host0["cmdlines"])   # the ranks' ssh clients
    assert any("read -r RDMATENSOR_TOKEN" in c for c in host1["cmdlines"])             # their remote scripts
    print(f"two VMs: raw verbs write, 8 MiB: {client['MB_per_s']:.1f} MB/s; "
          f"command lines read {host0['rounds']} and {host1['rounds']} times; guest clocks {offsets} s off; "
          f"{time.monotonic() - t0:.0f} s")
