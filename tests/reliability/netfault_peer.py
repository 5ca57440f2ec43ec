"""One side of the network-fault runs between two SoftRoCE VMs (run by
test_network_faults.py under `rdmatensor softroce vm --hosts 2`).

For each provider given: a clean transfer, then the same under netem (1 %
loss, 5 ms delay on both ends), checked byte for byte and timed; then a
stream of tensors during which host 1 takes its link down, after which both
sides must fail with a typed error within a bound (and the link comes back
for the next step). Prints one JSON line per step.

    python -m tests.reliability.netfault_peer tcp verbs
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from rdmatensor import Plan, RdmaTensorError, TensorSpec, connect

TOKEN = "netfault"
MIB = 1 << 20
BLOB = 4 * MIB
COUNT = {"tcp": 8, "verbs": 6, "shm": 8, "grpc": 4}
ERROR_BOUND = 30.0


def sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True)


def iface() -> str:
    addr = os.environ["RDMATENSOR_VM_ADDR"]
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if f" {addr}/" in line:
            return line.split()[1]
    raise SystemExit(f"no interface has {addr}")


def pattern(i: int) -> np.ndarray:
    base = (np.arange(BLOB, dtype=np.uint32) * (2 * i + 1) >> 3).astype(np.uint8)
    base[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return base


def peers(port: int) -> dict:
    return {r: f"{a}:{port}" for r, a in enumerate(os.environ["RDMATENSOR_VM_ADDRS"].split())}


def stream(s, rank: int, n: int, patterns) -> tuple[float, int]:
    """Rank 0 sends n blobs, rank 1 checks each; returns (seconds incl. the final ack, bad)."""
    t0 = time.perf_counter()
    bad = 0
    if rank == 0:
        for i in range(n):
            s.send("blob", patterns[i % len(patterns)])
        with s.recv("ack", timeout=300) as v:
            bad = int(v[0])
    else:
        for i in range(n):
            with s.recv("blob", timeout=300) as v:
                bad += int(not np.array_equal(v, patterns[i % len(patterns)]))
        s.send("ack", np.array([bad], np.int64))
    return time.perf_counter() - t0, bad


def netem_step(provider: str, rank: int, dev: str, port: int) -> dict:
    plan = Plan([TensorSpec("blob", (BLOB,), np.uint8, 0, 1), TensorSpec("ack", (1,), np.int64, 1, 0)])
    patterns = [pattern(i) for i in range(4)]
    n = COUNT[provider]
    with connect(rank, peers(port), plan, provider=provider, token=TOKEN, timeout=120) as s:
        stream(s, rank, 1, patterns)                    # warm-up
        s.barrier("clean")
        clean, bad_clean = stream(s, rank, n, patterns)
        sh(f"tc qdisc add dev {dev} root netem loss 1% delay 5ms")
        try:
            s.barrier("impaired", timeout=120)
            impaired, bad_impaired = stream(s, rank, n, patterns)
            s.barrier("measured", timeout=120)
        finally:
            sh(f"tc qdisc del dev {dev} root")
        s.barrier("restored", timeout=120)
        stats = s.stats()
    mb = n * BLOB / 1e6
    return {"step": "netem", "provider": provider, "rank": rank, "MB": round(mb, 1),
            "clean_MBps": round(mb / clean, 1), "impaired_MBps": round(mb / impaired, 1),
            "slowdown": round(impaired / clean, 2), "bad": bad_clean + bad_impaired,
            "writes": stats["writes"]}


def linkdown_step(provider: str, rank: int, dev: str, port: int) -> dict:
    plan = Plan([TensorSpec("blob", (MIB,), np.uint8, 0, 1)])
    data = np.arange(MIB, dtype=np.uint32).astype(np.uint8)
    out = {"step": "linkdown", "provider": provider, "rank": rank, "delivered": 0}
    s = connect(rank, peers(port), plan, provider=provider, token=TOKEN, timeout=120)
    t_down = None
    last_ok = time.monotonic()
    try:
        s.barrier("go")
        while True:
            try:
                if rank == 0:
                    s.send("blob", data, timeout=ERROR_BOUND)
                    out["delivered"] += 1
                    last_ok = time.monotonic()
                else:
                    with s.recv("blob", timeout=ERROR_BOUND) as v:
                        assert np.array_equal(v, data), "a tensor arrived corrupted"
                    out["delivered"] += 1
                    if out["delivered"] == 5:
                        sh(f"ip link set {dev} down")
                        t_down = time.monotonic()
                        print(json.dumps({"step": "linkdown", "event": "link down", "rank": rank}), flush=True)
            except RdmaTensorError as exc:
                out["error"] = type(exc).__name__
                out["message"] = str(exc)[:200]
                out["error_at"] = time.monotonic()
                break
    finally:
        t0 = time.monotonic()
        s.close()
        out["close_s"] = round(time.monotonic() - t0, 2)
    # Host 1 knows when its link went down; host 0 only when it last got through.
    out["detected_s"] = round(out["error_at"] - (t_down if t_down is not None else last_ok), 2)
    out.pop("error_at", None)
    if rank == 1:
        sh(f"ip link set {dev} up")
    return out


def main() -> None:
    rank = int(os.environ["RDMATENSOR_VM_INDEX"])
    dev = iface()
    port = 47300
    for provider in sys.argv[1:]:
        print(json.dumps(netem_step(provider, rank, dev, port)), flush=True)
        port += 1
    for provider in sys.argv[1:]:
        # Let the link (and rxe port) come back before the next step.
        time.sleep(3)
        print(json.dumps(linkdown_step(provider, rank, dev, port)), flush=True)
        port += 1


if __name__ == "__main__":
    main()
