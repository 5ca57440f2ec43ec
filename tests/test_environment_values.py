"""Every setting on docs/environment.md, read by the code itself in a fresh
process: set to "" it behaves exactly as unset, and unset it takes the
default the page states."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rdmatensor import UsageError
from tf_plugin.core import settings
from tf_plugin.errors import SettingError

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "environment.md").read_text()
SECTIONS = ("Yours to set", "The verbs fabric", "Horovod's settings, under either name")
CLEAN = ("RDMATENSOR_", "HOROVOD_", "TF_CONFIG", "MASTER_", "SLURM_", "OMPI_", "RANK", "WORLD_SIZE", "LOCAL_")

# What the code makes of each setting, in the page's units: a job of one joins through
# world.init() and each other part answers through the function that reads its variable.
SNAPSHOT = r"""
import dataclasses, json, logging, os
from rdmatensor.providers.shm import completion_ring
from rdmatensor.providers.tcp import inbox
from rdmatensor.providers.verbs import addressing, channel, choose_endpoint, choose_port
from rdmatensor.runner.rendezvous_client import LauncherEnv
from rdmatensor.session import liveness, send, slots
from tf_plugin.core import checked_collectives, layout, settings, world
from tf_plugin.core.timeline import Timeline
from tf_plugin.native import build as native_build
from tf_plugin.training.horovod_baseline import ROOT, horovod_venv

world.init()
w = world.world()
stall = checked_collectives.Stall.from_env()
fabric = dataclasses.asdict(addressing.Fabric.from_env())
slurm = dict(os.environ, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODELIST="node[1-2]",
             SLURM_JOB_ID="7")
rendezvous = LauncherEnv.detect(slurm).address
out = {
    "RDMATENSOR_TOKEN": w.token, "RDMATENSOR_PROVIDER": w.provider, "RDMATENSOR_TIMEOUT": w.timeout,
    "RDMATENSOR_CHECK_FINITE": w.check_finite, "TF_CONFIG": [w.rank, w.size],
    "RDMATENSOR_VERBS_ENDPOINT": choose_endpoint.endpoint_kind(),
    "RDMATENSOR_SHM_RING": completion_ring.compiled(), "RDMATENSOR_TCP_INBOX": inbox.compiled(),
    "RDMATENSOR_SLOTS": slots.compiled is not None,
    "RDMATENSOR_HOROVOD_VENV": os.path.relpath(horovod_venv(), ROOT),
    "RDMATENSOR_RENDEZVOUS_ADDR": rendezvous, "RDMATENSOR_RENDEZVOUS_PORT": rendezvous,
    "MASTER_ADDR": rendezvous, "MASTER_PORT": rendezvous,
    "RDMATENSOR_IB_HCA": choose_port.hca(), "RDMATENSOR_IB_RAILS": choose_port.rails(),
    "RDMATENSOR_IB_GID_INDEX": choose_port.gid_index(),
    "RDMATENSOR_VERBS_REGISTER_MIN": send.REGISTER_MIN, "RDMATENSOR_PEER_TIMEOUT": liveness.peer_timeout_from_env(),
    "RDMATENSOR_VERBS_SPIN_US": round(channel.SPIN_SECONDS * 1e6, 3),
    "RDMATENSOR_VERBS_SLEEP_MS": round(channel.SLEEP_SECONDS * 1e3, 3),
    "RDMATENSOR_FUSION_THRESHOLD": layout.fusion_threshold(),
    "RDMATENSOR_TIMELINE": [settings.text(settings.TIMELINE), Timeline.from_env(0) is None],
    "RDMATENSOR_HIERARCHICAL_ALLREDUCE": settings.flag(settings.HIERARCHICAL_ALLREDUCE),
    "RDMATENSOR_LOG_LEVEL": logging.getLevelName(settings.apply_log_level()).lower(),
    "RDMATENSOR_STALL_CHECK_TIME_SECONDS": stall.check_time,
    "RDMATENSOR_STALL_SHUTDOWN_TIME_SECONDS": stall.shutdown_time,
    "RDMATENSOR_STALL_CHECK_DISABLE": stall.check_time is None,
    "RDMATENSOR_ELASTIC_TIMEOUT": settings.seconds(settings.ELASTIC_TIMEOUT),
    "RDMATENSOR_TF_OPS": native_build.choice(),
    "RDMATENSOR_EXECUTOR_NICE": settings.executor_nice(),
    "warned": settings.ignored_in(),
}
for var, (field, _, _) in addressing.Fabric.RANGES.items():
    out[var] = fabric[field]
out["RDMATENSOR_IB_MTU"], out["RDMATENSOR_IB_FORCE_GRH"] = fabric["mtu"], fabric["force_grh"]
world.shutdown()
print("SNAPSHOT " + json.dumps(out))
"""


def page_rows() -> list[tuple[list[str], str]]:
    """(the variables a row names, its default cell) of every row of the settings' tables."""
    rows, section = [], None
    for line in DOC.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section in SECTIONS and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            horovod = section.startswith("Horovod")
            names = re.findall(r"`([A-Z][A-Z0-9_]+)`", " ".join(cells[:2] if horovod else cells[:1]))
            rows.append((names, cells[2] if horovod else cells[1]))
    return rows


def snapshot(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    env.update(PYTHONPATH=str(REPO), **extra)
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("SNAPSHOT ", 1)[1])


def test_each_setting_set_to_empty_behaves_as_unset():
    variables = sorted({n for names, _ in page_rows() for n in names} | set(settings.IGNORED))
    assert len(variables) > 40
    unset = snapshot({})
    empty = snapshot({var: "" for var in variables})
    assert empty == unset
    assert unset["warned"] == {}
    twins = {s.horovod: s.name for s in settings.SETTINGS}
    uncovered = [v for v in variables if v not in unset and twins.get(v) not in unset and v not in settings.IGNORED]
    assert not uncovered, f"on the page but not read by the snapshot: {uncovered}"


def test_every_default_the_page_states_is_the_codes():
    unset = snapshot({})
    checked = 0
    for names, default in page_rows():
        stated = re.match(r"`([^`]+)`", default)
        if not stated:
            continue                     # a default in words (none, every ACTIVE port, ...)
        for name in names:
            if name not in unset:
                continue                 # Horovod's twin: the row's RDMATENSOR_* name holds its value
            value = unset[name]
            if isinstance(value, bool):
                value = "1" if value else "0"
            elif isinstance(value, float) and value.is_integer():
                value = int(value)
            assert str(value) == stated[1], f"{name}: the page says {stated[1]}, the code {value!r}"
            checked += 1
    assert checked >= 20
    # in words on the page: under srun, the step's first node and port 29500 + SLURM_JOB_ID % 1000 (7 here)
    assert "29500 + `SLURM_JOB_ID` % 1000" in DOC and unset["RDMATENSOR_RENDEZVOUS_ADDR"] == "node1:29507"


def test_horovods_timeouts_are_honoured_or_named():
    """horovodrun's gloo and elastic timeouts are the twins of ours (ours win); its start
    timeout is horovodrun's own and is named as meaning nothing to a rank; asking for
    dynamic process sets, always there here, draws no word."""
    horovod = snapshot({"HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "HOROVOD_ELASTIC_TIMEOUT": "30",
                        "HOROVOD_START_TIMEOUT": "90", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert horovod["RDMATENSOR_TIMEOUT"] == 45 and horovod["RDMATENSOR_ELASTIC_TIMEOUT"] == 30
    assert horovod["warned"] == {"HOROVOD_START_TIMEOUT": settings.IGNORED["HOROVOD_START_TIMEOUT"]}
    both = snapshot({"HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "RDMATENSOR_TIMEOUT": "50"})
    assert both["RDMATENSOR_TIMEOUT"] == 50
    with pytest.raises(SettingError, match="HOROVOD_GLOO_TIMEOUT_SECONDS='soon': expected seconds"):
        settings.seconds(settings.TIMEOUT, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "soon"})
    assert issubclass(SettingError, UsageError)


def test_what_launchers_set_is_unset_when_empty():
    # the variables a launcher sets (not on the settings' tables): "" is unset there too
    from rdmatensor.runner import cores
    from rdmatensor.runner.rendezvous_client import LauncherEnv
    empty = {"RDMATENSOR_BIND_TO": "", "RDMATENSOR_HOST_SLOT": "", "HOROVOD_LOCAL_RANK": "",
             "HOROVOD_LOCAL_SIZE": "", "TF_NUM_INTRAOP_THREADS": "", "RDMATENSOR_LOCAL_SIZE": ""}
    assert cores.host_slot(dict(empty)) is None
    assert cores.bind_cores(dict(empty)) is None
    assert cores.share_cores(dict(empty)) is None                  # alone on its host, as unset
    env = dict(empty, RDMATENSOR_LOCAL_SIZE="2")
    assert cores.share_cores(env) == max(1, cores.usable_cores() // 2) == int(env["TF_NUM_INTRAOP_THREADS"])
    with pytest.raises(ValueError, match="HOROVOD_LOCAL_RANK='x'"):
        cores.host_slot({"HOROVOD_LOCAL_RANK": "x", "HOROVOD_LOCAL_SIZE": "2"})
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "", "LOCAL_WORLD_SIZE": "",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    found = LauncherEnv.detect(torchrun)
    assert (found.rank, found.size, found.local_rank, found.local_size) == (1, 2, 0, 2)
