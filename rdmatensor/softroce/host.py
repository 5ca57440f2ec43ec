"""SoftRoCE on the host itself, where the running kernel has rdma_rxe."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import SoftRoceError

_NO_RXE = ("the running kernel ({release}) cannot load rdma_rxe: {detail}. "
           "Use `rdmatensor softroce vm -- CMD` to run on SoftRoCE inside a VM instead")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    if not shutil.which(argv[0]):
        raise SoftRoceError(f"{argv[0]} not found: install iproute2 and kmod (make setup does)")
    return subprocess.run(argv, capture_output=True, text=True)


def _rxe_links() -> list[tuple[str, str]]:
    """(device, netdev) of every rxe link."""
    out = _run(["rdma", "-j", "link", "show"]).stdout
    try:
        links = json.loads(out or "[]")
    except ValueError:
        return []
    return [(link["ifname"].split("/")[0], link.get("netdev", "")) for link in links
            if Path(f"/sys/class/infiniband/{link['ifname'].split('/')[0]}/parent").exists()]


def default_netdev() -> str:
    """The interface of the default route, else the first non-loopback one that is up."""
    try:
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000":
                return fields[0]
    except OSError:
        pass
    for dev in sorted(os.listdir("/sys/class/net")):
        if dev != "lo" and Path(f"/sys/class/net/{dev}/operstate").read_text().strip() == "up":
            return dev
    raise SoftRoceError("no network interface is up to carry SoftRoCE; pass --netdev")


def up(netdev: str | None = None) -> str:
    """Load rdma_rxe and add an rxe device on `netdev`; returns the device name."""
    netdev = netdev or default_netdev()
    if not Path(f"/sys/class/net/{netdev}").exists():
        raise SoftRoceError(f"no network interface named {netdev!r}")
    for dev, nd in _rxe_links():
        if nd == netdev:
            return dev
    probe = _run(["modprobe", "rdma_rxe"])
    if probe.returncode != 0:
        raise SoftRoceError(_NO_RXE.format(release=os.uname().release,
                                           detail=probe.stderr.strip() or "modprobe failed"))
    name = f"rxe_{netdev}"[:20]
    add = _run(["rdma", "link", "add", name, "type", "rxe", "netdev", netdev])
    if add.returncode != 0:
        raise SoftRoceError(f"rdma link add {name} on {netdev} failed: {add.stderr.strip()}")
    return name


def down() -> list[str]:
    """Remove every rxe device; returns their names."""
    removed = []
    for dev, _ in _rxe_links():
        res = _run(["rdma", "link", "delete", dev])
        if res.returncode != 0:
            raise SoftRoceError(f"rdma link delete {dev} failed: {res.stderr.strip()}")
        removed.append(dev)
    return removed


def status() -> dict:
    loaded = Path("/sys/module/rdma_rxe").exists()
    return {"kernel": os.uname().release, "rdma_rxe_loaded": loaded,
            "links": [{"device": d, "netdev": n} for d, n in (_rxe_links() if loaded else [])]}
