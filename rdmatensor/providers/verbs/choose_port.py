"""Which device, port and GID a rank's queue pairs open, in the spirit of
NCCL's NCCL_IB_HCA and NCCL_IB_GID_INDEX:

    RDMATENSOR_IB_HCA=mlx5_0,mlx5_1:1    only these (a device, or device:port)
    RDMATENSOR_IB_HCA=^mlx5_2            every ACTIVE port but these
    RDMATENSOR_IB_GID_INDEX=3            this GID index (default: the port's
                                         IPv4-mapped RoCE v2 GID; 0 on InfiniBand)

Among the ports left, a rank takes one on its own NUMA node where the host
says where its NICs and its cores are, and spreads ranks that share a host
round-robin by local rank (RDMATENSOR_LOCAL_RANK, or a launcher's): one NIC
per rank on a host with one NIC per socket or GPU.

    RDMATENSOR_IB_RAILS=2                two ports to each peer (rails.py): the
                                         first two left, in the order listed
                                         (by name without a list), the same
                                         order on every host: rail i meets the
                                         peer's rail i
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...devices import SYSFS, active_port, list_devices
from ...errors import DeviceError

HCA_ENV, GID_ENV, RAILS_ENV = "RDMATENSOR_IB_HCA", "RDMATENSOR_IB_GID_INDEX", "RDMATENSOR_IB_RAILS"
LOCAL_RANK_VARS = ("RDMATENSOR_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                   "LOCAL_RANK")


@dataclass(frozen=True)
class Candidate:
    device: str
    port: int
    numa: int          # -1: the host does not say


def parse_hca(spec: str) -> tuple[bool, list[tuple[str, int | None]]]:
    """'^a,b:2' -> (exclude, [("a", None), ("b", 2)])."""
    exclude = spec.startswith("^")
    items = []
    for item in spec.lstrip("^").split(","):
        name, _, port = item.strip().partition(":")
        if not name or (port and not port.isdigit()):
            raise DeviceError(f"{HCA_ENV}={spec!r}: {item!r} is not device or device:port")
        items.append((name, int(port) if port else None))
    return exclude, items


def allowed(candidates: list[Candidate], spec: str = "") -> list[Candidate]:
    """The ACTIVE ports RDMATENSOR_IB_HCA leaves, in its order (a port listed twice
    is two rails on it), else as given; DeviceError if none."""
    left = list(candidates)
    if spec:
        exclude, items = parse_hca(spec)

        def named(c: Candidate, name: str, port: int | None) -> bool:
            return c.device == name and port in (None, c.port)
        if exclude:
            left = [c for c in left if not any(named(c, *item) for item in items)]
        else:
            left = [c for item in items for c in candidates if named(c, *item)]
    if not left:
        there = ", ".join(f"{c.device}:{c.port}" for c in candidates) or "none"
        raise DeviceError("no ACTIVE RDMA port left" + (f" by {HCA_ENV}={spec!r}" if spec else "") +
                          f" (ACTIVE ports here: {there})")
    return left


def select(candidates: list[Candidate], spec: str = "", local_rank: int = 0, my_numa: set[int] = frozenset()
           ) -> Candidate:
    """The port this rank opens among the ACTIVE ones; DeviceError naming what was asked and what there is."""
    left = list(dict.fromkeys(allowed(candidates, spec)))
    near = [c for c in left if c.numa >= 0 and c.numa in my_numa]
    pool = near or left
    return pool[local_rank % len(pool)]


def _numa_of(device: str) -> int:
    try:
        return int((SYSFS / device / "device" / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


def _my_numa_nodes() -> set[int]:
    """The NUMA nodes of the cores this process may run on (empty where the host does not say)."""
    try:
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()
    nodes = set()
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        try:
            cpus = _cpulist((node / "cpulist").read_text())
        except OSError:
            continue
        if cpus & mine:
            nodes.add(int(node.name[4:]))
    return nodes


def _cpulist(text: str) -> set[int]:
    out = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            out.update(range(int(low), int(high or low) + 1))
    return out


def local_rank(env=os.environ) -> int:
    for var in LOCAL_RANK_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    return 0


def _candidates() -> list[Candidate]:
    devices = list_devices(gids=False)
    candidates = [Candidate(d.name, p.number, _numa_of(d.name)) for d in devices for p in d.ports if p.active]
    if not candidates:
        names = [d.name for d in devices]
        raise DeviceError("no RDMA device with an ACTIVE port" +
                          (f" (found {', '.join(names)}, none ACTIVE)" if names else " (no RDMA device at all)"))
    return sorted(candidates, key=lambda c: (c.device, c.port))


def rails(env=os.environ) -> int:
    """RDMATENSOR_IB_RAILS: how many ports this rank opens to each peer (default 1)."""
    raw = env.get(RAILS_ENV, "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= 8:
        raise DeviceError(f"{RAILS_ENV}={raw!r}: expected a number of rails from 1 to 8")
    return int(raw)


def choose_rails(count: int, env=os.environ) -> list[tuple[str, int, int]]:
    """(device, port, GID index) of each rail: the first `count` ports RDMATENSOR_IB_HCA
    leaves, in its order; DeviceError when there are fewer."""
    spec = hca(env)
    left = allowed(_candidates(), spec)
    if len(left) < count:
        raise DeviceError(f"{RAILS_ENV}={count} but only {len(left)} ACTIVE port(s) "
                          + (f"left by {HCA_ENV}={spec!r}" if spec else "here")
                          + f": {', '.join(f'{c.device}:{c.port}' for c in left)}")
    return [_with_gid(c, env) for c in left[:count]]


def choose(env=os.environ) -> tuple[str, int, int]:
    """(device, port, GID index) for this rank."""
    pick = select(_candidates(), hca(env), local_rank(env), _my_numa_nodes())
    return _with_gid(pick, env)


def hca(env=os.environ) -> str:
    """RDMATENSOR_IB_HCA, stripped ("": every ACTIVE port)."""
    return env.get(HCA_ENV, "").strip()


def gid_index(env=os.environ) -> int | None:
    """RDMATENSOR_IB_GID_INDEX, or None where unset (the port's RoCE v2 GID then)."""
    raw = env.get(GID_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise DeviceError(f"{GID_ENV}={raw!r}: expected a GID index (a whole number)")
    return int(raw)


def _with_gid(pick: Candidate, env) -> tuple[str, int, int]:
    index = gid_index(env)
    if index is not None:
        return pick.device, pick.port, index
    found = active_port(pick.device, pick.port)
    gid = found[1].roce_v2_gid() if found else None
    return pick.device, pick.port, gid.index if gid else 0
