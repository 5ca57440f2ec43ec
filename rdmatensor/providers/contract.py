"""The contract every data provider implements: a Channel to one peer.

A channel moves bytes one-sided: the receiver exposes regions of its memory
(each with a key), tells the sender about them over the authenticated control
plane, and the sender writes into them at an offset, with a 32-bit immediate
that the receiver's channel reports when the bytes are in place. A zero-length
write carries only the immediate (credits). No provider performs a write
outside an exposed region or with a wrong key: it is refused and reported.

Lifecycle: construct -> configure() -> expose()/register_source() -> params()
-> exchange over the control plane -> connect(peer_params) + attach(peer
regions) -> write()/notify() -> close(). `on_imm(imm)` and `on_lost(error)`
are called from the channel's own thread or from a thread inside wait_for()
or progress(); a provider may keep completions until one of those asks for
them (shm keeps them in its ring). `on_lost` is called at most once.
`on_imm` returns True when the immediate broke the rules and it reported
the channel lost: what follows it is not taken in.

What a session needs to know about a provider is in `capabilities`; it never
asks for a provider by name.
"""
from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import PeerLost, RefusedWrite, TransportError
from ..memory import Arena
from ..plan import MAX_SLOTS


@dataclass(frozen=True)
class ControlPlane:
    """What the session hands a provider about its control plane (configure())."""
    address: str                        # this rank's control server, "host:port"
    token: str
    tls: object                         # TlsConfig or None
    pair_secret: Callable[[], str]      # this pair's credential, once exchanged


@dataclass(frozen=True)
class Capabilities:
    # Receive arenas must be shared-memory segments (the peer maps them).
    shared_arenas: bool = False
    # write() reads only from memory given to register_source().
    needs_registered_source: bool = False
    # write() returns while the NIC may still read its source: wait(handle) before reusing it.
    posted_writes: bool = False


class Channel(ABC):
    name = "?"
    capabilities = Capabilities()

    def __init__(self, rank: int, peer: int, host: str, on_imm: Callable[[int], bool | None],
                 on_lost: Callable[[Exception], None], max_incoming: int = 128):
        # max_incoming: the most immediates that can be in flight towards this
        # side (one DATA per slot it receives, one CREDIT per slot it sends).
        self.rank, self.peer, self.host = rank, peer, host
        self.on_imm, self._on_lost = on_imm, on_lost
        self._lost = False
        self.local: dict[int, tuple[Arena, int]] = {}    # region id -> (arena, key)
        self.remote: dict[int, dict] = {}                # region id -> descriptor
        self.copies = 0      # payload copies the provider makes itself (serialization)

    @classmethod
    def viable(cls) -> tuple[bool, str]:
        """Whether this provider can run here, and why (not)."""
        return True, ""

    # -- setup ------------------------------------------------------------
    def configure(self, control: ControlPlane) -> None:
        """What the session knows that a provider may need about the control
        plane (the grpc baseline carries its data there). Default: nothing."""
        return None

    def expose(self, region_id: int, arena: Arena) -> dict:
        """Make `arena` writable by the peer; returns the full descriptor the
        peer needs (region_id, size, key, and addr or shm_name where used)."""
        key = secrets.randbits(32) or 1
        self.local[region_id] = (arena, key)
        return {"region_id": region_id, "size": arena.size, "key": key}

    def unexpose(self, region_id: int) -> None:
        self.local.pop(region_id, None)

    def register_source(self, buf: np.ndarray) -> None:
        """Memory this side will write from (verbs registers it for the NIC to
        read alone, with no access flag, and keeps `buf` alive until deregister_source). Default: nothing to do."""
        return None

    def deregister_source(self, buf: np.ndarray) -> None:
        """Forget memory given to register_source(); no write may still read it."""
        return None

    def writes_from(self, src: np.ndarray) -> bool:
        """Whether write() reads `src` (uint8, contiguous) where it is; else the
        session copies it into registered staging first."""
        return not self.capabilities.needs_registered_source

    @abstractmethod
    def params(self) -> dict:
        """What the peer needs to connect to this side."""

    def accept_peer(self, peer_params: dict) -> None:
        """Refuse a peer this provider cannot serve, from its parameters, before
        any of its regions is opened (TransportError saying why). Default: any."""
        return None

    @abstractmethod
    def connect(self, peer_params: dict, initiator: bool, timeout: float) -> None:
        """Join the peer; return when writes in both directions can flow."""

    def attach(self, descriptor: dict) -> None:
        """Learn a region of the peer's that this side may write into."""
        self.remote[int(descriptor["region_id"])] = dict(descriptor)

    # -- data path --------------------------------------------------------
    @abstractmethod
    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int):
        """Place `src` (uint8, contiguous; or, unless needs_registered_source,
        Pieces of them laid end to end) at `offset` in the peer's region and
        deliver `imm`. Returns None once `src` may be reused, or (posted_writes)
        a handle to pass to wait() before reusing it."""

    def prepare_write(self, region_id: int, offset: int, src: np.ndarray, imm: int):
        """write() of these arguments, built and checked once, for a slot written
        again and again from the same registered memory: a callable that posts
        it and returns its handle, or a false value when it did not post (call
        write() then, which waits or raises as it must). None: no such path here."""
        return None

    def write_many(self, writes: list) -> list:
        """Several (region_id, offset, src, imm) writes, in order; their handles.
        Default: one write() each. verbs posts them with one doorbell."""
        return [self.write(*w) for w in writes]

    def wait(self, handle, timeout: float | None = None) -> None:
        """Block until the write behind `handle` no longer needs its source.
        Default: writes are complete when write() returns."""
        return None

    def receive(self, request) -> None:
        """Take in a write that came over the control plane (a Push). Only the
        grpc baseline carries data there; every other provider refuses it."""
        raise RefusedWrite(f"the {self.name} channel of rank {self.peer} takes no writes over the "
                           f"control plane", peer=self.peer)

    def progress(self, block_for: float = 0.0) -> bool:
        """Process pending completions now, on the calling thread, first waiting
        up to `block_for` seconds for one; True if any."""
        return False

    def wait_for(self, event, timeout: float) -> bool:
        """Wait until `event` is set by this channel's incoming immediates.
        Providers override this to take in completions on the waiting thread
        itself, so the fast path has no hand-off between threads."""
        return event.wait(timeout)

    def notify(self, imm: int) -> None:
        """Deliver only an immediate (a zero-length write)."""
        self.write(-1, 0, _EMPTY, imm)

    def notify_later(self, imm: int) -> None:
        """Deliver only an immediate that may wait a little (a credit): with
        this side's next write to the peer, when it next waits for the peer, or
        within a few milliseconds. Default: at once (notify())."""
        self.notify(imm)

    def credit_sink(self):
        """A compiled callable that takes a credit for later (notify_later's
        common case) and says True, or False for notify_later() to deliver
        it: the session's compiled hop calls it. None: none (the default)."""
        return None

    def waiter(self):
        """A compiled callable w(flag, limit=None): True once `flag` is set within
        a short spin (at most `limit` seconds), None for wait_for() to wait (and
        decide); the session's compiled hop calls it before wait_for(). w(None)
        takes in what completed without waiting (a sender's look after its
        write). None: none (the default)."""
        return None

    def arrivals(self) -> int | None:
        """How many messages from the peer have arrived so far, where the provider
        counts them. Each one shows the peer's process alive, so the session's
        heartbeat does not ping a peer whose count moved since its last look.
        None: not counted (the default; the heartbeat always pings)."""
        return None

    def peer_said_bye(self) -> None:
        """The peer closed in order; report it once everything it sent is in."""
        self.lost(PeerLost(f"peer {self.peer} closed the session", peer=self.peer))

    # -- helpers ----------------------------------------------------------
    def check_remote(self, region_id: int, offset: int, length: int) -> dict:
        desc = self.remote.get(region_id)
        if desc is None:
            raise TransportError(f"peer {self.peer} exposed no region {region_id}", peer=self.peer)
        if offset < 0 or length < 0 or offset + length > desc["size"]:
            raise TransportError(f"write [{offset}, {offset + length}) is outside peer {self.peer}'s "
                                 f"{desc['size']}-byte region {region_id}", peer=self.peer)
        return desc

    def check_local(self, region_id: int, key: int, offset: int, length: int) -> Arena:
        """What an emulated NIC checks before it lets a write land."""
        entry = self.local.get(region_id)
        if entry is None:
            raise RefusedWrite(f"peer {self.peer} wrote to region {region_id}, which is not exposed",
                               peer=self.peer)
        arena, want = entry
        if key != want:
            raise RefusedWrite(f"peer {self.peer} wrote to region {region_id} with a wrong key", peer=self.peer)
        if offset < 0 or length < 0 or offset + length > arena.size:
            raise RefusedWrite(f"peer {self.peer} wrote [{offset}, {offset + length}) outside the "
                               f"{arena.size}-byte region {region_id}", peer=self.peer)
        return arena

    def lost(self, error: Exception) -> None:
        if not self._lost:
            self._lost = True
            self._on_lost(error)

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""


_EMPTY = np.zeros(0, dtype=np.uint8)


class Pieces(tuple):
    """One write's source in several places: contiguous arrays laid end to end
    as one payload (a gather write). The ring's fused buckets leave from their
    members where TensorFlow put them, instead of being copied together first."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self)

    def into(self, dst: np.ndarray) -> np.ndarray:
        """Copy the pieces, end to end, into the flat uint8 `dst`; returns what they filled."""
        at = 0
        for p in self:
            dst[at:at + p.nbytes] = p.reshape(-1).view(np.uint8)
            at += p.nbytes
        return dst[:at]

    def tobytes(self) -> bytes:
        return b"".join(p.tobytes() for p in self)


class HeldPieces(Pieces):
    """Pieces their sender leaves untouched, and alive, until wait_sent() says the
    write is done (the ring waits for its first writes before it returns): over
    verbs the large ones are then written from where they are, registered for
    that write alone, instead of copied into staging first. Plain Pieces may be
    changed as soon as send() returns."""

# Immediates: 2 bits of kind, 12 bits of tag, 18 bits of slot index. The tag
# is the sender's label for the write (a DATA immediate's: which call it
# belongs to, see Session.send), so a receiver can tell one call's value from
# another's with no extra byte on the wire.
#
# A PAIR immediate is a credit riding in a write: a CREDIT's slot index and a
# tag-0 DATA's, PAIR_BITS each. An RC endpoint sends a credit it owes this
# way, instead of as a send of its own, when both indices fit (see pair_imm):
# on SoftRoCE every work request costs the kernel a packet.
# A PIECE immediate is one rail's part of a DATA write striped over several
# NICs (verbs/rails.py): the channel hands the session the DATA immediate once
# every piece is in, so a session never sees one.
IMM_DATA, IMM_CREDIT, IMM_PAIR, IMM_PIECE = 0, 1, 2, 3
WIRE_VERSION = 2        # this format (2: with PAIR); a pair of ranks checks it agrees before any write
INDEX_BITS = MAX_SLOTS.bit_length() - 1
TAG_BITS = 30 - INDEX_BITS
MAX_TAG = (1 << TAG_BITS) - 1
PAIR_BITS = 15


def make_imm(kind: int, index: int, tag: int = 0) -> int:
    return (kind << 30) | (tag << INDEX_BITS) | index


def split_imm(imm: int) -> tuple[int, int, int]:
    """(kind, tag, slot index)."""
    return imm >> 30, (imm >> INDEX_BITS) & MAX_TAG, imm & (MAX_SLOTS - 1)


def pair_imm(data: int, credit: int) -> int | None:
    """One PAIR immediate for a DATA immediate of tag 0 and a CREDIT, or None
    when they cannot pair (another kind, a tag, an index beyond PAIR_BITS)."""
    if data >> PAIR_BITS or credit >> 30 != IMM_CREDIT or (credit & ((1 << 30) - 1)) >> PAIR_BITS:
        return None
    return (IMM_PAIR << 30) | ((credit & ((1 << PAIR_BITS) - 1)) << PAIR_BITS) | data


def unpair_imm(imm: int) -> tuple[int, int]:
    """A PAIR immediate's (CREDIT slot index, DATA slot index)."""
    return (imm >> PAIR_BITS) & ((1 << PAIR_BITS) - 1), imm & ((1 << PAIR_BITS) - 1)
