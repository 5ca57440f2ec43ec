"""Bandwidth of one provider: rank 0 streams a tensor of a given size to rank 1
(another process) through a window of slots; rank 1 receives and releases.

Timing starts after a warm-up and a barrier and stops when rank 1 confirms the
last tensor, so it covers delivery, not just posting.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time
from dataclasses import asdict, dataclass

import numpy as np

from rdmatensor import Plan, TensorSpec, connect

TOKEN = "bench"


@dataclass
class BwRow:
    provider: str
    size: int
    iterations: int
    seconds: float
    mb_per_s: float
    copies: int
    window: int

    def to_dict(self) -> dict:
        return asdict(self)


def _plan(size: int, window: int) -> Plan:
    return Plan([TensorSpec(f"t{i}", (size,), np.uint8, 0, 1) for i in range(window)]
                + [TensorSpec("ack", (1,), np.int64, 1, 0)])


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _receiver(peers, provider, size, window, total):
    with connect(1, peers, _plan(size, window), provider=provider, token=TOKEN, timeout=120) as s:
        for i in range(total):
            s.recv(f"t{i % window}").release()
        s.send("ack", np.array([total], np.int64))
        s.barrier("end")


def measure(provider: str, size: int, iterations: int, warmup: int = 2, window: int | None = None,
            from_staging: bool = True) -> BwRow:
    window = window or max(1, min(8, (256 << 20) // size))
    total = warmup + iterations
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(_free_ports(2))}
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_receiver, args=(peers, provider, size, window, total), daemon=True)
    child.start()
    try:
        with connect(0, peers, _plan(size, window), provider=provider, token=TOKEN, timeout=120) as s:
            arrays = [s.buffer(f"t{i}") if from_staging else np.zeros(size, np.uint8)
                      for i in range(window)]
            for i, a in enumerate(arrays):
                a[:] = i
            for i in range(warmup):
                s.send(f"t{i % window}", arrays[i % window])
            copies0 = s.stats()["copies"]
            t0 = time.perf_counter()
            for i in range(warmup, total):
                s.send(f"t{i % window}", arrays[i % window])
            with s.recv("ack") as ack:
                assert int(ack[0]) == total
            seconds = time.perf_counter() - t0
            copies = s.stats()["copies"] - copies0
            s.barrier("end")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return BwRow(provider, size, iterations, seconds, size * iterations / seconds / 1e6, copies, window)


if __name__ == "__main__":
    import sys
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])).to_dict()))
