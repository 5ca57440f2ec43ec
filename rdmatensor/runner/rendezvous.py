"""Rendezvous: which workers form the job, and every rank's control address,
with no port known in advance.

Two users. An elastic job's launcher serves it (tf_plugin.launcher.elastic); a
worker started under it has RDMATENSOR_RENDEZVOUS=host:port and
RDMATENSOR_WORKER_ID in its environment. A job started by another launcher
(torchrun, Open MPI's mpirun, Slurm's srun, horovodrun: see LauncherEnv) gives
each rank only its rank, the job's size and one address: rank 0 serves the
rendezvous there (under horovodrun, on a free port it publishes in horovodrun's
own key-value store), every rank joins with worker id = its rank. Either way hvd.init() joins
a round instead of reading TF_CONFIG, with a port it bound itself. One request
per connection, one JSON line each way, every request carrying the job's token
(compared in constant time):

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

import hashlib
import hmac
import json
import os
import socket
import socketserver
import threading
import time
import urllib.error
import urllib.request
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
        self.established: set[int] = set()           # workers of a round that reached a commit
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

        self._server = _TCPServer((host, port), Handler)
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


def _call(request: dict, timeout: float, address: str | None = None) -> dict:
    host, port = (address or os.environ["RDMATENSOR_RENDEZVOUS"]).rsplit(":", 1)
    request = dict(request, token=os.environ.get("RDMATENSOR_TOKEN", ""))
    deadline = time.monotonic() + timeout
    while True:                           # rank 0's server may not be up yet
        try:
            return _once(host.strip("[]"), int(port), request, timeout)
        except ConnectionRefusedError as exc:
            if time.monotonic() > deadline:
                raise PeerLost(f"the job's rendezvous at {host}:{port} refused every connection for "
                               f"{timeout:g} s: {exc}") from exc
            time.sleep(0.1)


def _once(host: str, port: int, request: dict, timeout: float) -> dict:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(json.dumps(request).encode() + b"\n")
            line = sock.makefile("rb").readline(MAX_REQUEST)
    except ConnectionRefusedError:
        raise                              # not up yet: the caller tries again
    except OSError as exc:
        raise PeerLost(f"the job's rendezvous at {host}:{port} cannot be reached: {exc}") from exc
    if not line:
        raise PeerLost(f"the job's rendezvous at {host}:{port} closed without an answer")
    reply = json.loads(line)
    if "error" in reply:
        kind = {"AuthenticationError": AuthenticationError, "UsageError": UsageError}.get(reply["error"], PeerLost)
        raise kind(reply["message"])
    return reply


def join(host: str, port: int, after: int, timeout: float = 660.0, worker: int | None = None,
         address: str | None = None) -> dict:
    """This worker's place in the first round after `after` (-1: the first one)."""
    worker = int(os.environ["RDMATENSOR_WORKER_ID"]) if worker is None else worker
    return _call({"op": "join", "worker": worker, "host": host, "port": port, "after": after}, timeout, address)


# ------------------------------------------------------------- other launchers
@dataclass(frozen=True)
class LauncherEnv:
    """What a launcher other than rdmatensor-run told this rank: who it is, how
    many there are, and where rank 0 serves the rendezvous."""
    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    address: str                       # host:port of rank 0's rendezvous; "" when rank 0 publishes it in `store`
    store: str = ""                    # host:port of horovodrun's key-value store

    @property
    def route(self) -> str:
        """An address of the job's side of the network (for route_to)."""
        return self.address or self.store

    @classmethod
    def detect(cls, env=None) -> "LauncherEnv | None":
        """horovodrun (--gloo), torchrun (and Kubernetes operators that set its
        variables), Open MPI's mpirun, Slurm's srun; None outside them. The
        rendezvous address is RDMATENSOR_RENDEZVOUS_ADDR (host:port), else
        MASTER_ADDR and MASTER_PORT, else under horovodrun a free port of rank 0
        published in horovodrun's store (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT), else
        under Slurm the step's first node and RDMATENSOR_RENDEZVOUS_PORT (default
        29500 + SLURM_JOB_ID % 1000); under mpirun on one host, this host and
        that port."""
        env = os.environ if env is None else env
        found = None
        if env.get("HOROVOD_RANK") and env.get("HOROVOD_SIZE"):
            found = ("horovodrun", env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env.get("HOROVOD_LOCAL_RANK", "0"),
                     env.get("HOROVOD_LOCAL_SIZE"))
        elif env.get("RANK") and env.get("WORLD_SIZE"):
            found = ("torchrun", env["RANK"], env["WORLD_SIZE"], env.get("LOCAL_RANK", "0"),
                     env.get("LOCAL_WORLD_SIZE"))
        elif env.get("OMPI_COMM_WORLD_RANK") and env.get("OMPI_COMM_WORLD_SIZE"):
            found = ("mpirun", env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"],
                     env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE"))
        elif env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
            found = ("srun", env["SLURM_PROCID"], env["SLURM_NTASKS"], env.get("SLURM_LOCALID", "0"),
                     _slurm_local_size(env))
        if found is None:
            return None
        launcher, *numbers = found
        try:
            rank, size, local_rank = (int(x) for x in numbers[:3])
            local_size = int(numbers[3]) if numbers[3] else size
        except ValueError:
            raise UsageError(f"{launcher}'s rank variables are not integers: {numbers}") from None
        if not (0 <= rank < size and 0 <= local_rank < local_size):
            raise UsageError(f"{launcher}: rank {rank} of {size}, local rank {local_rank} of {local_size}: "
                             f"out of range")
        if launcher == "horovodrun" and env.get("HOROVOD_ELASTIC") == "1":
            raise UsageError("horovodrun's elastic mode is not supported: start an elastic job with rdmatensor-run "
                             "--min-np/--max-np --host-discovery-script (horovodrun's flags)")
        store = ""
        if launcher == "horovodrun" and env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") and \
                env.get("HOROVOD_GLOO_RENDEZVOUS_PORT"):
            store = f"{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
        return cls(launcher, rank, size, local_rank, local_size, _rendezvous_address(launcher, env, store), store)


def _slurm_local_size(env) -> str | None:
    from .cluster import expand_tasks_per_node
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not counts or node is None:
        return None
    return str(expand_tasks_per_node(counts)[int(node)])


def _rendezvous_address(launcher: str, env, store: str) -> str:
    if env.get("RDMATENSOR_RENDEZVOUS_ADDR"):
        return env["RDMATENSOR_RENDEZVOUS_ADDR"]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if store:
        return ""                        # rank 0 publishes it there
    port = env.get("RDMATENSOR_RENDEZVOUS_PORT")
    if launcher == "srun":
        from .cluster import expand_hostlist
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodes:
            return f"{sorted(expand_hostlist(nodes))[0]}:{port or 29500 + int(env.get('SLURM_JOB_ID', 0)) % 1000}"
    if launcher == "mpirun" and port and env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == env.get("OMPI_COMM_WORLD_SIZE"):
        return f"127.0.0.1:{port}"
    raise UsageError(f"started by {launcher}, but no rendezvous address: set MASTER_ADDR and MASTER_PORT "
                     f"(or RDMATENSOR_RENDEZVOUS_ADDR=host:port), the same for every rank; rank 0 serves there")


def route_to(address: str) -> str:
    """This host's address on the route to `address`'s host (what peers can reach)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))             # no packet is sent: only the route is looked up
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def join_launcher(found: LauncherEnv, port: int, timeout: float) -> tuple[dict, Server | None]:
    """Rank 0 serves the rendezvous at `found.address` (until the round formed),
    or on a free port it publishes in `found.store`; every rank joins it with
    control port `port`."""
    server = None
    token = os.environ.get("RDMATENSOR_TOKEN", "")
    address = found.address
    if found.rank == 0:
        bind_port = int(address.rsplit(":", 1)[1]) if address else 0
        try:
            server = Server(Rounds(lambda: range(found.size)), token, join_timeout=timeout, port=bind_port)
        except OSError as exc:
            raise UsageError(f"rank 0 cannot serve the rendezvous on port {bind_port} ({found.launcher}): "
                             f"{exc}") from exc
    try:
        if not address and server is not None:
            address = f"{route_to(found.store)}:{server.port}"
            _publish(found.store, address, token, timeout)
        elif not address:
            address = _look_up(found.store, token, timeout)
        joined = join(route_to(address), port, -1, timeout + 30.0, worker=found.rank, address=address)
    except BaseException:
        if server is not None:
            server.close()
        raise
    return joined, server


# horovodrun's store is plain HTTP, without authentication (PUT and GET of
# /scope/key): what rank 0 puts there is signed with the job's token, so a
# rank joins no rendezvous but its own job's.
STORE_KEY = "/rdmatensor/rendezvous"


def _signature(token: str, address: str) -> str:
    return hmac.new(token.encode(), b"rdmatensor rendezvous " + address.encode(), hashlib.sha256).hexdigest()


def _publish(store: str, address: str, token: str, timeout: float) -> None:
    body = json.dumps({"address": address, "mac": _signature(token, address)}).encode()
    request = urllib.request.Request(f"http://{store}{STORE_KEY}", data=body, method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=min(timeout, 30.0)):
            pass
    except (OSError, urllib.error.URLError) as exc:
        raise PeerLost(f"horovodrun's key-value store at {store} cannot be reached: {exc}") from exc


def _look_up(store: str, token: str, timeout: float) -> str:
    """Rank 0's rendezvous address, once it published it (the others wait for it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{store}{STORE_KEY}", timeout=min(timeout, 30.0)) as reply:
                body = reply.read(MAX_REQUEST)
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise PeerLost(f"horovodrun's key-value store at {store} answered {exc.code}") from exc
        except (OSError, urllib.error.URLError) as exc:
            raise PeerLost(f"horovodrun's key-value store at {store} cannot be reached: {exc}") from exc
        if time.monotonic() > deadline:
            raise PeerLost(f"rank 0 did not publish its rendezvous in horovodrun's store at {store} within "
                           f"{timeout:g} s")
        time.sleep(0.1)
    try:
        entry = json.loads(body)
        address, mac = str(entry["address"]), str(entry["mac"])
    except (ValueError, TypeError, KeyError):
        address, mac = "", ""
    if not mac or not hmac.compare_digest(mac.encode(), _signature(token, address).encode()):
        raise AuthenticationError(f"the rendezvous published in horovodrun's store at {store} is not signed with "
                                  f"this job's token: give every rank the same RDMATENSOR_TOKEN")
    return address


def updated(number: int) -> bool:
    """Whether the job's workers changed since round `number` formed."""
    return bool(_call({"op": "updated", "round": number}, 30.0)["updated"])
