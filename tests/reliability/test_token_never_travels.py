"""The job token never crosses the network: every byte of a two-rank job's
control traffic (setup, heartbeats, a barrier, a dynamic tensor's growth, the
grpc baseline's pushes, goodbyes) and of an elastic rendezvous is recorded by
a relay between the ranks, and the token is in none of it, in any encoding."""
import base64
import socket
import threading

import numpy as np
import pytest

from rdmatensor import AuthenticationError, Plan, TensorSpec, connect
from rdmatensor.runner import rendezvous_client
from rdmatensor.runner.rendezvous_server import Rounds, Server

from ..support.ranks import free_ports

TOKEN = "job-token-4f9c2a7e1b5d8c3f6a0e9d2b7c4a1f8e"


class Relay:
    """host:port -> target, every byte both ways recorded."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.recorded, self._lock = target, bytearray(), threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            try:
                server = socket.create_connection(self.target)
            except OSError:      # the target not listening yet: refused, as it would be directly; the rank retries
                client.close()
                continue
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def forms(token: str) -> list[bytes]:
    raw = token.encode()
    return [raw, raw.upper(), raw.hex().encode(), base64.b64encode(raw), token.encode("utf-16-le"), raw[:16]]


@pytest.mark.parametrize("provider", ["tcp", "grpc"])
def test_no_token_in_a_jobs_control_traffic(provider):
    plan = Plan([TensorSpec("w", (4096,), np.float32, 0, 1), TensorSpec("g", (None,), np.float32, 1, 0,
                                                                          capacity=64)])
    ports = free_ports(2)
    relays = {r: Relay(("127.0.0.1", ports[r])) for r in (0, 1)}
    # each rank listens on its own port and reaches the other through a relay
    views = {r: {r: f"127.0.0.1:{ports[r]}", 1 - r: f"127.0.0.1:{relays[1 - r].port}"} for r in (0, 1)}
    results, errors = {}, []

    def rank(r):
        try:
            with connect(r, views[r], plan, provider=provider, token=TOKEN, heartbeat=0.2) as s:
                if r == 0:
                    s.send("w", np.arange(4096, dtype=np.float32))
                    with s.recv("g") as g:                 # grows its slot: a Grow call
                        results[0] = float(g.sum())
                else:
                    with s.recv("w") as w:
                        results[1] = float(w.sum())
                    s.send("g", np.ones(1000, np.float32))
                s.barrier("end")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for relay in relays.values():
        relay.close()
    assert not errors, errors
    assert results == {0: 1000.0, 1: float(np.arange(4096).sum())}
    recorded = b"".join(bytes(relay.recorded) for relay in relays.values())
    assert sum(relay.connections for relay in relays.values()) >= 2 and len(recorded) > 2000
    assert b"rdmatensor-proof" in recorded           # the calls were seen, with their proofs
    leaked = [form for form in forms(TOKEN) if form in recorded]
    assert not leaked, f"the token crossed the network as {leaked}"


def test_no_token_in_the_rendezvous(monkeypatch):
    server = Server(Rounds(lambda: range(2), min_np=2), TOKEN, host="127.0.0.1", join_timeout=30)
    relay = Relay(("127.0.0.1", server.port))
    monkeypatch.setenv("RDMATENSOR_TOKEN", TOKEN)
    answers = {}

    def join(worker):
        answers[worker] = rendezvous_client.join("127.0.0.1", 9000 + worker, after=-1, timeout=30, worker=worker,
                                                 address=f"127.0.0.1:{relay.port}")

    threads = [threading.Thread(target=join, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    relay.close()
    assert sorted(a["rank"] for a in answers.values()) == [0, 1]
    recorded = bytes(relay.recorded)
    assert b'"proof"' in recorded and not [form for form in forms(TOKEN) if form in recorded]
    monkeypatch.setenv("RDMATENSOR_TOKEN", "another job's token")
    try:
        with pytest.raises(AuthenticationError, match="proof of the job's token"):
            rendezvous_client.join("127.0.0.1", 9100, after=0, timeout=5, worker=0,
                                   address=f"127.0.0.1:{server.port}")
    finally:
        server.close()
