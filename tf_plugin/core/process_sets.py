"""Horovod's process sets as this rank runs them: collectives among some of the ranks.

A process set is a sorted list of (global) ranks. Registered, with
init(process_sets=[...]) or add_process_set(), it gets an id (the global set
is 0) and, on each of its members, collectives of its own (Group): a bootstrap
channel and a growing plan among its members only (the same engine as the
global set's, numbered by position in the set), so its calls never wait for
a rank outside it and never share a slot with another set's. Registering and
removing are calls of every rank, in the same order, as in Horovod
(register, unregister).

The sets a script holds (ProcessSet, global_process_set) and the registry of
the current world are world.py's: it imports this module and hands it the
world wherever one is needed, never the other way. As in Horovod, a rank
that is not in the set cannot call its collectives (NotAMember, a
ValueError; tensors.py raises InvalidArgumentError), roots are given as
global ranks, and ProcessSet.rank() is the position in the set. An elastic
reset ends the sets with the world they were registered in.
This module does not import TensorFlow.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .bootstrap import Bootstrap, PortReservation
from .checked_collectives import CheckedCollectives


@dataclass
class Group:
    """A registered set as this rank runs it: its ranks and, on a member, its
    bootstrap and collectives (the global set's are the world's, looked up at
    each call through `world`: an elastic reset replaces them)."""
    id: int
    ranks: tuple
    world: Callable                 # () -> the current world (world.world)
    own_bootstrap: Bootstrap | None = None
    own_collectives: CheckedCollectives | None = None

    @property
    def collectives(self) -> CheckedCollectives:
        return self.world().collectives if self.id == 0 else self.own_collectives

    @property
    def bootstrap(self) -> Bootstrap:
        return self.world().bootstrap if self.id == 0 else self.own_bootstrap

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def included(self) -> bool:
        return self.world().rank in self.ranks

    @property
    def rank(self) -> int:
        return self.ranks.index(self.world().rank)

    def local(self, rank: int, what: str = "root_rank") -> int:
        """A global rank's position in the set (roots are given as global ranks)."""
        if rank not in self.ranks:
            raise ValueError(f"{what} {rank} is not in process set {self.id} (ranks {list(self.ranks)})")
        return self.ranks.index(rank)

    def close(self) -> None:
        if self.own_collectives is not None:
            try:
                self.own_collectives.close()
            finally:
                self.own_bootstrap.close()


def register(world: Callable, candidates, adding: bool) -> None:
    """Give `candidates` (ProcessSets, made one by one as they are checked) ids and,
    on their members, collectives, in the current world (`world()`): a call of
    every rank. A set with the ranks of one already registered (the global one
    included) is refused when `adding` (ValueError, as Horovod), else left
    unregistered."""
    w = world()
    given = []
    for ps in candidates:
        ranks = list(ps.ranks or [])
        bad = [r for r in ranks if not 0 <= r < w.size]
        if not ranks or bad or len(set(ranks)) != len(ranks):
            raise ValueError(f"process set {ranks}: ranks must be distinct ranks of this job (0..{w.size - 1})"
                             + (f"; {bad} are not" if bad else ""))
        given.append((ps, tuple(ranks)))
    lists = [list(ranks) for _, ranks in given]
    for r, raw in enumerate(w.bootstrap.allgather("process_sets", json.dumps(lists).encode())):
        if json.loads(raw) != lists:
            raise ValueError(f"process sets: rank {r} registers {json.loads(raw)} while rank {w.rank} registers "
                             f"{lists}: every rank must register the same sets in the same order")
    taken = {g.ranks for g in w.sets.values()} | {tuple(range(w.size))}
    new = []
    for ps, ranks in given:
        if ranks in taken:
            if adding:
                raise ValueError(f"Attempted to add a duplicate process set: {ps}")
            ps._invalidate()
            continue
        taken.add(ranks)
        new.append((ps, ranks))
    reservations = {j: PortReservation(w.hosts[w.rank]) for j, (_, ranks) in enumerate(new)
                    if w.rank in ranks and len(ranks) > 1}
    try:
        ports = [json.loads(raw) for raw in w.bootstrap.allgather(
            "process_set_ports", json.dumps({j: res.port for j, res in reservations.items()}).encode())]
        for j, (ps, ranks) in enumerate(new):      # in the same order on every rank: no two wait on each other
            lowest_free = min(set(range(1, len(w.sets) + 2)) - set(w.sets))     # the id, as Horovod
            group = Group(lowest_free, ranks, world)
            if w.rank in ranks:
                peers = {i: f"{w.hosts[g]}:{ports[g].get(str(j), 0)}" for i, g in enumerate(ranks)}
                if j in reservations:
                    reservations.pop(j).close()    # the set's bootstrap server binds it now
                group.own_bootstrap = Bootstrap(ranks.index(w.rank), peers, w.provider, w.token, w.timeout)
                try:
                    group.own_collectives = CheckedCollectives(
                        group.own_bootstrap, [w.hosts[g] for g in ranks], w.provider, w.token, w.timeout,
                        w.fusion_threshold, watch=lambda s, ranks=ranks: w.failure.watch(s, ranks),
                        job_failure=lambda: w.failure.first, check_finite=w.check_finite, ranks=list(ranks))
                except BaseException:
                    group.own_bootstrap.close()
                    raise
                if group.own_bootstrap.session is not None:
                    w.failure.watch(group.own_bootstrap.session, ranks)
            w.sets[group.id] = group
            ps.process_set_id = group.id
    finally:
        for res in reservations.values():
            res.close()


def unregister(w, process_set) -> bool:
    """Close a registered set's collectives in world `w` (every rank calls it); False
    for the global set or one that is not registered."""
    ps_id = getattr(process_set, "process_set_id", None)
    if not ps_id or ps_id not in w.sets:
        return False
    for r, raw in enumerate(w.bootstrap.allgather("process_set_remove", str(ps_id).encode())):
        if int(raw) != ps_id:
            raise ValueError(f"remove_process_set: rank {r} removes process set {int(raw)} while rank {w.rank} "
                             f"removes {ps_id}: every rank must remove the same sets in the same order")
    process_set._invalidate()
    w.sets.pop(ps_id).close()
    return True
