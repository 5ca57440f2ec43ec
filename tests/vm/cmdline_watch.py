"""Read every process's command line, over and over, until STOP_FILE exists;
then print, as one JSON line, what was seen: how many rounds, the job tokens
found in processes' environments (RDMATENSOR_TOKEN, readable here as root),
the distinct command lines, those that hold a token or the variable's name,
and how many processes whose command line matches GONE (a regular
expression over the arguments joined by spaces) are still running 10 s
after STOP_FILE appeared (they stop when their launcher's connection ends).

    python cmdline_watch.py STOP_FILE [GONE]

Any user can read /proc/<pid>/cmdline (what `ps` shows); a token there is a
leak. Run on each host of a job, as root, while the job runs."""
import json
import os
import re
import socket
import sys
import time

NAME = b"RDMATENSOR_TOKEN="
PAUSE = 1.0         # each VM has one emulated vCPU: reading /proc back to back slowed the job it watched
GONE_WITHIN = 10.0


def command_lines() -> dict[int, bytes]:
    """Every other process's command line, as any user of this host reads it."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read()
            except OSError:
                pass                # ended meanwhile
    return out


def tokens_of(pids) -> set:
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found.update(v[len(NAME):] for v in f.read().split(b"\0") if v.startswith(NAME))
        except OSError:
            pass
    return found


def still_running(pattern: str) -> int:
    """How many processes match `pattern` (zombies have no command line)."""
    rx = re.compile(pattern.encode())
    return sum(bool(rx.search(c.rstrip(b"\0").replace(b"\0", b" "))) for c in command_lines().values() if c)


def main(stop: str, gone: str | None = None) -> None:
    cmdlines, tokens, rounds = set(), set(), 0
    while not os.path.exists(stop):
        lines = command_lines()
        cmdlines.update(lines.values())
        tokens |= tokens_of(lines)
        rounds += 1
        time.sleep(PAUSE)
    left = 0
    if gone:
        deadline = time.monotonic() + GONE_WITHIN
        while (left := still_running(gone)) and time.monotonic() < deadline:
            time.sleep(0.2)
    tokens.discard(b"")
    leaks = [c for c in cmdlines if NAME in c or any(t in c for t in tokens)]
    print(json.dumps({"host": socket.gethostname(), "rounds": rounds, "left": left,
                      "tokens": sorted(t.decode() for t in tokens),
                      "cmdlines": sorted(c.replace(b"\0", b" ").decode(errors="replace") for c in cmdlines),
                      "leaks": [c.replace(b"\0", b" ").decode(errors="replace") for c in leaks]}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
