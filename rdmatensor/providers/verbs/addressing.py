"""How a queue pair addresses its peer, by the verbs rules of each link layer,
and the fabric settings an operator sets (in the spirit of NCCL's NCCL_IB_*).

Both endpoints, the compiled one and pyverbs', connect with what `route()`
returns, so the rules live here once:

- RoCE (link layer Ethernet): a global route to the peer's GID, as always.
- InfiniBand within one subnet (the GIDs' subnet prefixes agree): the peer's
  LID and no GRH, unless RDMATENSOR_IB_FORCE_GRH=1 (virtual functions that
  share a LID need one).
- InfiniBand across subnets would need the router's LID from a path record (an
  SA query, as rdma_cm makes): refused, saying so.
- Link layers that differ between the two ends are refused.

The traffic class travels in the GRH and the service level in the address
handle; the path MTU is the smaller of both ports' and RDMATENSOR_IB_MTU.
The settings that shape the path (traffic class, service level, hop limit,
P_Key index, GRH, MTU cap) must be the same at both ends: each side sends them
and a difference is refused. InfiniBand is built to the specification and
tested here only through this function: SoftRoCE is RoCE, and cannot run a
route without a GRH.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...devices import MTU_BYTES, SYSFS
from ...errors import TransportError

ETHERNET, INFINIBAND = "Ethernet", "InfiniBand"


@dataclass(frozen=True)
class Fabric:
    traffic_class: int = 0      # RDMATENSOR_IB_TC: in the GRH (RoCE: DSCP << 2 | ECN), for lossless priorities
    service_level: int = 0      # RDMATENSOR_IB_SL: the address handle's SL (InfiniBand's virtual lanes, RoCE's PCP)
    hop_limit: int = 64         # RDMATENSOR_IB_HOP_LIMIT: the GRH's, 1 keeps packets in one subnet
    pkey_index: int = 0         # RDMATENSOR_IB_PKEY_INDEX: which partition of the port's P_Key table
    timeout: int = 14           # RDMATENSOR_IB_TIMEOUT: 4.096 us * 2^timeout per try (14: 67 ms)
    retry_count: int = 7        # RDMATENSOR_IB_RETRY_CNT: tries before a write fails
    mtu: int = 4096             # RDMATENSOR_IB_MTU: a cap on the path MTU (an InfiniBand path may be lower)
    force_grh: bool = False     # RDMATENSOR_IB_FORCE_GRH: a GRH on InfiniBand within a subnet too

    RANGES = {"RDMATENSOR_IB_TC": ("traffic_class", 0, 255), "RDMATENSOR_IB_SL": ("service_level", 0, 15),
              "RDMATENSOR_IB_HOP_LIMIT": ("hop_limit", 1, 255), "RDMATENSOR_IB_PKEY_INDEX": ("pkey_index", 0, 65535),
              "RDMATENSOR_IB_TIMEOUT": ("timeout", 0, 31), "RDMATENSOR_IB_RETRY_CNT": ("retry_count", 0, 7)}

    @classmethod
    def from_env(cls, env=os.environ) -> "Fabric":
        values = {}
        for var, (field, low, high) in cls.RANGES.items():
            raw = env.get(var, "")
            if raw == "":
                continue
            if not raw.strip().isdigit() or not low <= int(raw) <= high:
                raise TransportError(f"{var}={raw!r}: expected a whole number from {low} to {high}")
            values[field] = int(raw)
        raw = env.get("RDMATENSOR_IB_MTU", "")
        if raw:
            if not raw.strip().isdigit() or int(raw) not in MTU_BYTES.values():
                raise TransportError(f"RDMATENSOR_IB_MTU={raw!r}: expected one of {sorted(MTU_BYTES.values())}")
            values["mtu"] = int(raw)
        raw = env.get("RDMATENSOR_IB_FORCE_GRH", "")
        if raw:
            if raw not in ("0", "1"):
                raise TransportError(f"RDMATENSOR_IB_FORCE_GRH={raw!r}: expected 1 or 0")
            values["force_grh"] = raw == "1"
        return cls(**values)

    def agreed(self) -> str:
        """What both ends must set alike, as one string each sends at setup."""
        return (f"tc={self.traffic_class},sl={self.service_level},hop={self.hop_limit},pkey={self.pkey_index},"
                f"mtu={self.mtu},grh={int(self.force_grh)}")


@dataclass(frozen=True)
class Route:
    """The address handle and path attributes of one connection (ibv_qp_attr's)."""
    is_global: bool
    dlid: int
    dgid: str                 # the peer's GID where is_global, else ""
    sgid_index: int
    hop_limit: int
    traffic_class: int
    service_level: int
    path_mtu: int             # bytes
    timeout: int
    retry_count: int


def subnet_prefix(gid: str) -> str:
    """The first 64 bits of a GID ('fe80:0000:0000:0000:...' -> 'fe80:0000:0000:0000')."""
    return ":".join(gid.split(":")[:4])


def route(local_link: str, local_gid: str, local_mtu: int, gid_index: int, remote, fabric: Fabric) -> Route:
    """How to reach `remote` (its RcParams) from this port; TransportError where the two
    ends cannot be connected (link layers, settings, InfiniBand across subnets)."""
    if remote.link_layer != local_link:
        raise TransportError(f"the peer's port is {remote.link_layer}, this one {local_link}: a queue pair "
                             f"connects ports of one link layer")
    if remote.fabric and remote.fabric != fabric.agreed():
        raise TransportError(f"the fabric settings differ: the peer has {remote.fabric}, this rank "
                             f"{fabric.agreed()} (set RDMATENSOR_IB_* alike on every rank)")
    mtu = min(remote.mtu, local_mtu, fabric.mtu)
    common = dict(sgid_index=gid_index, hop_limit=fabric.hop_limit, traffic_class=fabric.traffic_class,
                  service_level=fabric.service_level, path_mtu=mtu, timeout=fabric.timeout,
                  retry_count=fabric.retry_count)
    if local_link == INFINIBAND:
        if subnet_prefix(remote.gid) != subnet_prefix(local_gid):
            raise TransportError(f"the peer is in another InfiniBand subnet ({subnet_prefix(remote.gid)}, this "
                                 f"port {subnet_prefix(local_gid)}): routing across subnets needs the router's "
                                 f"LID from a path record, which this provider does not query")
        if not 0 < remote.lid < 0xC000:
            raise TransportError(f"the peer's port has no unicast LID ({remote.lid:#x}): is a subnet manager "
                                 f"running?")
        return Route(is_global=fabric.force_grh, dlid=remote.lid, dgid=remote.gid if fabric.force_grh else "",
                     **common)
    if local_link != ETHERNET:
        raise TransportError(f"link layer {local_link!r}: this provider connects InfiniBand or Ethernet (RoCE) ports")
    return Route(is_global=True, dlid=0, dgid=remote.gid, **common)


def port_identity(device: str, port: int) -> tuple[int, str]:
    """(LID, link layer) of a port, from sysfs (a RoCE port's LID is 0)."""
    base = SYSFS / device / "ports" / str(port)
    try:
        lid = int((base / "lid").read_text().strip(), 16)
        link = (base / "link_layer").read_text().strip()
    except (OSError, ValueError):
        return 0, ETHERNET
    return lid, link or ETHERNET
