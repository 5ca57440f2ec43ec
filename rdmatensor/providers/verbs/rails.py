"""verbs over several NICs to one peer: rails, and large writes striped over them.

With RDMATENSOR_IB_RAILS=N, a verbs channel opens one RC queue pair per rail,
each on its own port (choose_port.choose_rails: rail i meets the peer's rail
i, so list the NICs in the same order on every host). Rail 0 is the channel
itself (a VerbsChannel: credits, small writes, the compiled waiter); rails 1..
are plain VerbsChannels of their own, each with its own protection domain.

- A region is registered on every rail: a remote key is per protection
  domain, so its descriptor carries one key per rail (`rail_keys`, after rail
  0's `key`). Memory this side sends from is registered on every rail too.
  Locked memory grows with the rails.
- A DATA write of at least STRIPE_MIN bytes goes as one piece per rail, each
  a WRITE WITH IMM of kind IMM_PIECE carrying the write's tag and slot. The
  receiver hands the write's DATA immediate to its session only once the
  piece of every rail is in: a completion with an immediate means that
  piece's bytes are placed, so the whole value is, whichever rail came last.
  Smaller writes, and every credit, go on rail 0 alone.
- A write's number is rail 0's; wait(number) also waits for the other rails'
  pieces of every striped write up to it, so "number done" still means every
  write before it is done, as with one queue pair.
- Both sides use min(their rails, the peer's) rails.
- Any rail lost is the channel lost.
"""
from __future__ import annotations

import os
import threading
from bisect import bisect_right

import numpy as np

from ...errors import PeerLost, TransportError
from ...memory import Arena
from ..contract import IMM_DATA, IMM_PIECE
from . import choose_port
from .channel import VerbsChannel

STRIPE_MIN = 256 << 10      # smaller writes are not worth a work request per rail
PIECE_ALIGN = 4096          # pieces start on page boundaries of the source
LOW_BITS = (1 << 30) - 1    # an immediate's tag and slot


class RailsChannel(VerbsChannel):
    """A verbs channel over RDMATENSOR_IB_RAILS ports to its peer."""

    sleeps_in_waiter = False    # a striped value's last piece may complete on another rail's CQ

    @staticmethod
    def wanted(env=os.environ) -> int:
        return choose_port.rails(env)

    def __init__(self, rank: int, peer: int, host: str, on_imm, on_lost, max_incoming: int = 128, **kwargs):
        ports = choose_port.choose_rails(self.wanted())
        self._deliver = on_imm                       # the session's: whole writes only
        self._pieces: dict[int, int] = {}            # a striped write's low bits -> pieces in so far
        self._pieces_lock = threading.Lock()
        super().__init__(rank, peer, host, self._take_imm, on_lost, max_incoming=max_incoming, port=ports[0])
        self.ports = ports
        self.rails: list[VerbsChannel] = []
        try:
            for port in ports[1:]:
                self.rails.append(VerbsChannel(rank, peer, host, self._take_imm, self._rail_lost,
                                               max_incoming=max_incoming, port=port))
        except Exception:
            self.close()
            raise
        self.width = 1                               # rails in use, once connected
        self._striped: list[int] = []                # rail 0 numbers of striped writes, in order
        self._striped_on: list[tuple[int, ...]] = []    # ... and each one's numbers on rails 1..
        self._stripe_lock = threading.Lock()

    # -- receiving: a striped write is delivered once all its pieces are in --
    def _take_imm(self, imm: int):
        if imm >> 30 != IMM_PIECE:
            return self._deliver(imm)
        low = imm & LOW_BITS
        with self._pieces_lock:
            seen = self._pieces.get(low, 0) + 1
            if seen < self.width:
                self._pieces[low] = seen
                return None
            self._pieces.pop(low, None)
        return self._deliver((IMM_DATA << 30) | low)

    def _rail_lost(self, error: Exception) -> None:
        if not (self._bye and isinstance(error, PeerLost)):    # after a bye, rail 0 reports it once drained
            self.lost(error)

    # -- setup ------------------------------------------------------------
    def expose(self, region_id: int, arena: Arena) -> dict:
        desc = super().expose(region_id, arena)
        desc["rail_keys"] = [rail.expose(region_id, arena)["key"] for rail in self.rails]
        return desc

    def unexpose(self, region_id: int) -> None:
        super().unexpose(region_id)
        for rail in self.rails:
            rail.unexpose(region_id)

    def register_source(self, buf: np.ndarray) -> None:
        super().register_source(buf)
        for rail in self.rails:
            rail.register_source(buf)

    def deregister_source(self, buf: np.ndarray) -> None:
        super().deregister_source(buf)
        for rail in self.rails:
            rail.deregister_source(buf)

    def attach(self, descriptor: dict) -> None:
        super().attach(descriptor)
        keys = list(descriptor.get("rail_keys") or ())
        for rail, key in zip(self.rails, keys, strict=False):
            rail.attach({**descriptor, "key": key})

    def params(self) -> dict:
        return {**super().params(), "rails": [rail.params() for rail in self.rails]}

    def connect(self, peer_params: dict, initiator: bool, timeout: float) -> None:
        theirs = list(peer_params.get("rails") or ())
        self.width = 1 + min(len(self.rails), len(theirs))
        for rail in self.rails[self.width - 1:]:       # the peer has fewer: these stay unused
            rail.close()
        del self.rails[self.width - 1:]
        super().connect(peer_params, initiator, timeout)
        for rail, params in zip(self.rails, theirs, strict=False):
            rail.connect(params, initiator, timeout)

    # -- sending ----------------------------------------------------------
    def _stripes(self, src: np.ndarray, imm: int) -> bool:
        return (self.width > 1 and isinstance(src, np.ndarray) and src.nbytes >= STRIPE_MIN
                and imm is not None and imm >> 30 == IMM_DATA)

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> int:
        if not self._stripes(src, imm):
            return super().write(region_id, offset, src, imm)
        self.check_remote(region_id, offset, src.nbytes)
        for rail in self.rails:
            if region_id not in rail._regions:
                raise TransportError(f"peer {self.peer} gave no key for region {region_id} on every rail",
                                     peer=self.peer)
        piece = -(-src.nbytes // self.width // PIECE_ALIGN) * PIECE_ALIGN
        cuts = [min(i * piece, src.nbytes) for i in range(self.width + 1)]
        cuts[-1] = src.nbytes
        imm = (IMM_PIECE << 30) | (imm & LOW_BITS)
        with self._stripe_lock:       # striped writes numbered in the same order on every rail
            others = tuple(rail.write(region_id, offset + lo, src[lo:hi], imm)
                           for rail, lo, hi in zip(self.rails, cuts[1:], cuts[2:], strict=False))
            first = super().write(region_id, offset, src[:cuts[1]], imm)
            self._striped.append(first)
            self._striped_on.append(others)
        return first

    def prepare_write(self, region_id: int, offset: int, src: np.ndarray, imm: int):
        return None if self._stripes(src, imm) else super().prepare_write(region_id, offset, src, imm)

    def write_many(self, writes: list) -> list[int]:
        if any(self._stripes(w[2], w[3]) for w in writes):
            return [self.write(*w) for w in writes]
        return super().write_many(writes)

    def wait(self, number: int, timeout: float | None = None) -> None:
        super().wait(number, timeout)
        with self._stripe_lock:
            last = bisect_right(self._striped, number) - 1
            others = self._striped_on[last] if last >= 0 else ()
        for rail, theirs in zip(self.rails, others, strict=False):
            rail.wait(theirs, timeout)
        if last >= 0:
            with self._stripe_lock:           # every striped write up to it is done on every rail
                done = bisect_right(self._striped, number)
                del self._striped[:done], self._striped_on[:done]

    # -- progress and the end -----------------------------------------------
    def progress(self, block_for: float = 0.0) -> bool:
        found = any([rail.progress() for rail in self.rails])
        return super().progress(0.0 if found else block_for) or found

    def arrivals(self) -> int:
        return super().arrivals() + sum(rail.arrivals() for rail in self.rails)

    def peer_said_bye(self) -> None:
        super().peer_said_bye()
        for rail in self.rails:
            rail._bye = True

    def lost(self, error: Exception) -> None:
        super().lost(error)
        for rail in self.rails:
            rail.lost(error)

    def close(self) -> None:
        for rail in getattr(self, "rails", ()):
            rail.close()
        super().close()


VerbsChannel.over_rails = RailsChannel
