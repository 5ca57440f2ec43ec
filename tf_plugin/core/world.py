"""Who this process is in the job, and what it can do before any tensor moves:
init, shutdown, rank and size, local rank and size, objects between ranks,
counters, and the registry of its process sets (ProcessSet, global_process_set,
add_process_set: the sets a script holds name a Group of process_sets.py,
which this module hands the current world). This module does not import
TensorFlow.

Where the job comes from:

- the workers of TF_CONFIG (rdmatensor/runner/cluster.py) are the ranks, in order;
  without TF_CONFIG the process is a job of one (as Horovod without a launcher);
- RDMATENSOR_TOKEN: the job's shared secret (required with more than one rank);
- RDMATENSOR_LOCAL_RANK / RDMATENSOR_LOCAL_SIZE: set by the launcher; without
  them, the workers of TF_CONFIG on this worker's host are counted;
- RDMATENSOR_PROVIDER (default auto), RDMATENSOR_CHECK_FINITE (1: allreduce
  raises NonFiniteValue on a NaN or Inf, see checked_collectives.py);
- the settings Horovod has too (timeout, elastic timeout, fusion threshold,
  time line, hierarchical all-reduce, log level, stall check), under either
  name: settings.py.

A variable set to "" is unset (rdmatensor.environment).
"""
from __future__ import annotations

import atexit
import enum
import os
import pickle
import threading
from dataclasses import dataclass, field

from rdmatensor import UsageError
from rdmatensor import environment

from .bootstrap import Bootstrap, PortReservation
from .checked_collectives import CheckedCollectives, finite_check_from_env
from .generations import COUNTED
from rdmatensor.runner import rendezvous_client as rendezvous
from rdmatensor.runner.cluster import Cluster
from .failure import JobFailure
from .timeline import Timeline
from . import process_sets as process_sets_module
from . import settings
from .process_sets import Group
from ..errors import NotAMember


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's values."""
    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum, ReduceOp.Min,
                                           ReduceOp.Max, ReduceOp.Product)


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    bootstrap: Bootstrap
    collectives: CheckedCollectives
    failure: JobFailure | None = None
    round: int = -1                # the elastic round this world is (-1: not an elastic job)
    # what a process set's collectives are built with (process_sets.py), and the sets registered
    hosts: list = field(default_factory=list)
    provider: str = "auto"
    token: str | None = None
    timeout: float = 120.0
    fusion_threshold: int | None = None
    check_finite: bool = False
    sets: dict = field(default_factory=dict)     # process set id -> process_sets.Group


_world: World | None = None
_last_round = -1                   # the elastic round this process last joined


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def local_of(cluster: Cluster) -> tuple[int, int]:
    """(local rank, local size): the launcher's environment, else this host's workers in TF_CONFIG."""
    env_rank, env_size = environment.get("RDMATENSOR_LOCAL_RANK"), environment.get("RDMATENSOR_LOCAL_SIZE")
    if env_rank is not None and env_size is not None:
        try:
            local_rank, local_size = int(env_rank), int(env_size)
        except ValueError:
            local_rank = local_size = -1
        if not 0 <= local_rank < local_size:
            raise UsageError(f"RDMATENSOR_LOCAL_RANK={env_rank!r}, RDMATENSOR_LOCAL_SIZE={env_size!r}: "
                             f"expected integers with 0 <= local rank < local size")
        return local_rank, local_size
    mine = _host(cluster.workers[cluster.rank])
    here = [r for r, a in enumerate(cluster.workers) if _host(a) == mine]
    return here.index(cluster.rank), len(here)


def init(provider: str | None = None, cluster: Cluster | None = None, token: str | None = None,
         timeout: float | None = None, fusion_threshold: int | None = None,
         check_finite: bool | None = None, process_sets=None) -> None:
    """Join the job: connect the bootstrap channel between the workers (once: a
    second call does nothing). `fusion_threshold`: bytes per
    all-reduce bucket (default RDMATENSOR_FUSION_THRESHOLD or HOROVOD_FUSION_THRESHOLD, else 64 MiB).
    `check_finite` (default RDMATENSOR_CHECK_FINITE): allreduce raises
    NonFiniteValue, naming the tensor, when a floating value holds a NaN or Inf.
    `process_sets`: ProcessSets (or lists of ranks) to register, as Horovod's
    init(process_sets=...): the same on every rank (see process_sets.py)."""
    global _world, _last_round
    if _world is None:
        settings.apply_log_level()
        settings.warn_ignored()
        reservation, joined, found = None, None, None
        if cluster is None and rendezvous.configured():
            reservation, cluster, joined = _join_round()
        elif cluster is None and environment.get("TF_CONFIG"):
            cluster = Cluster.from_tf_config()
        elif cluster is None and (found := rendezvous.LauncherEnv.detect()) is not None and found.size > 1:
            reservation, cluster, joined = _join_launcher(found, token, timeout)
        cluster = cluster or Cluster(("127.0.0.1:0",))
        if not cluster.is_worker:
            raise UsageError(f"task {cluster.task_type}:{cluster.task_index} is not a worker: only workers "
                             f"join the collectives (parameter servers run tf_plugin.graph.ps_step)")
        size, rank = cluster.num_workers, cluster.rank
        token = token or environment.get("RDMATENSOR_TOKEN")
        if size > 1 and not token:
            raise UsageError("RDMATENSOR_TOKEN is not set: every worker of the job needs its shared token")
        provider = provider or environment.get("RDMATENSOR_PROVIDER", "auto")
        timeout = float(timeout or settings.seconds(settings.TIMEOUT))
        peers = {r: a for r, a in enumerate(cluster.workers)}
        if reservation is not None:
            reservation.close()            # the bootstrap session's control server binds it now
        boot = Bootstrap(rank, peers, provider, token, timeout)
        failure = JobFailure(rank)           # a lost rank fails every collective of this one
        if boot.session is not None:
            failure.watch(boot.session)
        hosts = [_host(a) for a in cluster.workers]
        if check_finite is None:
            check_finite = finite_check_from_env()
        try:
            collectives = CheckedCollectives(boot, hosts, provider, token, timeout, fusion_threshold,
                                             watch=failure.watch, job_failure=lambda: failure.first,
                                             check_finite=check_finite)
        except BaseException:
            boot.close()
            raise
        local = (joined["local_rank"], joined["local_size"]) if joined else local_of(cluster)
        _world = World(rank, size, *local, boot, collectives, failure, joined["round"] if joined else -1,
                       hosts, provider, token, timeout, fusion_threshold, check_finite)
        if joined:
            _last_round = joined["round"]
        _at_exit(shutdown)                 # peers hear a goodbye, not a silence, when a script just ends
        global_process_set.ranks = list(range(size))      # as Horovod's init sets it
        if process_sets:
            process_sets_module.register(world, _as_process_sets(list(process_sets)), adding=False)


def _join_round():
    """An elastic job's worker: a port for its control server, then its place in
    the next round (rank, peers) from the launcher's rendezvous."""
    host = environment.get("RDMATENSOR_HOST", "127.0.0.1")
    timeout = settings.seconds(settings.ELASTIC_TIMEOUT) + 60.0   # the launcher's, then ours
    reservation = PortReservation(host)
    try:
        joined = rendezvous.join(host, reservation.port, _last_round, timeout)
    except BaseException:
        reservation.close()
        raise
    return reservation, Cluster(tuple(joined["workers"]), task_index=joined["rank"]), joined


def _join_launcher(found: rendezvous.LauncherEnv, token: str | None, timeout: float | None):
    """Started by torchrun, mpirun, srun or horovodrun: a port of its own, then every rank's
    address through rank 0's rendezvous (rank, size and local rank are the launcher's)."""
    token = token or environment.get("RDMATENSOR_TOKEN")
    if not token:
        raise UsageError(f"RDMATENSOR_TOKEN is not set: started by {found.launcher}, every rank needs the job's "
                         f"shared token (e.g. export RDMATENSOR_TOKEN=$(openssl rand -hex 16) and pass it on, "
                         f"mpirun -x RDMATENSOR_TOKEN)")
    if environment.get("RDMATENSOR_TOKEN") is None:
        os.environ["RDMATENSOR_TOKEN"] = token          # the rendezvous client reads it there
    reservation = PortReservation(rendezvous.route_to(found.route))
    try:
        joined, server = rendezvous.join_launcher(found, reservation.port,
                                                  float(timeout or settings.seconds(settings.TIMEOUT)))
    except BaseException:
        reservation.close()
        raise
    if server is not None:
        server.close()                 # the round formed: every rank has its answer
    joined = dict(joined, round=-1, local_rank=found.local_rank, local_size=found.local_size)
    return reservation, Cluster(tuple(joined["workers"]), task_index=joined["rank"]), joined


def _at_exit(fn) -> None:
    """Run `fn` when the interpreter exits, while gRPC can still serve: plain
    atexit handlers run after concurrent.futures has stopped every thread pool,
    when a control server can take no call (one arriving then, a peer's
    goodbye or ping, stops its serving thread for good). Threading's own exit
    hooks run first, the latest registered first."""
    register = getattr(threading, "_register_atexit", None)
    try:
        register(fn)
    except (TypeError, RuntimeError):           # no such hook, or the interpreter is already exiting
        atexit.register(fn)


def world() -> World:
    if _world is None:
        raise UsageError("tf_plugin is not initialized: call hvd.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


# ------------------------------------------------------------------ process sets
class ProcessSet:
    """A set of ranks that run collectives together (Horovod's class: pass it to
    init(process_sets=...) or add_process_set(); process_set_id is set then)."""
    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks (an MPI "
                             "communicator needs MPI, which rdmatensor does not use)") from None
        if any(not isinstance(rk, int) for rk in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """The number of ranks in the set, or None while it is not registered."""
        if self.process_set_id is None:
            return None
        return group_of(self).size

    def rank(self) -> int | None:
        """This rank's position in the set, or None while it is not registered."""
        if self.process_set_id is None:
            return None
        group = group_of(self)
        return group.rank if group.included else None

    def included(self) -> bool | None:
        if self.ranks is None:
            return None
        return world().rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _as_process_sets(candidates: list):
    """ProcessSets of `candidates` (ProcessSets or lists of ranks), each made as it is checked."""
    return (ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in candidates)


def group_of(process_set) -> Group:
    """The registered set a collective runs in (None: the global one). ValueError for
    a set that is not registered; the caller checks that this rank is in it."""
    w = world()
    ps_id = 0 if process_set is None else getattr(process_set, "process_set_id", None)
    if ps_id == 0:
        return Group(0, tuple(range(w.size)), world)
    if ps_id is None or ps_id not in w.sets:
        raise ValueError(f"{process_set} is not a registered process set: pass it to hvd.init(process_sets=...) "
                         f"or hvd.add_process_set() first, on every rank")
    return w.sets[ps_id]


def member_of(process_set) -> Group:
    """group_of(process_set), which this rank must be in (NotAMember)."""
    group = group_of(process_set)
    if not group.included:
        raise NotAMember(f"rank {world().rank} is not in process set {group.id} (ranks {list(group.ranks)}): "
                         f"it cannot take part in its collectives")
    return group


def add_process_set(process_set) -> ProcessSet:
    """Register a process set after init() (every rank calls it, in the same order); it is returned registered."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    process_sets_module.register(world, [ps], adding=True)
    return ps


def remove_process_set(process_set) -> bool:
    """Close a registered set's collectives (every rank calls it); False for the global
    set or one that is not registered."""
    return process_sets_module.unregister(world(), process_set)


def shutdown() -> None:
    """Close every session of this rank (idempotent); init() may be called again."""
    global _world
    w, _world = _world, None
    if w is not None:
        try:
            for group in w.sets.values():
                group.close()
            w.collectives.close()
        finally:
            w.bootstrap.close()


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def local_rank() -> int:
    return world().local_rank


def local_size() -> int:
    return world().local_size


def cross_rank() -> int:
    """This rank's host among the hosts that run a rank of its local rank (Horovod's cross rank)."""
    w = world()
    return _same_local_rank(w).index(w.rank)


def cross_size() -> int:
    """How many hosts run a rank of this rank's local rank (Horovod's cross size)."""
    return len(_same_local_rank(world()))


def _same_local_rank(w: World) -> list[int]:
    """The ranks whose position among their host's ranks is this rank's, in rank order."""
    position = [w.hosts[:r].count(w.hosts[r]) for r in range(w.size)]
    return [r for r in range(w.size) if position[r] == position[w.rank]]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the all-reduce's time line in `file_path` from now on (core/timeline.py;
    as RDMATENSOR_TIMELINE: rank 0 writes it, or every rank with {rank} in the path).
    A time line already recording is closed first. `mark_cycles`: accepted, as
    Horovod's, with no cycles to mark."""
    w = world()
    if not file_path:
        raise ValueError("start_timeline needs the path of the time line's file")
    stop_timeline()
    if "{rank}" in file_path or w.rank == 0:
        w.collectives.comm.timeline = Timeline(file_path.replace("{rank}", str(w.rank)), w.rank)


def stop_timeline() -> None:
    """Stop recording the time line and close its file (nothing if none records)."""
    comm = world().collectives.comm
    timeline, comm.timeline = comm.timeline, None
    if timeline is not None:
        timeline.close()


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None, process_set=None):
    """A function of one object that broadcasts it from root_rank, as Horovod's."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def broadcast_object(obj, root_rank: int = 0, session=None, name: str | None = None, process_set=None):
    """`obj` as root_rank has it, on every rank of the set (pickled; the ranks share a token)."""
    group = member_of(process_set)
    data = pickle.dumps(obj) if world().rank == root_rank else None
    return pickle.loads(group.bootstrap.broadcast(f"object:{name or ''}", data, group.local(root_rank)))


def allgather_object(obj, session=None, name: str | None = None, process_set=None) -> list:
    """Every rank's `obj` (of the set), in rank order."""
    group = member_of(process_set)
    return [pickle.loads(b) for b in group.bootstrap.allgather(f"objects:{name or ''}", pickle.dumps(obj))]


def stats() -> dict:
    """This rank's counters since init(): control_calls, bytes_sent/received, writes,
    recvs, copies (the sessions'; by purpose copies_gather, copies_array, copies_frame,
    with bytes_copied: Session.stats()), plugin_copies, dynamic, grows, over every plan
    generation and the bootstrap channel; generations (sessions the growing plan
    connected), extensions (generations after the first), tensor_sets, tensors (in
    the current plan), exchanges (bootstrap collectives: plan agreements, objects),
    provider (None in a job of one), fusion_threshold (bytes per all-reduce
    bucket) and buckets (over every all-reduce set planned), hierarchy (the
    ranks of each host, once an all-reduce was planned hierarchically; else
    None: the flat ring); native_requests: buckets the native all-reduce ran
    (tf_plugin/native: its bytes are in bytes_sent and bytes_received, as many
    each way as the ring's)."""
    w = world()
    out = w.collectives.stats()
    boot = w.bootstrap.stats()
    for k in COUNTED:
        out[k] += boot.get(k, 0)
    out["exchanges"] = w.bootstrap.exchanges
    out["provider"] = out["provider"] or boot.get("provider")
    return out


# ------------------------------------------------ what Horovod scripts ask of the build
def mpi_built() -> bool:
    """No MPI inside: rdmatensor moves tensors itself (rdmatensor-run, or any launcher's environment)."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def is_homogeneous() -> bool:
    """Every host runs as many ranks as this one (as Horovod reports it)."""
    counts = allgather_object(local_size(), name="homogeneous")
    return len(set(counts)) == 1
