"""The `rdmatensor` command: devices, and SoftRoCE on the host or in VMs."""
from __future__ import annotations

import argparse
import json
import sys

from . import devices, providers, softroce
from .errors import RdmaTensorError, VmTimeout


def _print_devices(as_json: bool) -> int:
    devs = devices.list_devices()
    viable = providers.viability()
    if as_json:
        print(json.dumps({"devices": devices.as_dict(devs),
                          "providers": {k: {"viable": v, "reason": r} for k, (v, r) in viable.items()}},
                         indent=2))
        return 0
    if not devs:
        print("no RDMA devices")
    for dev in devs:
        print(f"{dev.name}  ({dev.driver})")
        for port in dev.ports:
            mtu = f"{port.active_mtu}" if port.active_mtu else "?"
            print(f"  port {port.number}: {port.state}  link {port.link_layer}  active MTU {mtu}")
            best = port.roce_v2_gid()
            for gid in port.gids:
                mark = "  <- RoCE v2 (use this index)" if best and gid.index == best.index else ""
                print(f"    gid[{gid.index}] {gid.gid}  {gid.type or 'IB'}  {gid.netdev}{mark}")
    print("providers:")
    for name, (ok, reason) in viable.items():
        print(f"  {name:5} {'viable' if ok else 'not viable'}: {reason}")
    return 0


def _softroce(args: argparse.Namespace) -> int:
    if args.action == "up":
        print(softroce.up(args.netdev))
    elif args.action == "down":
        for name in softroce.down():
            print(f"removed {name}")
    elif args.action == "status":
        print(json.dumps(softroce.status(), indent=2))
    elif args.action == "vm":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise RdmaTensorError("give the command to run after --, e.g. "
                                  "`rdmatensor softroce vm -- ibv_devices`")
        try:
            return softroce.run(command, hosts=args.hosts, timeout=args.timeout, cpus=args.cpus,
                                memory_mb=args.memory, mtu=args.mtu, shares=args.share,
                                ssh=args.ssh, rails=args.rails).returncode
        except VmTimeout as exc:
            print(f"rdmatensor: {exc}", file=sys.stderr)
            return 124
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdmatensor", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    dev = sub.add_parser("devices", help="RDMA devices, ports, GIDs and viable providers")
    dev.add_argument("--json", action="store_true", help="machine-readable output")

    sr = sub.add_parser("softroce", help="SoftRoCE (rdma_rxe) on the host or in a VM")
    srs = sr.add_subparsers(dest="action", required=True)
    upp = srs.add_parser("up", help="add an rxe device on the host (kernel must have rdma_rxe)")
    upp.add_argument("--netdev", help="interface to carry RoCE (default: the default route's)")
    srs.add_parser("down", help="remove every rxe device from the host")
    srs.add_parser("status", help="rdma_rxe state on the host")
    vm = srs.add_parser("vm", help="run a command on SoftRoCE inside qemu VM(s)",
                        description="Run CMD on real SoftRoCE in one VM (one rxe device shared "
                                    "by all its processes), two VMs linked by a virtual wire, or up to "
                                    f"{softroce.vm.MAX_HOSTS} VMs on one virtual segment.")
    vm.add_argument("--hosts", type=int, choices=range(1, softroce.vm.MAX_HOSTS + 1), default=1,
                    metavar=f"1..{softroce.vm.MAX_HOSTS}")
    vm.add_argument("--rails", type=int, choices=(1, 2), default=1,
                    help="NICs per VM, each with its own rxe device and link or segment (2: with two hosts or more)")
    vm.add_argument("--timeout", type=float, default=softroce.vm.DEFAULT_TIMEOUT,
                    help="kill the VM(s) after this many seconds (default %(default)s)")
    vm.add_argument("--cpus", type=int, help="vCPUs per VM (default 2 for one host, 1 each for several)")
    vm.add_argument("--memory", type=int, help="MiB per VM (default 4096 for one host, 3072 each for several)")
    vm.add_argument("--mtu", type=int, default=softroce.vm.DEFAULT_MTU,
                    help="netdev MTU (default %(default)s, giving RoCE MTU 4096)")
    vm.add_argument("--share", action="append", default=[], metavar="DIR",
                    help="host directory to mount writable at the same path (repeatable)")
    vm.add_argument("--ssh", action="store_true",
                    help="run sshd in every VM (keys made for this boot) and CMD on host0 only, "
                         "which reaches the VMs by `ssh ADDR`")
    vm.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "devices":
            return _print_devices(args.json)
        return _softroce(args)
    except RdmaTensorError as exc:
        print(f"rdmatensor: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
