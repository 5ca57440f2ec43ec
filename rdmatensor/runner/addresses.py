"""This host's address as a peer reaches it: the one its route to that peer
leaves from, or that of a network interface the user names (horovodrun's
--network-interfaces). A host name is not enough: without DNS the peers
cannot resolve it, and Debian's /etc/hosts maps it to 127.0.1.1."""
from __future__ import annotations

import errno
import fcntl
import socket
import struct
from typing import Sequence


class AddressError(ValueError):
    """No address of this host as asked: an interface that does not exist or has
    no IPv4 address, a peer that does not resolve or has no route."""

SIOCGIFADDR = 0x8915            # Linux: an interface's (first) IPv4 address
DISCARD_PORT = 9                # any port does: connect() on a UDP socket sends nothing


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, None when it has none; AddressError when there is no such interface."""
    if name not in {n for _, n in socket.if_nameindex()}:
        raise AddressError(f"network interface {name!r} does not exist on this host "
                          f"(it has: {', '.join(sorted(n for _, n in socket.if_nameindex()))})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):
                return None
            raise
    return socket.inet_ntoa(answer[20:24])


def named_address(interfaces: Sequence[str]) -> str:
    """The IPv4 address of the first of `interfaces` that has one."""
    names = [n for n in interfaces if n]
    if not names:
        raise AddressError("--network-interfaces: no interface named")
    for name in names:
        address = interface_address(name)
        if address is not None:
            return address
    raise AddressError(f"--network-interfaces {','.join(names)}: "
                      + ("it has no" if len(names) == 1 else "none of them has an") + " IPv4 address")


def route_source(peer: str) -> str:
    """The address this host's route to `peer` leaves from (IPv4 preferred)."""
    try:
        infos = socket.getaddrinfo(peer, DISCARD_PORT, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise AddressError(f"host {peer!r}: cannot resolve it on this host ({exc.strerror})") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    last: OSError | None = None
    for family, kind, proto, _, target in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(target)
            except OSError as exc:
                last = exc
                continue
            return s.getsockname()[0]
    raise AddressError(f"host {peer!r}: this host has no route to it ({last})")


def address_for(peer: str, interfaces: Sequence[str] | None = None) -> str:
    """This host's address as `peer` reaches it: that of the named interfaces, else the route's source."""
    return named_address(interfaces) if interfaces else route_source(peer)


def host_port(address: str, port: int) -> str:
    """`address:port`, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
