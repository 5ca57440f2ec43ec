"""Named barriers across every rank of the plan.

The lowest rank coordinates: each other rank calls its Barrier and the call
returns once every rank arrived. The n-th use of a name on a rank meets the
n-th use on every other rank. A waiter that gives up takes its arrival back;
the last one out forgets the name.
"""
from __future__ import annotations

import threading
import time

from ..control.service import pb
from ..errors import BadRequest, PeerLost, TooManyBarriers
from .context import SessionContext
from .liveness import Liveness

MAX_OPEN_BARRIERS = 256


def ranks_and_coordinator(plan, rank: int) -> tuple[set[int], int]:
    """Every rank a barrier waits for, and the one that coordinates (the lowest)."""
    everyone = plan.ranks() | {rank}
    return everyone, min(everyone)


class Barriers:
    def __init__(self, ctx: SessionContext, live: Liveness):
        self.ctx, self.live = ctx, live
        self.everyone, self.coordinator = ranks_and_coordinator(ctx.plan, ctx.rank)
        self.open: dict[str, list] = {}          # key -> [ranks arrived, ranks departed]
        self._generation: dict[str, int] = {}
        self._cv = threading.Condition()
        live.when_failed(self._wake)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def wait(self, name: str, timeout: float | None = None) -> None:
        """Return once every rank of the plan reached the barrier `name`."""
        ctx = self.ctx
        self.live.check()
        timeout = ctx.timeout if timeout is None else timeout
        with self._cv:
            generation = self._generation.get(name, 0)
            self._generation[name] = generation + 1
        key = f"{name}#{generation}"
        if self.coordinator == ctx.rank:
            self._arrive(key, ctx.rank, timeout)
        else:
            request = pb.BarrierRequest(rank=ctx.rank, name=key,
                                        pair_secret=ctx.credentials.secret(self.coordinator))
            ctx.call(self.coordinator, "Barrier", request, timeout=timeout, wait_for_ready=True)

    def on_barrier(self, rank: int, key: str, active) -> None:
        """Coordinator: `rank` arrived at `key` (a control-server thread waits
        here; the caller proved it is `rank`)."""
        if rank not in self.everyone or rank == self.ctx.rank:
            raise BadRequest(f"rank {rank} is not another rank of this plan", peer=rank)
        self._arrive(key, rank, self.ctx.timeout, active)

    def _arrive(self, key: str, rank: int, timeout: float, active=lambda: True) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            if key not in self.open and len(self.open) >= MAX_OPEN_BARRIERS:
                raise TooManyBarriers(f"more than {MAX_OPEN_BARRIERS} barriers open at once")
            entry = self.open.setdefault(key, [set(), 0])
            entry[0].add(rank)
            self._cv.notify_all()
            try:
                while not self.everyone <= entry[0]:
                    remaining = deadline - time.monotonic()
                    if rank == self.ctx.rank:
                        try:
                            self.ctx.check_abort()
                        except BaseException:
                            entry[0].discard(rank)
                            raise
                    if remaining <= 0 or self.live.error or not active():
                        entry[0].discard(rank)
                        raise self.live.error or PeerLost(
                            f"barrier {key!r}: ranks {sorted(self.everyone - entry[0])} "
                            f"did not arrive within {timeout:.0f} s")
                    self._cv.wait(min(remaining, 0.2))
            finally:
                entry[1] += 1
                if entry[1] >= len(self.everyone) or not entry[0]:
                    self.open.pop(key, None)
