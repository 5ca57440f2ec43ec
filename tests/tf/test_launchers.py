"""Jobs started by the launchers users already have, with no port known in
advance: each rank knows its rank, the job's size and one rendezvous address;
rank 0 serves the rendezvous there, every rank binds a free port of its own
and learns the others' through it, with the job's token. Open MPI's mpirun
really runs (Debian's openmpi-bin); under horovodrun's environment, rank 0
publishes its rendezvous in Horovod's own key-value store (Horovod's sources,
which make setup fetches; `make horovod-reference` also runs real horovodrun);
Slurm's srun and torchrun are their environments, set as they set them."""
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rdmatensor import AuthenticationError, PeerLost, UsageError
from rdmatensor.runner import rendezvous_client as rendezvous
from rdmatensor.runner.cluster import free_ports
from rdmatensor.runner.rendezvous_client import LauncherEnv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "launcher_script.py"
BASE = {k: v for k, v in os.environ.items()
        if not k.startswith(("TF_CONFIG", "RDMATENSOR_", "OMPI_", "SLURM_", "HOROVOD_", "PMIX_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
BASE.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), RDMATENSOR_PROVIDER="tcp")


def check_ranks(outputs: list[str], n: int) -> None:
    # Found anywhere, not per line: mpirun forwards each rank's output in chunks, and one
    # rank's newline can come after another rank's text.
    lines = sorted(m.group(0) for out in outputs
                   for m in re.finditer(r"rank \d+ of \d+ local \d+/\d+ sum -?\d+(?:\.\d+)?", out))
    want = n * (n + 1) // 2
    assert lines == [f"rank {r} of {n} local {r}/{n} sum {want}" for r in range(n)], outputs


def by_hand(n: int, env_of) -> list[str]:
    """Start n ranks as a launcher would, each with env_of(rank): rank 0 last, 2 s after
    the others, which must wait for its rendezvous to come up."""
    def start(r):
        return subprocess.Popen([sys.executable, str(SCRIPT)], env={**BASE, **env_of(r)}, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    others = [start(r) for r in range(1, n)]
    time.sleep(2.0)
    procs = [start(0), *others]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


def test_open_mpi_mpirun_on_one_host():
    """mpirun -np 2 with only the token and a port: rank 0 serves on this host."""
    assert shutil.which("mpirun"), "Open MPI's mpirun is missing: make setup installs it (openmpi-bin)"
    port, token = free_ports(1)[0], secrets.token_hex(16)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "RDMATENSOR_TOKEN",
           "-x", "RDMATENSOR_RENDEZVOUS_PORT", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL",
           "-x", "RDMATENSOR_PROVIDER", sys.executable, str(SCRIPT)]
    proc = subprocess.run(cmd, env={**BASE, "RDMATENSOR_TOKEN": token, "RDMATENSOR_RENDEZVOUS_PORT": str(port)},
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    check_ranks([proc.stdout], 2)


def test_torchrun_environment_master_addr_and_port():
    """What torchrun (and Kubernetes training operators) set: RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    port, token = free_ports(1)[0], secrets.token_hex(16)
    outs = by_hand(2, lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDMATENSOR_TOKEN": token})
    check_ranks(outs, 2)


def test_slurm_srun_environment_without_fixed_ports():
    port, token = free_ports(1)[0], secrets.token_hex(16)
    env = {"SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "77",
           "SLURM_STEP_NODELIST": "localhost", "RDMATENSOR_TOKEN": token, "RDMATENSOR_RENDEZVOUS_PORT": str(port)}
    outs = by_hand(2, lambda r: {**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
    check_ranks(outs, 2)


@pytest.fixture
def horovod_store():
    """Horovod's own HTTP key-value store, as horovodrun serves it: host:port."""
    sources = Path(sys.prefix) / "share" / "horovod-0.28.1"
    assert (sources / "horovod").is_dir(), f"Horovod's sources are missing in {sources}: make setup fetches them"
    code = ("import sys\nfrom horovod.runner.http.http_server import RendezvousServer\n"
            "s = RendezvousServer()\nprint(s.start(), flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**BASE, "PYTHONPATH": str(sources)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield f"127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()


def test_horovodrun_environment_rank_0_publishes_its_rendezvous_in_horovods_store(horovod_store):
    """What horovodrun --gloo sets: HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE and its
    store's HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT; no port of the job's is known in advance."""
    token = secrets.token_hex(16)
    addr, port = horovod_store.split(":")
    outs = by_hand(2, lambda r: {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                                 "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CONTROLLER": "gloo",
                                 "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
                                 "RDMATENSOR_TOKEN": token})
    check_ranks(outs, 2)


def test_a_rendezvous_in_horovods_store_not_signed_with_the_jobs_token_is_refused(horovod_store):
    """The store has no authentication: what rank 0 publishes there is signed."""
    with pytest.raises(PeerLost, match="did not publish its rendezvous"):
        rendezvous._look_up(horovod_store, "a" * 32, 0.3)
    rendezvous._publish(horovod_store, "127.0.0.1:1", "b" * 32, 5.0)
    with pytest.raises(AuthenticationError, match="not signed with this job's token"):
        rendezvous._look_up(horovod_store, "a" * 32, 5.0)
    forged = json.dumps({"address": "127.0.0.1:2", "mac": rendezvous._signature("a" * 32, "127.0.0.1:1")})
    urllib.request.urlopen(urllib.request.Request(f"http://{horovod_store}{rendezvous.STORE_KEY}",
                                                  data=forged.encode(), method="PUT"), timeout=5).close()
    with pytest.raises(AuthenticationError, match="not signed with this job's token"):
        rendezvous._look_up(horovod_store, "a" * 32, 5.0)
    rendezvous._publish(horovod_store, "127.0.0.1:3", "a" * 32, 5.0)
    assert rendezvous._look_up(horovod_store, "a" * 32, 5.0) == "127.0.0.1:3"


@pytest.mark.parametrize("env,message", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     "no rendezvous address: set MASTER_ADDR and MASTER_PORT"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "rank 2 of 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not integers"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "h",
      "HOROVOD_GLOO_RENDEZVOUS_PORT": "1"}, "horovodrun's elastic mode is not supported"),
])
def test_a_launcher_environment_that_cannot_work_is_refused_saying_why(env, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        LauncherEnv.detect(env)


def test_each_launchers_variables_are_read_as_it_sets_them():
    assert LauncherEnv.detect({}) is None
    assert LauncherEnv.detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                               "MASTER_ADDR": "node1", "MASTER_PORT": "29400"}) == \
        LauncherEnv("mpirun", 1, 4, 1, 2, "node1:29400")
    assert LauncherEnv.detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                               "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[02-03]",
                               "SLURM_JOB_ID": "4242"}) == LauncherEnv("srun", 3, 4, 1, 2, "gpu02:29742")
    assert LauncherEnv.detect({"RANK": "0", "WORLD_SIZE": "2", "RDMATENSOR_RENDEZVOUS_ADDR": "h:7"}).address == "h:7"
    assert LauncherEnv.detect({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
                               "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
                               "HOROVOD_GLOO_RENDEZVOUS_PORT": "4567"}) == \
        LauncherEnv("horovodrun", 1, 4, 1, 2, "", "10.0.0.1:4567")


def test_without_the_token_a_rank_is_told_how_to_pass_it():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**BASE, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "1"})
    assert proc.returncode != 0 and "RDMATENSOR_TOKEN is not set: started by torchrun" in proc.stderr, \
        proc.stderr[-2000:]
