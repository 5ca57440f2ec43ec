"""Run several ranks of a session in threads of this process (fast, and every
provider still goes through its real sockets, shared memory or queue pairs)."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import traceback

from rdmatensor import connect

TOKEN = "test-token"
# verbs over two rails (providers/verbs/rails.py), both on this host's one RDMA
# port (RDMATENSOR_IB_HCA names it twice): every write of 256 KiB and more striped
RAILS = "verbs+rails"


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
    if provider == RAILS:
        with _two_rails():
            return run_ranks(n, plan, "verbs", _striping(body), join_timeout, token, tokens, plans, peers, **kw)
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


@contextlib.contextmanager
def _two_rails():
    from rdmatensor.devices import active_port
    dev, port = active_port()
    saved = {k: os.environ.get(k) for k in ("RDMATENSOR_IB_RAILS", "RDMATENSOR_IB_HCA")}
    os.environ.update(RDMATENSOR_IB_RAILS="2", RDMATENSOR_IB_HCA=f"{dev.name}:{port.number},{dev.name}:{port.number}")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _striping(body):
    """body, then a check that every channel of the session ran over two rails."""
    def run(s, r):
        out = body(s, r)
        widths = [getattr(ch, "width", 1) for ch in s._ctx.channels.values()]
        assert widths and set(widths) == {2}, f"rank {r}: rails in use per channel {widths}, not 2"
        return out
    return run


def check(results):
    """Raise the first rank's exception, else return the results."""
    for r, res in sorted(results.items()):
        if isinstance(res, BaseException):
            raise AssertionError(f"rank {r} failed:\n{res.trace}") from res
    return results
