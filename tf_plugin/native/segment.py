"""A rank's shared-memory segment for the all-reduce on one host, and handing
segments' descriptors between local processes.

The layout is shm_allreduce.h's (the C executor computes the same from the
same bucket sizes and checks every header against it):

    0      header: magic u64, version u32, rank u32, ranks u32, buckets u32,
           total bytes u64, layout checksum u64 (FNV-1a of the buckets' sizes)
    64     state u32 (0 live, else the status its rank aborted with)
    128    sleeping u32 (1 while its executor sleeps in a futex wait)
    192 + 128 b        bucket b: in_seq u64, count u64, dtype u32, op u32, scale f64
    192 + 128 b + 64   bucket b: out_seq u64
    data: per bucket an `in` then an `out` region, each 64-byte aligned

A segment is a memfd sealed against shrinking and growing: a peer maps it
read-only and can count on its size. It serves one group: its sequence
numbers start at 0.

How the descriptors travel: in a job, as the shm provider hands over its
arenas (rdmatensor/memory.py): the descriptor is parked in a socket of this
process, offered on its hand-over socket under a one-time nonce, and the
locator (pid, hand-over socket, nonce) goes to the peer over the job's
authenticated channel; the peer checks with SO_PEERCRED that the socket is
that process's, of this user, presents the nonce and is sent the descriptor
(offer / take). Between processes with a socket of their own (tests, tools):
send_fd / recv_fd / relay / exchange over a Unix socket. No TensorFlow here.
"""
from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import struct

from rdmatensor import memory

MAGIC = 0x31524448534D4452          # "RDMSHDR1"
VERSION = 2                         # 2: the pipelined calls' progress words
LINE = 64
OFF_STATE, OFF_SLEEPING, OFF_BUCKETS, BUCKET_STRIDE = 64, 128, 192, 128
PROGRESS_DONE = 0xFFFFFF            # a progress word's chunks field once every chunk is done
PIPELINE_BYTES = 256 * 1024         # a chunk of a pipelined call's slice (RDT_SHM_PIPELINE_BYTES)
HEADER = struct.Struct("<QIIIIQQ")  # magic, version, rank, ranks, buckets, total, checksum
NAME = "rdmatensor-shm-allreduce-"
LOCATOR = re.compile(r"([1-9][0-9]{0,9}):([0-9a-f]{24}):([0-9a-f]{32})")     # pid:hand-over socket:nonce


def align64(n: int) -> int:
    return (n + 63) & ~63


def pipeline_chunks(count: int, itemsize: int, ranks: int) -> int:
    """The chunks a call of `count` elements runs in, pipelined: 0 (run whole) unless
    its widest slice exceeds PIPELINE_BYTES (shm_allreduce.c's pipeline_chunks)."""
    per = PIPELINE_BYTES // itemsize
    widest = -(-count // ranks)
    return 0 if per == 0 or widest <= per else -(-widest // per)


def checksum(bucket_bytes) -> int:
    """FNV-1a over the buckets' sizes, 8 bytes each, little-endian."""
    h = 1469598103934665603
    for size in bucket_bytes:
        for byte in int(size).to_bytes(8, "little"):
            h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


class Layout:
    """Where everything of a segment is, for these bucket sizes (bytes)."""

    def __init__(self, bucket_bytes):
        self.bucket_bytes = tuple(int(b) for b in bucket_bytes)
        if any(b < 0 for b in self.bucket_bytes):
            raise ValueError(f"bucket sizes must be 0 or more bytes: {self.bucket_bytes}")
        off = align64(OFF_BUCKETS + BUCKET_STRIDE * len(self.bucket_bytes))
        self.in_off = []
        for size in self.bucket_bytes:
            self.in_off.append(off)
            off += 2 * align64(size)
        self.total = off
        self.checksum = checksum(self.bucket_bytes)

    def in_seq(self, b: int) -> int:
        return OFF_BUCKETS + BUCKET_STRIDE * b

    def out_seq(self, b: int) -> int:
        return OFF_BUCKETS + BUCKET_STRIDE * b + LINE

    def in_progress(self, b: int) -> int:
        """A pipelined call's input progress: (k << 24) | chunks copied in (shm_allreduce.h)."""
        return self.in_seq(b) + 32

    def out_progress(self, b: int) -> int:
        """... and its results': (k << 24) | chunks reduced."""
        return self.out_seq(b) + 8

    def out_off(self, b: int) -> int:
        return self.in_off[b] + align64(self.bucket_bytes[b])


def create_segment(rank: int, ranks: int, bucket_bytes) -> int:
    """A new segment for `rank` of `ranks` (its header written, sealed): its fd,
    which the caller owns (close it once every group over it is made)."""
    layout = Layout(bucket_bytes)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks}")
    fd = os.memfd_create(f"{NAME}{rank}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, layout.total)
        header = HEADER.pack(MAGIC, VERSION, rank, ranks, len(layout.bucket_bytes), layout.total, layout.checksum)
        os.pwrite(fd, header, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_segment(fd: int, rank: int, ranks: int, layout: Layout) -> None:
    """Raise ValueError unless `fd` is rank `rank`'s segment for this layout (as the C side checks)."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if os.fstat(fd).st_size < layout.total or not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError(f"rank {rank}'s segment (fd {fd}) is not a memfd of at least {layout.total} bytes "
                         "sealed against shrinking")
    magic, version, r, n, buckets, total, sums = HEADER.unpack(os.pread(fd, HEADER.size, 0))
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"rank {rank}'s segment is not an rdmatensor shm all-reduce segment of version {VERSION}")
    if r != rank or n != ranks:
        raise ValueError(f"the segment given as rank {rank}'s belongs to rank {r} of {n} (this group: {ranks} ranks)")
    if buckets != len(layout.bucket_bytes) or total != layout.total or sums != layout.checksum:
        raise ValueError(f"rank {rank}'s segment is laid out for {buckets} buckets in {total} bytes, this rank's "
                         f"layout {len(layout.bucket_bytes)} buckets in {layout.total} bytes (or the bucket sizes "
                         "differ): every rank must give the same buckets")


# ------------------------------------------------- descriptors between processes
def send_fd(sock: socket.socket, rank: int, fd: int) -> None:
    """Send rank `rank`'s segment descriptor over a Unix socket."""
    socket.send_fds(sock, [struct.pack("<i", rank)], [fd])


def recv_fd(sock: socket.socket) -> tuple[int, int]:
    """(rank, fd) sent by send_fd; the fd is new in this process (the caller closes it)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 4, 1)
    if len(data) != 4 or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("expected one rank and one segment descriptor")
    return struct.unpack("<i", data)[0], fds[0]


def relay(socks: list[socket.socket]) -> None:
    """One rank's segment in from each of `socks` (one socket per rank, any
    order), then every segment out to every socket, in rank order: what a local
    launcher does so that each rank gets all the fds (exchange() is the rank's side)."""
    got = {}
    try:
        for sock in socks:
            rank, fd = recv_fd(sock)
            if rank in got or not 0 <= rank < len(socks):
                os.close(fd)
                raise ValueError(f"a second or impossible rank {rank}")
            got[rank] = fd
        for sock in socks:
            for rank in range(len(socks)):
                send_fd(sock, rank, got[rank])
    finally:
        for fd in got.values():
            os.close(fd)


def exchange(sock: socket.socket, rank: int, ranks: int, fd: int) -> list[int]:
    """Send my segment to the relay, receive every rank's: fds in rank order
    (my own a new descriptor too; the caller closes them all once the group is made)."""
    send_fd(sock, rank, fd)
    fds = {}
    for _ in range(ranks):
        r, got = recv_fd(sock)
        fds[r] = got
    return [fds[r] for r in range(ranks)]


def held() -> int:
    """How many descriptors and mappings of segments this process holds (none
    once every group it made is closed: what a leak check counts)."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{entry}").startswith(f"/memfd:{NAME}")
        except OSError:                       # the listing's own descriptor, gone by now
            pass
    with open("/proc/self/maps") as maps:
        return count + sum(f"/memfd:{NAME}" in line for line in maps)


# ------------------------------------------------- descriptors over a job's channel
class Offer:
    """Segment `fd` offered to one peer: `locator` is what the peer needs to take it
    (send it only over an authenticated channel: the nonce in it is the secret).
    withdraw() once the peer took it or gave up (a descriptor not taken is closed)."""

    def __init__(self, fd: int):
        self._key, address, nonce = memory.offer_descriptor(fd)
        self.locator = f"{os.getpid()}:{address}:{nonce}"

    def withdraw(self) -> None:
        memory.withdraw_descriptor(self._key)


def take(locator: str, rank: int) -> int:
    """Rank `rank`'s segment descriptor, from the process its locator names (an
    Offer's): only a memfd segment of this user, handed over by that process, is
    taken. The caller closes it."""
    m = LOCATOR.fullmatch(locator)
    if not m:
        raise ValueError(f"rank {rank}'s segment locator {locator[:80]!r} is not one")
    pid, address, nonce = m.groups()
    fd = memory.fetch_descriptor(f"{NAME}{rank}", int(pid), address, bytes.fromhex(nonce))
    try:
        st = os.fstat(fd)
        if (not os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{NAME}{rank} ")
                or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
            raise ValueError(f"process {pid} handed over something else than rank {rank}'s segment")
    except BaseException:
        os.close(fd)
        raise
    return fd
