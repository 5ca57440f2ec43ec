"""rdmatensor-run: ranks, environment, prefixed output, failures, timeout, arguments.

The ranks here are small plain Python scripts (no TensorFlow): the launcher is
what is tested, with real processes, signals and process groups."""
import io
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from rdmatensor.runner import addresses, elastic, placement, processes, ssh

from .processes import gone, lines_of
from tests.vm.cmdline_watch import command_lines      # every command line, as any user reads them

LAUNCHER = [sys.executable, "-m", "rdmatensor.runner.cli"]


def launcher(*args, timeout=60, **kw):
    """Run rdmatensor-run; (completed process, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run([*LAUNCHER, *args], capture_output=True, text=True, timeout=timeout, **kw)
    return proc, time.monotonic() - t0


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)




def test_two_ranks_get_distinct_tf_config_ranks_and_one_token(tmp_path):
    body = script(tmp_path, "env.py", """
        import json, os, sys
        print(json.dumps({k: v for k, v in os.environ.items()
                          if k.startswith(("TF_CONFIG", "RDMATENSOR_", "HOROVOD_", "OMPI_"))}))
        print("to stderr", file=sys.stderr)
    """)
    proc, _ = launcher("-np", "2", "--provider", "tcp", sys.executable, body)
    assert proc.returncode == 0, proc.stderr
    envs = {r: json.loads(lines_of(proc.stdout, r)[0]) for r in (0, 1)}
    assert lines_of(proc.stderr, 0) == lines_of(proc.stderr, 1) == ["to stderr"]
    configs = {r: json.loads(e["TF_CONFIG"]) for r, e in envs.items()}
    workers = configs[0]["cluster"]["worker"]
    assert len(workers) == 2 and len(set(workers)) == 2 and "ps" not in configs[0]["cluster"]
    for r in (0, 1):
        e = envs[r]
        assert configs[r]["cluster"]["worker"] == workers
        assert configs[r]["task"] == {"type": "worker", "index": r}
        assert (e["RDMATENSOR_RANK"], e["RDMATENSOR_SIZE"]) == (str(r), "2")
        assert (e["RDMATENSOR_LOCAL_RANK"], e["RDMATENSOR_LOCAL_SIZE"]) == (str(r), "2")
        assert (e["HOROVOD_RANK"], e["HOROVOD_LOCAL_SIZE"], e["OMPI_COMM_WORLD_SIZE"]) == (str(r), "2", "2")
        assert e["RDMATENSOR_PROVIDER"] == "tcp"
    assert envs[0]["RDMATENSOR_TOKEN"] == envs[1]["RDMATENSOR_TOKEN"] and len(envs[0]["RDMATENSOR_TOKEN"]) == 32
    again, _ = launcher("-np", "1", sys.executable, body)
    assert json.loads(lines_of(again.stdout, 0)[0])["RDMATENSOR_TOKEN"] != envs[0]["RDMATENSOR_TOKEN"]
    assert "RDMATENSOR_PROVIDER" not in json.loads(lines_of(again.stdout, 0)[0])


def test_ranks_sharing_a_host_split_its_cores_unless_the_user_chose(tmp_path):
    body = script(tmp_path, "threads.py", """
        import os
        import tf_plugin
        print(os.environ.get("TF_NUM_INTRAOP_THREADS"))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TF_NUM_INTRAOP_THREADS"}
    share = str(max(1, len(os.sched_getaffinity(0)) // 3))
    proc, _ = launcher("-np", "3", sys.executable, body, env=env)
    assert proc.returncode == 0, proc.stderr
    assert [lines_of(proc.stdout, r) for r in range(3)] == [[share]] * 3
    proc, _ = launcher("-np", "2", sys.executable, body, env={**env, "TF_NUM_INTRAOP_THREADS": "0"})
    assert [lines_of(proc.stdout, r) for r in range(2)] == [["0"]] * 2      # TensorFlow's own default, as asked
    alone = subprocess.run([sys.executable, body], capture_output=True, text=True, env=env, timeout=60)
    assert alone.stdout.split() == ["None"]                                  # no launcher: nothing changed


def test_ranks_sharing_a_host_are_bound_each_to_its_own_cores_unless_told_not_to(tmp_path):
    """--bind-to core (the default) as mpirun's: every thread of a rank, those started
    before `import tf_plugin` too, runs on its own block of the cores; ps tasks count."""
    body = script(tmp_path, "bound.py", """
        import os, threading
        early = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
        early.start()
        import tf_plugin
        print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(early.native_id)),
              os.environ["RDMATENSOR_HOST_SLOT"])
    """)
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "binding needs at least 2 cores to be seen"
    proc, _ = launcher("-np", "2", sys.executable, body)
    assert proc.returncode == 0, proc.stderr
    share = len(cores) // 2
    for r in (0, 1):
        mine = str(cores[r * share:(r + 1) * share])
        assert lines_of(proc.stdout, r) == [f"{mine} {mine} {r}/2"]
    proc, _ = launcher("-np", "2", "--bind-to", "none", sys.executable, body)
    assert [lines_of(proc.stdout, r) for r in (0, 1)] == [[f"{cores} {cores} {r}/2"] for r in (0, 1)]
    if len(cores) == 2:        # three tasks on two cores: nobody is bound, nobody shares a core with two
        proc, _ = launcher("-np", "2", "--ps", "1", sys.executable, body)
        assert [lines_of(proc.stdout, r) for r in range(3)] == [[f"{cores} {cores} {r}/3"] for r in range(3)]
    proc, _ = launcher("-np", "2", "--bind-to", "socket", sys.executable, body)
    assert proc.returncode == 2 and "--bind-to: invalid choice: 'socket'" in proc.stderr


def test_the_cores_of_a_slot_and_refusals_of_a_bad_binding():
    from rdmatensor.runner.cores import bind_cores, host_slot, slot_cores
    assert slot_cores({3, 1, 2, 0}, 1, 2) == [2, 3]
    assert slot_cores(range(5), 1, 2) == [2, 3]           # the fifth core stays unbound
    assert slot_cores(range(2), 0, 3) is None and slot_cores(range(4), 0, 1) is None
    assert host_slot({"RDMATENSOR_HOST_SLOT": "1/4"}) == (1, 4)
    assert host_slot({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}) == (1, 2)
    assert host_slot({}) is None
    for bad, message in (("2/2", "host slot 2/2: expected 0 <= I < N"), ("x", "expected I/N")):
        with pytest.raises(ValueError, match=message):
            host_slot({"RDMATENSOR_HOST_SLOT": bad})
    with pytest.raises(ValueError, match="RDMATENSOR_BIND_TO='numa': choose one of core, none"):
        bind_cores({"RDMATENSOR_BIND_TO": "numa"})
    assert bind_cores({"RDMATENSOR_BIND_TO": "none", "RDMATENSOR_HOST_SLOT": "0/2"}) is None
    assert bind_cores({"RDMATENSOR_BIND_TO": "core"}) is None          # no slot known: left alone


def test_ps_tasks_join_tf_config_after_the_workers(tmp_path):
    body = script(tmp_path, "cfg.py", """
        import os
        print(os.environ["TF_CONFIG"])
        print(os.environ["RDMATENSOR_LOCAL_RANK"], os.environ["RDMATENSOR_LOCAL_SIZE"],
              os.environ.get("HOROVOD_SIZE", "-"))
    """)
    proc, _ = launcher("-np", "2", "--ps", "1", sys.executable, body)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(lines_of(proc.stdout, 2)[0])
    assert len(cfg["cluster"]["worker"]) == 2 and len(cfg["cluster"]["ps"]) == 1
    assert cfg["task"] == {"type": "ps", "index": 0}
    # local rank and size count the host's tasks of the same type: 2 workers, 1 ps here
    assert [lines_of(proc.stdout, r)[1] for r in range(3)] == ["0 2 2", "1 2 2", "0 1 -"]


def test_long_lines_from_both_ranks_arrive_whole(tmp_path):
    body = script(tmp_path, "lines.py", """
        import os, sys
        r = os.environ["RDMATENSOR_RANK"]
        for i in range(300):
            stream = sys.stdout if i % 2 else sys.stderr
            stream.write(f"{r}:{i}:" + r * 5000 + "\\n")
            stream.flush()
        sys.stdout.write("no newline at the end")
    """)
    proc, _ = launcher("-np", "2", sys.executable, body)
    assert proc.returncode == 0, proc.stderr
    for r in (0, 1):
        out, err = lines_of(proc.stdout, r), lines_of(proc.stderr, r)
        assert len(out) == 151 and len(err) == 150 and out[-1] == "no newline at the end"
        for line in out[:-1] + err:
            head, _, payload = line.rpartition(":")
            assert head.startswith(f"{r}:") and payload == str(r) * 5000, line[:80]
    assert all(line.startswith(("[0] ", "[1] ")) for line in proc.stdout.splitlines())


@pytest.mark.parametrize("death", ["exit3", "sigkill"])
def test_a_failing_rank_stops_the_job_naming_it_and_leaves_no_process(tmp_path, death):
    """Rank 1 fails; rank 0 (and its own child) would sleep for a minute."""
    pids = tmp_path / "pids"
    body = script(tmp_path, "fail.py", f"""
        import os, signal, subprocess, sys, time
        if os.environ["RDMATENSOR_RANK"] == "0":
            child = subprocess.Popen(["sleep", "60"])
            with open({str(pids)!r}, "w") as f:
                f.write(f"{{os.getpid()}} {{child.pid}}")
            time.sleep(60)
        else:
            while not os.path.exists({str(pids)!r}):
                time.sleep(0.05)
            if {death!r} == "exit3":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc, seconds = launcher("-np", "2", "--grace", "2", "--failure-wait", "1", sys.executable, body)
    want = "exited with status 3" if death == "exit3" else "was killed by signal 9 (SIGKILL)"
    assert f"rank 1 (worker 1 on localhost) {want}: the first rank to fail" in proc.stderr, proc.stderr
    assert "1 s after the first failure: stopping 1 other rank(s)" in proc.stderr, proc.stderr
    assert proc.returncode == (3 if death == "exit3" else 128 + 9)
    assert seconds < 15, f"the launcher took {seconds:.1f} s to stop the job"
    for pid in map(int, pids.read_text().split()):
        assert gone(pid), f"process {pid} outlived the job"


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    pidfile = tmp_path / "pid"
    body = script(tmp_path, "stubborn.py", f"""
        import os, signal, sys, time
        if os.environ["RDMATENSOR_RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open({str(pidfile)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.05)
        sys.exit(1)
    """)
    proc, seconds = launcher("-np", "2", "--grace", "1", "--failure-wait", "0", sys.executable, body)
    assert proc.returncode == 1 and "still running after 1 s: SIGKILL" in proc.stderr, proc.stderr
    assert seconds < 15 and gone(int(pidfile.read_text()))


def test_after_a_failure_the_others_end_by_themselves(tmp_path):
    """Rank 1 is killed first; ranks 0 and 2 notice and fail on their own within the
    failure wait: the launcher names rank 1 as the first to fail and how, then each
    other rank as it ends, stops nobody, and exits with rank 1's status."""
    body = script(tmp_path, "notice.py", """
        import os, signal, sys, time
        rank = int(os.environ["RDMATENSOR_RANK"])
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5 * rank + 0.5)                                       # noticing takes a moment
        sys.exit(1)
    """)
    proc, seconds = launcher("-np", "3", "--failure-wait", "20", sys.executable, body)
    err = proc.stderr
    assert proc.returncode == 128 + 9, err
    first = err.index("rank 1 (worker 1 on localhost) was killed by signal 9 (SIGKILL): the first rank to fail; "
                      "the other 2 rank(s) get 20 s to end")
    assert first < err.index("rank 0 (worker 0 on localhost) exited with status 1") < \
        err.index("rank 2 (worker 2 on localhost) exited with status 1"), err
    assert "stopping" not in err and seconds < 10, (seconds, err)


def sleeper(tmp_path):
    """A rank that records its pid, then sleeps for a minute; (script, pid file)."""
    pids = tmp_path / "pids"
    return script(tmp_path, "sleep.py", f"""
        import os, time
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(60)
    """), pids


def test_timeout_stops_every_rank_with_status_124(tmp_path):
    body, pids = sleeper(tmp_path)
    proc, seconds = launcher("-np", "2", "--timeout", "2", sys.executable, body)
    assert proc.returncode == 124, proc.stderr
    assert "did not finish within its 2 s timeout (--timeout)" in proc.stderr
    assert seconds < 12
    assert len(pids.read_text().split()) == 2 and all(gone(int(p)) for p in pids.read_text().split())


def test_sigterm_to_the_launcher_stops_the_ranks(tmp_path):
    body, pids = sleeper(tmp_path)
    proc = subprocess.Popen([*LAUNCHER, "-np", "2", sys.executable, body], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143 and "got SIGTERM" in err, err
    assert all(gone(int(p)) for p in pids.read_text().split())


def test_every_rank_succeeding_exits_zero_and_a_missing_command_is_named(tmp_path):
    proc, _ = launcher("-np", "2", sys.executable, "-c", "pass")
    assert proc.returncode == 0 and proc.stderr == ""
    proc, _ = launcher("-np", "1", "/nonexistent/command")
    assert proc.returncode != 0 and "cannot start rank 0" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "true"], "need at least one worker"),
    (["-np", "3", "-H", "localhost:2", "true"], "3 ranks, but the hosts have 2 slot(s)"),
    (["-np", "2", "--ps", "1", "-H", "localhost:2", "true"], "-np 2 + --ps 1 = 3 ranks"),
    (["-np", "2", "-H", "a:x", "true"], "slots of 'a' must be a positive integer, not 'x'"),
    (["-np", "2", "-H", "a:0", "true"], "slots of 'a' must be a positive integer"),
    (["-np", "2", "-H", ":2", "true"], "':2' is not host[:slots]"),
    (["-np", "2", "-H", "a:1,a:1", "true"], "host 'a' is listed twice"),
    (["-np", "2"], "give the command every rank runs"),
    (["-np", "2", "--timeout", "0", "true"], "--timeout 0: must be positive"),
    (["-np", "2", "--provider", "carrier-pigeon", "true"], "invalid choice: 'carrier-pigeon'"),
    (["-np", "2", "-H", "127.0.0.2:2", "--softroce-vm", "true"], "-H must name only this host"),
    (["-np", "2", "-H", "elsewhere.invalid:2", "true"], "host 'elsewhere.invalid': cannot resolve it on this host"),
    (["true"], "-np is required (or --host-discovery-script"),
    (["--min-np", "2", "true"], "--min-np/--max-np need --host-discovery-script"),
    (["--min-np", "3", "--max-np", "2", "--host-discovery-script", "/bin/true", "true"],
     "need 1 <= min-np <= np <= max-np"),
    (["--min-np", "1", "--host-discovery-script", "/nonexistent", "true"], "not an executable file"),
    (["--min-np", "1", "-H", "a:2", "--host-discovery-script", "/bin/true", "true"], "no -H, --ps or --softroce-vm"),
    (["-np", "1", "-x", "1BAD", "true"], "-x 1BAD: give an environment variable's name, or name=value"),
    (["-np", "1", "-x", "=x", "true"], "-x =x: give an environment variable's name"),
    (["-np", "1", "-x", "RDMATENSOR_TOKEN=abc", "true"], "a token on the command line shows in ps"),
])
def test_bad_arguments_are_refused_saying_what_is_wrong(args, message):
    proc, _ = launcher(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_x_name_equals_value_sets_it_for_every_rank_as_mpiruns_does(tmp_path):
    """`-x NAME=VALUE` sets NAME (it was once taken for a variable's name and dropped),
    `-x NAME` passes this shell's value on, an unset one stays unset."""
    show = "import os; print(os.environ.get('PYTHONPATH'), os.environ.get('SHOWN'), os.environ.get('UNSET_HERE'))"
    proc, _ = launcher("-np", "2", "-x", "PYTHONPATH=/from/x", "-x", "SHOWN", "-x", "UNSET_HERE",
                       sys.executable, "-c", show, env={**os.environ, "SHOWN": "a b"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] /from/x a b None", "[1] /from/x a b None"], proc.stdout


def test_eight_ranks_that_end_cleanly_print_only_what_the_script_prints(tmp_path):
    """gRPC logs a GOAWAY on a connection whose server stops under it: ranks
    now close their control clients, and wait for their peers' goodbyes,
    before their own server stops. TensorFlow's log level left as users have it."""
    body = script(tmp_path, "clean.py", """
        import tensorflow as tf
        import tf_plugin as hvd
        hvd.init()
        print("sum", int(hvd.allreduce(tf.constant([hvd.rank()]), op=hvd.Sum, name="r")[0]))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")}
    proc, _ = launcher("-np", "8", "--provider", "shm", sys.executable, body, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensorflow_startup = ("oneDNN custom operations", "cpu_feature_guard", "To enable the following instructions",
                          "absl::InitializeLog", "computation placer", "Unable to register")
    for r in range(8):
        assert lines_of(proc.stdout, r) == ["sum 28"], proc.stdout
        noise = [line for line in lines_of(proc.stderr, r) if not any(s in line for s in tensorflow_startup)]
        assert not noise, (r, noise)


def test_hosts_fill_in_order_with_local_ranks_and_ssh_for_remote_hosts():
    with pytest.raises(placement.LaunchError, match="4 ranks, but the hosts have 3 slot"):
        placement.place(3, placement.parse_hosts("localhost:1,127.0.0.2:2"), ps=1, ports=[0] * 4)
    placements = placement.place(3, placement.parse_hosts("localhost:1,127.0.0.2:2,127.0.0.3"), ps=1,
                                 ports=[7000, 7001, 7002, 7003])
    assert [(p.rank, p.task_type, p.index, p.host, p.local_rank, p.local_size, p.local) for p in placements] == [
        (0, "worker", 0, "localhost", 0, 1, True), (1, "worker", 1, "127.0.0.2", 0, 2, False),
        (2, "worker", 2, "127.0.0.2", 1, 2, False), (3, "ps", 0, "127.0.0.3", 0, 1, False)]
    shared = placement.place(3, placement.parse_hosts("127.0.0.2:2,127.0.0.3:2"), ps=1, ports=[0] * 4)
    assert [(p.host, p.task_type, p.local_rank, p.local_size) for p in shared] == [
        ("127.0.0.2", "worker", 0, 2), ("127.0.0.2", "worker", 1, 2), ("127.0.0.3", "worker", 0, 1),
        ("127.0.0.3", "ps", 0, 1)]
    # the local rank is named by the address this host's route to the first remote host leaves from
    assert [p.address for p in placements] == ["127.0.0.1:7000", "127.0.0.2:7001", "127.0.0.2:7002",
                                               "127.0.0.3:7003"]
    env = placement.rank_env(placements, placements[2], "tok", "verbs")
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": [placements[0].address, "127.0.0.2:7001",
                                                                   "127.0.0.2:7002"], "ps": ["127.0.0.3:7003"]},
                                            "task": {"type": "worker", "index": 2}}
    assert (env["RDMATENSOR_LOCAL_RANK"], env["HOROVOD_LOCAL_RANK"], env["HOROVOD_SIZE"]) == ("1", "1", "3")
    assert (env["RDMATENSOR_BIND_TO"], env["RDMATENSOR_HOST_SLOT"]) == ("core", "1/2")     # 127.0.0.2's second task
    ps_env = placement.rank_env(shared, shared[3], "tok", None, bind_to="none")
    assert (ps_env["RDMATENSOR_BIND_TO"], ps_env["RDMATENSOR_HOST_SLOT"]) == ("none", "1/2")   # 127.0.0.3: worker, ps
    cmd = ssh.ssh_command("127.0.0.2", {"A": "x y", "B": "it's"}, ["python", "train.py", "--lr", "0.1"],
                          "/data/my job", ssh_port=2222, identity_file="/keys/id job")
    assert cmd[:8] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/keys/id job", "127.0.0.2"]
    assert len(cmd) == 9
    script_text = ssh.remote_script({"A": "x y", "B": "it's"}, ["python", "train.py", "--lr", "0.1"], "/data/my job")
    assert cmd[8] == "sh -c " + shlex.quote(script_text)
    assert "\ncd '/data/my job' || exit 127\n" in script_text
    setsid, sh, dash_c, rank_command = shlex.split(next(line for line in script_text.splitlines()
                                                        if line.startswith("setsid")))[:4]
    assert (setsid, sh, dash_c) == ("setsid", "sh", "-c")
    assert shlex.split(rank_command) == ["exec", "env", "A=x y", "B=it's", "python", "train.py", "--lr", "0.1"]
    token = secrets.token_hex(16)
    job = processes.Job(placements, ["python", "train.py"], provider="tcp", forward=["FORWARDED_VAR"], token=token)
    os.environ["FORWARDED_VAR"] = "1"
    try:
        argv, env_local = job.argv_of(placements[1])
    finally:
        del os.environ["FORWARDED_VAR"]
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "127.0.0.2"] and env_local is None
    assert "FORWARDED_VAR=1" in argv[4] and "PYTHONUNBUFFERED=1" in argv[4]
    assert token not in argv[4] and "RDMATENSOR_TOKEN=" not in argv[4]         # on ssh's stdin instead
    with pytest.raises(ValueError, match="RDMATENSOR_TOKEN would be on the remote command line"):
        ssh.remote_script({"RDMATENSOR_TOKEN": "tok"}, ["true"], "/")
    argv, env_local = job.argv_of(placements[0])
    assert argv == ["python", "train.py"] and env_local["RDMATENSOR_PROVIDER"] == "tcp"
    assert env_local["RDMATENSOR_TOKEN"] == token


def test_remote_ranks_reach_this_host_at_its_routes_source_or_at_a_named_interface():
    """Not this host's name (without DNS the peers cannot resolve it; Debian maps it to
    127.0.1.1) but the address its route to the first remote host leaves from, or that
    of the first named interface with an IPv4 address; a bad name is refused naming it."""
    names = [n for _, n in socket.if_nameindex()]
    own = {n: addresses.interface_address(n) for n in names}
    assert own["lo"] == "127.0.0.1"
    for name, address in own.items():
        if address and name != "lo":       # the route to one's own address leaves from it
            assert addresses.route_source(address) == address
            job = placement.place(2, [("localhost", 1), (address, 1)], ports=[7000, 7001])
            assert [p.address for p in job] == [f"{address}:7000", f"{address}:7001"] and not job[1].local
            named = placement.place(2, [("localhost", 1), (address, 1)], ports=[7000, 7001],
                                    network_interfaces=["lo", name])
            assert named[0].address == "127.0.0.1:7000"
    assert placement.place(2, [("localhost", 1), ("127.0.0.2", 1)], ports=[1, 2])[0].address == "127.0.0.1:1"
    assert placement.place(1, [("localhost", 1)], ports=[1])[0].address == "127.0.0.1:1"
    with pytest.raises(placement.LaunchError, match="network interface 'nosuch0' does not exist on this host"):
        placement.place(1, [("localhost", 1)], ports=[1], network_interfaces=["nosuch0", "lo"])
    for name in [n for n, a in own.items() if a is None][:1]:          # an interface without IPv4 (if any)
        with pytest.raises(placement.LaunchError, match=f"--network-interfaces {name}: it has no IPv4 address"):
            placement.place(1, [("localhost", 1)], ports=[1], network_interfaces=[name])
        assert addresses.named_address([name, "lo"]) == "127.0.0.1"
    with pytest.raises(placement.LaunchError, match="host 'nosuch.invalid': cannot resolve it on this host"):
        placement.place(1, [("nosuch.invalid", 1)], ports=[1])
    # an elastic job's remote workers reach its rendezvous server the same way
    job = elastic.ElasticJob(["true"], "/bin/true", 1, 1)
    try:
        remote = placement.Placement(0, "worker", 0, "127.0.0.2", "", 0, 1, False)
        assert job._rendezvous_address(remote) == f"127.0.0.1:{job.server.port}"
        job.network_interfaces = ["nosuch0"]
        with pytest.raises(addresses.AddressError, match="'nosuch0' does not exist"):
            job._rendezvous_address(remote)
    finally:
        job.server.close()
    # a discovered host this one cannot resolve gets no worker, said once, not retried
    said = io.BytesIO()
    job = elastic.ElasticJob(["true"], "/bin/true", 1, 2, stderr=said)
    try:
        job._scale([("nosuch.invalid", 2)])
        job._scale([("nosuch.invalid", 2)])
        lines = said.getvalue().decode().splitlines()
        assert not job.started and len(lines) == 1, lines
        assert re.fullmatch(r"rdmatensor-run: no worker on nosuch.invalid: host 'nosuch.invalid': cannot resolve it "
                            r"on this host \(.+\); it is not tried again while the discovery script offers the same "
                            r"hosts", lines[0]), lines
    finally:
        job.server.close()
    with pytest.raises(placement.LaunchError, match="'nosuch0' does not exist"):
        elastic.launch_elastic(["true"], "/bin/true", 1, 1, network_interfaces=["nosuch0"])


def remote_rank(tmp_path, body: str, env=None, token="a" * 32, command=None, interpreter=None, path=None):
    """A rank started the way a remote host starts it (the ssh remote script, run by sh
    here instead of sshd), its standard input standing for the ssh connection, the
    job's token its first line as the launcher sends it."""
    command = command or [sys.executable, script(tmp_path, "remote.py", body)]
    text = ssh.remote_script(env or {"RANK_VAR": "r1"}, command, str(tmp_path), grace=1, interpreter=interpreter)
    proc = subprocess.Popen(["sh", "-c", text], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PATH=path or os.environ["PATH"]))
    ssh.send_token(proc.stdin, token)
    return proc


def finished(proc) -> tuple[str, str]:
    """A remote rank's output once it ended by itself, its connection still open (closing it stops the rank)."""
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.wait(timeout=30)
    proc.stdin.close()
    return out, err


def test_remote_script_runs_the_rank_in_its_directory_with_its_variables_and_status(tmp_path):
    proc = remote_rank(tmp_path, """
        import os, sys
        print(os.getcwd(), os.environ["RANK_VAR"])
        sys.exit(3)
    """)
    out, _ = finished(proc)
    assert proc.returncode == 3 and out.split() == [str(tmp_path), "r1"]


def test_remote_rank_stops_when_its_connection_ends(tmp_path):
    """Closing the connection (the launcher stopping, or the ssh client dying) stops the
    rank's whole process group on the remote host."""
    pids = tmp_path / "pids"
    proc = remote_rank(tmp_path, f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
    """)
    deadline = time.monotonic() + 20
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.stdin.close()
    proc.wait(timeout=20)
    assert time.monotonic() - t0 < 5 and proc.returncode == 128 + signal.SIGTERM
    for pid in map(int, pids.read_text().split()):
        assert gone(pid), f"process {pid} outlived its connection"


def test_the_token_reaches_a_remote_rank_on_no_command_line(tmp_path):
    """The token, sent as the first line of the connection, is in the rank's
    environment and on no command line while the rank runs (not ssh's, not the
    remote shell's, not the rank's); the rest of the connection still stops it."""
    token = secrets.token_hex(16)
    seen = tmp_path / "seen"
    proc = remote_rank(tmp_path, f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        open({str(seen)!r}, "w").write(os.environ["RDMATENSOR_TOKEN"] + " " + str(os.getpid()))
        time.sleep(60)
    """, token=token)
    deadline = time.monotonic() + 20
    while not seen.exists() or len(seen.read_text().split()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    got, pid = seen.read_text().split()
    assert got == token
    samples = []
    for _ in range(20):
        lines = command_lines()
        samples.append(len(lines))
        assert int(pid) in lines and proc.pid in lines          # the rank and its remote shell were read
        leaks = {p: c for p, c in lines.items() if token.encode() in c}
        assert not leaks, leaks
        time.sleep(0.02)
    proc.stdin.close()
    proc.wait(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM and gone(int(pid))


def test_a_remote_script_without_its_token_line_starts_nothing(tmp_path):
    marker = tmp_path / "ran"
    text = ssh.remote_script({}, ["touch", str(marker)], str(tmp_path))
    proc = subprocess.run(["sh", "-c", text], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "no job token on standard input" in proc.stderr and not marker.exists()



def test_an_elastic_workers_ssh_carries_the_token_on_stdin_not_its_command_line(tmp_path):
    """A remote elastic worker starts the same way: its ssh client (real, connected to a
    listener that never answers, so it stays up to be read) has the remote script on
    its command line, and no token."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.2", 0))
        listener.listen()
        job = elastic.ElasticJob(["python", "train.py"], "/bin/true", 1, 1, ssh_port=listener.getsockname()[1],
                                 ssh_identity_file=str(tmp_path / "id"), stderr=open(os.devnull, "wb"))
        try:
            job.start_worker("127.0.0.2")
            (p, proc), = job.started
            conn, _ = listener.accept()          # the ssh client is up and connected
            with conn:
                cmdline = command_lines()[proc.pid]
                argv = cmdline.rstrip(b"\0").split(b"\0")
                assert argv[0] == b"ssh" and b"-i" in argv and argv[-2] == b"127.0.0.2"
                assert b"read -r RDMATENSOR_TOKEN" in argv[-1] and b"RDMATENSOR_WORKER_ID=0" in argv[-1]
                assert job.token.encode() not in cmdline and b"RDMATENSOR_TOKEN=" not in cmdline
        finally:
            job.stop("test over")
            job.cleanup()
            job.server.close()

PROBE = "import os, sys; print(sys.executable, os.environ.get('VIRTUAL_ENV'))"
DEBIAN_PATH = "/usr/local/bin:/usr/bin:/bin"


def test_python_in_a_local_ranks_command_is_the_launchers_interpreter(tmp_path):
    """With Debian's default PATH, `python` is the launcher's (a virtualenv's python
    is a symlink, not resolved), as in an activated virtualenv."""
    proc, _ = launcher("-np", "2", "python", "-c", PROBE, env=dict(os.environ, PATH=DEBIAN_PATH))
    assert proc.returncode == 0, proc.stderr
    venv = sys.prefix if sys.prefix != sys.base_prefix else "None"
    for r in (0, 1):
        assert lines_of(proc.stdout, r) == [f"{sys.executable} {venv}"], proc.stdout


def test_python_in_a_remote_ranks_command_is_the_launchers_where_that_host_has_it(tmp_path):
    """The remote script puts the launcher's interpreter first on PATH where the same
    path exists on that host; where it does not, PATH is left alone, said in one line."""
    proc = remote_rank(tmp_path, "", command=["python", "-c", PROBE], path=DEBIAN_PATH)
    out, err = finished(proc)
    venv = sys.prefix if sys.prefix != sys.base_prefix else "None"
    assert proc.returncode == 0 and out.split() == [sys.executable, venv] and not err, err
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    proc = remote_rank(tmp_path, "", command=["sh", "-c", "echo $PATH"], interpreter=missing, path=DEBIAN_PATH)
    out, err = finished(proc)
    assert proc.returncode == 0 and out.strip() == DEBIAN_PATH
    assert err.splitlines() == [f"rdmatensor-run: {missing} is not on this host ({os.uname().nodename}): "
                                         "PATH left as it is"]


@pytest.mark.vm
def test_softroce_vm_runs_every_rank_in_one_vm_with_an_active_rdma_port(vm_ready):
    probe = ("import os; from rdmatensor.devices import active_port; "
             "print(os.environ['RDMATENSOR_RANK'], os.environ['RDMATENSOR_PROVIDER'], active_port()[0].name)")
    proc, _ = launcher("-np", "2", "--provider", "verbs", "--softroce-vm", "--timeout", "120",
                       sys.executable, "-c", probe, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert sorted(x for x in proc.stdout.splitlines() if x.startswith("[")) == ["[0] 0 verbs rxe0",
                                                                                "[1] 1 verbs rxe0"]
