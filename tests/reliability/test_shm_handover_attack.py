"""A shared arena reaches its authenticated peer and nobody else on the host.

An owner process makes a shared arena; an attacker, another process of the
same user that knows everything /proc shows (the owner's pid, its
descriptors, the segment's name in its maps, the hand-over socket in
/proc/net/unix) but not the nonce the control plane would have told the peer,
tries every way in: a wrong nonce, no nonce, half a nonce, every entry of
/proc/<owner>/fd, and the peer's own locator once the peer used it. It maps
nothing, each try is counted by the owner, and the peer, with the locator,
maps the arena and writes into it. A process of another user is refused even
with the right nonce. Root (ptrace, /proc/<pid>/map_files with CAP_SYS_ADMIN)
is beyond what a library can stop, and not tried here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from rdmatensor.errors import ForeignSegment
from rdmatensor.memory import LOCATOR, NONCE_BYTES, MappedArena

from ..support.ranks import free_ports
from .test_killed_ranks import ROOT, _line, _start

OWNER = """
import sys
from rdmatensor.memory import Arena, refused_handovers
arena = Arena(1 << 16, shared=True)
arena.buf[:] = 0xA5
waiting = Arena(4096, shared=True)     # still offered after the peer took `arena`: the socket stays up
print(arena.name, flush=True)
for line in sys.stdin:
    print(refused_handovers(), int(arena.buf[0]), flush=True)
"""

# The attacker: the locator's name, pid and socket are public (maps, /proc/net/unix); its nonce is not.
ATTACKER = """
import json, os, socket, sys
from rdmatensor.errors import ForeignSegment
from rdmatensor.memory import MappedArena
name, pid, address, nonce = sys.argv[1].split(":")
tries = {}

def map_with(nonce):
    try:
        MappedArena(f"{name}:{pid}:{address}:{nonce}")
        return "mapped"
    except ForeignSegment as exc:
        return str(exc)

def raw(sent):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(f"\\0rdmatensor-arenas-{address}")
    s.sendall(sent)
    s.shutdown(socket.SHUT_WR)
    s.settimeout(15)
    msg, fds, _, _ = socket.recv_fds(s, 1, 4)
    s.close()
    return len(fds)

if sys.argv[2] == "replay":
    print(json.dumps({"replay": map_with(nonce)}))
    sys.exit()
tries["wrong nonce"] = map_with(os.urandom(16).hex())
tries["no nonce: descriptors"] = raw(b"")
tries["half a nonce: descriptors"] = raw(bytes.fromhex(nonce)[:8])
opened = []
for entry in os.listdir(f"/proc/{pid}/fd"):
    path = f"/proc/{pid}/fd/{entry}"
    try:
        link = os.readlink(path)
        fd = os.open(path, os.O_RDWR)
    except OSError:
        continue
    opened.append(link)
    os.close(fd)
tries["opened"] = opened
print(json.dumps(tries))
"""


def _python(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60, **kw)


@pytest.fixture
def owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc, _line(proc)
    finally:
        proc.kill()
        proc.wait(10)


def _ask(proc: subprocess.Popen) -> tuple[int, int]:
    """(the hand-overs the owner refused, its arena's first byte)."""
    proc.stdin.write("?\n")
    proc.stdin.flush()
    refused, first = _line(proc).split()
    return int(refused), int(first)


def test_a_same_user_process_without_the_nonce_maps_nothing_and_the_peer_does(owner):
    proc, locator = owner
    assert LOCATOR.fullmatch(locator), locator
    attack = _python(ATTACKER, locator, "first")
    assert attack.returncode == 0, attack.stderr
    tries = json.loads(attack.stdout)
    assert "sent no descriptor" in tries["wrong nonce"], tries
    assert tries["no nonce: descriptors"] == 0 and tries["half a nonce: descriptors"] == 0, tries
    assert not [link for link in tries["opened"] if "memfd:" in link], tries["opened"]   # sockets cannot be opened
    assert _ask(proc) == (3, 0xA5)                     # each try counted; the arena untouched

    peer = MappedArena(locator)                        # the peer, told the locator over the control plane
    try:
        assert peer.size == 1 << 16 and np.all(peer.buf == 0xA5)
        peer.buf[0] = 0x5A
        assert _ask(proc) == (3, 0x5A)
        own = [os.readlink(f"/proc/self/fd/{e}") for e in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{e}")]
        assert not [link for link in own if "memfd:" in link], own    # nor is one left open in the peer
    finally:
        peer.close()

    replay = _python(ATTACKER, locator, "replay")      # the peer's locator, once spent, opens nothing
    assert replay.returncode == 0, replay.stderr
    assert "sent no descriptor" in json.loads(replay.stdout)["replay"], replay.stdout
    assert _ask(proc) == (4, 0x5A)
    with pytest.raises(ForeignSegment, match="sent no descriptor"):
        MappedArena(locator)                           # the peer itself cannot take it twice
    assert _ask(proc) == (5, 0x5A)


OTHER_USER = """
import socket, sys
address, nonce = sys.argv[1], bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(f"\\0rdmatensor-arenas-{address}")
try:
    s.sendall(nonce)
    s.settimeout(15)
    print(len(socket.recv_fds(s, 1, 4)[1]))
except OSError as exc:
    print(0, exc)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root")
def test_a_process_of_another_user_with_the_right_nonce_gets_nothing(owner):
    proc, locator = owner
    _, _, address, nonce = locator.split(":")
    assert len(bytes.fromhex(nonce)) == NONCE_BYTES
    other = subprocess.run(["/usr/bin/python3", "-c", OTHER_USER, address, nonce], cwd="/", user=65534,
                           group=65534, extra_groups=[], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert other.stdout.split()[0] == "0", other.stdout
    assert _ask(proc) == (1, 0xA5)
    peer = MappedArena(locator)                        # refused before its nonce was read: still the peer's
    peer.close()


def test_no_rank_of_a_running_shm_job_holds_a_descriptor_of_its_memory():
    """Two ranks move tensors over shm (segments made while they run too):
    their maps hold the job's segments, their descriptor tables none that stays.
    A segment being made or taken over has a descriptor for the moment between
    its creation (or receipt) and its mapping: one seen is looked at again a
    second later, and fails only if it is still there."""
    job = os.urandom(6).hex()
    ports = free_ports(2)
    procs = [_start(r, ports, job) for r in (0, 1)]

    def memfds(pid: int) -> dict:
        found = {}
        for e in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{e}")
            except OSError:
                continue
            if "memfd:" in link:
                found[e] = link
        return found

    try:
        assert [_line(p) for p in procs] == ["steady", "steady"]
        deadline, seen = time.monotonic() + 2, 0
        while time.monotonic() < deadline:             # a while, as segments come and go
            for p in procs:
                with open(f"/proc/{p.pid}/maps") as f:
                    assert f"/memfd:rdmatensor-{job}-" in f.read()
                held = memfds(p.pid)
                if held:
                    seen += 1
                    time.sleep(1.0)
                    again = memfds(p.pid)
                    kept = {e: link for e, link in held.items() if again.get(e) == link}
                    assert not kept, f"rank {procs.index(p)} kept {kept} for a second; all now: {again}"
            time.sleep(0.05)
        print(f"descriptors seen in passing: {seen}")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
