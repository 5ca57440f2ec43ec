"""The sender's data path: check the array, take the slot's credit, write.

A static tensor (no checksum) goes in one one-sided write straight from
wherever it is: the staging buffer the user filled (buffer()), or the user's
own array where the provider can write from it (any memory; on verbs,
memory registered with register_source()); otherwise it is copied into
staging first. A static tensor may also be given as Pieces,
arrays of its dtype whose elements, end to end, are the tensor's (a gather
write: the ring's fused buckets), written from where they are, or on verbs
copied once into staging; HeldPieces, which their sender keeps unchanged
until wait_sent(), have each piece of RDMATENSOR_VERBS_REGISTER_MIN bytes or
more registered for that write alone instead (deregistered once it
completed), the smaller ones copied into their place in staging. Dynamic tensors and checksummed plans go as one
write from staging laid out by wire.encode(). A posted write (verbs) may
still read staging after send() returns, so staging is reused only once that
write completed.
"""
from __future__ import annotations


import numpy as np

from .. import environment
from ..errors import PeerLost, RdmaTensorError, SendTimeout, TensorMismatch, UnknownTensor, UsageError
from ..plan import TensorSpec
from ..providers.contract import INDEX_BITS, MAX_TAG, HeldPieces, Pieces
from . import wire
from .context import SessionContext, count_copy
from .credits import Credits, SendSlot
from .growth import Growth
from .liveness import Liveness


BATCH = 32      # send_many() posts its queue once it holds this many writes (one chain on verbs)
# A piece of a gather write at least this large is registered for its write
# (on verbs) instead of copied into staging: registering and deregistering it
# cost less than copying it in the SoftRoCE VM from 64 KiB up (bench/registration_cost.py).
REGISTER_MIN = int(environment.get("RDMATENSOR_VERBS_REGISTER_MIN", str(256 << 10)))


def tag_bits(tag: int) -> int:
    """A write's tag, as its bits in a DATA immediate."""
    if not 0 <= tag <= MAX_TAG:
        raise UsageError(f"a write's tag is an integer in 0..{MAX_TAG}, not {tag!r}")
    return tag << INDEX_BITS


def _shape_str(shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _fits(spec: TensorSpec, array) -> bool:
    """Whether `array`, not an ndarray, is a value of `spec`: Pieces of a static tensor."""
    return (isinstance(array, Pieces) and spec.is_static
            and all(isinstance(p, np.ndarray) and p.dtype == spec.dtype and p.flags.c_contiguous for p in array)
            and sum(p.nbytes for p in array) == spec.nbytes)


class Sender:
    def __init__(self, ctx: SessionContext, credits: Credits, growth: Growth, live: Liveness):
        self.ctx, self.credits, self.growth, self.live = ctx, credits, growth, live
        self._looks: dict = {}           # peer -> its channel's waiter(), or None

    def _slot(self, name: str) -> tuple[TensorSpec, SendSlot]:
        self.live.check()
        spec = self.ctx.spec(name)
        st = self.credits.send.get(name)
        if st is None:
            raise UnknownTensor(f"rank {self.ctx.rank} does not send {name!r} (rank {spec.src} does)", tensor=name)
        return spec, st

    def buffer(self, name: str) -> np.ndarray:
        """The registered staging array of a static tensor; waits until no write still reads it.
        A send() of it makes it read-only until this hands it out again: on verbs the NIC
        still reads it after send() returns, and a refill then would reach the receiver torn
        (numpy's "assignment destination is read-only" instead, on every provider alike)."""
        spec, st = self._slot(name)
        if not spec.is_static:
            raise UsageError(f"{name!r} has a dynamic shape: it has no fixed staging buffer", tensor=name)
        self.source_free(st)
        if st.view is None:              # one array, so that send() knows it at a glance
            st.staging_bytes = st.staging[:spec.nbytes]
            if st.raw:
                st.post = self.ctx.channels[st.peer].prepare_write(st.region, st.offset, st.staging_bytes, st.imm)
            st.view = st.staging_bytes.view(spec.dtype).reshape(spec.shape)
            st.seal = st.view.setflags
        else:
            st.seal(True)
        return st.view

    def source_free(self, st: SendSlot) -> None:
        """Wait until the previous write no longer reads this slot's staging memory,
        nor memory registered for it alone, which is then deregistered."""
        if st.pending is not None:
            self.ctx.channels[st.peer].wait(st.pending, self.ctx.timeout)
            st.pending = None
        if st.borrowed:
            self._give_back(st)

    def _give_back(self, st: SendSlot) -> None:
        """Deregister what was registered for the slot's last write. It ran while this
        side still holds the memory (st.borrowed keeps it alive), so a registration
        never outlives what it maps."""
        ch = self.ctx.channels[st.peer]
        borrowed, st.borrowed = st.borrowed, []
        for buf in borrowed:
            ch.deregister_source(buf)

    def wait_sent(self, names) -> None:
        """Wait until no write of these tensors still reads its source."""
        for name in names:
            self.source_free(self._slot(name)[1])

    def flush(self) -> None:
        """Wait until every posted write completed, so close() cuts none off
        (a write that failed, or whose peer is gone, has nothing left to wait for)."""
        for st in self.credits.send.values():
            try:
                self.source_free(st)
            except RdmaTensorError:
                st.pending = None

    def send(self, name: str, array, timeout: float | None = None, tag: int = 0) -> None:
        st = self.credits.send.get(name)
        if st is None or not ((array is st.view and array is not None)     # its own staging: matches by making
                              or (st.spec.matches(array) if isinstance(array, np.ndarray)
                                  else _fits(st.spec, array))):
            self._refuse(name, array)
        imm = st.imm | tag_bits(tag) if tag else st.imm
        live = self.live
        if st.credit.is_set() and live.error is None and st.peer not in live.peer_errors:
            st.credit.clear()            # Credits.take(), when the credit is here and nothing failed
        else:
            self.credits.take(st, timeout)
        # Counted per slot while this thread holds its credit (no other can),
        # and before the write, after which the credit may come back at once.
        st.writes += 1
        st.bytes_sent += array.nbytes
        if array is st.view:
            st.seal(False)               # refilled only once buffer() waited for this write
        try:
            if array is st.view and st.raw:      # the common case, kept short: filled in place, no header
                st.pending = ((not tag and st.post is not None and st.post())
                              or self.ctx.channels[st.peer].write(st.region, st.offset, st.staging_bytes, imm))
            else:
                self._write(st, st.spec, array, imm)
        except BaseException as exc:
            st.writes -= 1
            st.bytes_sent -= array.nbytes
            self.credits.keep(st)
            if st.borrowed and st.pending is None:
                self._give_back(st)
            if isinstance(exc, PeerLost):
                # A write that finds its peer gone reports the loss like any other: it
                # sticks, watchers hear it, and this call raises what every later one will.
                self.ctx.channels[st.peer].lost(exc)
                self.live.check()
                self.live.check(st.peer)
            raise
        self._look(st.peer)

    def _look(self, peer: int) -> None:
        """After a write, take in this channel's completions and credits on this thread
        (its waiter(None)), so that its background thread is not woken for each: on
        SoftRoCE that thread takes the CPU the sender's NIC runs on. What it finds
        wrong becomes the channel's error, which the next call reports."""
        look = self._looks.get(peer, False)
        if look is False:
            look = self._looks[peer] = self.ctx.channels[peer].waiter()
        if look is not None:
            try:
                look(None)
            except RdmaTensorError:
                pass

    def wait_released(self, names, timeout: float | None = None) -> None:
        for name in names:
            _, st = self._slot(name)
            if not st.credit.is_set():
                timeout = self.ctx.timeout if timeout is None else timeout
                if not self.ctx.channels[st.peer].wait_for(st.credit, timeout):
                    raise SendTimeout(f"{name!r}: rank {st.peer} did not take the value within {timeout:.1f} s",
                                      peer=st.peer, tensor=name)
            self.live.check(st.peer)

    def send_many(self, items, timeout: float | None = None, tag: int = 0) -> None:
        """send() of each (name, array), in order (any bad one refuses the call
        before anything goes). Static tensors without a checksum are queued, each
        from its source (staging it was filled in, a copy there, or the array
        itself where the provider writes from any memory), and written together
        per peer with write_many(), as soon as BATCH are queued (so the receiver
        starts on them while the rest are prepared) and before anything that
        must wait or go alone, so no credit is waited for while it holds writes."""
        bits = tag_bits(tag)
        slots = []
        send = self.credits.send
        for name, array in items:                  # bad input refuses the whole call: nothing goes
            st = send.get(name)
            if st is None or not ((array is st.view and array is not None)
                                  or (st.spec.matches(array) if isinstance(array, np.ndarray)
                                      else _fits(st.spec, array))):
                self._refuse(name, array)
            slots.append((st, name, array))
        live = self.live
        queued: dict[int, list] = {}        # peer -> [(slot, source, immediate)], in order
        count = 0
        try:
            for st, name, array in slots:
                if not st.raw:
                    self._write_queued(queued)
                    count = 0
                    self.send(name, array, timeout, tag)
                    continue
                if not st.credit.is_set():         # (a queued slot's credit is taken: a repeat lands here too)
                    self._write_queued(queued)     # the receiver may need them to give this credit back
                    count = 0
                if st.credit.is_set() and live.error is None and st.peer not in live.peer_errors:
                    st.credit.clear()              # Credits.take(), when the credit is here and nothing failed
                else:
                    self.credits.take(st, timeout)
                try:
                    if array is st.view:
                        st.seal(False)             # as send() does
                    src = st.staging_bytes if array is st.view else self._source(st, array)
                except BaseException:
                    self.credits.keep(st)
                    raise
                pairs = queued.get(st.peer)
                if pairs is None:
                    pairs = queued[st.peer] = []
                pairs.append((st, src, st.imm | bits))
                count += 1
                if count >= BATCH:                 # a full chain goes now: the receiver starts on it
                    self._write_queued(queued)
                    count = 0
            self._write_queued(queued)
        finally:
            for pairs in queued.values():          # taken but not written (an error on the way)
                for st, _, _ in pairs:
                    self.credits.keep(st)

    def _write_queued(self, queued: dict) -> None:
        """Write every queued (slot, source, immediate), one write_many() per
        peer; a peer's slots leave `queued` once their writes are posted."""
        for peer in list(queued):
            pairs = queued[peer]
            writes = []
            for st, src, imm in pairs:             # counted before the write, as send() does
                st.writes += 1
                st.bytes_sent += st.spec.nbytes
                writes.append((st.region, st.offset, src, imm))
            try:
                handles = self.ctx.channels[peer].write_many(writes)
            except BaseException as exc:
                for st, _, _ in pairs:
                    st.writes -= 1
                    st.bytes_sent -= st.spec.nbytes
                if isinstance(exc, PeerLost):
                    self.ctx.channels[peer].lost(exc)
                    self.live.check()
                    self.live.check(peer)
                raise
            del queued[peer]
            for (st, _, _), handle in zip(pairs, handles, strict=True):
                st.pending = handle
            self._look(peer)

    def _refuse(self, name: str, array) -> None:
        """Why send() cannot take `array` for `name`, as the error to raise."""
        spec, _ = self._slot(name)
        if isinstance(array, Pieces):
            got = [f"{p.dtype} {_shape_str(p.shape)}" if isinstance(p, np.ndarray) else type(p).__name__
                   for p in array]
            raise TensorMismatch(f"{name!r}: expected pieces of {spec.dtype} holding {_shape_str(spec.shape)} "
                                 f"end to end, each contiguous, got {', '.join(got) or 'none'}", tensor=name)
        if not isinstance(array, np.ndarray):
            raise TensorMismatch(f"{name!r}: expected a numpy array, got {type(array).__name__}", tensor=name)
        raise TensorMismatch(f"{name!r}: expected {spec.dtype} {_shape_str(spec.shape)}, "
                             f"got {array.dtype} {_shape_str(array.shape)}", tensor=name)

    def _write(self, st: SendSlot, spec: TensorSpec, array: np.ndarray, imm: int) -> None:
        ctx = self.ctx
        ch = ctx.channels[st.peer]
        if wire.is_raw(spec, ctx.plan):
            if spec.nbytes == 0:
                ch.notify(imm)
            else:
                st.pending = ch.write(st.region, st.offset, self._source(st, array), imm)
        else:
            if isinstance(array, Pieces):            # framed (checksum): one array first
                array = np.concatenate([p.reshape(-1) for p in array]).reshape(spec.shape)
            need = wire.frame_bytes(spec, ctx.plan, array.nbytes)
            if need > st.capacity:
                self.growth.request(st, need)
            self.source_free(st)
            need, copied = wire.encode(spec, ctx.plan, array, st.staging)
            if copied:
                count_copy(ctx.counters, "frame", array.nbytes)
            st.pending = ch.write(st.region, st.offset, st.staging[:need], imm)
            if not spec.is_static:
                ctx.counters.add("dynamic", "fallbacks")

    def _gather(self, st: SendSlot, ch, pieces: HeldPieces, staging: np.ndarray):
        """HeldPieces for a channel that writes only from registered memory: a piece of
        REGISTER_MIN bytes or more is written from where it is, registered for this
        write alone unless it is already; runs of smaller ones are copied into their
        place in staging. The result, end to end, is the tensor."""
        out, at, run, copied = [], 0, None, 0
        for p in pieces:
            flat = p.reshape(-1).view(np.uint8)
            n = flat.nbytes
            if n and (n >= REGISTER_MIN or ch.writes_from(flat)):
                if run is not None:
                    out.append(staging[run:at])
                    run = None
                if not ch.writes_from(flat):
                    ch.register_source(flat)
                    st.borrowed.append(flat)
                out.append(flat)
            elif n:
                staging[at:at + n] = flat
                copied += n
                run = at if run is None else run
            at += n
        if run is not None:
            out.append(staging[run:at])
        if copied:
            count_copy(self.ctx.counters, "gather", copied)
        return out[0] if len(out) == 1 else Pieces(out)

    def _source(self, st: SendSlot, array: np.ndarray) -> np.ndarray:
        """Where a static tensor's write reads from, copying into staging only if it must."""
        staging = st.staging[:array.nbytes]
        if array is st.view:
            return staging                           # filled in place: no copy
        if isinstance(array, Pieces):
            ch = self.ctx.channels[st.peer]
            if not ch.capabilities.needs_registered_source:
                if len(array) == 1:                  # one array after all: its own path (shm's ring)
                    return array[0].reshape(-1).view(np.uint8)
                return Pieces(p.reshape(-1).view(np.uint8) for p in array)     # a gather write, no copy
            self.source_free(st)
            if not isinstance(array, HeldPieces):
                count_copy(self.ctx.counters, "gather", staging.nbytes)
                return array.into(staging)           # one copy: the caller may change them once send() returns
            return self._gather(st, ch, array, staging)
        if array.flags.c_contiguous and self.ctx.channels[st.peer].writes_from(array):
            return array.reshape(-1).view(np.uint8)  # written straight from the array (registered, on verbs)
        self.source_free(st)
        np.copyto(staging.view(array.dtype).reshape(array.shape), array)
        count_copy(self.ctx.counters, "array", array.nbytes)
        return staging
