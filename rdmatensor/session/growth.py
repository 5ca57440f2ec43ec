"""Dynamic growth, both sides of Grow.

A dynamic tensor that outgrows its slot cannot be written there. The sender,
holding the slot's credit (so the receiver holds no view of it), asks the
receiver for room; the receiver allocates and registers a region of the next
power of two, moves the slot there, frees the region it replaces and answers
with the new descriptor. Only then does the data go. Smaller values keep
using the grown region.
"""
from __future__ import annotations

import threading

from ..control.service import pb
from ..errors import BadRequest
from .context import SessionContext
from .credits import Credits, SendSlot
from .exchange import region_dict, region_msg

GROWN_REGION_BASE = 1 << 20      # region ids of grown slots start here
MIN_GROWN_REGION = 4096


class Growth:
    def __init__(self, ctx: SessionContext, credits: Credits):
        self.ctx, self.credits = ctx, credits
        self._lock = threading.Lock()
        self._next_region = GROWN_REGION_BASE

    def request(self, st: SendSlot, need: int) -> None:
        """Sender: get a region of the receiver's that holds `need` bytes, and staging as large."""
        ctx = self.ctx
        reply = ctx.call(st.peer, "Grow", pb.GrowRequest(rank=ctx.rank, slot=st.slot.index, nbytes=need,
                                                          pair_secret=ctx.credentials.secret(st.peer)),
                         timeout=ctx.timeout)
        desc = region_dict(reply.region)
        ch = ctx.channels[st.peer]
        ch.attach(desc)
        staging = ctx.arena(desc["size"])
        ch.register_source(staging.buf)
        st.region, st.offset, st.capacity = desc["region_id"], 0, desc["size"]
        st.staging = staging.buf
        ctx.counters.add("grows")

    def on_grow(self, peer: int, slot_index: int, nbytes: int) -> pb.Region:
        """Receiver: move `peer`'s slot to a region of at least `nbytes` (the caller is authorized)."""
        ctx = self.ctx
        st = self.credits.recv_slot(peer, slot_index)
        if st is None or st.slot.spec.is_static:
            raise BadRequest(f"slot {slot_index} from rank {peer} is not a dynamic tensor", peer=peer)
        if nbytes > ctx.plan.max_arena_bytes:
            raise BadRequest(f"{nbytes} bytes exceed one region ({ctx.plan.max_arena_bytes})",
                             peer=peer, tensor=st.name)
        size = max(MIN_GROWN_REGION, 1 << (int(nbytes) - 1).bit_length())
        with self._lock:
            region_id = self._next_region
            self._next_region += 1
        ch = ctx.channels[peer]
        arena = ctx.arena(size, shared=ch.capabilities.shared_arenas)
        desc = ch.expose(region_id, arena)
        try:
            old = st.regrow(region_id, arena)
        except BaseException:
            ch.unexpose(region_id)
            ctx.arenas.remove(arena)
            arena.close()
            raise
        if old:
            ch.unexpose(old[0])
            ctx.arenas.remove(old[1])
            old[1].close()
        return region_msg(desc)
