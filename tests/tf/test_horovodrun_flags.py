"""Every flag of horovodrun 0.28.1's parser, read from Horovod's own sources
(horovod/runner/launch.py, which `make setup` fetches; its imports need
packages this project does not, so the parser is read with ast): each one,
given a valid value, either does what the table below says to what
rdmatensor-run would launch, changes nothing because what it asks for always
holds here, or is refused in one line naming it and saying why (exit 2).
None is an "unrecognized argument"."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rdmatensor.runner import cli
from rdmatensor.runner.horovodrun_flags import NO_EFFECT, REFUSED, TimestampedLines

ROOT = Path(__file__).resolve().parents[2]
HOROVOD = Path(sys.prefix) / "share" / "horovod-0.28.1" / "horovod" / "runner"
MiB = 1 << 20
# Horovod's argparse actions (launch.py) by how many values they take
TAKES_NONE = {"store_true", "version", "make_check_build_action", "make_override_true_action",
              "make_override_false_action", "make_deprecated_bool_action"}
TAKES_ONE = {"store", "make_override_action", "make_nic_action"}


def horovod_flags() -> dict[str, dict]:
    """flag -> {nargs, type, choices, hidden} for every option of horovodrun's parse_args()."""
    launch = HOROVOD / "launch.py"
    assert launch.is_file(), f"Horovod's sources are missing ({launch}): make setup fetches them"
    tree = ast.parse(launch.read_text())
    parse_args = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
    levels = next(ast.literal_eval(n.value) for n in ast.walk(ast.parse(
        (HOROVOD / "common" / "util" / "config_parser.py").read_text()))
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LOG_LEVELS")
    flags = {}
    for call in ast.walk(parse_args):
        if not (isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and a.value.startswith("-")]
        if not names:
            continue                                    # the positional command
        kw = {k.arg: k.value for k in call.keywords}
        action = kw.get("action")
        action = (action.value if isinstance(action, ast.Constant) else action.func.id) if action else "store"
        if "nargs" in kw:
            nargs = ast.literal_eval(kw["nargs"])
        else:
            assert action in TAKES_NONE | TAKES_ONE, f"{names}: Horovod's action {action} is new to this test"
            nargs = 0 if action in TAKES_NONE else 1
        hidden = isinstance(kw.get("help"), ast.Attribute) and kw["help"].attr == "SUPPRESS"
        spec = {"nargs": nargs, "type": getattr(kw.get("type"), "id", "str"),
                "choices": levels if "choices" in kw else None, "hidden": hidden}
        flags.update({name: spec for name in names})
    return flags


FLAGS = horovod_flags()


def valid(flag: str) -> list[str]:
    """A value horovodrun takes for `flag`, by its type."""
    spec = FLAGS[flag]
    one = spec["choices"][1] if spec["choices"] else {"int": "2", "float": "0.5"}.get(spec["type"], "x")
    return [one] * spec["nargs"]


@pytest.fixture
def files(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:4\n")
    script.chmod(0o755)
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    (tmp_path / "id_test").write_text("not a key: only read by ssh\n")
    (tmp_path / "horovod.yaml").write_text("params:\n  fusion_threshold_mb: 8\n")
    return tmp_path


BASES = {"static": ["-np", "2"], "elastic": ["-np", "2", "--host-discovery-script", "{dir}/discover.sh"],
         "hosts": ["-np", "1", "-H", "localhost,127.0.0.1"]}


def is_elastic(plan, d):
    return plan.kind == "elastic" and plan.kwargs["script"] == f"{d}/discover.sh" and plan.kwargs["min_np"] == 2


# flag -> (its values, the command line it is added to, what it changes: kwargs of the launch,
# $VARIABLES the ranks get, or a check of the whole plan). {dir}: the files fixture's folder.
EFFECTS = {
    "-np": (["3"], "static", {"np": 3}),
    "--num-proc": (["3"], "static", {"np": 3}),
    "-v": ([], "static", lambda plan, d: plan.kind == "print" and plan.text.startswith("rdmatensor-run ")),
    "--version": ([], "static", lambda plan, d: plan.kind == "print" and plan.text.startswith("rdmatensor-run ")),
    "-cb": ([], "static", lambda plan, d: plan.kind == "print" and "Providers" in plan.text),
    "--check-build": ([], "static", lambda plan, d: plan.kind == "print" and "Providers" in plan.text),
    "--network-interfaces": (["lo"], "static", {"network_interfaces": ["lo"]}),
    "--network-interface": (["lo"], "static", {"network_interfaces": ["lo"]}),
    "--output-filename": (["out"], "static", {"output_dir": "out"}),
    "--verbose": ([], "static", {"verbose": True}),
    "--config-file": (["{dir}/horovod.yaml"], "static", {"$RDMATENSOR_FUSION_THRESHOLD": str(8 * MiB)}),
    "-p": (["2222"], "static", {"ssh_port": 2222}),
    "--ssh-port": (["2222"], "static", {"ssh_port": 2222}),
    "-i": (["{dir}/id_test"], "static", {"ssh_identity_file": "{dir}/id_test"}),
    "--ssh-identity-file": (["{dir}/id_test"], "static", {"ssh_identity_file": "{dir}/id_test"}),
    "--fusion-threshold-mb": (["8"], "static", {"$RDMATENSOR_FUSION_THRESHOLD": str(8 * MiB)}),
    "--hierarchical-allreduce": ([], "static", {"$RDMATENSOR_HIERARCHICAL_ALLREDUCE": "1"}),
    "--no-hierarchical-allreduce": ([], "static", {"$RDMATENSOR_HIERARCHICAL_ALLREDUCE": "0"}),
    "--min-np": (["1"], "elastic", {"min_np": 1}),
    "--min-num-proc": (["1"], "elastic", {"min_np": 1}),
    "--max-np": (["3"], "elastic", {"max_np": 3}),
    "--max-num-proc": (["3"], "elastic", {"max_np": 3}),
    "--slots-per-host": (["2"], "hosts", {"hosts": [("localhost", 2), ("127.0.0.1", 2)]}),
    "--elastic-timeout": (["30"], "elastic", {"elastic_timeout": 30.0}),
    "--reset-limit": (["2"], "elastic", {"reset_limit": 2}),
    "--timeline-filename": (["{dir}/t.json"], "static", {"$RDMATENSOR_TIMELINE": "{dir}/t.json"}),
    "--no-stall-check": ([], "static", {"$RDMATENSOR_STALL_CHECK_DISABLE": "1"}),
    "--stall-check": ([], "static", {}),         # the default (it wins over a config file: tested below)
    "--stall-check-warning-time-seconds": (["5"], "static", {"$RDMATENSOR_STALL_CHECK_TIME_SECONDS": "5"}),
    "--stall-check-shutdown-time-seconds": (["9"], "static", {"$RDMATENSOR_STALL_SHUTDOWN_TIME_SECONDS": "9"}),
    "--tcp": ([], "static", {"provider": "tcp"}),
    "--gloo-timeout-seconds": (["30"], "static", {"$RDMATENSOR_TIMEOUT": "30"}),
    "--log-level": (["DEBUG"], "static", {"$RDMATENSOR_LOG_LEVEL": "debug"}),
    "-prefix-timestamp": ([], "static", {"stdout": TimestampedLines, "stderr": TimestampedLines}),
    "--prefix-output-with-timestamp": ([], "static", {"stdout": TimestampedLines, "stderr": TimestampedLines}),
    "-H": (["localhost:3"], "static", {"hosts": [("localhost", 3)]}),
    "--hosts": (["localhost:3"], "static", {"hosts": [("localhost", 3)]}),
    "-hostfile": (["{dir}/hosts"], "static", {"hosts": [("localhost", 2)]}),
    "--hostfile": (["{dir}/hosts"], "static", {"hosts": [("localhost", 2)]}),
    "--host-discovery-script": (["{dir}/discover.sh"], "static", is_elastic),
}


def plan_of(argv: list[str]) -> cli.Plan:
    return cli.plan(cli.parser(), argv)


def changes(plan: cli.Plan, base: cli.Plan) -> dict:
    """What `plan` launches differently from `base`: launch arguments, and $VARIABLES for the ranks."""
    assert plan.kwargs["forward"] == list(plan.env)          # every variable a flag sets reaches remote ranks
    out = {k: v for k, v in plan.kwargs.items() if k != "forward" and base.kwargs.get(k, ...) != v}
    out.update({f"${k}": v for k, v in plan.env.items() if base.env.get(k) != v})
    return out


def test_every_horovodrun_flag_is_ours_accepted_or_refused():
    """The three lists cover Horovod's parser exactly: none left out, none made up."""
    assert len(FLAGS) > 60 and {"-hostfile", "-prefix-timestamp", "-i", "--no-autotune"} <= set(FLAGS)
    hidden = {f for f, spec in FLAGS.items() if spec["hidden"]}
    assert {"--no-autotune", "--stall-check", "--log-with-timestamp", "--log-hide-timestamp"} <= hidden
    covered = [set(EFFECTS), set(NO_EFFECT), set(REFUSED)]
    assert set.union(*covered) == set(FLAGS), set.union(*covered) ^ set(FLAGS)
    assert sum(map(len, covered)) == len(FLAGS)              # each in one list only
    help_text = cli.parser().format_help()
    assert all(flag in help_text for flag in FLAGS)


@pytest.mark.parametrize("flag", sorted(EFFECTS))
def test_a_flag_with_a_meaning_here_does_it(flag, files):
    values, base, expected = EFFECTS[flag]
    spec = FLAGS[flag]
    assert len(values) == spec["nargs"]
    for value in values:                                     # a value horovodrun takes too
        {"int": int, "float": float}.get(spec["type"], str)(value)
        assert spec["choices"] is None or value in spec["choices"]
    d = str(files)
    argv = [a.format(dir=d) for a in BASES[base]]
    got = plan_of([*argv, flag, *(v.format(dir=d) for v in values), "true"])
    if callable(expected):
        assert expected(got, d), got
        return
    expected = {k: v.format(dir=d) if isinstance(v, str) else v for k, v in expected.items()}
    diff = changes(got, plan_of([*argv, "true"]))
    assert diff.keys() == expected.keys(), diff
    for key, want in expected.items():
        assert isinstance(diff[key], want) if isinstance(want, type) else diff[key] == want, (key, diff[key])


@pytest.mark.parametrize("flag", sorted(NO_EFFECT))
def test_a_flag_asking_for_what_always_holds_changes_nothing(flag):
    assert FLAGS[flag]["nargs"] == 0 and NO_EFFECT[flag]
    assert changes(plan_of(["-np", "2", flag, "true"]), plan_of(["-np", "2", "true"])) == {}


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_a_flag_with_no_meaning_here_is_refused_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_of(["-np", "2", flag, *valid(flag), "true"])
    assert exit_.value.code == 2
    why = REFUSED[flag]
    assert why and "\n" not in why
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"rdmatensor-run: error: {flag} (horovodrun's) does not apply here: {why}"


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        plan_of(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_the_flags_values_are_checked(files, capsys):
    d = str(files)
    assert "--mpi-args (horovodrun's)" in refusal(["-np", "2", "--mpi-args=--map-by ppr:6:node", "true"], capsys)
    assert "--tcp means --provider tcp, not --provider shm" in refusal(["-np", "2", "--tcp", "--provider", "shm",
                                                                         "true"], capsys)
    assert plan_of(["-np", "2", "--tcp", "--provider", "tcp", "true"]).kwargs["provider"] == "tcp"
    assert f"--ssh-identity-file {d}/none: not a readable file" in refusal(["-np", "2", "-i", f"{d}/none", "true"],
                                                                          capsys)
    assert "--slots-per-host 0: must be 1 or more" in refusal(["-np", "1", "-H", "a", "--slots-per-host", "0",
                                                                "true"], capsys)
    # elastic: a host the discovery script names without :N has the flag's slots
    from rdmatensor.runner.elastic import parse_discovery
    elastic = plan_of(["--host-discovery-script", f"{d}/discover.sh", "--slots-per-host", "2", "true"])
    assert elastic.kwargs["slots_per_host"] == 2
    assert parse_discovery("a\nb:3\n", elastic.kwargs["slots_per_host"]) == [("a", 2), ("b", 3)]
    assert "--slots-per-host 0: must be 1 or more" in refusal(
        ["--host-discovery-script", f"{d}/discover.sh", "--slots-per-host", "0", "true"], capsys)
    assert "--gloo-timeout-seconds 0: must be positive" in refusal(["-np", "2", "--gloo-timeout-seconds", "0",
                                                                    "true"], capsys)
    # -H hosts with their own :N keep it; the flag fills in the others only
    assert plan_of(["-np", "2", "-H", "localhost:3,127.0.0.1", "--slots-per-host", "2", "true"]).kwargs["hosts"] \
        == [("localhost", 3), ("127.0.0.1", 2)]
    # both spellings of the interfaces, in the order given, each once
    got = cli.parser().parse_args(["-np", "2", "--network-interface", "eth1", "--network-interfaces", "eth0,eth1",
                                   "true"])
    assert got.network_interfaces == ["eth1", "eth0"]         # (placing checks they exist: below)
    assert "an empty interface name" in refusal(["-np", "2", "--network-interfaces", "eth0,", "true"], capsys)
    with pytest.raises(SystemExit) as exit_:           # checked as the launch places the ranks, before any starts
        cli.main(["-np", "1", "--network-interfaces", "nope0", "true"])
    assert exit_.value.code == 2 and "'nope0'" in capsys.readouterr().err.splitlines()[-1]


def test_the_config_files_library_options_and_a_flag_that_wins(files, capsys):
    config = files / "horovod.yaml"
    config.write_text("library_options:\n  gloo_timeout_seconds: 45\n  thread_affinity: 1\n"
                      "stall_check:\n  enabled: false\n")
    got = plan_of(["-np", "2", "--config-file", str(config), "true"])
    assert got.env == {"RDMATENSOR_TIMEOUT": "45", "RDMATENSOR_STALL_CHECK_DISABLE": "1"}
    assert "library_options.thread_affinity means nothing here, ignored" in capsys.readouterr().err
    got = plan_of(["-np", "2", "--config-file", str(config), "--stall-check", "--gloo-timeout-seconds", "7", "true"])
    assert got.env == {"RDMATENSOR_TIMEOUT": "7"}


def test_timestamped_lines_stamp_each_line_once(tmp_path):
    with open(tmp_path / "out", "wb") as raw:
        out = TimestampedLines(raw)
        out.write(b"[0] one\n[1] tw")
        out.write(b"o\n\n")
        out.flush()
    lines = (tmp_path / "out").read_bytes().decode().splitlines()
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} "
    assert [re.sub(stamp, "<t> ", line) for line in lines] == ["<t> [0] one", "<t> [1] two", "<t> "], lines


def test_a_job_with_horovodruns_flags(tmp_path):
    """One real launch: -prefix-timestamp stamps every line, --tcp and --gloo-timeout-seconds
    reach the ranks, -hostfile with --slots-per-host gives the slots, --min-num-proc's twin
    flags parse, and the no-effect and hidden flags are taken."""
    (tmp_path / "hosts").write_text("localhost\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "RDMATENSOR_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "rdmatensor.runner.cli", "-np", "2", "-hostfile", str(tmp_path / "hosts"),
         "--slots-per-host", "2", "-prefix-timestamp", "--tcp", "--gloo-timeout-seconds", "33", "--disable-cache",
         "--no-autotune", "--log-with-timestamp", "--stall-check", "sh", "-c",
         'echo "$RDMATENSOR_RANK $RDMATENSOR_PROVIDER $RDMATENSOR_TIMEOUT"; echo err >&2'],
        env=dict(env, PYTHONPATH=str(ROOT)), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} "
    assert sorted(re.sub(stamp, "", line) for line in proc.stdout.splitlines()) == ["[0] 0 tcp 33", "[1] 1 tcp 33"]
    assert all(re.match(stamp, line) for line in proc.stdout.splitlines() + proc.stderr.splitlines())
    assert sorted(re.sub(stamp, "", line) for line in proc.stderr.splitlines()) == ["[0] err", "[1] err"]



def test_elastic_timeout_defaults_to_the_environments_as_horovodruns(files, monkeypatch, capsys):
    argv = [a.format(dir=files) for a in BASES["elastic"]] + ["true"]
    for ours, horovods, want in (("", "", 600.0), ("", "45", 45.0), ("30", "45", 30.0)):
        monkeypatch.setenv("RDMATENSOR_ELASTIC_TIMEOUT", ours)
        monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", horovods)
        assert plan_of(argv).kwargs["elastic_timeout"] == want
        assert plan_of(argv[:-1] + ["--elastic-timeout", "7", "true"]).kwargs["elastic_timeout"] == 7.0
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "soon")
    monkeypatch.delenv("RDMATENSOR_ELASTIC_TIMEOUT")
    assert "HOROVOD_ELASTIC_TIMEOUT='soon': expected seconds" in refusal(argv, capsys)


def test_an_interface_this_host_lacks_is_refused_before_anything_starts(capsys):
    assert "eth9" in refusal(["-np", "2", "--network-interfaces", "eth9,lo", "true"], capsys)


def test_output_filenames_pad_the_rank_as_horovods_gloo_run():
    # Horovod's own _pad_rank, taken from its sources, is the oracle (from size 2: it fails on 1)
    from rdmatensor.runner.processes import padded_rank
    tree = ast.parse((HOROVOD / "gloo_run.py").read_text())
    pad = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_pad_rank")
    scope: dict = {}
    module = ast.fix_missing_locations(ast.Module([ast.Import([ast.alias("math")]), pad], []))
    exec(compile(module, "gloo_run.py", "exec"), scope)
    for size in (2, 9, 10, 11, 99, 100, 101, 1000, 1001):
        for rank in {0, 1, size // 2, size - 1}:
            assert padded_rank(rank, size) == scope["_pad_rank"](rank, size), (rank, size)
    assert padded_rank(0, 1) == "0" and padded_rank(3, 11) == "03"
