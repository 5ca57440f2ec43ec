"""The collective engine: a plan that grows from what the job actually calls.

Without a model in hand, the tensors a step moves are only known when it
runs. Each collective call names a tensor set (tensor_sets.py). The first
time a set is seen, every rank proposes it over the bootstrap channel; the
proposals are compared (a difference fails on every rank with PlanMismatch
naming the first differing tensor; names are not compared, as Keras numbers
layers per process), and the plan is extended: a new *generation*
(generations.py), the union of every set so far, connected as a fresh
session on ports the ranks agreed on in the same exchange. Buffers are
registered and addresses swapped once per generation; a set already in the
plan costs no control call, whatever the step. What each set becomes in the
plan, and how a call moves its values, is algorithms.py's; how an all-reduce
combines, reductions.py's.

The previous generation is closed once the next one is connected and the
communication thread has finished every ring on it: the new setup barrier
means every rank finished every other collective of the old one. This
module does not import TensorFlow until a ring is built.
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np

from rdmatensor import PeerLost, Plan, PlanMismatch, RdmaTensorError, UsageError, connect
from rdmatensor.providers.contract import MAX_TAG

from . import adasum, algorithms, scaling
from .algorithms import contiguous
from .layout import fusion_threshold
from ..executor.comm_thread import CommThread
from .bootstrap import Bootstrap, PortReservation
from .generations import COUNTED, Reset, Settled, collateral, disagreement, earliest_failure
from .meter import Meter
from .reductions import COMBINE, Reduction, allreduce_buckets, allreduce_op
from .tensor_sets import AllreduceGroup, Described, TensorSet, describe, entries_of, set_key
from .timeline import Timeline

TAGS = MAX_TAG + 1     # call numbers travel mod this in every write's tag


class Collectives:
    """This rank's view of the growing plan: tensor sets, the current generation's
    session, and allreduce / broadcast / allgather of numpy arrays through it.

    Every collective call has a number, counted alike on every rank (calls run
    in program order), and each of its writes carries the number as its tag
    (mod 4096): a value is handed only to the call it was written for (recv
    with tag=), and a value of this rank's call number in another tensor set's
    slot means the ranks called different collectives (checked_collectives.py watches for
    it). A call that fails after any value moved ends the generation on its
    rank: the session is closed, so every peer's wait on it ends too, and the
    ranks agree in one exchange on the earliest failed call (and on the next
    call's number) and connect a fresh generation with empty slots. Every
    rank's call raises. So no value outlives the call it was written for, and
    an error in one call never fails the next."""

    def __init__(self, bootstrap: Bootstrap, hosts: list[str], provider: str, token: str, timeout: float,
                 threshold: int | None = None, watch=lambda session: None, job_failure=lambda: None):
        self.bootstrap, self.hosts, self.watch = bootstrap, hosts, watch   # watch: each generation's session
        self.job_failure = job_failure            # () -> the lost rank's PeerLost once the job failed, else None
        self.rank, self.size = bootstrap.rank, bootstrap.size
        self.provider, self.token, self.timeout = provider, token, timeout
        self.threshold = fusion_threshold(threshold)     # bytes per all-reduce bucket
        self.meter = Meter()
        self.comm = CommThread(self.rank, timeout, self.meter,
                               Timeline.from_env(self.rank) if self.size > 1 else None)
        self.session = None
        self.generations = 0
        self.calls = 0                             # collective calls begun: the next one's number
        self.resets: list[Reset] = []
        self.seen: tuple | None = None            # (generation, why) the watchdog (checked_collectives.py) ended
        self._active: dict[int, tuple[int, int, list]] = {}   # tag -> (call number, set index, entries)
        self.waiting: dict[int, list] = {}         # call number -> [since, entries, attempts running] (stall check)
        self._sets: dict[tuple, TensorSet] = {}
        self._order: list[TensorSet] = []
        self._rings: dict[int, object] = {}       # set index -> RingAllReduce over the current session
        self._open_calls: dict[tuple, tuple] = {}  # all-reduce set key -> (its latest call's number, set)
        self._groups: dict[tuple, AllreduceGroup] = {}   # (set key, names) -> its all-reduce's layout
        self._retired_session = None
        self._retired = dict.fromkeys(COUNTED, 0)  # counters of closed generations
        self._lock = threading.RLock()             # one collective at a time per process
        # what lives as long as this plan (a native all-reduce group per tensor set, graph/native_allreduce.py):
        # closed with it, so an elastic reset, a shutdown or a removed process set closes them
        self.attached: dict = {}
        self.mender = None                         # graph/native_allreduce.Mender once a native group is attached
        self._retired_native = (0, 0)              # (calls, bytes moved) of closed native groups

    # ------------------------------------------------------------- calls
    def begin(self) -> int:
        """The next call's number (every rank numbers its calls alike)."""
        with self._lock:
            self.mend()
            number, self.calls = self.calls, self.calls + 1
            return number

    def mend(self) -> None:
        """A native all-reduce that failed (a wait timed out, the ranks all-reduced
        different things) broke its group out of Python's sight, and its peers
        reset from their side of that call (attempt). Before this rank's next
        call: the same reset, which makes every attached group afresh."""
        why = self.mender.broken(self.attached) if self.mender is not None and self.size > 1 else None
        if why is None:
            return
        lost = self.job_failure()
        if lost is not None:
            raise lost
        self._abandon(PlanMismatch(why))
        try:
            self._next_generation(self.calls, [], failed=why, cause=True)
        except Settled as settled:
            raise settled.error from None

    def attempt(self, number: int, body, entries: list):
        """Run call `number` (body(), which moves its values). If it fails after
        values may have moved, the generation is reset with every rank before the
        error is raised: the next call starts on empty slots, its number agreed."""
        generation = self.generations
        waiting = self.waiting.setdefault(number, [time.monotonic(), entries, 0])
        waiting[2] += 1
        try:
            return body()
        except Settled as settled:
            raise settled.error from None
        except RdmaTensorError as exc:
            lost = self.job_failure()
            if lost is not None:
                raise lost from exc
            try:
                reset = self._recover(number, generation, exc, entries)
            except Settled as settled:        # the reset's own exchange failed (a rank gone or silent)
                raise settled.error from exc
            raise self._failed(exc, reset) from exc
        finally:
            self._active.pop(number % TAGS, None)
            waiting[2] -= 1
            if not waiting[2]:
                self.waiting.pop(number, None)

    def _failed(self, exc: RdmaTensorError, reset: Reset) -> RdmaTensorError:
        """What a failed call raises: its own error where this rank saw the cause,
        else the cause as the rank that saw it reported it (the earliest failed
        call's: a later call cut off by the reset fails with it)."""
        if reset.rank == self.rank or not collateral(exc):
            return exc
        return PlanMismatch(f"rank {reset.rank}: {reset.why}", peer=reset.rank, tensor=exc.tensor)

    def active(self, number: int, ts: TensorSet, entries: list) -> int:
        """Mark call `number` as moving the values of `ts` (the watchdog's view), its
        tensors as this call names them (`entries`: a set is shared by every call that
        moves the same shapes and dtypes, whatever their names); its tag."""
        tag = number % TAGS
        self._active[tag] = (number, ts.index, entries)
        return tag

    def _recover(self, number: int, generation: int, exc: RdmaTensorError, entries: list) -> Reset:
        with self._lock:
            if self.generations != generation and self.resets:
                return self.resets[-1]          # another thread of this rank reset it since this call began
            self._abandon(exc)
            why = f"{describe(entries)} failed: {exc}"
            return self._next_generation(number, [], failed=why, cause=not collateral(exc))

    def _abandon(self, exc: RdmaTensorError) -> None:
        """End the current generation on this rank: whoever waits on it (a thread of
        this rank, a peer) stops waiting now."""
        session = self.session
        if session is not None and not session.closed:
            session.abort(exc if not isinstance(exc, PeerLost) else PlanMismatch(str(exc), peer=exc.peer))
            self._retire(session)

    # ------------------------------------------------------------ the plan
    def ensure(self, requests: list[tuple[str, str, list, list]], number: int | None = None) -> list[TensorSet]:
        """The tensor sets of `requests` (kind, op, names, arrays: arrays may be
        anything with .shape and .dtype), adding the missing ones to the plan in
        one exchange, as part of call `number` (default: the next call's).
        Every rank must make the same call."""
        if self.size == 1:
            return []
        with self._lock:
            keys = [set_key(k, op, names, arrays) for k, op, names, arrays in requests]
            missing = {key: req for key, req in zip(keys, requests, strict=True) if key not in self._sets}
            if not missing and self.session is not None:
                return [self._sets[key] for key in keys]
            reset = self._next_generation(self.calls if number is None else number, list(missing.items()))
            if reset is not None:          # a rank's call failed meanwhile: this one fails with it
                raise Settled(PlanMismatch(f"rank {reset.rank}: {reset.why}", peer=reset.peer_of(self.rank),
                                           tensor=requests[0][2][0] if requests[0][2] else None))
            return [self._sets[key] for key in keys]

    def _next_generation(self, number: int, missing, failed: str | None = None, cause: bool = False) -> Reset | None:
        """One exchange with every rank, then a new generation: the plan extended by
        `missing` (kind, op, names, arrays) when every rank proposes the same sets,
        or, when a rank reports a failed call (`failed`: why, on this rank), the
        same plan in fresh slots, and the earliest failed call as a Reset (`cause`:
        this rank saw why it failed, rather than a peer leaving or going quiet)."""
        proposal = [entries_of(k, op, names, arrays) for _, (k, op, names, arrays) in missing]
        hints = [[int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in arrays]
                 for _, (_, _, _, arrays) in missing]
        seen = self.seen[1] if self.seen is not None and self.seen[0] == self.generations else None
        proposing, self.seen = failed is None, None
        reservation = PortReservation(self.hosts[self.rank])
        reset = None
        try:
            payload = json.dumps({"sets": proposal, "hints": hints, "port": reservation.port, "call": number,
                                  "failed": failed or seen, "cause": cause or seen is not None}).encode()
            try:
                got = [json.loads(raw) for raw in self.bootstrap.allgather("plan", payload)]
            except RdmaTensorError as exc:   # no value moved: nothing to reset, and no rank to reset with
                raise Settled(exc) from exc
            numbers = [g["call"] for g in got]
            reset = earliest_failure(got)
            if reset is not None or len(set(numbers)) > 1:
                self.calls = max(numbers) + 1      # every rank numbers its next call alike again
            if reset is not None:
                missing = []
                if proposing:               # the others reset under this rank's proposal
                    self._abandon(PlanMismatch(f"rank {reset.rank}: {reset.why}", peer=reset.rank))
            else:
                problem = disagreement(got, proposal, self.rank)
                if problem:
                    raise Settled(PlanMismatch(problem))
            new = []
            for j, (key, (kind, op, _, _)) in enumerate(missing):
                ts = TensorSet(len(self._order) + len(new), kind, op, proposal[j])
                algorithms.lay_out(ts, [max(g["hints"][j][t] for g in got) for t in range(len(ts.entries))],
                                   self.hosts, self.size)
                new.append((key, ts))
            plan = Plan([s for ts in self._order + [t for _, t in new] for s in ts.specs])
            peers = {r: f"{self.hosts[r]}:{g['port']}" for r, g in enumerate(got)}
        finally:
            reservation.close()            # the new session's control server binds it now
        if reset is None and new and not any(ts.specs for _, ts in new):
            for key, ts in new:            # sets with no slots (a native all-reduce's): agreed, no new session
                self._sets[key] = ts
                self._order.append(ts)
            return None
        if reset is None:
            self.comm.drain()              # no ring still runs on the session being replaced
        session = connect(self.rank, peers, plan, provider=self.provider, token=self.token, timeout=self.timeout,
                          abort=self._stop_if_job_failed)
        self.watch(session)
        for key, ts in new:
            self._sets[key] = ts
            self._order.append(ts)
        if reset is None:
            self._retire(self.session)
        self.generations += 1              # first: the watchdog reads the session, then the generation
        self.session = session
        self._rings.clear()
        if reset is not None:
            self.resets.append(reset)
            if self.mender is not None:      # every rank, in one order: the groups a traced graph names, afresh
                self._retired_native = tuple(a + b for a, b in zip(self._retired_native,
                                                                   self._native_counters(self.attached), strict=True))
                self.mender.remake(self)
        return reset

    def _stop_if_job_failed(self) -> None:
        """A new generation's setup gives up as soon as the job lost a rank (the
        bootstrap session sees it within the peer timeout), not at the setup timeout."""
        lost = self.job_failure()
        if lost is not None:
            raise lost

    def _retire(self, session) -> None:
        if session is None or session is self._retired_session:
            return
        self._retired_session = session
        stats = session.stats()
        for k in COUNTED:
            self._retired[k] += stats.get(k, 0)
        session.close()

    # --------------------------------------------------------- collectives
    def allreduce_group(self, names, shapes, dtypes, op: str = "average", prescale: float = 1.0,
                        postscale: float = 1.0, scatter: bool = False) -> AllreduceGroup:
        """An all-reduce of tensors whose shapes are known ahead (a graph being
        built): its buckets, for launch() and collect()."""
        described = [Described(tuple(s), np.dtype(d)) for s, d in zip(shapes, dtypes, strict=True)]
        request = ("allreduce", allreduce_op(op, self.threshold, prescale, postscale, scatter), list(names),
                   described)
        key = set_key(*request)
        group = self._groups.get((key, tuple(names)))    # an eager call repeats its layout every step: derived once
        if group is None:
            if len(self._groups) >= 4096:
                self._groups.clear()
            group = self._groups[(key, tuple(names))] = AllreduceGroup(request, key, allreduce_buckets(shapes, dtypes,
                                                                                       self.threshold))
        return group

    def launch(self, group: AllreduceGroup, j: int, arrays: list) -> int:
        """Hand bucket j of the group's all-reduce to the communication thread; the
        round's number, for collect. The first bucket opens a call (and the first
        call of a new set plans it: every rank must make the same calls)."""
        prescale = Reduction.of(group.request[1]).prescale
        if prescale != 1.0:         # each rank's input, before the sum, as Horovod
            arrays = [scaling.scaled(np.asarray(a), prescale) for a in arrays]
        entries = entries_of(*group.request)     # this call's names (the set may have been planned under others)
        with self._lock:
            if j == 0 or group.key not in self._open_calls:
                number = self.begin()
                ts = self.attempt(number, lambda: self._sets.get(group.key) or self.ensure([group.request], number)[0],
                                  entries)
                self._open_calls[group.key] = (number, ts)
            number, ts = self._open_calls[group.key]

            def run(k: int, bucket: list, number=number, ts=ts):
                def body():
                    tag = self.active(number, ts, entries)
                    return self._ring(ts).reduce_bucket(k, bucket, tag=tag)
                return self.attempt(number, body, entries)

            return self.comm.launch(ts.index, j, arrays, len(ts.analysis.buckets), run, self._ring(ts).describe)

    def collect(self, group: AllreduceGroup, j: int, number: int | None = None) -> np.ndarray:
        """Bucket j's result of the round `number` (launch's; its flat output:
        group.members splits it), once its ring is done."""
        ts = self._sets.get(group.key)
        if ts is None:
            raise UsageError(f"rank {self.rank}: bucket {j} of an all-reduce collected before any launch")
        return self.comm.collect(ts.index, j, number)

    def allreduce(self, names, arrays, op: str = "average", prescale: float = 1.0, postscale: float = 1.0,
                  scatter: bool = False) -> list[np.ndarray]:
        """The arrays combined over the ranks by `op` (average, sum, min, max,
        product, or adasum: every rank's values gathered, then adasum.combine),
        each rank's input times `prescale` and the result times `postscale`, as
        Horovod scales (scaling.py); `scatter`: a reducescatter's, which is
        another collective to compare with. The outputs are 64-byte aligned
        arrays that stay untouched while anything refers to them."""
        arrays = [contiguous(a) for a in arrays]
        pre, post = scaling.factor(prescale), scaling.factor(postscale)
        if self.size == 1 or op == "adasum":
            if pre != 1.0:
                arrays = [scaling.scaled(a, pre) for a in arrays]
            out = arrays if self.size == 1 else self._adasum(names, arrays)
            after = post / self.size if op == "average" and self.size == 1 else post    # adasum: no 1/N
            return [scaling.scaled(o, after) if after != 1.0 else o for o in out]
        group = self.allreduce_group(names, [a.shape for a in arrays], [a.dtype for a in arrays], op, pre, post,
                                     scatter)
        if not group.buckets:
            self._present(group)
            return [np.zeros_like(a) for a in arrays]
        members = [[int(key) for key, _, _ in b.members] for b in group.buckets]
        rounds = [self.launch(group, j, [arrays[p] for p in positions]) for j, positions in enumerate(members)]
        out, error = [None] * len(arrays), None
        for j, positions in enumerate(members):     # every bucket collected, even after one failed
            try:
                flat = self.collect(group, j, rounds[j])
            except RdmaTensorError as exc:
                error = error or exc
                continue
            for p, result in zip(positions, group.members(j, flat), strict=True):
                out[p] = result
        if error is not None:
            raise error
        return [o if o is not None else np.zeros_like(a) for o, a in zip(out, arrays, strict=True)]

    def _adasum(self, names, arrays) -> list[np.ndarray]:
        from .buffers import aligned_empty
        rows = self.allgather([f"{n}/adasum" for n in names], [a.reshape(1, -1) for a in arrays])
        out = [aligned_empty(a.shape, a.dtype) for a in arrays]
        for o, r in zip(out, rows, strict=True):
            o.reshape(-1)[...] = adasum.combine(r)
        return out

    def _present(self, group: AllreduceGroup) -> None:
        """An all-reduce with nothing to reduce (every tensor empty) is still a
        call: it takes its number and its set, and one byte to and from every
        rank proves that every rank made this same call."""
        number = self.begin()

        def body():
            with self._lock, self.meter.comm():
                (ts,) = self.ensure([group.request], number)
                tag = self.active(number, ts, entries_of(*group.request))
                algorithms.present(self.session, f"s{ts.index}", tag, self.rank, self.size)

        self.attempt(number, body, entries_of(*group.request))

    def _ring(self, ts: TensorSet):
        ring = self._rings.get(ts.index)
        if ring is None or ring.session is not self.session:
            from ..executor.ring import RingAllReduce
            reduction = Reduction.of(ts.op)
            ring = self._rings[ts.index] = RingAllReduce(self.session, ts.analysis, self.meter, average=False,
                                                         combine=COMBINE[reduction.op],
                                                         scale=reduction.after_sum(self.size))
        return ring

    def broadcast(self, names, arrays, root: int) -> list[np.ndarray]:
        """Root's arrays on every rank (each rank passes arrays of the same shapes);
        on the root, its own arrays come back as they are, once every rank took them."""
        if not 0 <= root < self.size:
            raise ValueError(f"root_rank {root} is not a rank of this job (size {self.size})")
        if self.size == 1:
            return list(arrays)
        request = ("broadcast", str(root), names, arrays)
        number = self.begin()

        def body():
            with self._lock, self.meter.comm():
                (ts,) = self.ensure([request], number)
                tag = self.active(number, ts, entries_of(*request))
                return algorithms.broadcast(self.session, f"s{ts.index}", tag, self.rank, self.size, root, arrays,
                                            self.meter)

        return self.attempt(number, body, entries_of(*request))

    def allgather(self, names, arrays) -> list[np.ndarray]:
        """Every rank's arrays concatenated along the first dimension, in rank order
        (the first dimension may differ between ranks, the others may not)."""
        scalars = [n for n, a in zip(names, arrays, strict=True) if np.ndim(a) == 0]
        if scalars:
            raise ValueError(f"allgather needs tensors of rank >= 1, not scalars: {scalars}")
        if self.size == 1:
            return [contiguous(a) for a in arrays]
        request = ("allgather", "", names, arrays)
        number = self.begin()

        def body():
            with self._lock, self.meter.comm():
                (ts,) = self.ensure([request], number)
                tag = self.active(number, ts, entries_of(*request))
                return algorithms.allgather(self.session, f"s{ts.index}", tag, self.rank, self.size, arrays,
                                            self.meter)

        return self.attempt(number, body, entries_of(*request))

    def alltoall(self, name: str, array: np.ndarray, splits) -> tuple[np.ndarray, np.ndarray]:
        """Rows splits[d] of `array` (in order along the first dimension) go to rank d;
        returns what every rank sent this one, concatenated in rank order, and how
        many rows came from each. splits None: equal parts."""
        rows = array.shape[0]
        if splits is None:
            if rows % self.size:
                raise ValueError(f"alltoall of {name!r}: {rows} rows do not split equally over {self.size} "
                                      f"ranks (pass splits)")
            splits = [rows // self.size] * self.size
        splits = [int(x) for x in np.asarray(splits).reshape(-1)]
        if len(splits) != self.size or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"alltoall of {name!r}: splits {splits} must be {self.size} non-negative counts "
                                  f"adding up to the first dimension ({rows})")
        bounds = np.concatenate([[0], np.cumsum(splits)])
        parts = [contiguous(array[bounds[d]:bounds[d + 1]]) for d in range(self.size)]
        if self.size == 1:
            return parts[0], np.array(splits, np.int32)
        request = ("alltoall", "", [name], [array])
        number = self.begin()

        def body():
            with self._lock, self.meter.comm():
                (ts,) = self.ensure([request], number)
                tag = self.active(number, ts, entries_of(*request))
                return algorithms.alltoall(self.session, f"s{ts.index}", tag, self.rank, self.size, parts, array,
                                           self.meter)

        return self.attempt(number, body, entries_of(*request))

    # ---------------------------------------------------------------- misc
    def _native_counters(self, attached: dict) -> tuple[int, int]:
        """(calls, bytes moved each way) of the native groups in `attached` (their
        executor counts them: nothing of theirs goes through the session)."""
        calls = moved = 0
        for thing in attached.values():
            counters = getattr(thing, "counters", None)
            if counters is not None:
                c, m = counters()
                calls, moved = calls + c, moved + m
        return calls, moved

    def stats(self) -> dict:
        with self._lock:
            current = self.session.stats() if self.session is not None else {}
            totals = {k: self._retired[k] + current.get(k, 0) for k in COUNTED}
            calls, moved = (a + b for a, b in zip(self._retired_native, self._native_counters(self.attached),
                                                  strict=True))
            totals["bytes_sent"] += moved
            totals["bytes_received"] += moved
            return dict(totals, provider=current.get("provider"), generations=self.generations,
                        extensions=max(0, self.generations - 1),
                        tensor_sets=sum(ts.kind != "native" for ts in self._order),
                        tensors=len(self.session.plan) if self.session else 0,
                        plugin_copies=self.meter.copies, comm_seconds=self.meter.comm_seconds,
                        ring_seconds=self.meter.ring_seconds, overlapped_seconds=self.meter.overlapped_seconds,
                        overlap=self.meter.overlap, allreduces=self.meter.rounds, native_requests=calls,
                        output_buffers=self.meter.tally["allocated"],
                        fusion_threshold=self.threshold,
                        buckets=sum(len(ts.analysis.buckets) for ts in self._order if ts.kind == "allreduce"),
                        hierarchy=next(([list(h) for h in ts.analysis.hierarchy.hosts] for ts in self._order
                                        if ts.kind == "allreduce" and ts.analysis.hierarchy), None))

    def close(self) -> None:
        self.comm.close()
        with self._lock:
            attached, self.attached = self.attached, {}
            try:
                for thing in attached.values():
                    if thing is not None:
                        thing.close()
            finally:
                self._retired_native = tuple(a + b for a, b in zip(self._retired_native,
                                                                   self._native_counters(attached), strict=True))
                self._retire(self.session)
            self.session = None
            self._rings.clear()
