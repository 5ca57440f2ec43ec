"""Horovod's environment and horovodrun's flags, as a Horovod user sets them:
HOROVOD_* variables are read (the RDMATENSOR_* twin wins where both are set),
ignored ones are named in one warning, and rdmatensor-run's horovodrun flags
set what they say; those that do not apply are refused, saying why."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rdmatensor.runner import horovodrun_flags
from rdmatensor.runner.cli import parser
from rdmatensor.runner.placement import LaunchError
from tf_plugin.core import settings
from tf_plugin.errors import SettingError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("horovod_env_script.py")
MiB = 1 << 20


def run(args, extra_env=None, timeout=180):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "RDMATENSOR_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "rdmatensor.runner.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def stats_of(proc) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line.split("STATS ", 1)[1]) for line in proc.stdout.splitlines() if "STATS " in line]


def test_horovodrun_flags_set_the_buckets_and_the_timeline(tmp_path):
    timeline = tmp_path / "timeline.json"
    proc = run(["-np", "2", "--provider", "tcp", "--fusion-threshold-mb", "1", "--timeline-filename", str(timeline),
                sys.executable, str(SCRIPT)])
    assert stats_of(proc) == [{"fusion_threshold": MiB, "buckets": 4}] * 2
    events = json.loads(timeline.read_text() + ("" if timeline.read_text().rstrip().endswith("]") else "]"))
    assert any(e.get("ph") == "X" for e in events), events[:5]


def test_horovods_variables_are_read_and_ours_win(tmp_path):
    timeline = tmp_path / "hvd.json"
    proc = run(["-np", "2", "--provider", "shm", sys.executable, str(SCRIPT)],
               {"HOROVOD_FUSION_THRESHOLD": str(MiB), "HOROVOD_TIMELINE": str(timeline)})
    assert stats_of(proc) == [{"fusion_threshold": MiB, "buckets": 4}] * 2
    assert timeline.exists() and timeline.stat().st_size > 100
    default = run(["-np", "2", "--provider", "shm", sys.executable, str(SCRIPT)])
    assert stats_of(default) == [{"fusion_threshold": 64 * MiB, "buckets": 1}] * 2
    both = run(["-np", "2", "--provider", "shm", sys.executable, str(SCRIPT)],
               {"HOROVOD_FUSION_THRESHOLD": str(MiB), "RDMATENSOR_FUSION_THRESHOLD": str(2 * MiB)})
    assert stats_of(both) == [{"fusion_threshold": 2 * MiB, "buckets": 2}] * 2


def test_a_horovod_variable_with_no_meaning_here_is_named_once_per_rank():
    proc = run(["-np", "2", "--provider", "tcp", sys.executable, str(SCRIPT)],
               {"HOROVOD_CYCLE_TIME": "5", "HOROVOD_CACHE_CAPACITY": "0"})
    stats_of(proc)
    warnings = [line for line in proc.stderr.splitlines() if "have no effect here" in line]
    assert len(warnings) == 2, proc.stderr[-3000:]
    assert all("HOROVOD_CYCLE_TIME (there is no coordinator cycle" in w and "HOROVOD_CACHE_CAPACITY" in w
               for w in warnings)
    assert not any("HOROVOD_RANK" in w for w in warnings)       # set by the launcher: not the user's


def test_settings_read_either_name_and_say_what_is_wrong():
    env = {"HOROVOD_FUSION_THRESHOLD": "1024"}
    assert settings.integer(settings.FUSION_THRESHOLD, env) == 1024
    env["RDMATENSOR_FUSION_THRESHOLD"] = "2048"
    assert settings.integer(settings.FUSION_THRESHOLD, env) == 2048
    assert settings.flag(settings.HIERARCHICAL_ALLREDUCE, {}) is True
    assert settings.flag(settings.HIERARCHICAL_ALLREDUCE, {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}) is False
    with pytest.raises(SettingError, match="HOROVOD_HIERARCHICAL_ALLREDUCE='maybe': expected 1 or 0"):
        settings.flag(settings.HIERARCHICAL_ALLREDUCE, {"HOROVOD_HIERARCHICAL_ALLREDUCE": "maybe"})
    with pytest.raises(SettingError, match="HOROVOD_LOG_LEVEL='loud'"):
        settings.apply_log_level({"HOROVOD_LOG_LEVEL": "loud"})
    assert settings.apply_log_level({"HOROVOD_LOG_LEVEL": "ERROR", "RDMATENSOR_LOG_LEVEL": "debug"}) == 10
    assert settings.ignored_in({"HOROVOD_CYCLE_TIME": "1", "HOROVOD_RANK": "0", "HOROVOD_TIMELINE": "x",
                                "HOROVOD_MADE_UP": "1"}) == {
        "HOROVOD_CYCLE_TIME": settings.IGNORED["HOROVOD_CYCLE_TIME"],
        "HOROVOD_MADE_UP": "not a setting of this project"}
    settings.apply_log_level({})


def test_flags_map_to_the_ranks_environment():
    args = parser().parse_args(["-np", "1", "--fusion-threshold-mb", "32", "--no-hierarchical-allreduce",
                                "--log-level", "debug", "--stall-check-warning-time-seconds", "5", "x"])
    assert horovodrun_flags.environment(args) == {
        "RDMATENSOR_FUSION_THRESHOLD": str(32 * MiB), "RDMATENSOR_HIERARCHICAL_ALLREDUCE": "0",
        "RDMATENSOR_LOG_LEVEL": "debug", "RDMATENSOR_STALL_CHECK_TIME_SECONDS": "5"}
    with pytest.raises(LaunchError, match="--fusion-threshold-mb -1"):
        horovodrun_flags.environment(parser().parse_args(["--fusion-threshold-mb", "-1", "x"]))


def test_horovodruns_config_file_sets_what_it_means_here_and_a_flag_wins(tmp_path):
    """horovodrun's YAML layout: the settings with a meaning here become the ranks'
    variables, a flag given as well wins, the rest are named and ignored, and a
    wrong setting is refused naming it."""
    config = tmp_path / "horovod.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 5\n  hierarchical_allreduce: false\n"
                      f"timeline:\n  filename: {tmp_path / 't.json'}\nstall_check:\n  enabled: false\n"
                      "logging:\n  level: debug\n")
    proc = run(["-np", "1", "--config-file", str(config), "--log-level", "error", "sh", "-c",
                "env | grep ^RDMATENSOR_ | sort"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = dict(line.split("] ", 1)[1].split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert got["RDMATENSOR_FUSION_THRESHOLD"] == str(8 * MiB) and got["RDMATENSOR_HIERARCHICAL_ALLREDUCE"] == "0"
    assert got["RDMATENSOR_TIMELINE"] == str(tmp_path / "t.json") and got["RDMATENSOR_STALL_CHECK_DISABLE"] == "1"
    assert got["RDMATENSOR_LOG_LEVEL"] == "error"                    # the flag, not the file's debug
    assert f"--config-file {config}: params.cycle_time_ms means nothing here, ignored" in proc.stderr
    for text, says in (("params:\n  fusion_threshold_mb: lots\n", "params.fusion_threshold_mb is 'lots', expected int"),
                       ("params:\n  fusion_mb: 8\n", "unknown setting params.fusion_mb"),
                       ("tuning: {}\n", "unknown section 'tuning'"), ("logging:\n  level: loud\n", "'loud'")):
        config.write_text(text)
        proc = run(["-np", "1", "--config-file", str(config), "true"], timeout=60)
        assert proc.returncode == 2 and says in proc.stderr, (text, proc.stderr)


def test_a_hostfile_as_horovodrun_reads_it(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the job\nnode1 slots=2\nnode2:4\n\nnode3\n")
    assert horovodrun_flags.read_hostfile(str(hosts)) == "node1:2,node2:4,node3"
    hosts.write_text("node1 slots=two\n")
    with pytest.raises(LaunchError, match="line 1: 'node1 slots=two' is not `host slots=N`"):
        horovodrun_flags.read_hostfile(str(hosts))
    proc = run(["-np", "2", "--hostfile", str(tmp_path / "missing"), "true"], timeout=60)
    assert proc.returncode == 2 and "--hostfile" in proc.stderr and "No such file" in proc.stderr


def test_version_check_build_output_files_and_verbose(tmp_path):
    version = run(["--version"], timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("rdmatensor-run ")
    build = run(["--check-build"], timeout=60)
    assert build.returncode == 0 and "[X] shm" in build.stdout and "[X] tcp's inbox" in build.stdout
    proc = run(["-np", "2", "--verbose", "--output-filename", str(tmp_path / "out"), sys.executable, "-c",
                "import os, sys; print('out', os.environ['RDMATENSOR_RANK']); "
                "print('err', file=sys.stderr)"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 (worker 0 on localhost): here, local rank 0 of 2" in proc.stderr
    for rank in (0, 1):
        assert (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (tmp_path / "out" / f"rank.{rank}" / "stderr").read_text() == "err\n"


STALL = Path(__file__).with_name("stall_script.py")


def test_a_rank_held_back_past_the_stall_time_is_named():
    proc = run(["-np", "2", "--provider", "tcp", "--stall-check-warning-time-seconds", "2", sys.executable,
                str(STALL), "6"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("RESULT 8.0") == 2, proc.stdout
    warned = [line for line in proc.stderr.splitlines() if "has waited" in line]
    assert any(line.startswith("[0] ") and "ranks [1] have not called it" in line and "'late'" in line
               for line in warned), proc.stderr[-3000:]
    assert not any(line.startswith("[1] ") for line in warned)


def test_the_stall_shutdown_time_ends_the_call_naming_the_rank(tmp_path):
    proc = run(["-np", "2", "--provider", "tcp", "--stall-check-warning-time-seconds", "1",
                "--stall-check-shutdown-time-seconds", "3", sys.executable, str(STALL), "8"],
               {"RDMATENSOR_TIMEOUT": "60"})
    rank0 = [line for line in proc.stdout.splitlines() if line.startswith("[0] ")]
    assert any("RAISED" in line and "waited" in line and "ranks [1]" in line and "stall shutdown" in line
               for line in rank0), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_no_stall_check_means_no_warning():
    proc = run(["-np", "2", "--provider", "tcp", "--no-stall-check", sys.executable, str(STALL), "3"],
               {"RDMATENSOR_STALL_CHECK_TIME_SECONDS": "1"})
    assert proc.returncode == 0 and proc.stdout.count("RESULT 8.0") == 2, proc.stderr[-3000:]
    assert "has waited" not in proc.stderr
