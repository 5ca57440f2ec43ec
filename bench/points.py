"""One measurement point: a fresh two-rank session, one mode, one size.

Both ranks run the same function. Rank 0 measures; rank 1 serves. For
bandwidth and steps, rank 0 times a warm-up, picks the iteration count that
fills the time budget and tells rank 1 through a small `ctl` tensor, so both
sides agree without any out-of-band channel; a bandwidth point's warm-up
lasts as long as a latency point's, its length told the same way. A latency
point instead runs until its time budget (at least MIN_LAT_SECONDS) and
MIN_LAT_ITERS round trips are done, after a warm-up of its own
(MIN_WARM_SECONDS, or a fifth of the budget): its first round trips are
the slowest (first touches, an emulator's first translations), and an
estimate from them alone measured far too few. The last ping says it is the last.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from rdmatensor import Plan, TensorSpec, connect
from rdmatensor.providers.verbs.choose_endpoint import ENDPOINT_ENV

TOKEN = "rdmatensor-bench"
SETUP_TIMEOUT = 120.0    # also bounds every wait: a peer that died is not waited on for long
MIN_LAT_ITERS = 200      # round trips every latency point measures at least
MIN_LAT_SECONDS = 1.0    # ... and for at least this long, whatever --seconds says
MIN_WARM_SECONDS = 0.5   # a latency point warms up at least this long, or a fifth of its budget


@dataclass
class Point:
    mode: str          # lat, bw, step
    provider: str
    size: int          # bytes per tensor (step: bytes per step)
    tensors: tuple = ()          # step mode: sizes of the tensors of one step
    seconds: float = 1.0         # time budget for the measured part
    warmup: int = 5
    max_iters: int = 100000
    checksum: bool = False       # CRC32 on every tensor (Plan(checksum=True))
    model: str = ""              # step mode: the model whose gradient set `tensors` is
    endpoint: str = ""           # verbs providers: the RC endpoint (native, pyverbs); "" is the default
    send_many: bool = False      # step mode: one send_many() per step instead of a send() per tensor
    tx_depth: int = 0            # bw mode: writes in flight (slots); 0: window_for(size)

    @property
    def label(self) -> str:
        name = f"{self.provider}/{self.endpoint}" if self.endpoint else self.provider
        name += "+many" if self.send_many else ""
        return f"{name}+crc" if self.checksum else name


@dataclass
class Result:
    mode: str
    provider: str
    size: int
    iterations: int
    lat_us: dict | None = None         # min, median, p99, max (half round trip for lat; step time for step)
    mb_per_s: float | None = None
    gb_per_s: float | None = None
    msg_per_s: float | None = None
    copies: int = 0
    window: int = 1
    extra: dict = field(default_factory=dict)


def window_for(size: int, tx_depth: int = 0) -> int:
    # Deep enough to keep the link busy, shallow enough not to flood a software NIC.
    return tx_depth or max(1, min(16, (16 << 20) // max(size, 1)))


def plan_for(point: Point) -> Plan:
    specs = [TensorSpec("ctl", (1,), np.int64, 0, 1)]
    if point.mode == "lat":
        specs += [TensorSpec("ping", (point.size,), np.uint8, 0, 1),
                  TensorSpec("pong", (point.size,), np.uint8, 1, 0)]
    elif point.mode == "bw":
        window = window_for(point.size, point.tx_depth)
        specs += [TensorSpec(f"w{i}", (point.size,), np.uint8, 0, 1) for i in range(window)]
        specs += [TensorSpec("ack", (1,), np.int64, 1, 0)]
    elif point.mode == "step":
        specs += [TensorSpec(f"g{i}", (n,), np.uint8, 0, 1) for i, n in enumerate(point.tensors)]
        specs += [TensorSpec("ack", (1,), np.int64, 1, 0)]
    else:
        raise ValueError(f"unknown mode {point.mode!r}")
    return Plan(specs, checksum=point.checksum)


def _lat_stats(samples_s: list[float]) -> dict:
    us = np.asarray(samples_s) * 1e6
    return {"min": float(us.min()), "median": float(np.median(us)),
            "p99": float(np.percentile(us, 99)), "max": float(us.max())}


def _iterations(point: Point, warm_seconds: float, warm_iters: int) -> int:
    per = warm_seconds / max(warm_iters, 1)
    return int(max(3, min(point.max_iters, point.seconds / max(per, 1e-7))))


def run_point(rank: int, peers: dict, point: Point) -> Result | None:
    saved = os.environ.get(ENDPOINT_ENV)
    if point.endpoint:            # read when the channel opens its endpoint
        os.environ[ENDPOINT_ENV] = point.endpoint
    try:
        with connect(rank, peers, plan_for(point), provider=point.provider, token=TOKEN,
                     timeout=SETUP_TIMEOUT) as s:
            fn = {"lat": _lat, "bw": _bw, "step": _step}[point.mode]
            result = fn(s, rank, point)
            if result is not None:
                result.provider = point.label
                if point.endpoint:
                    result.extra["endpoint"] = point.endpoint
            s.barrier("point-done")
    finally:
        if saved is None:
            os.environ.pop(ENDPOINT_ENV, None)
        else:
            os.environ[ENDPOINT_ENV] = saved
    return result


def _tell(s, iters: int) -> None:
    ctl = s.buffer("ctl")
    ctl[0] = iters
    s.send("ctl", ctl)


def _hear(s) -> int:
    with s.recv("ctl") as v:
        return int(v[0])


LAST = 1        # the tag of the last ping: the loop reads no payload, as perftest's does not


def _lat(s, rank: int, p: Point) -> Result | None:
    if rank == 1:
        pong = s.buffer("pong")
        more = True
        while more:
            got = s.recv("ping")
            more = got.tag != LAST
            got.release()
            s.send("pong", pong)
        return None
    ping = s.buffer("ping")
    ping[:] = 1
    clock = time.perf_counter
    send, recv = s.send, s.recv

    t0, n = clock(), 0
    while n < p.warmup or clock() - t0 < max(MIN_WARM_SECONDS, p.seconds / 5):
        send("ping", ping)
        recv("pong").release()
        n += 1
    samples = []
    end = clock() + max(MIN_LAT_SECONDS, p.seconds)
    tag = 0
    while not tag:
        t = clock()
        if len(samples) + 1 >= p.max_iters or (len(samples) + 1 >= MIN_LAT_ITERS and t >= end):
            tag = LAST
        send("ping", ping, tag=tag)
        recv("pong").release()
        samples.append((clock() - t) / 2)
    return Result("lat", p.provider, p.size, len(samples), lat_us=_lat_stats(samples))


def _bw(s, rank: int, p: Point) -> Result | None:
    window = window_for(p.size, p.tx_depth)
    names = [f"w{i}" for i in range(window)]
    warm = max(p.warmup, window)
    if rank == 1:
        for i in range(warm):
            s.recv(names[i % window]).release()
        for i in range(_hear(s)):             # the rest of the warm-up
            s.recv(names[i % window]).release()
        iters = _hear(s)
        for i in range(iters):
            s.recv(names[i % window]).release()
        ack = s.buffer("ack")
        ack[0] = iters
        s.send("ack", ack)
        return None
    bufs = [s.buffer(n) for n in names]
    for i, b in enumerate(bufs):
        b[:] = i
    t0 = time.perf_counter()
    for i in range(warm):
        s.send(names[i % window], bufs[i % window])
    # Warm up as long as a latency point does: the first writes are the slowest (an emulator's
    # first translations, threads settling), so the timed ones start from a steady state.
    warm_for = max(MIN_WARM_SECONDS, p.seconds / 5)
    more = _iterations(replace(p, seconds=warm_for), time.perf_counter() - t0, warm)
    _tell(s, more)
    t1 = time.perf_counter()
    for i in range(more):
        s.send(names[i % window], bufs[i % window])
    iters = _iterations(p, time.perf_counter() - t1, more)
    _tell(s, iters)
    copies0, waits0 = s.stats()["copies"], s.stats()["waits"]
    t0 = time.perf_counter()
    if p.send_many:       # a window's writes per call: one doorbell on verbs
        items = list(zip(names, bufs, strict=True))
        for k in range(0, iters, window):
            s.send_many(items[:min(window, iters - k)])
    else:
        for i in range(iters):
            s.send(names[i % window], bufs[i % window])
    with s.recv("ack") as ack:
        assert int(ack[0]) == iters
    seconds = time.perf_counter() - t0
    return Result("bw", p.provider, p.size, iters, mb_per_s=p.size * iters / seconds / 1e6,
                  gb_per_s=p.size * iters * 8 / seconds / 1e9, msg_per_s=iters / seconds,
                  copies=s.stats()["copies"] - copies0, window=window,
                  extra={"credit_waits": s.stats()["waits"] - waits0})


def _step(s, rank: int, p: Point) -> Result | None:
    names = [f"g{i}" for i in range(len(p.tensors))]
    if rank == 1:
        def serve():
            for n in names:
                s.recv(n).release()
            ack = s.buffer("ack")
            ack[0] = 1
            s.send("ack", ack)
        for _ in range(p.warmup):
            serve()
        for _ in range(_hear(s)):
            serve()
        return None
    bufs = [s.buffer(n) for n in names]

    items = list(zip(names, bufs, strict=True))

    def step():
        if p.send_many:
            s.send_many(items)
        else:
            for n, b in items:
                s.send(n, b)
        s.recv("ack").release()
    t0 = time.perf_counter()
    for _ in range(p.warmup):
        step()
    iters = _iterations(p, time.perf_counter() - t0, p.warmup)
    _tell(s, iters)
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t)
    total = sum(samples)
    return Result("step", p.provider, p.size, iters, lat_us=_lat_stats(samples),
                  mb_per_s=p.size * iters / total / 1e6, gb_per_s=p.size * iters * 8 / total / 1e9,
                  msg_per_s=len(names) * iters / total,
                  extra={"tensors": len(names), **({"model": p.model} if p.model else {})})
