"""The ranks of one job as processes: started (locally, or through ssh.py),
every line of their output prefixed with the rank, watched, and stopped
together when one fails, the job times out or the launcher is signalled.
cli.py describes what a user sees of it."""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Sequence

from .placement import Placement, place, rank_env
from .ssh import TOKEN, send_token, ssh_command, virtualenv

TIMEOUT_STATUS = 124
START_FAILED = 127                 # as a shell says when it cannot run a command
FAILURE_WAIT = 10.0                # the session's default peer_timeout: survivors have reported by then


SSH_FAILED = 255     # ssh's own status: no connection, refused, or the connection broke


def describe(status: int, remote: bool = False) -> str:
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


class Prefixer(threading.Thread):
    """Copy one rank's stream to ours, line by line, each line whole and prefixed
    (and as it is to `copy`, a file of its own, where one is given)."""

    def __init__(self, pipe: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock,
                 copy: BinaryIO | None = None):
        super().__init__(daemon=True)
        self.pipe, self.out, self.prefix, self.lock, self.copy = pipe, out, prefix, lock, copy

    def run(self) -> None:
        try:
            for line in iter(self.pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self.lock:
                    self.out.write(self.prefix + line)
                    self.out.flush()
                if self.copy is not None:
                    self.copy.write(line)
                    self.copy.flush()
        except (OSError, ValueError):
            pass                                        # our own stream closed: nothing left to copy to
        finally:
            self.pipe.close()
            if self.copy is not None:
                self.copy.close()


class Job:
    """The ranks of one launch: start, watch, stop."""

    def __init__(self, placements: Sequence[Placement], command: Sequence[str], provider: str | None = None,
                 grace: float = 5.0, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 forward: Sequence[str] = (), ssh_port: int | None = None, token: str | None = None,
                 failure_wait: float = FAILURE_WAIT, bind_to: str = "core", output_dir: str | None = None,
                 ssh_identity_file: str | None = None, network_interfaces: Sequence[str] | None = None):
        self.ssh_identity_file = ssh_identity_file              # ssh -i
        self.network_interfaces = list(network_interfaces or ())  # whose address the remote ranks reach us at
        self.placements, self.command, self.grace = list(placements), list(command), grace
        self.output_dir = output_dir            # horovodrun's --output-filename: DIR/rank.N/stdout, stderr
        self.bind_to = bind_to
        self.provider, self.forward, self.ssh_port = provider, list(forward), ssh_port
        self.failure_wait = failure_wait
        self.token = token or secrets.token_hex(16)
        self.job = secrets.token_hex(6)        # in this job's shared-memory segments' names
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.started: list[tuple[Placement, subprocess.Popen]] = []
        self.readers: list[Prefixer] = []
        self._locks = {id(s): threading.Lock() for s in (self.stdout, self.stderr)}     # one per stream
        self.stop_request: tuple[str, int] | None = None        # (why, exit status), set by a signal

    def say(self, message: str) -> None:
        with self._locks[id(self.stderr)]:
            self.stderr.write(f"rdmatensor-run: {message}\n".encode())
            self.stderr.flush()

    def most_ranks(self) -> int:
        """The most ranks this job runs at once (the width of a rank's number in file names)."""
        return len(self.placements)

    def readers_of(self, rank: int, proc: subprocess.Popen) -> list[Prefixer]:
        """The two threads that copy a rank's stdout and stderr, prefixed with `rank`."""
        prefix, out = f"[{rank}] ".encode(), []
        for pipe, ours, name in ((proc.stdout, self.stdout, "stdout"), (proc.stderr, self.stderr, "stderr")):
            copy = None
            if self.output_dir:
                folder = os.path.join(self.output_dir, f"rank.{padded_rank(rank, self.most_ranks())}")
                os.makedirs(folder, exist_ok=True)
                copy = open(os.path.join(folder, name), "ab")
            out.append(Prefixer(pipe, ours, prefix, self._locks[id(ours)], copy))
        return out

    def argv_of(self, p: Placement) -> tuple[list[str], dict[str, str] | None]:
        """The command line and environment that start rank `p` (a remote rank's
        token goes on its connection's standard input, see spawn)."""
        env = rank_env(self.placements, p, self.token, self.provider, self.job, self.bind_to)
        if p.local:
            return list(self.command), local_env(env)
        env.update({k: os.environ[k] for k in self.forward if k in os.environ})
        return self.remote_argv(p.host, env), None

    def remote_argv(self, host: str, env: dict[str, str]) -> list[str]:
        env = {k: v for k, v in env.items() if k != TOKEN}
        return ssh_command(host, env, self.command, os.getcwd(), self.ssh_port, self.grace, self.ssh_identity_file)

    def spawn(self, argv: list[str], env: dict[str, str] | None, local: bool) -> subprocess.Popen:
        """Start one rank: a local one with `env`; a remote one (env None) through
        ssh, which lives as long as its standard input stays open (ssh.py), the
        job's token its first line."""
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL if local else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=die_with_parent)
        if not local:
            send_token(proc.stdin, self.token)
        return proc

    def start(self) -> bool:
        """Start every rank; False (the ones started are stopped) when one cannot start."""
        # Every rank is started before any reader thread: the child hook below runs
        # between fork and exec, which is only safe while this process has one thread.
        for p in self.placements:
            argv, env = self.argv_of(p)
            try:
                self.started.append((p, self.spawn(argv, env, p.local)))
            except OSError as exc:
                self.stop(f"cannot start {p.label}: {exc}")
                self.cleanup()
                return False
        for p, proc in self.started:
            self.readers += self.readers_of(p.rank, proc)
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
        self.say(f"{first.label} {describe(code, not first.local)}: the first rank to fail" +
                 (f"; the other {len(running)} rank(s) get {self.failure_wait:g} s to end"
                  if running and self.failure_wait > 0 else ""))
        deadline = time.monotonic() + self.failure_wait
        while running and time.monotonic() < deadline and not self.stop_request:
            time.sleep(0.05)
            for p, proc in list(running):
                if proc.poll() is not None:
                    self.say(f"{p.label} {describe(proc.returncode, not p.local)}")
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


def local_env(env: dict[str, str]) -> dict[str, str]:
    """A local rank's environment: the launcher's, `env` on top, and the launcher's
    interpreter first on PATH, as an activated virtualenv would put it (the
    symlink a virtualenv's python is, not what it points to), so that `python`
    in the command is the launcher's own."""
    out = dict(os.environ, **env)
    folder = os.path.dirname(sys.executable)
    path = out.get("PATH", os.defpath)
    out["PATH"] = folder + os.pathsep + path if path else folder
    if virtualenv():
        out["VIRTUAL_ENV"] = virtualenv()
    return out


def padded_rank(rank: int, size: int) -> str:
    """`rank` zero-padded to the width of the highest rank of `size`, as horovodrun names rank.N."""
    return str(rank).zfill(len(str(max(size - 1, 0))))


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


def die_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def launch(command: Sequence[str], np: int, hosts: Sequence[tuple[str, int]] | None = None, ps: int = 0,
           provider: str | None = None, timeout: float | None = None, grace: float = 5.0,
           stdout: BinaryIO | None = None, stderr: BinaryIO | None = None, forward: Sequence[str] = (),
           ssh_port: int | None = None, failure_wait: float = FAILURE_WAIT, bind_to: str = "core",
           output_dir: str | None = None, verbose: bool = False, ssh_identity_file: str | None = None,
           network_interfaces: Sequence[str] | None = None) -> int:
    """Run `command` on np workers (+ ps parameter servers); the job's exit status.
    SIGINT and SIGTERM stop every rank (when called from the main thread). LaunchError
    when the job cannot be placed (too few slots, a host or interface that does not resolve)."""
    placements = place(np, hosts or [("localhost", np + ps)], ps, network_interfaces=network_interfaces)
    job = Job(placements, command, provider, grace, stdout, stderr, forward, ssh_port, failure_wait=failure_wait,
              bind_to=bind_to, output_dir=output_dir, ssh_identity_file=ssh_identity_file,
              network_interfaces=network_interfaces)
    if verbose:
        for p in placements:
            job.say(f"{p.label}: {'here' if p.local else 'over ssh'}, local rank {p.local_rank} of {p.local_size}")
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
