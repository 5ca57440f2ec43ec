"""Run the whole test suite and report it as one.

0. lint:  ruff over the tree (pyproject.toml's [tool.ruff]); unclean code fails the run
          before any test starts;
1. host:  every test not marked `rdma`, natively (including the `vm` tests,
          which boot SoftRoCE VMs themselves);
2. rdma:  the tests marked `rdma`, natively where this host has an ACTIVE
          RDMA port, else inside a SoftRoCE VM (`rdmatensor softroce vm`).

The two suites run side by side: the host suite leaves about a third of two
cores idle (it waits on processes starting, on timeouts, on VMs booting), and
the rdma suite's VM fills it. The host suite prints as it goes; the rdma
suite's output goes to test-results/rdma.log and is printed when both are
done. `--one-by-one` runs them in turn, each printing as it goes.

Arguments after `--` go to every pytest run (e.g. `-- -k write -x`).
Ends with one line: `total: N passed, N failed, N skipped`.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
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


def _wait(proc: subprocess.Popen) -> float:
    proc.wait()
    return time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("host", "rdma"))
    parser.add_argument("--one-by-one", action="store_true",
                        help="run the suites in turn instead of side by side")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    extra = [a for a in args.pytest_args if a != "--"]
    results = ROOT / "test-results"
    results.mkdir(exist_ok=True)
    py = sys.executable

    suites = []
    if args.only in (None, "host"):
        suites.append(("host", [py, "-m", "pytest", "-m", "not rdma", "-rs",
                                f"--junitxml={results}/host.xml", *extra], "natively"))
    if args.only in (None, "rdma"):
        pytest_rdma = [py, "-m", "pytest", "-m", "rdma", "-rs", f"--junitxml={results}/rdma.xml", *extra]
        found = active_port()
        if found:
            suites.append(("rdma", pytest_rdma, f"natively on {found[0].name}"))
        else:
            suites.append(("rdma", [py, "-m", "rdmatensor", "softroce", "vm", "--timeout", "1800",
                                    "--share", str(results), "--", *pytest_rdma],
                           "inside a SoftRoCE VM (this host has no ACTIVE RDMA port)"))

    print("=== lint: ruff check", flush=True)
    if subprocess.run([py, "-m", "ruff", "check", "."], cwd=ROOT).returncode != 0:
        print("=== lint failed: fix what ruff reports (no test ran)", flush=True)
        return 1

    ok = True
    summary = []
    started = time.monotonic()
    running = []          # [name, process, log or None, start, end]
    for i, (name, cmd, where) in enumerate(suites):
        (results / f"{name}.xml").unlink(missing_ok=True)
        log = None
        if i == 0 or args.one_by_one:
            print(f"\n=== {name} tests, {where}", flush=True)
        else:
            log = results / f"{name}.log"
            print(f"\n=== {name} tests, {where}, alongside (output in {log.relative_to(ROOT)}, "
                  "printed at the end)", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w") if log else None,
                                stderr=subprocess.STDOUT if log else None)
        running.append([name, proc, log, time.monotonic(), None])
        if args.one_by_one:
            proc.wait()
            running[-1][4] = time.monotonic()
    while any(r[4] is None for r in running):
        for r in running:
            if r[4] is None and r[1].poll() is not None:
                r[4] = time.monotonic()
        time.sleep(0.2)
    for name, proc, log, t0, t1 in running:
        if log:
            print(f"\n=== {name} tests (from {log.relative_to(ROOT)})", flush=True)
            sys.stdout.write(log.read_text(errors="replace"))
            sys.stdout.flush()
        rc = proc.returncode
        c = counts(results / f"{name}.xml")
        failed = c["failures"] + c["errors"]
        passed = c["tests"] - failed - c["skipped"]
        seconds = t1 - t0
        if rc != 0 or c["tests"] == 0:
            ok = False
            if c["tests"] == 0:
                print(f"=== {name}: no test ran (exit status {rc})", flush=True)
        summary.append((name, passed, failed, c["skipped"], seconds, rc))

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
