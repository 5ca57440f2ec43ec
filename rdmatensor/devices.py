"""What RDMA hardware (or SoftRoCE) this machine has, read from sysfs and verbs."""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Held while a device context or completion channel is opened, so the event
# descriptor each one adds to the process can be told apart (pyverbs_endpoint).
CONTEXT_LOCK = threading.Lock()

SYSFS = Path("/sys/class/infiniband")
# Path MTUs: verbs' enum (IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5) <-> bytes. The one table.
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
MTU_ENUM = {nbytes: enum for enum, nbytes in MTU_BYTES.items()}


@dataclass
class Gid:
    index: int
    gid: str
    type: str          # "RoCE v2", "IB/RoCE v1" or "" (InfiniBand)
    netdev: str


@dataclass
class Port:
    number: int
    state: str         # ACTIVE, DOWN, INIT, ...
    link_layer: str    # Ethernet or InfiniBand
    active_mtu: int | None
    gids: list[Gid] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def roce_v2_gid(self) -> Gid | None:
        """The GID to use for RoCE v2 traffic: IPv4-mapped first, like perftest's -x."""
        v2 = [g for g in self.gids if g.type == "RoCE v2"]
        ipv4 = [g for g in v2 if g.gid.startswith("0000:0000:0000:0000:0000:ffff:")]
        return (ipv4 or v2 or [None])[0]


@dataclass
class Device:
    name: str
    driver: str
    ports: list[Port]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _active_mtus(name: str) -> dict[int, int]:
    """Active MTU per port from verbs; sysfs does not expose it."""
    try:
        from pyverbs.device import Context
    except ImportError:
        return {}
    try:
        with CONTEXT_LOCK, Context(name=name) as ctx:
            nports = ctx.query_device().phys_port_cnt
            return {p: MTU_BYTES.get(ctx.query_port(p).active_mtu) for p in range(1, nports + 1)}
    except Exception:  # noqa: BLE001 - a device we cannot open is still listed
        return {}


def _gids(pdir: Path, first_roce_v2_ipv4: bool = False) -> list[Gid]:
    """A port's GIDs. A RoCE port has about a thousand GID files, mostly empty:
    with `first_roce_v2_ipv4` the scan stops at the one a connection would use."""
    gids = []
    for gfile in sorted((pdir / "gids").iterdir(), key=lambda p: int(p.name)):
        gid = _read(gfile)
        if not gid or gid == "0000:0000:0000:0000:0000:0000:0000:0000":
            continue
        g = Gid(int(gfile.name), gid, _read(pdir / "gid_attrs" / "types" / gfile.name),
                _read(pdir / "gid_attrs" / "ndevs" / gfile.name))
        gids.append(g)
        if first_roce_v2_ipv4 and g.type == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            break
    return gids


def list_devices(gids: bool = True) -> list[Device]:
    """Every RDMA device and port; `gids=False` skips the (slow) GID table and the
    verbs query of the MTU, for callers that only need port states."""
    if not SYSFS.is_dir():
        return []
    devices = []
    for dev in sorted(SYSFS.iterdir()):
        if (dev / "device" / "driver").exists():
            driver = os.path.basename(os.path.realpath(dev / "device" / "driver"))
        else:  # software devices (rxe, siw) sit on a netdev instead of a bus
            driver = f"software on {_read(dev / 'parent') or '?'}"
        mtus = _active_mtus(dev.name) if gids else {}
        ports = []
        for pdir in sorted((dev / "ports").iterdir(), key=lambda p: int(p.name)):
            num = int(pdir.name)
            state = _read(pdir / "state").split(":")[-1].strip()
            ports.append(Port(num, state, _read(pdir / "link_layer"), mtus.get(num),
                              _gids(pdir) if gids else []))
        devices.append(Device(dev.name, driver, ports))
    return devices


def active_port(device: str | None = None, number: int | None = None) -> tuple[Device, Port] | None:
    """The first ACTIVE port (of `device`, numbered `number`, where given) with the GIDs a
    connection needs, or None."""
    for dev in list_devices(gids=False):
        for port in dev.ports:
            if port.active and device in (None, dev.name) and number in (None, port.number):
                port.gids = _gids(SYSFS / dev.name / "ports" / str(port.number), first_roce_v2_ipv4=True)
                return dev, port
    return None


def as_dict(devices: list[Device]) -> list[dict]:
    return [asdict(d) for d in devices]
