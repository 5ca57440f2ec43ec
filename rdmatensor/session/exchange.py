"""Setup: arenas, channels and slots for every peer, then one Exchange per pair.

Every rank allocates its receive arenas (the slots of every tensor it will
receive) and its staging arenas (the same layout, for what it sends), and
registers them with one channel per peer. Then, for each pair, the lower
rank makes one Exchange call: token and plan digest checked, arena
descriptors and channel parameters swapped, the pair credential set. The
barrier coordinator (the lowest rank) also exchanges with every rank it
shares no tensor with, for the pair credential alone (no channel, no
regions), so that every Barrier call carries one. The protobuf <->
descriptor converters live here too.
"""
from __future__ import annotations

import json
import threading
import time
from functools import partial

from ..control.service import pb
from ..errors import AuthenticationError, BadRequest, PeerLost, PlanMismatch, RdmaTensorError
from ..providers.contract import WIRE_VERSION, ControlPlane
from . import wire
from .barrier import ranks_and_coordinator
from .context import SessionContext
from .credits import Credits, RecvSlot, SendSlot
from .liveness import Liveness


def region_msg(desc: dict) -> pb.Region:
    return pb.Region(region_id=desc["region_id"], size=desc["size"], key=desc["key"],
                     addr=desc.get("addr", 0), shm_name=desc.get("shm_name", ""),
                     rail_keys=desc.get("rail_keys", ()))


def region_dict(msg: pb.Region) -> dict:
    return {"region_id": msg.region_id, "size": msg.size, "key": msg.key, "addr": msg.addr,
            "shm_name": msg.shm_name, "rail_keys": list(msg.rail_keys)}


def params_msg(provider: str, params: dict) -> pb.ChannelParams:
    rails = [params_msg(provider, rail) for rail in params.get("rails", ())]
    return pb.ChannelParams(provider=provider, rails=rails, **{k: v for k, v in params.items() if k != "rails"})


def params_dict(msg: pb.ChannelParams) -> dict:
    return {f.name: [params_dict(r) for r in v] if f.name == "rails" else v for f, v in msg.ListFields()}


class Exchange:
    def __init__(self, ctx: SessionContext, credits: Credits, live: Liveness):
        self.ctx, self.credits, self.live = ctx, credits, live
        self.regions: dict[int, list[dict]] = {}        # peer -> descriptors of what it may write
        self.exchanged: dict[int, dict] = {}            # lower-ranked peer -> its channel parameters
        everyone, coordinator = ranks_and_coordinator(ctx.plan, ctx.rank)
        partners = everyone if ctx.rank == coordinator else {coordinator}
        # Ranks that exchange with this one for the pair credential alone.
        self.credential_only = partners - ctx.plan.peers_of(ctx.rank) - {ctx.rank}
        self._events = {p: threading.Event() for p in ctx.plan.peers_of(ctx.rank) | self.credential_only
                        if p < ctx.rank}
        live.when_failed(self._wake)

    def _wake(self) -> None:
        for ev in self._events.values():
            ev.set()

    # -- before any call --------------------------------------------------
    def prepare(self, peer_ranks: list[int]) -> None:
        """One channel per peer, its arenas exposed or registered, its slots ready."""
        ctx = self.ctx
        for peer in peer_ranks:
            incoming = ctx.plan.pairs.get((peer, ctx.rank))
            outgoing = ctx.plan.pairs.get((ctx.rank, peer))
            n_in, n_out = len(incoming.slots) if incoming else 0, len(outgoing.slots) if outgoing else 0
            cls = ctx.provider_classes[peer]
            ch = cls(ctx.rank, peer, ctx.host(ctx.rank), on_imm=self.credits.immediates(peer),
                     on_lost=partial(self.live.lost, peer), max_incoming=n_in + n_out)
            ch.configure(ControlPlane(ctx.peers[ctx.rank], ctx.token, ctx.tls,
                                      partial(ctx.credentials.secret, peer)))
            ctx.channels[peer] = ch
            receiving, sending = [], []
            if incoming:
                arenas = [ctx.arena(size, cls.capabilities.shared_arenas) for size in incoming.arena_sizes]
                self.regions[peer] = [ch.expose(i, arena) for i, arena in enumerate(arenas)]
                receiving = [RecvSlot(slot, peer, arenas[slot.arena].view(slot.offset, slot.size))
                             for slot in incoming.slots]
            if outgoing:
                arenas = [ctx.arena(size) for size in outgoing.arena_sizes]
                for arena in arenas:
                    ch.register_source(arena.buf)
                sending = [SendSlot(slot, peer, arenas[slot.arena].view(slot.offset, slot.size),
                                    raw=wire.is_raw(slot.spec, ctx.plan) and slot.spec.nbytes > 0)
                           for slot in outgoing.slots]
            self.credits.add(peer, sending, receiving)

    def _local_regions(self, peer: int) -> list[pb.Region]:
        return [region_msg(desc) for desc in self.regions.get(peer, [])]

    # -- the lower rank's side --------------------------------------------
    def run(self, peer_ranks: list[int]) -> None:
        """Exchange with every higher-ranked peer, then wait for every lower-ranked one's."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.timeout
        specs_json = ctx.plan.to_json()
        for peer in sorted(p for p in set(peer_ranks) | self.credential_only if p > ctx.rank):
            ch = ctx.channels.get(peer)
            params = ch.params() if ch else {}
            req = pb.ExchangeRequest(rank=ctx.rank, peer=peer, plan_digest=ctx.plan.digest, plan_specs=specs_json,
                                     channel=params_msg(ctx.provider_name(peer), params),
                                     regions=self._local_regions(peer),
                                     pair_secret=ctx.credentials.draw(peer), wire=WIRE_VERSION)
            reply = ctx.call(peer, "Exchange", req, timeout=max(1.0, deadline - time.monotonic()),
                             wait_for_ready=True)
            self._check_wire(peer, reply.wire)
            if ch is None:
                continue
            ch.accept_peer(params_dict(reply.channel))
            for region in reply.regions:
                ch.attach(region_dict(region))
            ch.connect(params_dict(reply.channel), initiator=True, timeout=max(1.0, deadline - time.monotonic()))
        for peer in sorted(self._events):
            while not self._events[peer].wait(min(max(0.0, deadline - time.monotonic()), 0.2)):
                ctx.check_abort()
                if time.monotonic() < deadline:
                    continue
                raise PeerLost(f"rank {peer} never set up its side with rank {ctx.rank} "
                               f"within {ctx.timeout:.0f} s", peer=peer)
            self.live.check()
            if peer in ctx.channels:
                ctx.channels[peer].connect(self.exchanged[peer], initiator=False,
                                       timeout=max(1.0, deadline - time.monotonic()))

    def _check_wire(self, peer: int, theirs: int) -> None:
        """Both ranks of a pair write the same data path format, or neither starts."""
        if theirs != WIRE_VERSION:
            ctx = self.ctx
            said = f"format {theirs}" if theirs else "a release older than format numbers"
            error = PlanMismatch(f"rank {peer} writes the data path in {said}, rank {ctx.rank} in format "
                                 f"{WIRE_VERSION}: run the same rdmatensor on every rank", peer=peer)
            self.live.fail(error)
            raise error

    # -- the higher rank's side (a control-server thread) -----------------
    def on_exchange(self, request) -> pb.ExchangeReply:
        ctx = self.ctx
        peer = request.rank
        if request.peer != ctx.rank:
            raise BadRequest(f"this is rank {ctx.rank}, not {request.peer}", peer=peer)
        if peer not in self._events:
            raise AuthenticationError(f"rank {peer} is not a lower-ranked peer of rank {ctx.rank} in this plan",
                                      peer=peer)
        ctx.credentials.claim(peer, request.pair_secret)     # one Exchange per peer, ever
        if request.plan_digest != ctx.plan.digest:
            try:
                theirs = json.loads(request.plan_specs)["specs"]
            except (ValueError, KeyError, TypeError):
                theirs = []
            error = PlanMismatch(f"plan mismatch between rank {peer} and rank {ctx.rank}: "
                                 f"{ctx.plan.first_difference(theirs)}", peer=peer)
            self.live.fail(error)
            raise error
        self._check_wire(peer, request.wire)
        if request.channel.provider != ctx.provider_name(peer):
            error = PlanMismatch(f"provider mismatch: rank {peer} uses {request.channel.provider!r} with rank "
                                 f"{ctx.rank}, rank {ctx.rank} uses {ctx.provider_name(peer)!r} with it", peer=peer)
            self.live.fail(error)
            raise error
        ch = ctx.channels.get(peer)
        if ch is None:                       # the coordinator, for the pair credential alone
            self._events[peer].set()
            return pb.ExchangeReply(wire=WIRE_VERSION)
        try:
            ch.accept_peer(params_dict(request.channel))
        except RdmaTensorError as exc:
            self.live.fail(exc)
            raise BadRequest(f"rank {ctx.rank} cannot serve rank {peer} over {ctx.provider_name(peer)}: {exc}",
                             peer=peer) from exc
        try:
            for region in request.regions:
                ch.attach(region_dict(region))
        except RdmaTensorError as exc:
            self.live.fail(exc)
            raise BadRequest(f"rank {peer}'s regions are unusable: {exc}", peer=peer) from exc
        self.exchanged[peer] = params_dict(request.channel)
        reply = pb.ExchangeReply(channel=params_msg(ctx.provider_name(peer), ch.params()),
                                 regions=self._local_regions(peer), wire=WIRE_VERSION)
        self._events[peer].set()
        return reply
