"""rdmatensor-run: start a script on N ranks, as horovodrun and mpirun do.

    rdmatensor-run -np N [-H host1:slots,host2:slots] [--ps M] [--provider P]
                   [--bind-to core|none] [--softroce-vm] [--timeout S] [--failure-wait S] CMD [ARGS ...]
    rdmatensor-run [-np N] --min-np MIN --max-np MAX --host-discovery-script SCRIPT
                   [--elastic-timeout S] [--provider P] CMD [ARGS ...]      (elastic.py)

Every rank runs CMD with, in its environment:

    TF_CONFIG                  the cluster (workers, then --ps parameter servers) and this task
    RDMATENSOR_TOKEN           a fresh random token shared by the job's ranks
    RDMATENSOR_JOB             the job's id, in its shared-memory segments' names (/proc/*/maps)
    RDMATENSOR_PROVIDER        the provider, when --provider is given
    RDMATENSOR_RANK, RDMATENSOR_SIZE                   rank in the cluster, number of ranks
    RDMATENSOR_LOCAL_RANK, RDMATENSOR_LOCAL_SIZE       rank among its host's tasks of its type
    RDMATENSOR_BIND_TO, RDMATENSOR_HOST_SLOT           --bind-to (core, the default, or none), and
                               I/N: its place among all N tasks on its host; `import tf_plugin`
                               binds the rank to the I-th of N blocks of its cores (runner/cores.py)
    HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE, OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE
                               the same for workers, as Horovod's and Open MPI's launchers name them
    PYTHONUNBUFFERED=1         so that a Python rank's lines arrive as it prints them

Ranks fill the hosts in order (-H a:2,b:2: ranks 0-1 on a, 2-3 on b), workers
first, then parameter servers; each gets a port below the ephemeral range.
Local ranks run in their own process group; remote ones through
`ssh -o BatchMode=yes HOST sh -c SCRIPT`, a script that runs CMD with its
variables in CWD and stops it when the ssh connection ends (remote_script).
The token is the first line of that connection's standard input, never on a
command line. Remote ranks reach this host at the address of its route to
them, or of the first --network-interfaces interface that has one. Ranks run
with the launcher's interpreter's folder first on PATH, as an activated
virtualenv would, so `python` is the launcher's (remote hosts where that
interpreter exists too).

Every line a rank prints (stdout or stderr) is copied whole to the same
stream of the launcher, prefixed with `[rank] `. When a rank fails, the
launcher names it and its exit status or signal as the first to fail, gives
the other ranks --failure-wait seconds to end by themselves (a rank blocked
in a collective sees the loss as PeerLost within the peer timeout, and says
so), names each as it ends, then sends SIGTERM to every rank's process
group still running, SIGKILL after --grace seconds, and exits with the first failed rank's
status (128 + signal when killed). --timeout bounds the whole job (exit
124); SIGINT or SIGTERM to the launcher stops every rank at once (exit 130
or 143).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Sequence

from .. import __version__, environment
from ..providers import REGISTRY
from . import horovodrun_flags
from .cores import BINDINGS
from .placement import LaunchError, parse_hosts, place
from .processes import FAILURE_WAIT, launch

IN_VM = "RDMATENSOR_RUN_IN_VM"     # set on the launcher re-run inside the VM: never re-run twice


def run_in_vm(argv: Sequence[str], timeout: float | None) -> int:
    """Re-run this launcher inside one SoftRoCE VM (every rank there, verbs available)."""
    inner = [a for a in argv if a != "--softroce-vm"]
    vm_timeout = (timeout or 3600.0) + 300.0                 # the launcher's own timeout, plus boot
    cmd = [sys.executable, "-m", "rdmatensor", "softroce", "vm", "--timeout", f"{vm_timeout:g}", "--",
           "env", f"{IN_VM}=1", sys.executable, "-m", "rdmatensor.runner.cli", *inner]
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdmatensor-run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("-np", "--num-proc", dest="np", type=int,
                   help="number of workers (elastic: at first; default what the discovery script offers)")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: this machine, one slot per rank)")
    p.add_argument("--ps", type=int, default=0,
                   help="parameter-server tasks added to TF_CONFIG (ranks after the workers)")
    p.add_argument("--provider", choices=["auto", *REGISTRY],
                   help="sets RDMATENSOR_PROVIDER for every rank")
    p.add_argument("--bind-to", choices=BINDINGS, default="core",
                   help="core (default): each rank runs on its own block of its host's cores, as mpirun's; "
                        "none: wherever the scheduler puts it (elastic jobs are not bound)")
    p.add_argument("--softroce-vm", action="store_true", help="run every rank inside one SoftRoCE VM (verbs)")
    p.add_argument("--timeout", type=float, help="seconds for the whole job, exit 124 past it (horovodrun's "
                   "--start-timeout bounds only start-up: see below)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--failure-wait", type=float, default=FAILURE_WAIT,
                   help="seconds the other ranks get to end by themselves after one fails, before they are "
                        f"stopped (default {FAILURE_WAIT:g}: the peer timeout, within which they see the loss)")
    p.add_argument("-x", dest="forward", action="append", default=[], metavar="VAR",
                   help="forward this environment variable to remote ranks (local ranks get all); "
                        "name=value sets it for every rank, as mpirun's -x")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    elastic = p.add_argument_group("elastic jobs (as horovodrun's; see rdmatensor.runner.elastic)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="prints the hosts that may run workers now, one host:slots per line")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="fewest workers the job trains with")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="most workers the job trains with")
    elastic.add_argument("--elastic-timeout", type=float,
                         help="seconds the job waits for --min-np workers before it fails (default "
                              "RDMATENSOR_ELASTIC_TIMEOUT, else HOROVOD_ELASTIC_TIMEOUT, else 600, as horovodrun)")
    elastic.add_argument("--discovery-interval", type=float, default=1.0,
                         help="seconds between runs of the discovery script (default 1)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="stop the job when it would form again (a worker lost or added) more than N times "
                              "after its first round (horovodrun's; default: no limit)")
    horovodrun_flags.add_to(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="CMD [ARGS ...]")
    return p


def check_build() -> str:
    """What this installation can do, as horovodrun --check-build says it for Horovod."""
    from .. import native, providers
    lines = [f"rdmatensor v{__version__}:", "", "Providers (where they can run here):"]
    for name, (ok, why) in providers.viability().items():
        lines.append(f"    [{'X' if ok else ' '}] {name}" + ("" if ok else f"  ({why})"))
    lines += ["", "Compiled parts (else their Python twins run):"]
    for what, loaded in native.built().items():
        lines.append(f"    [{'X' if loaded is None else ' '}] {what}" + ("" if loaded is None else f"  ({loaded})"))
    return "\n".join(lines)


def parsed_without_defaults(argv: list[str]) -> argparse.Namespace:
    """Only what the command line gave (a flag wins over --config-file)."""
    p = parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return p.parse_args(argv)


@dataclass
class Plan:
    """What a command line asks main() to do, decided before anything starts."""
    kind: str                   # print (text), vm (re-run in a VM), static (processes.launch), elastic
    text: str = ""
    env: dict[str, str] = field(default_factory=dict)       # the flags' variables, for every rank
    kwargs: dict = field(default_factory=dict)              # the launch function's arguments


def plan(p: argparse.ArgumentParser, argv: list[str]) -> Plan:
    """The Plan for `argv`; a command line that cannot run is p.error() (exit 2, saying why)."""
    args = p.parse_args(argv)
    if args.version:
        return Plan("print", f"rdmatensor-run {__version__}")
    if args.check_build:
        return Plan("print", check_build())
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if args.config_file:
            given = set(vars(parsed_without_defaults(argv)))
            horovodrun_flags.read_config(args.config_file, args, given,
                                         lambda msg: print(f"rdmatensor-run: {msg}", file=sys.stderr))
        if args.hostfile:
            if args.hosts:
                raise LaunchError("give the hosts once: -H or --hostfile")
            args.hosts = horovodrun_flags.read_hostfile(args.hostfile)
        if args.slots_per_host is not None:
            if args.slots_per_host < 1:
                raise LaunchError(f"--slots-per-host {args.slots_per_host}: must be 1 or more")
            if args.hosts:
                args.hosts = horovodrun_flags.with_slots(args.hosts, args.slots_per_host)
        env = horovodrun_flags.environment(args)
    except LaunchError as exc:
        p.error(str(exc))
    if args.tcp:
        if args.provider not in (None, "tcp"):
            p.error(f"--tcp means --provider tcp, not --provider {args.provider}")
        args.provider = "tcp"
    if args.ssh_identity_file and not os.access(args.ssh_identity_file, os.R_OK):
        p.error(f"--ssh-identity-file {args.ssh_identity_file}: not a readable file")
    if not command:
        p.error("give the command every rank runs, e.g. rdmatensor-run -np 2 python train.py")
    if args.timeout is not None and args.timeout <= 0:
        p.error(f"--timeout {args.timeout:g}: must be positive")
    if args.failure_wait < 0:
        p.error(f"--failure-wait {args.failure_wait:g}: must be 0 or more")
    # -x name=value sets it for every rank, as mpirun's does; -x name forwards this shell's
    names = []
    for item in args.forward:
        name, is_set, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            p.error(f"-x {item}: give an environment variable's name, or name=value")
        if is_set and name == "RDMATENSOR_TOKEN":
            p.error(f"-x {name}=...: a token on the command line shows in ps; export {name} instead")
        if is_set:
            env[name] = value
        names.append(name)
    args.forward = list(dict.fromkeys(names))
    # the launch's own arguments, with the variables the flags set forwarded to remote ranks
    common = dict(command=command, provider=args.provider, timeout=args.timeout, grace=args.grace,
                  forward=args.forward + [k for k in env if k not in args.forward], ssh_port=args.ssh_port,
                  output_dir=args.output_filename, ssh_identity_file=args.ssh_identity_file,
                  network_interfaces=args.network_interfaces)
    if args.prefix_output_with_timestamp:
        common.update(stdout=horovodrun_flags.TimestampedLines(sys.stdout.buffer),
                      stderr=horovodrun_flags.TimestampedLines(sys.stderr.buffer))
    if args.host_discovery_script or args.min_np is not None or args.max_np is not None:
        return Plan("elastic", env=env, kwargs=elastic_arguments(p, args, common))
    if args.np is None:
        p.error("-np is required (or --host-discovery-script with --min-np/--max-np for an elastic job)")
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else None
        placements = place(args.np, hosts or [("localhost", args.np + args.ps)], args.ps,
                           ports=[0] * (args.np + args.ps), network_interfaces=args.network_interfaces)
        if args.softroce_vm and not all(pl.local for pl in placements):
            raise LaunchError("--softroce-vm runs every rank in one VM on this machine: -H must name only this host")
    except LaunchError as exc:
        p.error(str(exc))
    if args.softroce_vm and not os.environ.get(IN_VM):
        return Plan("vm", env=env, kwargs={"timeout": args.timeout})
    return Plan("static", env=env, kwargs=dict(common, np=args.np, hosts=hosts, ps=args.ps,
                                               failure_wait=args.failure_wait, bind_to=args.bind_to,
                                               verbose=args.verbose))


def elastic_timeout_default() -> float:
    """horovodrun's --elastic-timeout default: the environment's, ours winning over Horovod's name."""
    for name in ("RDMATENSOR_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"):
        value = environment.get(name)
        if value is not None:
            try:
                return float(value)
            except ValueError:
                raise LaunchError(f"{name}={value!r}: expected seconds") from None
    return 600.0


def elastic_arguments(p: argparse.ArgumentParser, args, common: dict) -> dict:
    """launch_elastic's arguments (elastic.py), checked."""
    if not args.host_discovery_script:
        p.error("--min-np/--max-np need --host-discovery-script (which hosts may run workers)")
    if args.ps or args.hosts or args.softroce_vm:
        p.error("an elastic job takes its hosts from --host-discovery-script: no -H, --ps or --softroce-vm")
    min_np = args.min_np if args.min_np is not None else (args.np or 1)
    max_np = args.max_np if args.max_np is not None else max(min_np, args.np or min_np)
    if not 1 <= min_np <= max_np or (args.np is not None and not min_np <= args.np <= max_np):
        p.error(f"--min-np {min_np}, -np {args.np}, --max-np {max_np}: need 1 <= min-np <= np <= max-np")
    if args.elastic_timeout is None:
        try:
            args.elastic_timeout = elastic_timeout_default()
        except LaunchError as exc:
            p.error(str(exc))
    if args.elastic_timeout <= 0 or args.discovery_interval <= 0:
        p.error("--elastic-timeout and --discovery-interval must be positive")
    if args.reset_limit is not None and args.reset_limit < 0:
        p.error(f"--reset-limit {args.reset_limit}: must be 0 or more")
    if not os.access(args.host_discovery_script, os.X_OK):
        p.error(f"--host-discovery-script {args.host_discovery_script}: not an executable file")
    return dict(common, script=os.path.abspath(args.host_discovery_script), min_np=min_np, max_np=max_np,
                np=args.np, elastic_timeout=args.elastic_timeout, discovery_interval=args.discovery_interval,
                reset_limit=args.reset_limit, slots_per_host=args.slots_per_host or 1)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    todo = plan(p, argv)
    if todo.kind == "print":
        print(todo.text)
        return 0
    os.environ.update(todo.env)               # local ranks inherit it, remote ones get it forwarded
    if todo.kind == "vm":
        return run_in_vm(argv, todo.kwargs["timeout"])
    try:
        if todo.kind == "elastic":
            from .elastic import launch_elastic
            return launch_elastic(**todo.kwargs)
        return launch(**todo.kwargs)
    except LaunchError as exc:               # an interface or host that does not resolve, before any rank starts
        p.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
