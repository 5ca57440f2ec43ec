"""horovodrun's flags on rdmatensor-run, with horovodrun's meanings where they
have one here, and a one-line refusal saying why where they do not: a script
written for horovodrun runs as it is, or says at once what to change.

Most set a variable every rank reads (the RDMATENSOR_* twin of Horovod's,
which wins over a HOROVOD_* one the user also set); the rest act here.
"""
from __future__ import annotations

import argparse
import os

from .placement import LaunchError

# flag -> why it does not apply here
REFUSED = {
    "--cycle-time-ms": "there is no coordinator cycle: a collective starts when every rank calls it",
    "--cache-capacity": "there is no response cache: a tensor set, once planned, costs no control call",
    "--disable-cache": "nothing is cached between launches: every launch checks its hosts afresh",
    "--start-timeout": "ranks start at once; the time they have to find each other is RDMATENSOR_TIMEOUT "
                       "(seconds, default 120: -x it), and --timeout bounds the whole job",
    "--network-interface": "the control plane uses the addresses -H names, and each pair of ranks picks its data "
                           "path by --provider",
    "--autotune": "nothing is autotuned",
    "--hierarchical-allgather": "the all-gather is always direct, rank to rank",
    "--torus-allreduce": "no NCCL",
    "--mpi-threads-disable": "no MPI",
    "--num-nccl-streams": "no NCCL",
    "--gloo": "rdmatensor-run is the launcher: there is no Gloo or MPI to choose",
    "--mpi": "rdmatensor-run is the launcher: there is no Gloo or MPI to choose",
}
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        kwargs.setdefault("nargs", "?")
        kwargs.setdefault("metavar", "VALUE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (horovodrun's) does not apply here: {REFUSED[option_string]}")


def add_to(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("horovodrun's flags, with horovodrun's meanings")
    group.add_argument("--hostfile", metavar="FILE",
                       help="hosts, one per line as `host slots=N` (or host:N); instead of -H")
    group.add_argument("--fusion-threshold-mb", type=int, metavar="MB",
                       help="MiB per all-reduce bucket, 0: no fusion (RDMATENSOR_FUSION_THRESHOLD; default 64)")
    group.add_argument("--timeline-filename", metavar="FILE",
                       help="rank 0 writes the all-reduce's Chrome trace there (RDMATENSOR_TIMELINE)")
    hierarchical = group.add_mutually_exclusive_group()
    hierarchical.add_argument("--hierarchical-allreduce", dest="hierarchical_allreduce", action="store_true",
                              default=None, help="hierarchical all-reduce across hosts (the default here)")
    hierarchical.add_argument("--no-hierarchical-allreduce", dest="hierarchical_allreduce", action="store_false",
                              help="one flat ring (Horovod's default)")
    group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                       help="the ranks' 'rdmatensor' logger level (RDMATENSOR_LOG_LEVEL)")
    group.add_argument("--no-stall-check", action="store_true", help="no stall warning")
    group.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                       help="warn, naming the ranks that have not called it, when a collective waits this long "
                            "(default 60)")
    group.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                       help="fail a collective that waited this long (default 0: until the timeout)")
    group.add_argument("--config-file", metavar="FILE",
                       help="horovodrun's YAML configuration: params (fusion_threshold_mb, hierarchical_allreduce), "
                            "timeline (filename), stall_check (enabled, warning_time_seconds, shutdown_time_seconds), "
                            "logging (level); a flag given too wins, and settings that mean nothing here are named "
                            "in one warning each")
    group.add_argument("--output-filename", metavar="DIR",
                       help="also write each rank's output to DIR/rank.N/stdout and stderr")
    group.add_argument("--verbose", action="store_true", help="say where each rank runs and what it is given")
    group.add_argument("-cb", "--check-build", action="store_true",
                       help="show which providers and compiled parts this installation has, and exit")
    group.add_argument("-v", "--version", action="store_true", help="show the version and exit")
    refused = parser.add_argument_group("horovodrun's flags that do not apply here (each refused, saying why)")
    for flag in REFUSED:
        refused.add_argument(flag, action=_Refuse, help=REFUSED[flag])


# horovodrun's configuration file: section -> {key: the flag's dest here, or None: means nothing here}
CONFIG = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "hierarchical_allreduce": "hierarchical_allreduce",
               "cycle_time_ms": None, "cache_capacity": None, "hierarchical_allgather": None,
               "torus_allreduce": None},
    "timeline": {"filename": "timeline_filename", "mark_cycles": None},
    "stall_check": {"enabled": "no_stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "logging": {"level": "log_level", "with_timestamp": None},
    "autotune": None, "library_options": None, "controller": None,
}
CONFIG_TYPES = {"fusion_threshold_mb": int, "hierarchical_allreduce": bool, "timeline_filename": str,
                "no_stall_check": bool, "stall_check_warning_time_seconds": float,
                "stall_check_shutdown_time_seconds": float, "log_level": str}


def read_config(path: str, args, given: set[str], warn) -> None:
    """Set `args` from horovodrun's YAML configuration file, as horovodrun does: a
    flag on the command line (its dest in `given`) wins over the file. What means
    nothing here is named through warn(), once per setting; a wrong type or an
    unknown section is a LaunchError naming it."""
    import yaml
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except OSError as exc:
        raise LaunchError(f"--config-file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise LaunchError(f"--config-file {path}: not YAML: {exc}") from None
    if not isinstance(config, dict):
        raise LaunchError(f"--config-file {path}: expected sections (params, timeline, ...), not a "
                          f"{type(config).__name__}")
    for section, values in config.items():
        if section not in CONFIG:
            raise LaunchError(f"--config-file {path}: unknown section {section!r} "
                              f"(horovodrun's are {', '.join(CONFIG)})")
        keys = CONFIG[section]
        if keys is None or not isinstance(values, dict):
            if keys is None and values and values != {"enabled": False}:
                warn(f"--config-file {path}: {section} means nothing here, ignored")
            continue
        for key, value in values.items():
            if key not in keys:
                raise LaunchError(f"--config-file {path}: unknown setting {section}.{key}")
            dest = keys[key]
            if dest is None:
                warn(f"--config-file {path}: {section}.{key} means nothing here, ignored")
                continue
            if dest in given or value is None:
                continue
            want = CONFIG_TYPES[dest]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise LaunchError(f"--config-file {path}: {section}.{key} is {value!r}, expected {want.__name__}")
            if dest == "no_stall_check":
                value = not value
            elif dest == "log_level":
                if value.upper() not in LOG_LEVELS:
                    raise LaunchError(f"--config-file {path}: logging.level {value!r} is not one of "
                                      f"{', '.join(LOG_LEVELS)}")
                value = value.upper()
            setattr(args, dest, value)


def environment(args) -> dict[str, str]:
    """The variables the flags set for every rank."""
    env = {}
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb < 0:
            raise LaunchError(f"--fusion-threshold-mb {args.fusion_threshold_mb}: must be 0 or more")
        env["RDMATENSOR_FUSION_THRESHOLD"] = str(args.fusion_threshold_mb << 20)
    if args.timeline_filename:
        env["RDMATENSOR_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.hierarchical_allreduce is not None:
        env["RDMATENSOR_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical_allreduce else "0"
    if args.log_level:
        env["RDMATENSOR_LOG_LEVEL"] = args.log_level.lower()
    if args.no_stall_check:
        env["RDMATENSOR_STALL_CHECK_DISABLE"] = "1"
    for value, name in ((args.stall_check_warning_time_seconds, "RDMATENSOR_STALL_CHECK_TIME_SECONDS"),
                        (args.stall_check_shutdown_time_seconds, "RDMATENSOR_STALL_SHUTDOWN_TIME_SECONDS")):
        if value is not None:
            if value < 0:
                raise LaunchError(f"{name}: {value:g} seconds, must be 0 or more")
            env[name] = f"{value:g}"
    return env


def read_hostfile(path: str) -> str:
    """horovodrun's host file (`host slots=N` or `host:N` per line, # comments) as -H's text."""
    try:
        lines = open(path).read().splitlines()
    except OSError as exc:
        raise LaunchError(f"--hostfile {path}: {exc.strerror or exc}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if len(words) == 1:
            hosts.append(words[0])
        elif len(words) == 2 and words[1].startswith("slots=") and words[1][6:].isdigit():
            hosts.append(f"{words[0]}:{words[1][6:]}")
        else:
            raise LaunchError(f"--hostfile {path}, line {number}: {line!r} is not `host slots=N`")
    if not hosts:
        raise LaunchError(f"--hostfile {path}: no hosts in it")
    return ",".join(hosts)
