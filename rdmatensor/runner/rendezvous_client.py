"""The rendezvous' client: a worker joins a round of the job
(rendezvous_server.py says how rounds form), either at the address an
elastic launcher gave it or, under another launcher, at rank 0, which serves
the rendezvous itself."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from rdmatensor import AuthenticationError, PeerLost, UsageError, environment
from rdmatensor.control.proof import Signer, digest

from .cluster import expand_hostlist, expand_tasks_per_node
from .rendezvous_server import MAX_REQUEST, Rounds, Server, canonical


def configured() -> bool:
    """Whether this process was started as a worker of an elastic job."""
    return bool(os.environ.get("RDMATENSOR_RENDEZVOUS"))


def _call(request: dict, timeout: float, address: str | None = None) -> dict:
    host, port = (address or os.environ["RDMATENSOR_RENDEZVOUS"]).rsplit(":", 1)
    request = dict(request, proof=_signer().sign("rendezvous", digest(canonical(request))))
    deadline = time.monotonic() + timeout
    while True:                           # rank 0's server may not be up yet
        try:
            return _once(host.strip("[]"), int(port), request, timeout)
        except ConnectionRefusedError as exc:
            if time.monotonic() > deadline:
                raise PeerLost(f"the job's rendezvous at {host}:{port} refused every connection for "
                               f"{timeout:g} s: {exc}") from exc
            time.sleep(0.1)


_signers: dict[str, Signer] = {}


def _signer() -> Signer:
    """This process's signer for the job's token (one sender id, calls numbered)."""
    token = os.environ.get("RDMATENSOR_TOKEN", "")
    if token not in _signers:
        _signers[token] = Signer(token)
    return _signers[token]


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

        def var(name, default=None):
            return environment.get(name, default, env)
        found = None
        if env.get("HOROVOD_RANK") and env.get("HOROVOD_SIZE"):
            found = ("horovodrun", env["HOROVOD_RANK"], env["HOROVOD_SIZE"], var("HOROVOD_LOCAL_RANK", "0"),
                     var("HOROVOD_LOCAL_SIZE"))
        elif env.get("RANK") and env.get("WORLD_SIZE"):
            found = ("torchrun", env["RANK"], env["WORLD_SIZE"], var("LOCAL_RANK", "0"),
                     var("LOCAL_WORLD_SIZE"))
        elif env.get("OMPI_COMM_WORLD_RANK") and env.get("OMPI_COMM_WORLD_SIZE"):
            found = ("mpirun", env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"],
                     var("OMPI_COMM_WORLD_LOCAL_RANK", "0"), var("OMPI_COMM_WORLD_LOCAL_SIZE"))
        elif env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
            found = ("srun", env["SLURM_PROCID"], env["SLURM_NTASKS"], var("SLURM_LOCALID", "0"),
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
