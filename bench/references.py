"""The physical references each provider is compared with, measured in the same run:

    verbs  perftest's ib_write_bw / ib_write_lat on the same device
    shm    a plain memcpy (numpy copyto) of the same size
    tcp    raw socket sendall / recv_into between two processes on loopback
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import time

import numpy as np

from rdmatensor.errors import RdmaTensorError

from .perftest import run_write_bw, run_write_lat


def memcpy(size: int, seconds: float = 0.3) -> dict:
    src = np.ones(size, np.uint8)
    dst = np.empty(size, np.uint8)
    np.copyto(dst, src)
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < 5:
        t = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t)
    med = float(np.median(samples))
    return {"name": "memcpy", "mb_per_s": size / med / 1e6, "lat_us": med * 1e6}


def _recv_exact(sock, view):
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("closed")
        got += n


def _socket_peer(port: int, size: int, mode: str, iters: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(size)
        view = memoryview(buf)
        for _ in range(iters):
            _recv_exact(sock, view)
            if mode == "lat":
                sock.sendall(view)
        sock.sendall(b"done")


def raw_socket(size: int, mode: str, iters: int) -> dict:
    """sendall/recv_into of `size` bytes, `iters` times, to another process."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        peer = mp.get_context("spawn").Process(target=_socket_peer, args=(port, size, mode, iters), daemon=True)
        peer.start()
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = memoryview(bytearray(size))
            back = memoryview(bytearray(size))
            samples = []
            t0 = time.perf_counter()
            for _ in range(iters):
                t = time.perf_counter()
                conn.sendall(data)
                if mode == "lat":
                    _recv_exact(conn, back)
                    samples.append((time.perf_counter() - t) / 2)
            _recv_exact(conn, memoryview(bytearray(4)))
            seconds = time.perf_counter() - t0
        peer.join(10)
    if mode == "lat":
        return {"name": "socket", "lat_us": float(np.median(samples)) * 1e6}
    return {"name": "socket", "mb_per_s": size * iters / seconds / 1e6}


def perftest(size: int, mode: str, device: str, gid_index: int, cpus: tuple[int, int] | None = None) -> dict:
    if mode == "lat":
        r = run_write_lat(device, gid_index, size, iterations=1000 if size <= 65536 else 100, cpus=cpus)
        return {"name": "ib_write_lat", "lat_us": r.typical_us, "p99_us": r.p99_us}
    iters = int(max(20, min(1000, (256 << 20) // size)))
    r = run_write_bw(device, gid_index, size, iterations=iters, cpus=cpus)
    return {"name": "ib_write_bw", "mb_per_s": r.mb_per_s}


def reference(provider: str, mode: str, size: int, device=None, cpus: tuple[int, int] | None = None) -> dict | None:
    """The reference figure for one provider and point, or None where there is none;
    `cpus`: perftest's client and server CPUs, as the bench's ranks are bound."""
    try:
        if provider == "shm":
            return memcpy(size)
        if provider == "tcp":
            iters = 2000 if mode == "lat" else int(max(10, min(5000, (512 << 20) // size)))
            if mode == "lat" and size > (1 << 20):
                iters = 50
            return raw_socket(size, mode, iters)
        if provider == "verbs" and device is not None:
            return perftest(size, mode, device[0], device[1], cpus)
    except (RdmaTensorError, OSError) as exc:
        return {"name": "error", "error": str(exc)}
    return None


