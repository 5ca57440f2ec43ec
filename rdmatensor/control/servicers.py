"""The gRPC handlers of a session's control server.

Each handler authorizes the caller (the token was checked before any handler
runs; per-rank calls also need the pair credential, see `auth.py`), hands the
request to the part of the session that owns it, and turns a typed error into
a refusal (see `status.py`). No session state lives here.
"""
from __future__ import annotations

import grpc

from ..errors import BadRequest, PeerLost, RdmaTensorError, RefusedWrite, TooManyBarriers
from . import control_pb2 as pb
from . import control_pb2_grpc as pb_grpc
from .auth import PairCredentials
from .status import abort


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, rank: int, credentials: PairCredentials, exchange, growth, barriers, liveness):
        self.rank, self.credentials = rank, credentials
        self.exchange, self.growth, self.barriers, self.liveness = exchange, growth, barriers, liveness

    def Exchange(self, request, context):
        try:
            return self.exchange.on_exchange(request)
        except RdmaTensorError as exc:
            abort(context, exc, grpc.StatusCode.INVALID_ARGUMENT)

    def Grow(self, request, context):
        try:
            self.credentials.check(request.rank, request.pair_secret)
            return pb.GrowReply(region=self.growth.on_grow(request.rank, request.slot, request.nbytes))
        except RdmaTensorError as exc:
            abort(context, exc, grpc.StatusCode.INVALID_ARGUMENT)

    def Barrier(self, request, context):
        try:
            self.credentials.check(request.rank, request.pair_secret)
        except RdmaTensorError as exc:
            abort(context, exc)
        try:
            self.barriers.on_barrier(request.rank, request.name, active=context.is_active)
        except (BadRequest, TooManyBarriers) as exc:
            abort(context, exc)
        except RdmaTensorError as exc:
            # Whatever ended the wait here, for the caller this rank is gone.
            abort(context, exc if isinstance(exc, PeerLost) else PeerLost(str(exc), peer=self.rank),
                  grpc.StatusCode.DEADLINE_EXCEEDED)
        return pb.BarrierReply()

    def Bye(self, request, context):
        try:
            self.credentials.check(request.rank, request.pair_secret)
        except RdmaTensorError as exc:
            abort(context, exc)
        self.liveness.on_bye(request.rank, request.lost_rank if request.HasField("lost_rank") else None,
                             request.reason)
        return pb.ByeReply()

    def Ping(self, request, context):
        # Only the peer that exchanged with this rank learns it is alive and who it is.
        try:
            self.credentials.check(request.rank, request.pair_secret)
        except RdmaTensorError as exc:
            abort(context, exc)
        return pb.PingReply(rank=self.rank, status=self.liveness.describe())


class BaselineServicer(pb_grpc.BaselineServicer):
    """The grpc baseline's data path: a Push is a write, taken in by the channel."""

    def __init__(self, channels: dict, credentials: PairCredentials):
        self.channels, self.credentials = channels, credentials

    def Push(self, request, context):
        channel = self.channels.get(request.rank)
        try:
            self.credentials.check(request.rank, request.pair_secret)
            if channel is None:
                raise RefusedWrite(f"no grpc channel for rank {request.rank}", peer=request.rank)
            channel.receive(request)
        except RdmaTensorError as exc:
            abort(context, exc)
        return pb.PushReply()

