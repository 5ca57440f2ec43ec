"""The rendezvous' server: which workers form the job, and every rank's control address,
with no port known in advance.

Two users. An elastic job's launcher serves it (elastic.py); a
worker started under it has RDMATENSOR_RENDEZVOUS=host:port and
RDMATENSOR_WORKER_ID in its environment. A job started by another launcher
(torchrun, Open MPI's mpirun, Slurm's srun, horovodrun: see LauncherEnv) gives
each rank only its rank, the job's size and one address: rank 0 serves the
rendezvous there (under horovodrun, on a free port it publishes in horovodrun's
own key-value store), every rank joins with worker id = its rank. Either way hvd.init() joins
a round instead of reading TF_CONFIG, with a port it bound itself. One request
per connection, one JSON line each way, every request carrying a proof that it
knows the job's token (rdmatensor/control/proof.py: the token never travels)
(compared in constant time):

    join     {worker, host, port, after}  -> the first round after `after` that
             includes this worker, once every member joined: {round, rank, size,
             local_rank, local_size, workers: ["host:port", ...]}
    updated  {round}                      -> {updated: bool}: the workers alive
             now are not round's members (one was lost, or new ones wait)

A round forms when a worker asks for one after the round it knows (at start,
and after it lost a peer or was told the workers changed): its members are
the workers alive then, the previous round's in their old rank order first,
so rank 0 is a worker that holds the last committed state. A worker's side is
rendezvous_client.py.
"""
from __future__ import annotations

import json
import socketserver
import threading
import time
from dataclasses import dataclass, field

from rdmatensor import AuthenticationError, PeerLost, UsageError
from rdmatensor.control.proof import Verifier, digest

MAX_REQUEST = 1 << 16


def canonical(request: dict) -> bytes:
    """A request's bytes as its proof covers them (the proof itself left out)."""
    return json.dumps(request, sort_keys=True, separators=(",", ":")).encode()


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
        self.established: set[int] = set()           # workers of a round that reached a commit
        self.resets = 0                               # rounds begun after one that formed (horovodrun's resets)
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
                self.resets += self.current is not None
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
        """Asked by rank 0 at each commit of round `number`: its members are established."""
        with self._cv:
            if self.current is not None and self.current.number == number:
                self.established.update(self.current.members)
            return (self.current is None or self.current.number != number
                    or set(self.current.members) != set(self.alive()))


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True        # a fixed rendezvous port, reused by the next job at once
    daemon_threads = True


class Server:
    """The rendezvous server: a thread per request, on an ephemeral port."""

    def __init__(self, rounds: Rounds, token: str, host: str = "0.0.0.0", join_timeout: float = 600.0,
                 port: int = 0):
        self.rounds, self.join_timeout = rounds, join_timeout
        self._verifier = Verifier(token)
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

        self._server = _TCPServer((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="rdmatensor-rendezvous")
        self._thread.start()

    def _serve(self, request: dict) -> dict:
        proof = request.pop("proof", "")
        try:
            bound = self._verifier.check("rendezvous", str(proof))
        except AuthenticationError:
            raise AuthenticationError("the rendezvous needs a proof of the job's token") from None
        if bound != digest(canonical(request)):
            raise AuthenticationError("the request is not the one its proof was made for")
        if request["op"] == "join":
            address = f"{request['host']}:{int(request['port'])}"
            return self.rounds.join(int(request["worker"]), address, int(request["after"]), self.join_timeout)
        if request["op"] == "updated":
            return {"updated": self.rounds.updated(int(request["round"]))}
        raise ValueError(f"unknown op {request['op']!r}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
