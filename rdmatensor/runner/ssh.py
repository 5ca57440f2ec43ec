"""How a rank on another host starts: one ssh connection per rank, running a
shell script that stops the rank when the connection ends."""
from __future__ import annotations

import shlex
from typing import Sequence


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
                ssh_port: int | None = None, grace: float = 5.0, identity_file: str | None = None) -> list[str]:
    """The ssh command line that runs `command` on `host` with `env`, in `cwd` (see remote_script)."""
    return ["ssh", "-o", "BatchMode=yes", *(["-p", str(ssh_port)] if ssh_port else []),
            *(["-i", identity_file] if identity_file else []), host,
            "sh -c " + shlex.quote(remote_script(env, command, cwd, grace))]
