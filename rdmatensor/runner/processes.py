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
                               binds the rank to the I-th of N blocks of its cores (launcher/cores.py)
    HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE, OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE
                               the same for workers, as Horovod's and Open MPI's launchers name them
    PYTHONUNBUFFERED=1         so that a Python rank's lines arrive as it prints them

Ranks fill the hosts in order (-H a:2,b:2: ranks 0-1 on a, 2-3 on b), workers
first, then parameter servers; each gets a port below the ephemeral range.
Local ranks run in their own process group; remote ones through
`ssh -o BatchMode=yes HOST sh -c SCRIPT`, a script that runs CMD with its
variables in CWD and stops it when the ssh connection ends (remote_script).

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
import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Sequence

from .cores import BIND_TO, BINDINGS, HOST_SLOT

IN_VM = "RDMATENSOR_RUN_IN_VM"     # set on the launcher re-run inside the VM: never re-run twice
TIMEOUT_STATUS = 124
START_FAILED = 127                 # as a shell says when it cannot run a command
FAILURE_WAIT = 10.0                # the session's default peer_timeout: survivors have reported by then
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class LaunchError(ValueError):
    """A launch that cannot start as asked (bad -H, too few slots, ...)."""


@dataclass(frozen=True)
class Placement:
    """Where one rank runs and what it is."""
    rank: int
    task_type: str          # worker | ps
    index: int              # within its task type
    host: str               # as given in -H
    address: str            # host:port in TF_CONFIG
    local_rank: int         # among this host's tasks of the same type (workers, or ps)
    local_size: int
    local: bool             # runs on this machine (no ssh)

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.task_type} {self.index} on {self.host})"


# ----------------------------------------------------------------- hosts
def parse_hosts(text: str) -> list[tuple[str, int]]:
    """-H "a:2,b:4" -> [("a", 2), ("b", 4)]; a host without ":slots" has one slot."""
    hosts: list[tuple[str, int]] = []
    for item in text.split(","):
        item = item.strip()
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not name or any(c.isspace() for c in name):
            raise LaunchError(f"-H {text!r}: {item!r} is not host[:slots]")
        if not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"-H {text!r}: slots of {name!r} must be a positive integer, not {slots!r}")
        if name in (h for h, _ in hosts):
            raise LaunchError(f"-H {text!r}: host {name!r} is listed twice")
        hosts.append((name, int(slots)))
    return hosts


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES or host == socket.gethostname()


def place(np: int, hosts: Sequence[tuple[str, int]], ps: int = 0, ports: Sequence[int] | None = None
          ) -> list[Placement]:
    """Ranks 0..np-1 (workers) then np..np+ps-1 (parameter servers), filling the hosts in order."""
    if np < 1 or ps < 0:
        raise LaunchError(f"-np {np} / --ps {ps}: need at least one worker")
    total = np + ps
    slots = sum(s for _, s in hosts)
    if total > slots:
        raise LaunchError(f"-np {np}" + (f" + --ps {ps}" if ps else "") + f" = {total} ranks, but the hosts "
                          f"have {slots} slot(s): " + ",".join(f"{h}:{s}" for h, s in hosts))
    where = [h for h, s in hosts for _ in range(s)][:total]
    kinds = ["worker"] * np + ["ps"] * ps
    everything_local = all(is_local(h) for h in where)
    ports = list(ports) if ports is not None else _ports(total)
    out = []
    for rank, (host, kind) in enumerate(zip(where, kinds, strict=True)):
        local = is_local(host)
        addr_host = "127.0.0.1" if local and everything_local else (socket.gethostname() if local else host)
        # local rank and size count this host's tasks of the same type: among workers, Horovod's meaning
        same = [r for r, (h, k) in enumerate(zip(where, kinds, strict=True)) if h == host and k == kind]
        out.append(Placement(rank, kind, rank if kind == "worker" else rank - np, host,
                             f"{addr_host}:{ports[rank]}", same.index(rank), len(same), local))
    return out


def _ports(n: int) -> list[int]:
    from .cluster import free_ports
    return free_ports(n)


def tf_config(placements: Sequence[Placement], me: Placement) -> str:
    from .cluster import Cluster
    workers = tuple(p.address for p in placements if p.task_type == "worker")
    ps = tuple(p.address for p in placements if p.task_type == "ps")
    return Cluster(workers, ps, me.task_type, me.index).to_tf_config()


def rank_env(placements: Sequence[Placement], me: Placement, token: str, provider: str | None,
             job: str = "", bind_to: str = "core") -> dict[str, str]:
    """The variables one rank gets (on top of the launcher's own, for local ranks)."""
    workers = sum(p.task_type == "worker" for p in placements)
    host = [p.rank for p in placements if p.host == me.host]
    env = {"TF_CONFIG": tf_config(placements, me), "RDMATENSOR_TOKEN": token, "RDMATENSOR_JOB": job,
           "RDMATENSOR_RANK": str(me.rank), "RDMATENSOR_SIZE": str(len(placements)),
           "RDMATENSOR_LOCAL_RANK": str(me.local_rank), "RDMATENSOR_LOCAL_SIZE": str(me.local_size),
           BIND_TO: bind_to, HOST_SLOT: f"{host.index(me.rank)}/{len(host)}", "PYTHONUNBUFFERED": "1"}
    if provider:
        env["RDMATENSOR_PROVIDER"] = provider
    if me.task_type == "worker":
        for prefix in ("HOROVOD_", "OMPI_COMM_WORLD_"):
            for name, value in (("RANK", me.rank), ("SIZE", workers), ("LOCAL_RANK", me.local_rank),
                                ("LOCAL_SIZE", me.local_size)):
                env[prefix + name] = str(value)
    return env


def remote_script(env: dict[str, str], command: Sequence[str], cwd: str, grace: float = 5.0) -> str:
    """The POSIX shell script a remote host runs for one rank.

    The rank runs in its own session (setsid), and a watcher waits for the
    end of its standard input, which is the ssh connection: when the launcher
    closes it or the ssh client dies, the watcher stops the rank's process
    group (SIGTERM, SIGKILL after `grace`), so nothing outlives the job there
    either. The script exits with the rank's status."""
    run = "exec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " " + shlex.join(command)
    # A background list reads /dev/null unless redirected: the watcher reads the connection as fd 3.
    return (f"cd {shlex.quote(cwd)} || exit 127\n"
            "exec 3<&0\n"
            f"setsid sh -c {shlex.quote(run)} </dev/null 3<&- & rank=$!\n"
            f"(while read -r _; do :; done; kill -TERM -$rank; sleep {grace:g}; kill -KILL -$rank) "
            "<&3 >/dev/null 2>&1 &\n"
            "watcher=$!\n"
            "wait $rank; status=$?\n"
            "kill $watcher 2>/dev/null\n"
            "exit $status\n")


def ssh_command(host: str, env: dict[str, str], command: Sequence[str], cwd: str,
                ssh_port: int | None = None, grace: float = 5.0) -> list[str]:
    """The ssh command line that runs `command` on `host` with `env`, in `cwd` (see remote_script)."""
    return ["ssh", "-o", "BatchMode=yes", *(["-p", str(ssh_port)] if ssh_port else []), host,
            "sh -c " + shlex.quote(remote_script(env, command, cwd, grace))]


# ----------------------------------------------------------------- the job
SSH_FAILED = 255     # ssh's own status: no connection, refused, or the connection broke


def _describe(status: int, remote: bool = False) -> str:
    """How a rank ended. A remote rank's status is its ssh's: the remote shell's
    128+N for a rank killed by signal N, ssh's 255 for a failed connection."""
    if remote and status == SSH_FAILED:
        return "lost its ssh connection (ssh exited with status 255)"
    if remote and 128 < status <= 128 + 64:
        status = 128 - status
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "?"
        return f"was killed by signal {-status} ({name})" + (" on its host" if remote else "")
    return f"exited with status {status}"


class _Prefixer(threading.Thread):
    """Copy one rank's stream to ours, line by line, each line whole and prefixed."""

    def __init__(self, pipe: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock):
        super().__init__(daemon=True)
        self.pipe, self.out, self.prefix, self.lock = pipe, out, prefix, lock

    def run(self) -> None:
        try:
            for line in iter(self.pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self.lock:
                    self.out.write(self.prefix + line)
                    self.out.flush()
        except (OSError, ValueError):
            pass                                        # our own stream closed: nothing left to copy to
        finally:
            self.pipe.close()


class Job:
    """The ranks of one launch: start, watch, stop."""

    def __init__(self, placements: Sequence[Placement], command: Sequence[str], provider: str | None = None,
                 grace: float = 5.0, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 forward: Sequence[str] = (), ssh_port: int | None = None, token: str | None = None,
                 failure_wait: float = FAILURE_WAIT, bind_to: str = "core"):
        self.placements, self.command, self.grace = list(placements), list(command), grace
        self.bind_to = bind_to
        self.provider, self.forward, self.ssh_port = provider, list(forward), ssh_port
        self.failure_wait = failure_wait
        self.token = token or secrets.token_hex(16)
        self.job = secrets.token_hex(6)        # in this job's shared-memory segments' names
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.started: list[tuple[Placement, subprocess.Popen]] = []
        self.readers: list[_Prefixer] = []
        self._locks = {id(s): threading.Lock() for s in (self.stdout, self.stderr)}     # one per stream
        self.stop_request: tuple[str, int] | None = None        # (why, exit status), set by a signal

    def say(self, message: str) -> None:
        with self._locks[id(self.stderr)]:
            self.stderr.write(f"rdmatensor-run: {message}\n".encode())
            self.stderr.flush()

    def argv_of(self, p: Placement) -> tuple[list[str], dict[str, str] | None]:
        """The command line and environment that start rank `p`."""
        env = rank_env(self.placements, p, self.token, self.provider, self.job, self.bind_to)
        if p.local:
            return list(self.command), dict(os.environ, **env)
        env.update({k: os.environ[k] for k in self.forward if k in os.environ})
        return ssh_command(p.host, env, self.command, os.getcwd(), self.ssh_port, self.grace), None

    def start(self) -> bool:
        """Start every rank; False (the ones started are stopped) when one cannot start."""
        # Every rank is started before any reader thread: the child hook below runs
        # between fork and exec, which is only safe while this process has one thread.
        for p in self.placements:
            argv, env = self.argv_of(p)
            try:
                # a remote rank lives as long as its ssh's standard input stays open (remote_script)
                stdin = subprocess.DEVNULL if p.local else subprocess.PIPE
                self.started.append((p, subprocess.Popen(argv, env=env, stdin=stdin,
                                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                         start_new_session=True, preexec_fn=_die_with_parent)))
            except OSError as exc:
                self.stop(f"cannot start {p.label}: {exc}")
                self.cleanup()
                return False
        for p, proc in self.started:
            prefix = f"[{p.rank}] ".encode()
            self.readers += [_Prefixer(proc.stdout, self.stdout, prefix, self._locks[id(self.stdout)]),
                             _Prefixer(proc.stderr, self.stderr, prefix, self._locks[id(self.stderr)])]
        for r in self.readers:
            r.start()
        return True

    def wait(self, timeout: float | None = None) -> int:
        """Until every rank exits 0 (0), one fails, the timeout passes or a stop is requested."""
        deadline = None if timeout is None else time.monotonic() + timeout
        status = 0
        while True:
            codes = [proc.poll() for _, proc in self.started]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                p, code = self.started[failed][0], codes[failed]
                status = code if code > 0 else 128 - code
                self.let_others_end(p, code)
                if any(proc.poll() is None for _, proc in self.started):
                    self.stop(f"{self.failure_wait:g} s after the first failure")
                break
            if all(c == 0 for c in codes):
                break
            if self.stop_request:
                why, status = self.stop_request
                self.stop(why)
                break
            if deadline is not None and time.monotonic() > deadline:
                status = TIMEOUT_STATUS
                self.stop(f"the job did not finish within its {timeout:g} s timeout (--timeout)")
                break
            time.sleep(0.05)
        self.cleanup()
        return status

    def let_others_end(self, first: Placement, code: int) -> None:
        """The first failure: say which rank and how, then give the others
        failure_wait seconds to end by themselves, naming each as it does."""
        running = [(p, proc) for p, proc in self.started if proc.poll() is None]
        self.say(f"{first.label} {_describe(code, not first.local)}: the first rank to fail" +
                 (f"; the other {len(running)} rank(s) get {self.failure_wait:g} s to end"
                  if running and self.failure_wait > 0 else ""))
        deadline = time.monotonic() + self.failure_wait
        while running and time.monotonic() < deadline and not self.stop_request:
            time.sleep(0.05)
            for p, proc in list(running):
                if proc.poll() is not None:
                    self.say(f"{p.label} {_describe(proc.returncode, not p.local)}")
                    running.remove((p, proc))

    def stop(self, why: str) -> None:
        """SIGTERM every running rank's process group, SIGKILL what is left after the grace period."""
        running = [(p, proc) for p, proc in self.started if proc.poll() is None]
        self.say(why + (f": stopping {len(running)} other rank(s)" if running else ""))
        for _, proc in running:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while any(proc.poll() is None for _, proc in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p, proc in running:
            if proc.poll() is None:
                self.say(f"{p.label} still running after {self.grace:g} s: SIGKILL")
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()

    def cleanup(self) -> None:
        """No process a rank started outlives the job (shared arenas have no
        name, so they go with the processes); its output is copied to the end."""
        for _, proc in self.started:
            _signal_group(proc.pid, signal.SIGKILL)     # leftovers in a finished rank's group
            proc.wait()
            if proc.stdin:
                proc.stdin.close()
        for r in self.readers:
            r.join(timeout=2.0)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _libc_prctl():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()          # looked up here, not in the forked child
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def launch(command: Sequence[str], np: int, hosts: Sequence[tuple[str, int]] | None = None, ps: int = 0,
           provider: str | None = None, timeout: float | None = None, grace: float = 5.0,
           stdout: BinaryIO | None = None, stderr: BinaryIO | None = None, forward: Sequence[str] = (),
           ssh_port: int | None = None, failure_wait: float = FAILURE_WAIT, bind_to: str = "core") -> int:
    """Run `command` on np workers (+ ps parameter servers); the job's exit status.
    SIGINT and SIGTERM stop every rank (when called from the main thread)."""
    placements = place(np, hosts or [("localhost", np + ps)], ps)
    job = Job(placements, command, provider, grace, stdout, stderr, forward, ssh_port, failure_wait=failure_wait,
              bind_to=bind_to)
    with stop_on_signals(job):
        return job.wait(timeout) if job.start() else START_FAILED


@contextlib.contextmanager
def stop_on_signals(job: Job):
    """SIGINT, SIGTERM and SIGHUP ask `job` to stop (from the main thread only)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)):
            def handler(signum, frame, status=status):
                job.stop_request = (f"got {signal.Signals(signum).name}", status)
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ----------------------------------------------------------------- the VM
def run_in_vm(argv: Sequence[str], timeout: float | None) -> int:
    """Re-run this launcher inside one SoftRoCE VM (every rank there, verbs available)."""
    inner = [a for a in argv if a != "--softroce-vm"]
    vm_timeout = (timeout or 3600.0) + 300.0                 # the launcher's own timeout, plus boot
    cmd = [sys.executable, "-m", "rdmatensor", "softroce", "vm", "--timeout", f"{vm_timeout:g}", "--",
           "env", f"{IN_VM}=1", sys.executable, "-m", "tf_plugin.launcher.run", *inner]
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode


# ----------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    from rdmatensor.providers import REGISTRY
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
    p.add_argument("--timeout", type=float, help="seconds for the whole job; exit 124 past it")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--failure-wait", type=float, default=FAILURE_WAIT,
                   help="seconds the other ranks get to end by themselves after one fails, before they are "
                        f"stopped (default {FAILURE_WAIT:g}: the peer timeout, within which they see the loss)")
    p.add_argument("-x", dest="forward", action="append", default=[], metavar="VAR",
                   help="forward this environment variable to remote ranks (local ranks get all)")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    elastic = p.add_argument_group("elastic jobs (as horovodrun's; see tf_plugin.launcher.elastic)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="prints the hosts that may run workers now, one host:slots per line")
    elastic.add_argument("--min-np", type=int, help="fewest workers the job trains with")
    elastic.add_argument("--max-np", type=int, help="most workers the job trains with")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0,
                         help="seconds the job waits for --min-np workers before it fails (default 600)")
    elastic.add_argument("--discovery-interval", type=float, default=1.0,
                         help="seconds between runs of the discovery script (default 1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="CMD [ARGS ...]")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command every rank runs, e.g. rdmatensor-run -np 2 python train.py")
    if args.timeout is not None and args.timeout <= 0:
        p.error(f"--timeout {args.timeout:g}: must be positive")
    if args.failure_wait < 0:
        p.error(f"--failure-wait {args.failure_wait:g}: must be 0 or more")
    if args.host_discovery_script or args.min_np is not None or args.max_np is not None:
        return main_elastic(p, args, command)
    if args.np is None:
        p.error("-np is required (or --host-discovery-script with --min-np/--max-np for an elastic job)")
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else None
        placements = place(args.np, hosts or [("localhost", args.np + args.ps)], args.ps,
                           ports=[0] * (args.np + args.ps))
        if args.softroce_vm and not all(pl.local for pl in placements):
            raise LaunchError("--softroce-vm runs every rank in one VM on this machine: -H must name only this host")
    except LaunchError as exc:
        p.error(str(exc))
    if args.softroce_vm and not os.environ.get(IN_VM):
        return run_in_vm(argv, args.timeout)
    return launch(command, args.np, hosts, args.ps, args.provider, args.timeout, args.grace,
                  forward=args.forward, ssh_port=args.ssh_port, failure_wait=args.failure_wait,
                  bind_to=args.bind_to)


def main_elastic(p: argparse.ArgumentParser, args, command: list[str]) -> int:
    from .elastic import launch_elastic
    if not args.host_discovery_script:
        p.error("--min-np/--max-np need --host-discovery-script (which hosts may run workers)")
    if args.ps or args.hosts or args.softroce_vm:
        p.error("an elastic job takes its hosts from --host-discovery-script: no -H, --ps or --softroce-vm")
    min_np = args.min_np if args.min_np is not None else (args.np or 1)
    max_np = args.max_np if args.max_np is not None else max(min_np, args.np or min_np)
    if not 1 <= min_np <= max_np or (args.np is not None and not min_np <= args.np <= max_np):
        p.error(f"--min-np {min_np}, -np {args.np}, --max-np {max_np}: need 1 <= min-np <= np <= max-np")
    if args.elastic_timeout <= 0 or args.discovery_interval <= 0:
        p.error("--elastic-timeout and --discovery-interval must be positive")
    if not os.access(args.host_discovery_script, os.X_OK):
        p.error(f"--host-discovery-script {args.host_discovery_script}: not an executable file")
    return launch_elastic(command, os.path.abspath(args.host_discovery_script), min_np, max_np, args.np,
                          args.provider, args.timeout, args.elastic_timeout, args.discovery_interval,
                          grace=args.grace, forward=args.forward, ssh_port=args.ssh_port)


if __name__ == "__main__":
    sys.exit(main())
