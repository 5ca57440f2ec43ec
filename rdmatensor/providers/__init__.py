"""Data providers: one way each to do a one-sided write into a peer's memory.

    verbs  real RDMA through pyverbs (InfiniBand, RoCE, SoftRoCE)
    shm    same host: shared-memory arenas, memcpy + a completion on a Unix socket
    tcp    the same contract emulated over TCP, payload received straight into the slot
    grpc   the baseline being replaced: tensors serialized into gRPC messages

`auto` picks verbs where an ACTIVE RDMA port exists, else shm when every peer
is on this host, else tcp.
"""
from __future__ import annotations

import logging
import socket

from ..errors import ProviderUnavailable
from .base import Channel

log = logging.getLogger("rdmatensor")
NAMES = ("verbs", "shm", "tcp", "grpc")


def provider_class(name: str) -> type[Channel]:
    if name == "verbs":
        from .verbs import VerbsChannel
        return VerbsChannel
    if name == "shm":
        from .shm import ShmChannel
        return ShmChannel
    if name == "tcp":
        from .tcp import TcpChannel
        return TcpChannel
    if name == "grpc":
        from .grpc_baseline import GrpcChannel
        return GrpcChannel
    raise ProviderUnavailable(f"unknown provider {name!r}; choose auto or one of {', '.join(NAMES)}")


def is_local_host(host: str) -> bool:
    """True when `host` is an address of this machine (it can be bound here)."""
    try:
        for family, _, _, _, addr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
        return True
    except OSError:
        return False


def choose(name: str, peer_hosts: list[str]) -> type[Channel]:
    """The provider class for `name` ("auto" decides), or ProviderUnavailable saying why."""
    if name != "auto":
        cls = provider_class(name)
        ok, why = cls.viable()
        if not ok:
            raise ProviderUnavailable(f"provider {name!r} is not viable here: {why}")
        return cls
    verbs = provider_class("verbs")
    ok, why = verbs.viable()
    if ok:
        log.info("provider auto -> verbs: %s", why)
        return verbs
    if all(is_local_host(h) for h in peer_hosts):
        shm = provider_class("shm")
        ok_shm, why_shm = shm.viable()
        if ok_shm:
            log.info("provider auto -> shm: every peer is on this host (verbs: %s)", why)
            return shm
    log.info("provider auto -> tcp: verbs: %s; peers on other hosts or no shm", why)
    return provider_class("tcp")
