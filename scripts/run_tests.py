"""Run the whole test suite and report it as one.

0. lint:  ruff over the tree (pyproject.toml's [tool.ruff]); unclean code fails the run
          before any test starts;
1. host:  every test not marked `rdma`, natively (including the `vm` tests,
          which boot SoftRoCE VMs themselves);
2. rdma:  the tests marked `rdma`, natively where this host has an ACTIVE
          RDMA port, else inside a SoftRoCE VM (`rdmatensor softroce vm`).

An rdma suite that runs in a VM runs beside the host suite, not after it: the
host suite keeps the cores busy only about 60% of its time (its tests wait on
timeouts, links taken down, hung VMs), and the VM fills the rest (1,447 s ->
1,204 s here). Its output is kept in test-results/rdma.log and shown once both
have ended. --serial runs them one after the other, the VM's output as it comes.

Arguments after `--` go to every pytest run (e.g. `-- -k write -x`).
Ends with one line: `total: N passed, N failed, N skipped`.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rdmatensor.devices import active_port  # noqa: E402


def counts(junit: Path) -> dict[str, int]:
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not junit.exists():
        return total
    root = ET.parse(junit).getroot()
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for key in total:
            total[key] += int(suite.get(key, 0))
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("host", "rdma"))
    parser.add_argument("--serial", action="store_true",
                        help="run the VM's rdma suite after the host suite, not beside it")
    parser.add_argument("--beside", action="store_true", help=argparse.SUPPRESS)    # the default, once an option
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    extra = [a for a in args.pytest_args if a != "--"]
    results = ROOT / "test-results"
    results.mkdir(exist_ok=True)
    py = sys.executable

    suites = []          # (name, command, where, beside): `beside` runs alongside the suites after it
    if args.only in (None, "host"):
        suites.append(("host", [py, "-m", "pytest", "-m", "not rdma", "-rs",
                                f"--junitxml={results}/host.xml", *extra], "natively", False))
    if args.only in (None, "rdma"):
        pytest_rdma = [py, "-m", "pytest", "-m", "rdma", "-rs", f"--junitxml={results}/rdma.xml", *extra]
        found = active_port()
        if found:
            suites.append(("rdma", pytest_rdma, f"natively on {found[0].name}", False))
        else:
            beside = not args.serial and args.only is None
            # first, so that it starts before the host suite it runs beside
            suites.insert(0 if beside else len(suites), (
                "rdma", [py, "-m", "rdmatensor", "softroce", "vm", "--timeout", "1800",
                         "--share", str(results), "--", *pytest_rdma],
                "inside a SoftRoCE VM (this host has no ACTIVE RDMA port)"
                + (", beside the host tests: its output follows them" if beside else ""), beside))

    print("=== lint: ruff check", flush=True)
    if subprocess.run([py, "-m", "ruff", "check", "."], cwd=ROOT).returncode != 0:
        print("=== lint failed: fix what ruff reports (no test ran)", flush=True)
        return 1

    ok = True
    summary = []
    started = time.monotonic()
    running = []         # (name, process, log, started) of the suites running beside the others
    ended = {}           # name -> when a suite running beside ended

    def watch(name: str, proc: subprocess.Popen) -> None:
        proc.wait()
        ended[name] = time.monotonic()

    def result(name: str, rc: int, seconds: float) -> None:
        nonlocal ok
        c = counts(results / f"{name}.xml")
        failed = c["failures"] + c["errors"]
        passed = c["tests"] - failed - c["skipped"]
        if rc != 0 or c["tests"] == 0:
            ok = False
            if c["tests"] == 0:
                print(f"=== {name}: no test ran (exit status {rc})", flush=True)
        summary.append((name, passed, failed, c["skipped"], seconds, rc))

    try:
        for name, cmd, where, beside in suites:
            (results / f"{name}.xml").unlink(missing_ok=True)
            print(f"\n=== {name} tests, {where}", flush=True)
            t0 = time.monotonic()
            if beside:
                log = (results / f"{name}.log").open("wb")
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                threading.Thread(target=watch, args=(name, proc), daemon=True).start()
                running.append((name, proc, log, t0))
                continue
            rc = subprocess.run(cmd, cwd=ROOT).returncode
            result(name, rc, time.monotonic() - t0)
        for name, proc, log, t0 in running:
            print(f"\n=== {name} tests: waiting for the suite running beside ({results / name}.log)", flush=True)
            rc = proc.wait()
            log.close()
            sys.stdout.buffer.write((results / f"{name}.log").read_bytes())
            sys.stdout.flush()
            result(name, rc, ended.get(name, time.monotonic()) - t0)
    finally:
        for _, proc, _, _ in running:
            if proc.poll() is None:      # interrupted: its VM goes with it (softroce vm cleans up on SIGTERM)
                proc.terminate()
                proc.wait()

    print("\n=== summary")
    for name, passed, failed, skipped, seconds, rc in summary:
        print(f"  {name:5} {passed} passed, {failed} failed, {skipped} skipped "
              f"in {seconds:.0f} s (pytest exit {rc})")
    tp, tf, ts = (sum(s[i] for s in summary) for i in (1, 2, 3))
    print(f"  suite duration {time.monotonic() - started:.0f} s")
    print(f"total: {tp} passed, {tf} failed, {ts} skipped", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
