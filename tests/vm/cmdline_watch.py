"""Read every process's command line, over and over, until STOP_FILE exists;
then print, as one JSON line, what was seen: how many rounds, the job tokens
found in processes' environments (RDMATENSOR_TOKEN, readable here as root),
the distinct command lines, and those that hold a token or the variable's
name. READY_FILE is created once the first round is done.

    python cmdline_watch.py STOP_FILE READY_FILE

Any user can read /proc/<pid>/cmdline (what `ps` shows); a token there is a
leak. Run on each host of a job, as root, while the job runs."""
import json
import os
import socket
import sys
import time

NAME = b"RDMATENSOR_TOKEN="
PAUSE = 0.25        # each VM has one emulated vCPU: reading /proc back to back slowed the job it watched


def one_round(cmdlines: set, tokens: set) -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdlines.add(f.read())
            with open(f"/proc/{entry}/environ", "rb") as f:
                tokens.update(v[len(NAME):] for v in f.read().split(b"\0") if v.startswith(NAME))
        except OSError:
            pass                    # ended meanwhile


def main(stop: str, ready: str) -> None:
    cmdlines, tokens, rounds = set(), set(), 0
    while not os.path.exists(stop):
        one_round(cmdlines, tokens)
        rounds += 1
        if rounds == 1:
            open(ready, "w").close()
        time.sleep(PAUSE)
    tokens.discard(b"")
    leaks = [c for c in cmdlines if NAME in c or any(t in c for t in tokens)]
    print(json.dumps({"host": socket.gethostname(), "rounds": rounds,
                      "tokens": sorted(t.decode() for t in tokens),
                      "cmdlines": sorted(c.replace(b"\0", b" ").decode(errors="replace") for c in cmdlines),
                      "leaks": [c.replace(b"\0", b" ").decode(errors="replace") for c in leaks]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
