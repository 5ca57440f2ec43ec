"""Run a command on real SoftRoCE inside one or two qemu VMs.

Where the host kernel has no rdma_rxe, the distribution's stock kernel is
booted under qemu (TCG: the stock kernel does not boot under KVM on every
host) with the host's root filesystem mounted read-only, so the guest runs
the same interpreter, virtualenv, pyverbs and project tree as the host.

- hosts=1: one VM, one rxe device shared by every process in it (loopback).
- hosts=2: two VMs whose NICs are joined by a qemu socket netdev on the
  host's loopback, one rxe device each: a two-host RDMA cluster.
- hosts=3..MAX_HOSTS: every VM's NIC on one shared segment, a qemu
  multicast socket netdev on the host's loopback (a group and port of this
  run's own, so that two runs never share a segment): an N-host cluster.
- rails=2 (with two hosts or more): each VM has a second NIC, on a second
  link or segment with a subnet of its own, with its own rxe device (rxe1 on
  eth1): two rails between the hosts. eth0 also carries the
  control traffic.
- ssh=True: each VM also runs Debian's sshd with host keys made for this
  boot and one job key authorized; the command runs on host0 only and
  reaches every VM by plain `ssh ADDR` (as a launcher does), while the other
  VMs serve until it ends.

The job directory (a host temp dir shared writable over 9p at the same path)
carries the command, the environment, the output and the exit status.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Sequence

from ..errors import SoftRoceError, VmTimeout
from .initramfs import find_kernel, initramfs_for

GUEST_INIT = Path(__file__).with_name("guest_init.sh")
# TEST-NET-1 (RFC 5737): documentation addresses, only ever used on the
# VMs' private link inside qemu.
MAX_HOSTS = 8
GUEST_ADDRS = tuple(f"192.0.2.{i + 1}" for i in range(MAX_HOSTS))
RAIL_ADDRS = tuple(f"198.51.100.{i + 1}" for i in range(MAX_HOSTS))    # TEST-NET-2: the second rail's link
DEFAULT_TIMEOUT = 600.0
DEFAULT_MTU = 9000
BOOT_TIMEOUT = 180.0

# Host variables that describe the host's session rather than the command.
_ENV_SKIP = {"PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "DISPLAY", "TMUX", "TMUX_PANE",
             "SSH_AUTH_SOCK", "SSH_CONNECTION", "SSH_CLIENT", "SSH_TTY", "PS1", "PROMPT_COMMAND"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class VmResult:
    returncode: int
    returncodes: list[int]
    boot_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0


def qemu_binary() -> str:
    path = shutil.which("qemu-system-x86_64")
    if not path:
        raise SoftRoceError("qemu-system-x86_64 not found: install qemu-system-x86 (make setup does)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segment() -> str:
    """A multicast group and port for one run's shared segment: administratively
    scoped (RFC 2365), random, with the port free on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = "239.255.{}.{}".format(*os.urandom(2))
    return f"{group}:{port}"


def _listening(port: int) -> bool:
    # Probing with connect() would be taken by qemu as its peer: read the
    # kernel's socket table instead.
    needle = f":{port:04X} "
    try:
        with open("/proc/net/tcp") as f:
            return any(needle in line and line.split()[3] == "0A" for line in f)
    except OSError:
        return False


def _write_env(path: Path, cwd: str, extra: dict[str, str] | None) -> None:
    env = {k: v for k, v in os.environ.items() if _ENV_NAME.match(k) and k not in _ENV_SKIP}
    # Make the interpreter that launched us (typically the project venv) the
    # first python on PATH inside the guest.
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env.update(extra or {})
    env["RDT_CWD"] = cwd
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items())))


class _Tail(threading.Thread):
    """Copy what a guest appends to a job file onto a host stream."""

    def __init__(self, path: Path, out: BinaryIO, prefix: bytes):
        super().__init__(daemon=True)
        self.path, self.out, self.prefix = path, out, prefix
        self.stopping = threading.Event()
        self.pos = 0
        self.partial = b""

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        if not data:
            return
        self.pos += len(data)
        if self.prefix:
            data = self.partial + data
            lines = data.split(b"\n")
            self.partial = lines.pop()
            data = b"".join(self.prefix + line + b"\n" for line in lines)
        self.out.write(data)
        self.out.flush()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            self.pump()

    def finish(self) -> None:
        self.stopping.set()
        self.join()
        self.pump()
        if self.partial:
            self.out.write(self.prefix + self.partial + b"\n")
            self.out.flush()


def _exit_on_termination():
    """SIGTERM and SIGHUP end run() through its cleanup, as Ctrl-C does: the VMs run in
    sessions of their own (a terminal's signals never reach them), so without this a
    terminated run left them running. Returns what puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def leave(signum, frame):
        raise SystemExit(128 + signum)
    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    return lambda: [signal.signal(sig, old) for sig, old in previous.items()]


def _tail_text(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(nothing)"


def _make_ssh(job: Path, hosts: int) -> None:
    """Keys and configuration for sshd in each VM and ssh between them, fresh
    for this boot, in the job directory (0700): host keys (known to the
    client in advance, so host keys are checked), and one job key that
    every VM authorizes for root."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not shutil.which("ssh-keygen") or not os.access(sshd, os.X_OK):
        raise SoftRoceError("ssh in the VMs needs openssh-client and openssh-server (make setup installs them)")
    d = job / "ssh"
    d.mkdir(mode=0o700)

    def keygen(name: str) -> str:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(d / name)],
                       check=True, stdin=subprocess.DEVNULL, capture_output=True)
        return (d / f"{name}.pub").read_text().strip()

    (d / "authorized_keys").write_text(keygen("job_key") + "\n")
    known = []
    for i in range(hosts):
        known.append(f"{GUEST_ADDRS[i]},rdt-host{i} {keygen(f'host{i}_key')}")
        (d / f"sshd_config-{i}").write_text(
            f"ListenAddress 0.0.0.0\nHostKey {d}/host{i}_key\nAuthorizedKeysFile {d}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPidFile /run/sshd.pid\n")
    (d / "known_hosts").write_text("\n".join(known) + "\n")
    (d / "ssh_config").write_text(
        f"Host *\n  IdentityFile {d}/job_key\n  UserKnownHostsFile {d}/known_hosts\n"
        "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
        "  ConnectTimeout 10\n")
    (d / "sshd_path").write_text(sshd)


def _clock_offsets(job: Path, hosts: int) -> str:
    """Each guest's clock less this host's when it wrote its ready and clock files (the
    files' times are this host's): TCG guests calibrate their TSC under load, and the
    job token's proofs hold only within 300 s of the receiver's clock."""
    out = []
    for i in range(hosts):
        marks = []
        for name in (f"ready-{i}", f"clock-{i}"):
            try:
                path = job / name
                marks.append(f"{float(path.read_text()) - path.stat().st_mtime:+.1f} s")
            except (OSError, ValueError):
                marks.append("?")
        out.append(f"host{i} {' / '.join(marks)}")
    return ", ".join(out)


def run(command: Sequence[str], hosts: int = 1, timeout: float = DEFAULT_TIMEOUT,
        cpus: int | None = None, memory_mb: int | None = None, mtu: int = DEFAULT_MTU,
        env: dict[str, str] | None = None, cwd: str | None = None, shares: Sequence[str] = (),
        stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
        log=None, ssh: bool = False, rails: int = 1) -> VmResult:
    """Run `command` in `hosts` SoftRoCE VMs; return its exit status(es).

    With several hosts the command runs on each; it learns its side from
    RDMATENSOR_VM_INDEX (0, 1, ...), RDMATENSOR_VM_HOSTS, RDMATENSOR_VM_ROLE
    (server on 0, client on the others), RDMATENSOR_VM_ADDR,
    RDMATENSOR_VM_PEER_ADDR (host1's for host0, host0's for the others) and
    RDMATENSOR_VM_ADDRS (every host's). `shares` are host
    directories mounted writable at the same path, for results to come back.
    With `ssh`, the command runs on host0 only and reaches the VMs by ssh
    (RDMATENSOR_VM_ADDRS lists them); its status is the run's.
    """
    if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise SoftRoceError(f"hosts must be between 1 and {MAX_HOSTS}, not {hosts!r}")
    if not command:
        raise SoftRoceError("no command given to run in the VM")
    if rails not in (1, 2) or (rails == 2 and hosts < 2):
        raise SoftRoceError(f"rails must be 1, or 2 with two hosts or more, not {rails!r} with {hosts} host(s)")
    if not 1280 <= mtu <= 9000:
        raise SoftRoceError(f"mtu must be between 1280 and 9000, not {mtu}")
    shares = [os.path.abspath(d) for d in shares]
    for d in shares:
        if not os.path.isdir(d) or "," in d or " " in d:
            raise SoftRoceError(f"cannot share {d!r}: it must be a directory whose path has "
                                "no spaces or commas")
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    log = log or (lambda msg: print(f"softroce vm: {msg}", file=sys.stderr, flush=True))
    ncpu = os.cpu_count() or 1
    cpus = cpus or (min(2, ncpu) if hosts == 1 else 1)
    memory_mb = memory_mb or (4096 if hosts == 1 else 3072)

    kernel = find_kernel()
    initrd = initramfs_for(kernel)
    qemu = qemu_binary()
    job = Path(tempfile.mkdtemp(prefix="rdmatensor-vm-"))
    procs: list[subprocess.Popen] = []
    tails: list[_Tail] = []
    started = time.monotonic()
    restore = _exit_on_termination()
    try:
        (job / "cmd.sh").write_text("exec " + shlex.join(command) + "\n")
        if ssh:
            _make_ssh(job, hosts)
            q = shlex.quote(str(job))
            # host0 starts once every sshd listens; the others serve until its command has ended
            (job / "cmd-0.sh").write_text("".join(f"until [ -e {q}/ready-{i} ]; do sleep 0.2; done\n"
                                                  for i in range(1, hosts)) + "exec " + shlex.join(command) + "\n")
            for i in range(1, hosts):
                (job / f"cmd-{i}.sh").write_text(f"until [ -e {q}/rc-0 ]; do sleep 0.2; done\n")
        _write_env(job / "cmd.env", cwd or os.getcwd(), env)
        ports = [_free_port() for _ in range(rails)]
        segments = [_segment() for _ in range(rails)]
        for i in range(hosts):
            peer = GUEST_ADDRS[1 if i == 0 and hosts > 1 else 0]
            role = "server" if i == 0 else "client"
            (job / f"vm-{i}.env").write_text(
                f"RDT_INDEX={i}\nRDT_ADDR={GUEST_ADDRS[i]}\nRDT_MTU={mtu}\nRDT_IFNAME=eth0\n"
                + (f"RDT_RAIL_ADDR={RAIL_ADDRS[i]}\nRDT_RAIL_IFNAME=eth1\n" if rails == 2 else "") +
                f"export RDMATENSOR_VM_INDEX={i} RDMATENSOR_VM_HOSTS={hosts} RDMATENSOR_VM_ROLE={role}\n"
                f"export RDMATENSOR_VM_ADDR={GUEST_ADDRS[i]} RDMATENSOR_VM_PEER_ADDR={peer}\n"
                f"export RDMATENSOR_VM_ADDRS='{' '.join(GUEST_ADDRS[:hosts])}'\n")
        for i in range(hosts):
            if hosts == 1:
                netdevs = ["hubport,id=net0,hubid=0"]  # a link to nowhere: rxe loops back locally
            elif hosts > 2:
                netdevs = [f"socket,id=net{r},mcast={seg},localaddr=127.0.0.1" for r, seg in enumerate(segments)]
            else:
                side = "listen" if i == 0 else "connect"
                netdevs = [f"socket,id=net{r},{side}=127.0.0.1:{port}" for r, port in enumerate(ports)]
            argv = [
                qemu, "-accel", "tcg", "-cpu", "max", "-smp", str(cpus), "-m", str(memory_mb),
                "-nodefaults", "-no-reboot", "-display", "none",
                "-kernel", str(kernel.image), "-initrd", str(initrd),
                "-append", (f"console=ttyS0 quiet panic=-1 clocksource=tsc tsc=reliable rdt_job={job} "
                            f"rdt_index={i} rdt_stage2={GUEST_INIT}"
                            + (f" rdt_shares={','.join(shares)}" if shares else "")),
                "-serial", f"file:{job}/console-{i}.log",
                "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
                "-virtfs", f"local,path={job},mount_tag=job,security_model=none,multidevs=remap",
                *[arg for n, d in enumerate(shares) for arg in (
                    "-virtfs", f"local,path={d},mount_tag=share{n},security_model=none,multidevs=remap")],
                *[arg for r, netdev in enumerate(netdevs) for arg in (
                    "-netdev", netdev,
                    "-device", f"virtio-net-pci,netdev=net{r},mac=52:54:00:0d:{0x72 + r:02x}:{i + 1:02x}")],
            ]
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            if hosts == 2 and i == 0:
                deadline = time.monotonic() + 30
                while not all(_listening(port) for port in ports):
                    if procs[0].poll() is not None or time.monotonic() > deadline:
                        raise SoftRoceError("first VM did not start listening for its peer: "
                                            + procs[0].stdout.read().decode(errors="replace"))
                    time.sleep(0.05)
        for i in range(hosts):
            prefix = f"[host{i}] ".encode() if hosts > 1 else b""
            tails += [_Tail(job / f"out-{i}", stdout, prefix), _Tail(job / f"err-{i}", stderr, prefix)]
        for t in tails:
            t.start()

        boot = [0.0] * hosts
        deadline = started + timeout
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for i in range(hosts):
                if not boot[i] and (job / f"ready-{i}").exists():
                    boot[i] = now - started
                    log(f"host{i} up, rxe0 ACTIVE, in {boot[i]:.1f} s "
                        f"(kernel {kernel.release}, {cpus} vCPU, {memory_mb} MiB)")
                if not boot[i] and now - started > min(BOOT_TIMEOUT, timeout):
                    raise VmTimeout(f"host{i} did not boot within {min(BOOT_TIMEOUT, timeout):.0f} s; "
                                    f"console:\n{_tail_text(job / f'console-{i}.log')}\n"
                                    f"{_tail_text(job / f'guest-{i}.log')}")
            if now > deadline:
                raise VmTimeout(f"command still running after the {timeout:.0f} s timeout: "
                                f"VM{'s' if hosts > 1 else ''} killed")
            time.sleep(0.1)
        for t in tails:
            t.finish()
        tails = []

        codes = []
        for i in range(hosts):
            rc_file = job / f"rc-{i}"
            if rc_file.exists():
                codes.append(int(rc_file.read_text().strip() or 125))
            else:
                qemu_out = procs[i].stdout.read().decode(errors="replace").strip()
                log(f"host{i} exited without running the command (qemu status {procs[i].returncode}).\n"
                    f"qemu: {qemu_out or '(nothing)'}\nconsole:\n{_tail_text(job / f'console-{i}.log')}\n"
                    f"guest: {_tail_text(job / f'guest-{i}.log')}")
                codes.append(125)
            if codes[-1] == 125 and (job / f"guest-{i}.log").exists():
                log(_tail_text(job / f"guest-{i}.log"))
        rc = next((c for c in codes if c != 0), 0)
        seconds = time.monotonic() - started
        log(f"finished in {seconds:.1f} s, exit status {codes if hosts > 1 else rc}; "
            f"guest clocks against this host's, at boot and at the end: {_clock_offsets(job, hosts)}")
        return VmResult(rc, codes, boot, seconds)
    finally:
        restore()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout:
                p.stdout.close()
        for t in tails:
            t.finish()
        shutil.rmtree(job, ignore_errors=True)
