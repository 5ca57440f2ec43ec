"""Run several ranks of a session in threads of this process (fast, and every
provider still goes through its real sockets, shared memory or queue pairs)."""
from __future__ import annotations

import os
import socket
import threading
import traceback

from rdmatensor import connect

TOKEN = "test-token"


_next_port = [20000 + os.getpid() % 4000 * 3]


def free_ports(n: int) -> list[int]:
    """Ports for control servers, taken below the kernel's ephemeral range so
    that data listeners (port 0) and outgoing connections never take them
    between this check and the server's bind."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = []
    while len(ports) < n:
        port = _next_port[0]
        _next_port[0] = port + 1 if port + 1 < low else 20000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def run_ranks(n, plan, provider, body, join_timeout=180.0, token=TOKEN, tokens=None, plans=None, peers=None,
              **kw):
    """Run body(session, rank) on ranks 0..n-1 at once; return {rank: result or exception}.
    `peers` gives every rank's address (ranks beyond n run elsewhere)."""
    peers = peers or {r: f"127.0.0.1:{p}" for r, p in enumerate(free_ports(n))}
    results = {}

    def rank(r):
        try:
            with connect(r, peers, (plans or {}).get(r, plan), provider=provider,
                         token=(tokens or {}).get(r, token), **kw) as s:
                results[r] = body(s, r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            exc.trace = traceback.format_exc()
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), f"a rank did not finish within {join_timeout} s"
    return results


def check(results):
    """Raise the first rank's exception, else return the results."""
    for r, res in sorted(results.items()):
        if isinstance(res, BaseException):
            raise AssertionError(f"rank {r} failed:\n{res.trace}") from res
    return results
