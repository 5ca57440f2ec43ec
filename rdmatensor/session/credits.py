"""Slot state and credits: who may write a slot, and where a credit is returned.

Every slot of a (sender, receiver) pair has one credit. The sender writes a
slot only while it holds the slot's credit; its write's DATA immediate hands
the slot to the receiver; the receiver returns the credit (a CREDIT
immediate, give_back()) once the user released the view recv() gave. So a
sender never overwrites a value the receiver still holds, and values of one
tensor arrive in the order they were sent.
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np

from ..errors import CreditViolation, RdmaTensorError, RemoteError, SendTimeout
from ..memory import Arena
from ..plan import Slot
from ..providers.contract import (IMM_CREDIT, IMM_DATA, IMM_PAIR, INDEX_BITS, MAX_SLOTS, MAX_TAG, make_imm,
                              unpair_imm)
from .context import SessionContext
from .flag import Flag
from .slots import SlotState, compiled
from .liveness import Liveness

log = logging.getLogger("rdmatensor")


class SendSlot(compiled.SendState if compiled else object):
    """The sender's end of a slot: its credit, where its bytes go, its staging
    memory (the fields the compiled hop reads are SendState's, in C)."""

    def __init__(self, slot: Slot, peer: int, staging: np.ndarray, raw: bool = False):
        self.slot, self.peer, self.spec, self.name = slot, peer, slot.spec, slot.spec.name
        self.nbytes = slot.spec.nbytes or 0   # what one write of `view` sends (a static tensor)
        self.credit = Flag(True)              # set: this side may write the slot
        self.region, self.offset, self.capacity = slot.arena, slot.offset, slot.size
        self.staging: np.ndarray | None = staging
        self.view: np.ndarray | None = None   # staging as the tensor (static ones), once buffer() made it
        self.seal = None                      # view.setflags: read-only from its send to the next buffer()
        self.staging_bytes: np.ndarray | None = None     # what one write of `view` sends
        self.raw = bool(raw)                  # a static value goes as it is: no header, no checksum, not empty
        self.pending = None                   # the last posted write's handle, while it may read staging
        self.borrowed: list = []              # memory registered for that write alone (send.py's _gather)
        self.post = None                      # the channel's prepared write of `view` (tag 0), if it has one
        self.writes = self.bytes_sent = 0
        self.imm = make_imm(IMM_DATA, slot.index)


class RecvSlot(SlotState):
    """The receiver's end of a slot: its state machine (slots.py), its memory,
    its counters. arrive() outside EMPTY means the sender wrote without the
    credit: a CreditViolation. release() is where the credit goes back (see
    Credits.give_back)."""
    EMPTY, FULL, HELD = "empty", "full", "held"

    def __init__(self, slot: Slot, peer: int, memory: np.ndarray):
        super().__init__(memory, Flag())     # memory: this slot's bytes in the receive arena
        self.slot, self.peer, self.spec, self.name = slot, peer, slot.spec, slot.spec.name
        self.credit_imm = make_imm(IMM_CREDIT, slot.index)

    def regrow(self, region_id: int, arena: Arena) -> tuple[int, Arena] | None:
        """Put the slot in a new region (only while EMPTY); returns the one it replaces."""
        replaced, old = self.replace((region_id, arena), arena.buf)
        if not replaced:
            raise CreditViolation(f"{self.name!r} is still held: rank {self.peer} has no credit to grow it",
                                  peer=self.peer, tensor=self.name)
        return old


class Credits:
    """Every slot of this rank, the immediates that move them, and their credits."""

    def __init__(self, ctx: SessionContext, live: Liveness):
        self.ctx, self.live = ctx, live
        self._channels, self._peer_errors = ctx.channels, live.peer_errors     # (never replaced)
        self.send: dict[str, SendSlot] = {}
        self.recv: dict[str, RecvSlot] = {}
        self._send_by_index: dict[int, list[SendSlot]] = {}
        self._recv_by_index: dict[int, list[RecvSlot]] = {}
        self._immediates: dict[int, object] = {}      # peer -> its channel's compiled on_imm
        live.when_peer_lost(self.wake_peer)
        live.when_failed(self.wake_all)          # a failed session fails every waiting call at once

    def immediates(self, peer: int):
        """The on_imm of `peer`'s channel: compiled (slots.py) for valid
        immediates once add() bound its slots, on_imm() for everything else."""
        rules = partial(self.on_imm, peer)
        if compiled is None:
            return rules
        self._immediates[peer] = fast = compiled.Immediates(rules, INDEX_BITS)
        return fast

    def add(self, peer: int, sending: list[SendSlot], receiving: list[RecvSlot]) -> None:
        self._send_by_index[peer], self._recv_by_index[peer] = sending, receiving
        if peer in self._immediates:
            self._immediates[peer].bind(receiving, [st.credit for st in sending])
        self.send.update((st.name, st) for st in sending)
        self.recv.update((st.name, st) for st in receiving)

    def traffic(self) -> dict:
        """Writes and receives, and their bytes, summed over the slots that count them;
        bytes_sent_to: the bytes written to each peer (payload only: what crosses a
        link, counted apart from control traffic)."""
        to: dict[int, int] = {}
        for st in self.send.values():
            to[st.peer] = to.get(st.peer, 0) + st.bytes_sent
        return {"writes": sum(st.writes for st in self.send.values()),
                "bytes_sent": sum(to.values()), "bytes_sent_to": to,
                "recvs": sum(st.recvs for st in self.recv.values()),
                "bytes_received": sum(st.bytes_received for st in self.recv.values())}

    def recv_slot(self, peer: int, index: int) -> RecvSlot | None:
        states = self._recv_by_index.get(peer, [])
        return states[index] if 0 <= index < len(states) else None

    # -- immediates -------------------------------------------------------
    def on_imm(self, peer: int, imm: int) -> bool | None:
        """An immediate from `peer`: DATA hands a slot to this side, CREDIT gives one back,
        PAIR does both (the credit first, as when it led the write's chain).
        True when it broke the rules: the channel is reported lost, and takes in no more."""
        kind, index, tag = imm >> 30, imm & (MAX_SLOTS - 1), (imm >> INDEX_BITS) & MAX_TAG    # split_imm()
        try:
            credit = None
            if kind == IMM_PAIR:
                credit, index = unpair_imm(imm)
                tag, kind = 0, IMM_DATA
            sending, receiving = self._send_by_index.get(peer, ()), self._recv_by_index.get(peer, ())
            slots = receiving if kind == IMM_DATA else sending
            if kind > IMM_CREDIT or index >= len(slots) or (credit is not None and credit >= len(sending)):
                raise CreditViolation(f"rank {peer} sent immediate {imm:#x} for no slot", peer=peer)
            if credit is not None:
                sending[credit].credit.set()
            if kind == IMM_DATA:
                st = slots[index]
                if not st.arrive(tag):
                    raise CreditViolation(f"rank {peer} wrote {st.name!r} without a credit",
                                          peer=peer, tensor=st.name)
            else:
                slots[index].credit.set()
        except RemoteError as exc:
            self.ctx.channels[peer].lost(exc)
            return True

    # -- the sender's side ------------------------------------------------
    def take(self, st: SendSlot, timeout: float | None) -> None:
        """Take the slot's credit, waiting while the receiver holds the previous value."""
        if not st.credit.is_set():
            channel = self.ctx.channels[st.peer]
            if not (channel.progress() and st.credit.is_set()):    # a credit already in, not taken in yet?
                self.ctx.counters.add("waits")
                timeout = self.ctx.timeout if timeout is None else timeout
                if not channel.wait_for(st.credit, timeout):
                    raise SendTimeout(f"{st.name!r}: rank {st.peer} held the previous value "
                                      f"for more than {timeout:.1f} s", peer=st.peer, tensor=st.name)
        self.live.check(st.peer)         # the session's error or the peer's (a loss also sets credits)
        st.credit.clear()

    def keep(self, st: SendSlot) -> None:
        """Nothing was written: the credit stays with the sender."""
        if not self.live.is_lost(st.peer):
            st.credit.set()

    # -- the receiver's side ----------------------------------------------
    def give_back(self, st: RecvSlot) -> None:
        """The user released the slot: return its credit to the sender."""
        st.release()
        self.return_credit(st)

    def return_credit(self, st: RecvSlot) -> None:
        """The credit of a slot just emptied, to its sender (unless it is gone)."""
        if self.ctx.closed or st.peer in self._peer_errors:     # (live.is_lost(), inline)
            return
        try:
            self._channels[st.peer].notify_later(st.credit_imm)
        except RdmaTensorError as exc:
            # The sender is gone; it needs no credit. Its loss is reported by
            # the channel once everything it sent has been taken in.
            log.debug("rank %d: credit for %r not delivered: %s", self.ctx.rank, st.name, exc)

    # -- failure ----------------------------------------------------------
    def wake_peer(self, peer: int) -> None:
        """Wake everyone waiting on `peer` so they see its error."""
        for st in self._send_by_index.get(peer, []):
            st.credit.set()
        for st in self._recv_by_index.get(peer, []):
            st.wake()

    def wake_all(self) -> None:
        for peer in set(self._send_by_index) | set(self._recv_by_index):
            self.wake_peer(peer)
