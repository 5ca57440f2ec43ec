"""Synchronous data parallelism: the ring all-reduce of gradients over an analyzed plan,
the executor's Python twin of contract.Ring.

    ring = RingAllReduce(session, analyze(model, "allreduce", workers))
    grads = ring.allreduce_arrays(keys, arrays)     # numpy, averaged over workers

(graph/ring_tape.py hands it TensorFlow's tensors and variables, eagerly and
inside tf.function.)

(`import tf_plugin as hvd` is the Horovod API; it runs this ring too, over a
plan grown from the step, see core/collectives.py.)

The ring: each bucket (one gradient, or with fusion gradients of a dtype
laid end to end up to a threshold, see core/layout.buckets_of) is cut into N chunks
(schedule.ring_bounds). Reduce-scatter (N-1 steps): every rank writes one
chunk into its right neighbour's preallocated slot, which adds it to its own
copy of that chunk *directly into the registered staging buffer of its next
write*; after N-1 steps each rank holds one chunk summed over all ranks.
All-gather (N-1 steps) passes the summed chunks around. Every chunk of every
step is its own TensorSpec, so each is one one-sided write, with no control
message.

Passes over the bytes: a bucket is never copied together. Its gradients stay
in TensorFlow's buffers and the ring reads the bucket through them
(BucketView): the chunk this rank sends first leaves from its members in one
gather write (Pieces: shm copies each straight into the peer's slot, tcp
hands them to one sendmsg, verbs copies them once into registered staging),
and the chunks it adds to are added straight from its members. Fusion still
makes fewer, larger writes (on tcp the per-write cost dominates small models).
An average is the sum times 1/N (times any postscale), computed as Horovod
does (core/scaling.py): float32 and float64 sums are added
and multiplied in one pass (rdmatensor.streaming, with streaming stores for
large chunks: the all-gather reads them back from memory anyway), other
dtypes block by block right after each block is added, while it is still in
cache. Dividing before the sum would be as cheap but round differently. Partial sums land in staging, the
complete sum of this rank's chunk straight in the output, which the
all-gather sends from; every other chunk is copied once from its slot into
the output (and, when N > 2, forwarded from there). On verbs each output
buffer is registered once, when allocated, so those writes leave from it
with no copy into staging; an output is leased again only once no write
still reads it (_lease). The outputs are 64-byte
aligned buffers reused once TensorFlow freed the previous step's
(core/buffers.Reused), and reach TensorFlow with no copy (DLPack, or
numpy_function's output).

Eagerly, every bucket's ring advances in lockstep on the calling thread
(allreduce). Inside tf.function (RingGradientTape) each bucket is handed to
the communication thread (comm_thread.py) as soon as its gradients exist
(graph/overlap.py) and its ring (reduce_bucket) runs while backprop goes on.

No TensorFlow, and nothing of the planner: the plan is read through the
fields contract.AnalyzedPlan names, the chunks as schedule.py lays them out.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

from rdmatensor import HeldPieces, streaming

from ..core import scaling
from ..core.buffers import Reused
from ..core.meter import Meter
from ..core.timeline import Timeline
from .comm_thread import CommThread
from .contract import AnalyzedPlan, Ring
from .schedule import ring_bounds, ring_chunk, ring_name


BLOCK = 1 << 16       # elements summed then divided at a time: about L2-sized, so the divide is nearly free


class BucketView:
    """A bucket read as one flat array of `size` elements from its members where
    they are: what the ring sends and adds from, so that a fused bucket is never
    copied together first. The alignment padding between members reads as zeros."""

    def __init__(self, size: int, dtype, parts: list):
        self.size, self.dtype = size, np.dtype(dtype)
        self._parts = parts                          # [(start, flat member)], in order
        self._starts = [start for start, _ in parts]
        ends = [start + member.size for start, member in parts]
        gaps = [b - a for a, b in zip([0, *ends], [*self._starts, size], strict=True)]
        self._zeros = np.zeros(max(gaps, default=0), self.dtype)     # the longest padding (under 64 bytes)

    @classmethod
    def of(cls, array: np.ndarray) -> "BucketView":
        return cls(array.size, array.dtype, [(0, array.reshape(-1))])

    def cover(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """Elements [lo, hi) as (position from lo, contiguous piece), padding as zeros, in order."""
        out, at = [], lo
        for start, member in self._parts[max(bisect_right(self._starts, lo) - 1, 0):]:
            if start >= hi:
                break
            end = min(hi, start + member.size)
            if end <= at:
                continue
            if start > at:
                out.append((at - lo, self._zeros[:start - at]))
                at = start
            out.append((at - lo, member[at - start:end - start]))
            at = end
        if at < hi:
            out.append((at - lo, self._zeros[:hi - at]))
        return out

    def source(self, lo: int, hi: int) -> HeldPieces:
        """What a write of elements [lo, hi) leaves from, one piece or several: held
        (the ring waits for the write before it returns: _inputs_read), so that
        verbs may write the large ones from where they are."""
        return HeldPieces(p for _, p in self.cover(lo, hi))


class RingAllReduce(Ring):
    """contract.Ring in Python, over rdmatensor's session."""

    def __init__(self, session, analysis: AnalyzedPlan, meter: Meter | None = None, average: bool = True,
                 combine=np.add, scale: float | None = None):
        # combine: how two ranks' values make one (np.add; np.minimum, np.maximum, np.multiply).
        # scale: the factor the combined values are multiplied by (Horovod's postscale, which
        # holds an average's 1/N); default 1/N when `average`, else none.
        self.session, self.analysis, self.combine = session, analysis, combine
        self.meter = meter or Meter()
        self.rank, self.size = session.rank, analysis.workers
        self.factor = scale if scale is not None else (1.0 / self.size if average else None)
        self.factor = None if self.factor == 1.0 else self.factor
        self.average = self.factor is not None        # whether the combined values are scaled
        self.shapes = {v.key: v.shape for v in analysis.variables}
        # a bucket's output buffers, reused once TensorFlow let go of them
        self._outputs = {b.key: Reused(b.size, b.dtype, self.meter.tally, self._writes_leave_from)
                         for b in analysis.buckets}
        self._in_flight: dict = {}    # bucket key -> the sends its last ring made from its output
        self._comm = None       # the communication thread of the in-graph ring (RingGradientTape)

    def _writes_leave_from(self, output: np.ndarray) -> None:
        """A new output buffer: the all-gather writes from it, so verbs registers it
        (local access only) and those writes need no copy into staging."""
        register = getattr(self.session, "register_source", None)
        if register is not None:
            register(output)

    def _lease(self, key: str) -> np.ndarray:
        """An output buffer for bucket `key`, once no write of its last ring still reads one
        (a posted write from the output must not see it change, even on a retransmission)."""
        sent = self._in_flight.pop(key, None)
        if sent:
            self.session.wait_sent(sent)
        return self._outputs[key].lease()

    # ------------------------------------------------------------- all-reduce
    def allreduce_arrays(self, keys, arrays, average: bool = True) -> list[np.ndarray]:
        """Average (or with average=False, sum) numpy gradients over the workers
        (`keys` name them as in the plan), every bucket at once on this thread.

        A fused bucket is read from its members where they are; its output
        members are 64-byte aligned views, fit for TensorFlow with no copy.
        Every ring step writes the chunks of all buckets before waiting for
        any: 2(N-1) round trips per step, however many buckets there are."""
        by_key = {k: np.ascontiguousarray(a) for k, a in zip(keys, arrays, strict=False)}
        buckets = self.analysis.buckets
        flats = [self._flat(b, [by_key[key] for key, _, _ in b.members], average) for b in buckets]
        with self.meter.comm():
            outs = self._ring([b.key for b in buckets], [f for f, _ in flats],
                              [self._lease(b.key) for b in buckets], [d for _, d in flats])
        result = {}
        for b, out in zip(buckets, outs, strict=True):
            result.update(zip((key for key, _, _ in b.members), b.split(out, self.shapes), strict=True))
        return [result[k] if k in result else np.zeros_like(by_key[k]) for k in keys]

    def reduce_bucket(self, j: int, arrays: list, tag: int = 0) -> np.ndarray:
        """Bucket j's ring alone (its members' arrays in order), averaged unless the
        ring was made with average=False: what the communication thread runs.
        Every write carries `tag`, and only values with it are taken (the call's
        number: see core/collectives.py). Returns the bucket's flat output (its
        members: Bucket.split)."""
        b = self.analysis.buckets[j]
        flat, divide = self._flat(b, [np.ascontiguousarray(a) for a in arrays], self.average)
        (out,) = self._ring([b.key], [flat], [self._lease(b.key)], [divide], tag)
        return out

    def _flat(self, bucket, arrays: list, average: bool) -> tuple[BucketView, bool]:
        """The bucket as one flat array (a view over its members where they are),
        and whether its sum over the ranks is to be divided by N."""
        return BucketView(bucket.size, bucket.dtype, [(offset, a.reshape(-1)) for (_, offset, _), a
                                                      in zip(bucket.members, arrays, strict=True)]), average

    def _ring(self, keys: list, flats: list, outs: list, divide: list, tag: int = 0) -> list[np.ndarray]:
        """Sum the flat arrays over the ranks into `outs` (divided by N where
        `divide` says so): one ring over every rank, or with a hierarchy, the
        ring of this host, the ring across hosts, and this host's ring again."""
        if self.size == 1:
            for f, o in zip(flats, outs, strict=False):
                for at, piece in f.cover(0, f.size):
                    o[at:at + piece.size] = piece
            return outs
        hierarchy = self.analysis.hierarchy
        # per array, the sends that left from its output (see _lease): recorded as they go, so a
        # ring that fails half-way still has its next lease wait for them
        sent = [[] for _ in keys]
        self._in_flight.update(zip(keys, sent, strict=True))
        if hierarchy is None:
            group = tuple(range(self.size))
            held = self._reduce_scatter(group, keys, flats, outs, divide, tag)
            self._all_gather(group, keys, outs, held, tag, sent)
            self._inputs_read(keys, flats)
        else:
            local, cross = hierarchy.local(self.rank), hierarchy.cross(self.rank)
            lkeys, xkeys = [f"{k}/local" for k in keys], [f"{k}/cross" for k in keys]
            # this host's sum of one chunk lands in the output, whose chunk the ranks across hosts then
            # all-reduce in place
            held = self._reduce_scatter(local, lkeys, flats, outs, [False] * len(flats), tag)
            chunks = [held.get(i, o[:0]) for i, o in enumerate(outs)]
            views = [BucketView.of(c) for c in chunks]      # added to in place
            cross_held = self._reduce_scatter(cross, xkeys, views, chunks, divide, tag)
            # its first write left from the output, where the all-gather now receives: it must be done
            first = {i: ring_name(xkeys[i], "rs", 0, self.rank) for i in cross_held}
            for i, name in first.items():
                sent[i].append(name)
            self.session.wait_sent(list(first.values()))
            self._all_gather(cross, xkeys, chunks, cross_held, tag, sent)
            self._all_gather(local, lkeys, outs, held, tag, sent)
            if len(local) > 1:
                self._inputs_read(lkeys, flats)
        return outs

    def _inputs_read(self, keys: list, flats: list) -> None:
        """Wait for the reduce-scatter's first writes, the only ones that leave from the
        caller's arrays (on verbs, their large pieces registered for that write alone,
        deregistered here): the caller may reuse them once the ring returns."""
        self.session.wait_sent([ring_name(keys[i], "rs", 0, self.rank) for i, f in enumerate(flats) if f.size])

    def _reduce_scatter(self, group, keys: list, flats: list, outs: list, divide: list, tag: int) -> dict:
        """The reduce-scatter of a ring over `group` (global ranks in ring order):
        returns, per live array, this rank's complete chunk, in its output. The
        last step adds straight into that chunk of the output; a partial sum
        lands where the next write leaves from."""
        s, n, me = self.session, len(group), self.rank
        p, left = group.index(me), group[group.index(me) - 1]
        live = [i for i, f in enumerate(flats) if f.size]
        bounds = {i: [slice(lo, hi) for lo, hi in ring_bounds(flats[i].size, n)] for i in live}
        factor = self._after_sum()

        def finish(chunk):                 # this rank's fully combined chunk, in place, as Horovod scales
            scaling.scale_into(chunk, chunk, factor)

        first = ring_chunk("rs", 0, p, n)
        outgoing = {i: flats[i].source(bounds[i][first].start, bounds[i][first].stop) for i in live}
        for step in range(n - 1):
            s.send_many([(ring_name(keys[i], "rs", step, me), outgoing[i]) for i in live], tag=tag)
            c = ring_chunk("rs", step, p, n, receiving=True)        # the last step: chunk p + 1, complete
            for i in live:
                last = step == n - 2
                dst = outs[i][bounds[i][c]] if last else s.buffer(ring_name(keys[i], "rs", step + 1, me))
                with s.recv(ring_name(keys[i], "rs", step, left), tag=tag) as chunk:
                    self._combine_into(dst, flats[i], bounds[i][c].start, chunk, finish if last and divide[i] else None)
                outgoing[i] = dst
        return outgoing

    def _after_sum(self) -> float:
        """What a finished chunk is multiplied by: the ring's factor, else (allreduce_arrays
        asked to average on a ring made without one) 1/N."""
        return self.factor if self.factor is not None else 1.0 / self.size

    def _combine_into(self, dst: np.ndarray, flat: BucketView, lo: int, chunk: np.ndarray, finish) -> None:
        """dst = this rank's elements [lo, lo + dst.size) of `flat` combined with the
        peer's `chunk`, then finish(dst) (the division by N) where one is given."""
        if self.combine is np.add and dst.dtype in streaming.FLOATS:     # added and divided in one pass
            scale = scaling.in_dtype(self._after_sum(), dst.dtype) if finish else None    # as finish() multiplies
            stream = dst.nbytes >= streaming.STREAM_BYTES
            for at, piece in flat.cover(lo, lo + dst.size):
                part = slice(at, at + piece.size)
                streaming.add(dst[part], piece, chunk[part], scale, stream)
            return
        block = BLOCK if finish else max(dst.size, 1)      # divided block by block, while still in cache
        for b in range(0, dst.size, block):
            for at, piece in flat.cover(lo + b, min(lo + b + block, lo + dst.size)):
                part = slice(b + at, b + at + piece.size)
                self.combine(piece, chunk[part], out=dst[part])
            if finish:
                finish(dst[b:b + block])

    def _all_gather(self, group, keys: list, outs: list, held: dict, tag: int, sent: list) -> None:
        """The all-gather of a ring over `group`, from this rank's complete chunks
        (`held`, in the outputs): every other chunk is copied once out of its
        receive slot into the output, and forwarded from there. The names it
        sends from outs[i] are added to sent[i]."""
        s, n, me = self.session, len(group), self.rank
        p, left = group.index(me), group[group.index(me) - 1]
        live = sorted(held)
        bounds = {i: [slice(lo, hi) for lo, hi in ring_bounds(outs[i].size, n)] for i in live}
        outgoing = dict(held)
        for step in range(n - 1):
            names = [ring_name(keys[i], "ag", step, me) for i in live]
            s.send_many(list(zip(names, (outgoing[i] for i in live), strict=True)), tag=tag)
            for i, name in zip(live, names, strict=True):
                sent[i].append(name)
            c = ring_chunk("ag", step, p, n, receiving=True)
            for i in live:
                dst = outs[i][bounds[i][c]]
                with s.recv(ring_name(keys[i], "ag", step, left), tag=tag) as chunk:
                    streaming.copy(dst, chunk)         # read next by the optimizer, from memory
                outgoing[i] = dst                  # forwarded next step (N > 2) from the output itself

    def launch(self, j: int, arrays: list) -> int:
        """Hand bucket j's gradients to the communication thread (in a graph: see
        RingGradientTape); the round's number, for collect."""
        if self._comm is None:
            self._comm = CommThread(self.rank, self.session.timeout, self.meter, Timeline.from_env(self.rank))
        return self._comm.launch("gradients", j, arrays, len(self.analysis.buckets), self.reduce_bucket,
                                 self.describe)

    def collect(self, j: int, number: int | None = None) -> np.ndarray:
        """Bucket j's averaged gradients, once its ring is done: its flat output,
        which TensorFlow takes with no copy (64-byte aligned), its members as views:
        each counted as a zero-copy receive, as allreduce() counts them."""
        out = self._comm.collect("gradients", j, number)
        self.meter.tally["zero_copy"] += len(self.analysis.buckets[j].members)
        return out

    def describe(self, j: int) -> dict:
        """What bucket j holds, for the time line and errors."""
        b = self.analysis.buckets[j]
        return {"bucket_key": b.key, "tensors": len(b.members), "bytes": b.size * b.dtype.itemsize}

    def close(self) -> None:
        """Stop the communication thread, if one was started (idempotent)."""
        if self._comm is not None:
            self._comm.close()
