"""Where each rank of a job runs and what it is told: hosts and slots (-H),
ranks placed on them in order, and the environment each rank starts with."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Sequence

from .addresses import AddressError, host_port, named_address, route_source
from .cluster import Cluster, free_ports
from .cores import BIND_TO, HOST_SLOT

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class LaunchError(ValueError):
    """A launch that cannot start as asked (bad -H, too few slots, ...)."""


@dataclass(frozen=True)
class Placement:
    """Where one rank runs and what it is."""
    rank: int
    task_type: str          # worker | ps
    index: int              # within its task type
    host: str               # as given in -H
    address: str            # host:port in TF_CONFIG
    local_rank: int         # among this host's tasks of the same type (workers, or ps)
    local_size: int
    local: bool             # runs on this machine (no ssh)

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.task_type} {self.index} on {self.host})"


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """-H "a:2,b:4" -> [("a", 2), ("b", 4)]; a host without ":slots" has one slot."""
    hosts: list[tuple[str, int]] = []
    for item in text.split(","):
        item = item.strip()
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not name or any(c.isspace() for c in name):
            raise LaunchError(f"-H {text!r}: {item!r} is not host[:slots]")
        if not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"-H {text!r}: slots of {name!r} must be a positive integer, not {slots!r}")
        if name in (h for h, _ in hosts):
            raise LaunchError(f"-H {text!r}: host {name!r} is listed twice")
        hosts.append((name, int(slots)))
    return hosts


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES or host == socket.gethostname()


def place(np: int, hosts: Sequence[tuple[str, int]], ps: int = 0, ports: Sequence[int] | None = None,
          network_interfaces: Sequence[str] | None = None) -> list[Placement]:
    """Ranks 0..np-1 (workers) then np..np+ps-1 (parameter servers), filling the hosts in order.
    This host's ranks are named by the address of the first of `network_interfaces` that has
    one when given; else, when some hosts are remote, by the address the first remote host
    reaches it at (addresses.py); else by 127.0.0.1."""
    if np < 1 or ps < 0:
        raise LaunchError(f"-np {np} / --ps {ps}: need at least one worker")
    total = np + ps
    slots = sum(s for _, s in hosts)
    if total > slots:
        raise LaunchError(f"-np {np}" + (f" + --ps {ps}" if ps else "") + f" = {total} ranks, but the hosts "
                          f"have {slots} slot(s): " + ",".join(f"{h}:{s}" for h, s in hosts))
    where = [h for h, s in hosts for _ in range(s)][:total]
    kinds = ["worker"] * np + ["ps"] * ps
    remote = [h for h in where if not is_local(h)]
    try:
        here = (named_address(network_interfaces) if network_interfaces else
                route_source(remote[0]) if remote else "127.0.0.1")
    except AddressError as exc:
        raise LaunchError(str(exc)) from None
    ports = list(ports) if ports is not None else _ports(total)
    out = []
    for rank, (host, kind) in enumerate(zip(where, kinds, strict=True)):
        local = is_local(host)
        addr_host = here if local else host
        # local rank and size count this host's tasks of the same type: among workers, Horovod's meaning
        same = [r for r, (h, k) in enumerate(zip(where, kinds, strict=True)) if h == host and k == kind]
        out.append(Placement(rank, kind, rank if kind == "worker" else rank - np, host,
                             host_port(addr_host, ports[rank]), same.index(rank), len(same), local))
    return out


def _ports(n: int) -> list[int]:
    return free_ports(n)


def tf_config(placements: Sequence[Placement], me: Placement) -> str:
    workers = tuple(p.address for p in placements if p.task_type == "worker")
    ps = tuple(p.address for p in placements if p.task_type == "ps")
    return Cluster(workers, ps, me.task_type, me.index).to_tf_config()


def rank_env(placements: Sequence[Placement], me: Placement, token: str, provider: str | None,
             job: str = "", bind_to: str = "core") -> dict[str, str]:
    """The variables one rank gets (on top of the launcher's own, for local ranks)."""
    workers = sum(p.task_type == "worker" for p in placements)
    host = [p.rank for p in placements if p.host == me.host]
    env = {"TF_CONFIG": tf_config(placements, me), "RDMATENSOR_TOKEN": token, "RDMATENSOR_JOB": job,
           "RDMATENSOR_RANK": str(me.rank), "RDMATENSOR_SIZE": str(len(placements)),
           "RDMATENSOR_LOCAL_RANK": str(me.local_rank), "RDMATENSOR_LOCAL_SIZE": str(me.local_size),
           BIND_TO: bind_to, HOST_SLOT: f"{host.index(me.rank)}/{len(host)}", "PYTHONUNBUFFERED": "1"}
    if provider:
        env["RDMATENSOR_PROVIDER"] = provider
    if me.task_type == "worker":
        for prefix in ("HOROVOD_", "OMPI_COMM_WORLD_"):
            for name, value in (("RANK", me.rank), ("SIZE", workers), ("LOCAL_RANK", me.local_rank),
                                ("LOCAL_SIZE", me.local_size)):
                env[prefix + name] = str(value)
    return env
