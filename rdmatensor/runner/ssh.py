"""How a rank on another host starts: one ssh connection per rank, running a
shell script that stops the rank when the connection ends.

The job's token is never on a command line (any user of either host reads
those with `ps`): the launcher writes it as the first line of the
connection's standard input, the script reads it with the shell's `read`
and exports it, so it reaches the rank through its environment only
(/proc/<pid>/environ, readable by its owner and root). The rest of standard
input is the liveness channel the script's watcher reads."""
from __future__ import annotations

import shlex
import sys
from typing import BinaryIO, Sequence

TOKEN = "RDMATENSOR_TOKEN"


def remote_script(env: dict[str, str], command: Sequence[str], cwd: str, grace: float = 5.0,
                  interpreter: str | None = None) -> str:
    """The POSIX shell script a remote host runs for one rank.

    It reads the job's token from the first line of its standard input (see
    send_token). When `interpreter` (default: this launcher's) exists on that
    host too, its directory goes first on PATH, as an activated virtualenv
    would put it, so `python` is this launcher's; else PATH is left as it is,
    said in one line. The rank runs in its own session (setsid), and a
    watcher waits for the end of its standard input, which is the ssh
    connection: when the launcher closes it or the ssh client dies, the
    watcher stops the rank's process group (SIGTERM, SIGKILL after `grace`),
    so nothing outlives the job there either. The script exits with the
    rank's status."""
    if TOKEN in env:
        raise ValueError(f"{TOKEN} would be on the remote command line: it goes on standard input (send_token)")
    interpreter = interpreter or sys.executable
    run = "exec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " " + shlex.join(command)
    # A background list reads /dev/null unless redirected: the watcher reads the connection as fd 3.
    return (f"IFS= read -r {TOKEN} || {{ echo 'rdmatensor-run: no job token on standard input' >&2; exit 1; }}\n"
            f"export {TOKEN}\n"
            f"cd {shlex.quote(cwd)} || exit 127\n"
            + activate(interpreter) +
            "exec 3<&0\n"
            f"setsid sh -c {shlex.quote(run)} </dev/null 3<&- & rank=$!\n"
            f"(while read -r _; do :; done; kill -TERM -$rank; sleep {grace:g}; kill -KILL -$rank) "
            "<&3 >/dev/null 2>&1 &\n"
            "watcher=$!\n"
            "wait $rank; status=$?\n"
            "kill $watcher 2>/dev/null\n"
            "exit $status\n")


def activate(interpreter: str) -> str:
    """Shell lines: `interpreter`'s directory first on PATH where it exists (and
    VIRTUAL_ENV, for a virtualenv's), else one line saying PATH is left alone."""
    folder = interpreter.rpartition("/")[0] or "/"
    venv = virtualenv()
    exports = f"PATH={shlex.quote(folder)}:$PATH; export PATH" + (
        f"; VIRTUAL_ENV={shlex.quote(venv)}; export VIRTUAL_ENV" if venv else "")
    missing = shlex.quote(f"rdmatensor-run: {interpreter} is not on this host")
    return (f"if [ -x {shlex.quote(interpreter)} ]; then {exports}\n"
            f"else echo {missing}\" ($(uname -n)): PATH left as it is\" >&2; fi\n")


def virtualenv() -> str:
    """The virtualenv this launcher runs in ("" when none)."""
    return sys.prefix if sys.prefix != sys.base_prefix else ""


def ssh_command(host: str, env: dict[str, str], command: Sequence[str], cwd: str,
                ssh_port: int | None = None, grace: float = 5.0, identity_file: str | None = None) -> list[str]:
    """The ssh command line that runs `command` on `host` with `env`, in `cwd` (see remote_script);
    its standard input must start with the token (send_token)."""
    return ["ssh", "-o", "BatchMode=yes", *(["-p", str(ssh_port)] if ssh_port else []),
            *(["-i", identity_file] if identity_file else []), host,
            "sh -c " + shlex.quote(remote_script(env, command, cwd, grace))]


def send_token(stdin: BinaryIO, token: str) -> None:
    """The first line of a remote rank's connection; the pipe stays open (the watcher's channel)."""
    if not token or "\n" in token:
        raise ValueError("the job token must be one non-empty line")
    try:
        stdin.write(token.encode() + b"\n")
        stdin.flush()
    except BrokenPipeError:
        pass                    # ssh ended already: its status says why
