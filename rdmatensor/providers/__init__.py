"""Data providers: one way each to do a one-sided write into a peer's memory.

`REGISTRY` is the one list of providers: everything that names them (`auto`,
`rdmatensor devices`, the launchers, the benchmark, the tests) reads it.
Each provider is a folder of the same shape: `channel.py` (its Channel, the
contract in contract.py), the mechanism behind it, and the mechanism's
compiled twin where it has one. `emulated/` holds what shm and tcp share;
`baselines/` the providers measured against, never chosen. Adding a provider
means its folder, one entry here, and its channel parameters in control.proto.

`auto` decides per peer, as NCCL does: shm with a peer on this host, verbs
with a peer elsewhere where an ACTIVE RDMA port exists, else tcp. Each
side decides the same way (a peer is on this host when its address can be
bound here), and the Exchange checks that they agree.

    contract.py   the Channel every provider implements, and the Pieces of a gather write
    verbs/        real one-sided RDMA WRITE over an RC queue pair
    shm/          a peer on the same host: shared-memory arenas
    tcp/          the contract emulated over a TCP stream
    emulated/     what shm and tcp share
    baselines/    gRPC messages and RPC over verbs, measured against
"""
from __future__ import annotations

import importlib
import logging
import socket
from dataclasses import dataclass

from ..errors import ProviderUnavailable
from .contract import Channel

log = logging.getLogger("rdmatensor")


@dataclass(frozen=True)
class Provider:
    name: str
    module: str          # within this package
    cls: str
    description: str
    baseline: bool = False      # measured against, never chosen by auto
    needs_rdma: bool = False    # runs only where an RDMA device is (tests mark it `rdma`)

    def load(self) -> type[Channel]:
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), self.cls)

    def viable(self) -> tuple[bool, str]:
        """Whether it can run here, and why (not), as the provider itself says."""
        try:
            return self.load().viable()
        except Exception as exc:  # noqa: BLE001 - a provider that cannot even load is not viable
            return False, f"cannot load: {exc}"


REGISTRY: dict[str, Provider] = {p.name: p for p in (
    Provider("verbs", "verbs.channel", "VerbsChannel",
             "real RDMA (InfiniBand, RoCE, SoftRoCE), through the compiled RC endpoint or pyverbs", needs_rdma=True),
    Provider("shm", "shm.channel", "ShmChannel",
             "same host: shared-memory arenas, memcpy + a completion on a Unix socket"),
    Provider("tcp", "tcp.channel", "TcpChannel",
             "the same contract emulated over TCP, payload received straight into the slot"),
    Provider("grpc", "baselines.grpc_channel", "GrpcChannel",
             "the baseline being replaced: tensors serialized into gRPC messages", baseline=True),
    Provider("verbs-rpc", "baselines.verbs_rpc_channel", "VerbsRpcChannel",
             "a baseline: RPC over the same verbs device, the way RDMA-optimized RPC libraries do it "
             "(SEND/RECV into private buffers, chunked, protobuf-serialized, copied out)",
             baseline=True, needs_rdma=True),
)}
NAMES = tuple(REGISTRY)


def viability() -> dict[str, tuple[bool, str]]:
    """Which providers can run here, and why not where not (each provider says)."""
    return {name: info.viable() for name, info in REGISTRY.items()}


def provider_class(name: str) -> type[Channel]:
    if name not in REGISTRY:
        raise ProviderUnavailable(f"unknown provider {name!r}; choose auto or one of {', '.join(NAMES)}")
    return REGISTRY[name].load()


def is_local_host(host: str) -> bool:
    """True when `host` is an address of this machine (it can be bound here)."""
    try:
        for family, _, _, _, addr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
        return True
    except OSError:
        return False


def choose(name: str, peer_hosts: dict[int, str], rank: int = 0) -> dict[int, type[Channel]]:
    """The provider class for each peer (rank -> host): `name` for all, or
    per peer when "auto"; ProviderUnavailable saying why one cannot run."""
    if name != "auto":
        cls = provider_class(name)
        ok, why = cls.viable()
        if not ok:
            raise ProviderUnavailable(f"provider {name!r} is not viable here: {why}")
        return dict.fromkeys(peer_hosts, cls)
    verbs, why_verbs = REGISTRY["verbs"].viable()
    shm, why_shm = REGISTRY["shm"].viable()
    out = {}
    for peer, host in sorted(peer_hosts.items()):
        local = is_local_host(host)
        if local and shm:
            pick, why = "shm", "on this host"
        elif verbs:
            pick, why = "verbs", f"{'on this host, shm: ' + why_shm if local else 'on ' + host}; {why_verbs}"
        else:
            pick, why = "tcp", f"{'on this host, shm: ' + why_shm if local else 'on ' + host}; verbs: {why_verbs}"
        log.info("provider auto: rank %d -> rank %d: %s (%s)", rank, peer, pick, why)
        out[peer] = provider_class(pick)
    return out
