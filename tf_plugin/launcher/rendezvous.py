"""Rendezvous of an elastic job: which workers form the job now, and who is which rank.

The launcher serves it (tf_plugin.launcher.elastic); a worker started under it
has RDMATENSOR_RENDEZVOUS=host:port and RDMATENSOR_WORKER_ID in its
environment, and hvd.init() joins a round through it instead of reading
TF_CONFIG. One request per connection, one JSON line each way, every
request carrying the job's token (compared in constant time):

    join     {worker, host, port, after}  -> the first round after `after` that
             includes this worker, once every member joined: {round, rank, size,
             local_rank, local_size, workers: ["host:port", ...]}
    updated  {round}                      -> {updated: bool}: the workers alive
             now are not round's members (one was lost, or new ones wait)

A round forms when a worker asks for one after the round it knows (at start,
and after it lost a peer or was told the workers changed): its members are
the workers alive then, the previous round's in their old rank order first,
so rank 0 is a worker that holds the last committed state. This module does
not import TensorFlow.
"""
from __future__ import annotations

import hmac
import json
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field

from rdmatensor import AuthenticationError, PeerLost, UsageError

MAX_REQUEST = 1 << 16


@dataclass
class Round:
    number: int
    members: list[int]                              # worker ids, in rank order
    joined: dict[int, str] = field(default_factory=dict)   # worker id -> "host:port"
    started: float = field(default_factory=time.monotonic)

    @property
    def complete(self) -> bool:
        return set(self.joined) == set(self.members)


class Rounds:
    """The rounds of one elastic job (the launcher's side). `alive()` says which
    workers run now; `min_np` rounds smaller than that wait for workers."""

    def __init__(self, alive, min_np: int = 1):
        self.alive, self.min_np = alive, min_np
        self.current: Round | None = None
        self.closed: str | None = None                # why the job ended, for joiners still waiting
        self._cv = threading.Condition()

    def _form(self) -> None:
        previous = self.current.members if self.current else []
        alive = set(self.alive())
        members = [w for w in previous if w in alive] + sorted(alive - set(previous))
        self.current = Round((self.current.number + 1) if self.current else 0, members)
        self._cv.notify_all()

    def changed(self) -> None:
        """A worker ended or started: a forming round is formed again from the workers alive."""
        with self._cv:
            if self.current is not None and not self.current.complete:
                self._form()
            self._cv.notify_all()

    def close(self, why: str) -> None:
        with self._cv:
            self.closed = why
            self._cv.notify_all()

    def join(self, worker: int, address: str, after: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            if self.current is None or (self.current.number <= after and self.current.complete):
                self._form()
            while True:
                if self.closed:
                    raise PeerLost(f"the job ended: {self.closed}")
                now = self.current
                if worker not in set(self.alive()):
                    raise UsageError(f"worker {worker} is not a live worker of this job")
                if worker in now.members and now.number > after and len(now.members) >= self.min_np:
                    now.joined[worker] = address
                    if now.complete:
                        self._cv.notify_all()
                        return self._assignment(now, worker)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(now.members) - set(now.joined))
                    raise PeerLost(f"round {now.number} did not form within {timeout:g} s: workers "
                                   f"{missing} did not join" if len(now.members) >= self.min_np else
                                   f"{len(now.members)} worker(s) alive, fewer than --min-np {self.min_np}")
                self._cv.wait(min(remaining, 0.5))
                if self.current is now and not now.complete and set(now.members) != set(self.alive()):
                    self._form()

    @staticmethod
    def _assignment(r: Round, worker: int) -> dict:
        workers = [r.joined[w] for w in r.members]
        hosts = [a.rsplit(":", 1)[0] for a in workers]
        rank = r.members.index(worker)
        here = [i for i, h in enumerate(hosts) if h == hosts[rank]]
        return {"round": r.number, "rank": rank, "size": len(workers), "workers": workers,
                "local_rank": here.index(rank), "local_size": len(here)}

    def updated(self, number: int) -> bool:
        with self._cv:
            return (self.current is None or self.current.number != number
                    or set(self.current.members) != set(self.alive()))


class Server:
    """The rendezvous server: a thread per request, on an ephemeral port."""

    def __init__(self, rounds: Rounds, token: str, host: str = "0.0.0.0", join_timeout: float = 600.0):
        self.rounds, self.token, self.join_timeout = rounds, token, join_timeout
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                try:
                    reply = outer._serve(json.loads(self.rfile.readline(MAX_REQUEST)))
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"error": "BadRequest", "message": f"malformed request: {exc}"}
                except (PeerLost, UsageError, AuthenticationError) as exc:
                    reply = {"error": type(exc).__name__, "message": str(exc)}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="rdmatensor-rendezvous")
        self._thread.start()

    def _serve(self, request: dict) -> dict:
        if not hmac.compare_digest(str(request.get("token", "")).encode(), self.token.encode()):
            raise AuthenticationError("the rendezvous needs the job's token")
        if request["op"] == "join":
            address = f"{request['host']}:{int(request['port'])}"
            return self.rounds.join(int(request["worker"]), address, int(request["after"]), self.join_timeout)
        if request["op"] == "updated":
            return {"updated": self.rounds.updated(int(request["round"]))}
        raise ValueError(f"unknown op {request['op']!r}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ------------------------------------------------------------- the worker's side
def configured() -> bool:
    """Whether this process was started as a worker of an elastic job."""
    return bool(os.environ.get("RDMATENSOR_RENDEZVOUS"))


def _call(request: dict, timeout: float) -> dict:
    host, port = os.environ["RDMATENSOR_RENDEZVOUS"].rsplit(":", 1)
    request = dict(request, token=os.environ.get("RDMATENSOR_TOKEN", ""))
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(json.dumps(request).encode() + b"\n")
            line = sock.makefile("rb").readline(MAX_REQUEST)
    except OSError as exc:
        raise PeerLost(f"the job's rendezvous at {host}:{port} cannot be reached: {exc}") from exc
    if not line:
        raise PeerLost(f"the job's rendezvous at {host}:{port} closed without an answer")
    reply = json.loads(line)
    if "error" in reply:
        kind = {"AuthenticationError": AuthenticationError, "UsageError": UsageError}.get(reply["error"], PeerLost)
        raise kind(reply["message"])
    return reply


def join(host: str, port: int, after: int, timeout: float = 660.0) -> dict:
    """This worker's place in the first round after `after` (-1: the first one)."""
    return _call({"op": "join", "worker": int(os.environ["RDMATENSOR_WORKER_ID"]), "host": host,
                  "port": port, "after": after}, timeout)


def updated(number: int) -> bool:
    """Whether the job's workers changed since round `number` formed."""
    return bool(_call({"op": "updated", "round": number}, 30.0)["updated"])
