"""horovodrun's flags on rdmatensor-run, with horovodrun's meanings where they
have one here, and a one-line refusal saying why where they do not: a script
written for horovodrun runs as it is, or says at once what to change. Every
flag of horovodrun 0.28.1's parser is here, its hidden and --no-* ones and its
single-dash spellings (-hostfile, -prefix-timestamp, -i) included.

Most set a variable every rank reads (the RDMATENSOR_* twin of Horovod's,
which wins over a HOROVOD_* one the user also set); the rest act here.
A --no-X flag that asks for what always holds here (no autotuning, no
hierarchical all-gather, ...) is accepted and changes nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from typing import BinaryIO

from .placement import LaunchError

NO_MPI = "no MPI"
NO_NCCL = "no NCCL"
NO_AUTOTUNE = "nothing is autotuned"
NO_CONTROLLER = "rdmatensor-run is the launcher: there is no Gloo, MPI or jsrun to choose"
LOG_TIME = ("the 'rdmatensor' logger's own handler writes each line's time; give the logger a handler of your "
            "own for another format")

# (flags, values horovodrun takes, why the flag does not apply here)
_REFUSALS = (
    (("--cycle-time-ms",), 1, "there is no coordinator cycle: a collective starts when every rank calls it"),
    (("--cache-capacity",), 1, "there is no response cache: a tensor set, once planned, costs no control call"),
    (("--start-timeout",), 1, "ranks start at once; the time they have to find each other is RDMATENSOR_TIMEOUT "
                              "(--gloo-timeout-seconds), and --timeout bounds the whole job"),
    (("--autotune",), 0, NO_AUTOTUNE),
    (("--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
      "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise"), 1, NO_AUTOTUNE),
    (("--hierarchical-allgather",), 0, "the all-gather is always direct, rank to rank"),
    (("--torus-allreduce",), 0, NO_NCCL),
    (("--timeline-mark-cycles",), 0, "there are no cycles to mark: a collective starts when every rank calls it"),
    (("--mpi-threads-disable", "--no-mpi-threads-disable"), 0, NO_MPI),
    (("--mpi-args",), 1, "no mpirun to pass them to: rdmatensor-run starts the ranks itself, here or over ssh"),
    (("--binding-args",), 1, "no mpirun or jsrun to pass them to: ranks are bound by --bind-to core|none"),
    (("--num-nccl-streams",), 1, NO_NCCL),
    (("--thread-affinity",), 1, "ranks are bound by --bind-to core|none (RDMATENSOR_BIND_TO)"),
    (("--log-without-timestamp", "--log-hide-timestamp"), 0, LOG_TIME),
    (("--blacklist-cooldown-range",), 2, "a host whose worker failed is not blacklisted: a slot the discovery "
                                         "script still offers gets a new worker"),
    (("--gloo", "--mpi", "--jsrun"), 0, NO_CONTROLLER),
)
REFUSED = {flag: why for flags, _, why in _REFUSALS for flag in flags}          # flag -> why

# flag -> why it changes nothing: what it asks for always holds here
NO_EFFECT = {
    "--disable-cache": "nothing is cached between launches: every launch checks its hosts afresh",
    "--no-autotune": NO_AUTOTUNE,
    "--no-hierarchical-allgather": "the all-gather is always direct, rank to rank",
    "--no-torus-allreduce": NO_NCCL,
    "--no-timeline-mark-cycles": "there are no cycles to mark",
    "--log-with-timestamp": LOG_TIME.split(";")[0],
    "--no-log-hide-timestamp": LOG_TIME.split(";")[0],
}
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        kwargs.setdefault("metavar", "VALUE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (horovodrun's) does not apply here: {REFUSED[option_string]}")


class _NoEffect(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def add_to(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("horovodrun's flags, with horovodrun's meanings")
    group.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help="hosts, one per line as `host slots=N` (or host:N); instead of -H")
    group.add_argument("--slots-per-host", type=int, metavar="N",
                       help="slots of each -H/--hostfile host, or host a discovery script names, "
                            "given without :N (default 1)")
    group.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                       help="the private key ssh reaches the remote hosts with (ssh -i FILE)")
    group.add_argument("--network-interfaces", dest="network_interfaces", action=_Interfaces, metavar="NIC[,NIC]",
                       help="remote ranks reach this host at the address of the first of these interfaces "
                            "that has an IPv4 one (default: this host's address on its route to them)")
    group.add_argument("--network-interface", dest="network_interfaces", action=_Interfaces, metavar="NIC",
                       help="one such interface (give it again for more)")
    group.add_argument("--tcp", action="store_true",
                       help="only TCP between the ranks: --provider tcp")
    group.add_argument("--gloo-timeout-seconds", type=float, metavar="S",
                       help="seconds a rank waits for the others at init() and in a collective before it raises "
                            "(RDMATENSOR_TIMEOUT; default 120)")
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
    stall = group.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", action="store_true", help="no stall warning")
    stall.add_argument("--stall-check", dest="no_stall_check", action="store_false",
                       help="the stall warning (the default; wins over --config-file's stall_check.enabled)")
    group.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                       help="warn, naming the ranks that have not called it, when a collective waits this long "
                            "(default 60)")
    group.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                       help="fail a collective that waited this long (default 0: until the timeout)")
    group.add_argument("--config-file", metavar="FILE",
                       help="horovodrun's YAML configuration: params (fusion_threshold_mb, hierarchical_allreduce), "
                            "timeline (filename), stall_check (enabled, warning_time_seconds, shutdown_time_seconds), "
                            "library_options (gloo_timeout_seconds), logging (level); a flag given too wins, and "
                            "settings that mean nothing here are named in one warning each")
    group.add_argument("--output-filename", metavar="DIR",
                       help="also write each rank's output to DIR/rank.N/stdout and stderr")
    group.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                       help="start each line the launcher prints, the ranks' included, with the local time")
    group.add_argument("--verbose", action="store_true", help="say where each rank runs and what it is given")
    group.add_argument("-cb", "--check-build", action="store_true",
                       help="show which providers and compiled parts this installation has, and exit")
    group.add_argument("-v", "--version", action="store_true", help="show the version and exit")
    accepted = parser.add_argument_group("horovodrun's flags that ask for what always holds here (accepted)")
    for flag, why in NO_EFFECT.items():
        accepted.add_argument(flag, action=_NoEffect, help=why)
    refused = parser.add_argument_group("horovodrun's flags that do not apply here (each refused, saying why)")
    for flags, values, why in _REFUSALS:
        for flag in flags:
            refused.add_argument(flag, action=_Refuse, help=why,
                                 **({"nargs": 0} if values == 0 else {"nargs": "?"} if values == 1 else
                                    {"nargs": values, "metavar": ("MIN", "MAX")}))


class _Interfaces(argparse.Action):
    """horovodrun's --network-interfaces (comma-separated) and --network-interface
    (once per interface): one list, in the order given, each name once."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list(getattr(namespace, self.dest, None) or [])
        for name in values.split(","):
            name = name.strip()
            if not name:
                parser.error(f"{option_string} {values!r}: an empty interface name")
            if name not in names:
                names.append(name)
        setattr(namespace, self.dest, names)


# horovodrun's configuration file: section -> {key: the flag's dest here, or None: means nothing here}
CONFIG = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "hierarchical_allreduce": "hierarchical_allreduce",
               "cycle_time_ms": None, "cache_capacity": None, "hierarchical_allgather": None,
               "torus_allreduce": None},
    "timeline": {"filename": "timeline_filename", "mark_cycles": None},
    "stall_check": {"enabled": "no_stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "logging": {"level": "log_level", "with_timestamp": None},
    "library_options": {"gloo_timeout_seconds": "gloo_timeout_seconds", "mpi_threads_disable": None,
                        "num_nccl_streams": None, "thread_affinity": None},
    "autotune": None, "controller": None,
}
CONFIG_TYPES = {"fusion_threshold_mb": int, "hierarchical_allreduce": bool, "timeline_filename": str,
                "no_stall_check": bool, "stall_check_warning_time_seconds": float,
                "stall_check_shutdown_time_seconds": float, "log_level": str, "gloo_timeout_seconds": float}


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
    if args.gloo_timeout_seconds is not None:
        if not args.gloo_timeout_seconds > 0:
            raise LaunchError(f"--gloo-timeout-seconds {args.gloo_timeout_seconds:g}: must be positive")
        env["RDMATENSOR_TIMEOUT"] = f"{args.gloo_timeout_seconds:g}"
    return env


def with_slots(hosts: str, slots: int) -> str:
    """--slots-per-host: -H's text with `:slots` added to each host written without it."""
    if slots < 1:
        raise LaunchError(f"--slots-per-host {slots}: must be 1 or more")
    return ",".join(item if ":" in item else f"{item.strip()}:{slots}" for item in hosts.split(","))


class TimestampedLines:
    """A binary stream that starts every line with the local time (time.asctime(),
    as horovodrun's --prefix-output-with-timestamp writes it). Writers hand it
    whole lines under one lock (processes.Prefixer), so a line is stamped once."""

    def __init__(self, out: BinaryIO):
        self.out, self.at_line_start = out, True

    def write(self, data: bytes) -> int:
        stamp, stamped = time.asctime().encode() + b" ", bytearray()
        for piece in re.split(rb"(?<=\n)", data):
            if piece:
                stamped += (stamp if self.at_line_start else b"") + piece
                self.at_line_start = piece.endswith(b"\n")
        self.out.write(bytes(stamped))
        return len(data)

    def flush(self) -> None:
        self.out.flush()


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
