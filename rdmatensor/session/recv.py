"""The receiver's data path: wait for a slot's value and lend it out as a
read-only view of the receive arena itself (zero copies); releasing the view
gives the slot's credit back to the sender."""
from __future__ import annotations

import numpy as np

from ..errors import CallMismatch, IntegrityError, RecvTimeout, TransportError, UnknownTensor, UsageError
from . import slots, wire
from .context import SessionContext
from .credits import Credits, RecvSlot
from .liveness import Liveness


class _Received:
    """A received tensor: a read-only view of the receive arena itself.

    Use as a context manager (`with session.recv(name) as array:`); leaving
    the block (or `release()`) hands the slot back to the sender. (Compiled
    in _slots.c, as the slots are: building one and releasing it are two
    calls per received tensor.)"""
    __slots__ = ("_credits", "_state", "array", "name", "tag", "__weakref__")

    def __init__(self, credits: Credits, state: RecvSlot, array: np.ndarray):
        self._credits, self._state, self.array = credits, state, array
        self.name, self.tag = state.name, state.tag
        state.recvs += 1                 # per slot: only the thread that took the value counts it
        state.bytes_received += array.nbytes

    def release(self) -> None:
        if self._state is None:
            return
        state, self._state = self._state, None
        self.array = None
        self._credits.give_back(state)

    @property
    def released(self) -> bool:
        return self._state is None

    def __enter__(self) -> np.ndarray:
        if self._state is None:
            raise UsageError(f"tensor {self.name!r} was already released", tensor=self.name)
        return self.array

    def __exit__(self, *exc) -> None:
        self.release()


Received = slots.compiled.Received if slots.compiled else _Received


class Receiver:
    def __init__(self, ctx: SessionContext, credits: Credits, live: Liveness):
        self.ctx, self.credits, self.live = ctx, credits, live

    def recv(self, name: str, timeout: float | None = None, tag: int | None = None) -> Received:
        st = self.credits.recv.get(name)
        if st is not None and self.live.error is None and st.take():
            # A value was waiting and nothing failed: the common case in a step.
            array = st.view
            if array is not None and tag is None:     # _hand_out's common case, inline
                return Received(self.credits, st, array)
            return self._hand_out(st, tag)
        ctx = self.ctx
        if st is None:
            self.live.check()
            spec = ctx.spec(name)
            raise UnknownTensor(f"rank {ctx.rank} does not receive {name!r} (rank {spec.dst} does)", tensor=name)
        if st.state == st.HELD:
            self.live.check()
            raise UsageError(f"{name!r} is still held: release the previous view first", tensor=name)
        # The session's error; and the peer's unless a value is there (lost while a
        # previous value was held: nothing more will come; else it is delivered).
        self.live.check(st.peer if st.state != st.FULL else None)
        if not st.arrived.is_set():
            timeout = ctx.timeout if timeout is None else timeout
            if not ctx.channels[st.peer].wait_for(st.arrived, timeout):
                self.timed_out(st, name, timeout)
        if not st.take():                # woken by a failure, not by data
            self.live.check()
            self.live.check(st.peer)
            raise TransportError(f"{name!r}: woken without data", peer=st.peer, tensor=name)
        array = st.view
        if array is not None and tag is None:     # as above: the value it waited for, handed over at once
            return Received(self.credits, st, array)
        return self._hand_out(st, tag)

    def timed_out(self, st: RecvSlot, name: str, timeout: float) -> None:
        """Raise why nothing arrived: the peer's error, else RecvTimeout."""
        self.live.check(st.peer)
        raise RecvTimeout(f"{name!r} from rank {st.peer} did not arrive within {timeout:.1f} s",
                          peer=st.peer, tensor=name)

    def _hand_out(self, st: RecvSlot, tag: int | None) -> Received:
        """The value `st` holds (taken: HELD) as a Received, unless it carries
        another call's tag or fails its checks (then the slot goes back)."""
        if tag is not None and st.tag != tag:     # another call's value: never handed to this one
            got = st.tag
            self.credits.give_back(st)
            raise CallMismatch(f"{st.name!r} from rank {st.peer} carries tag {got}, not {tag}: the value belongs "
                               f"to another call (discarded)", peer=st.peer, tensor=st.name, got=got, expected=tag)
        array = st.view
        if array is None:
            ctx = self.ctx
            try:
                array = wire.decode(st.spec, ctx.plan, st.memory)
            except IntegrityError:
                ctx.counters.add("corrupt")
                self.credits.give_back(st)
                raise
            array.flags.writeable = False
            if wire.is_raw(st.spec, ctx.plan):
                st.view = array          # the bytes alone, always in the same place: one view will do
        return Received(self.credits, st, array)
