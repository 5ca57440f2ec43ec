"""Generations: the growing plan's sessions, one after another.

Each time the plan grows, or a call fails after values may have moved, the
ranks agree in one exchange and connect a new generation: a fresh session on
the whole plan, with empty slots. This module holds what that exchange
decides, apart from the engine that runs it (collectives.py): the earliest
failed call the ranks reset for (Reset), an error every rank already agreed
on (Settled), whether the proposals disagree, and the counters carried over
from closed generations.
"""
from __future__ import annotations

from dataclasses import dataclass

from rdmatensor import PeerLost, RdmaTensorError, Timeout
from rdmatensor.session.context import COPY_PURPOSES

from .tensor_sets import describe, first_difference

COUNTED = ("control_calls", "bytes_sent", "bytes_received", "writes", "recvs", "copies", "dynamic", "grows",
           "bytes_copied", *(f"copies_{p}" for p in COPY_PURPOSES))


@dataclass
class Reset:
    """A generation replaced because a call failed on some rank: the earliest
    failed call's number, the rank it failed on, and why."""
    call: int
    rank: int
    why: str
    other: int | None = None       # the rank the cause names besides `rank`, if any

    def peer_of(self, rank: int) -> int | None:
        """The rank a failed call on `rank` blames."""
        return self.other if self.rank == rank else self.rank


class Settled(Exception):
    """Raised inside a call for an error every rank already agreed on (no reset needed)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def collateral(exc: RdmaTensorError) -> bool:
    """A call failed because a peer left the generation or went quiet, not for a cause seen here."""
    return isinstance(exc, (PeerLost, Timeout))


def earliest_failure(got: list[dict]) -> Reset | None:
    """The reset every rank's exchange message (`got`, by rank) leads to: the
    earliest failed call, blamed on the rank that saw its cause; None when no
    rank reports a failed call."""
    failures = [(g["call"], not g["cause"], r, g["failed"]) for r, g in enumerate(got) if g.get("failed")]
    if not failures:
        return None
    call, collateral_only, who, why = min(failures)   # the earliest call; the rank that saw its cause
    proposers = [r for r, g in enumerate(got) if g["sets"] and not g.get("failed") and g["call"] == call]
    other = None
    if collateral_only and proposers:   # the cause: a rank proposed new sets where the others had a plan
        p = proposers[0]
        why = (f"calls {describe([e for x in got[p]['sets'] for e in x])}, new to the plan, while "
               f"rank {who}'s {why}")
        who, other = p, who
    return Reset(call, who, why, other)


def disagreement(got: list[dict], proposal: list[list[dict]], rank: int) -> str | None:
    """Why the ranks' proposals (`got`, by rank; this rank's `proposal`) cannot
    extend the plan together, or None when they agree."""
    numbers = [g["call"] for g in got]
    problem = first_difference([[e for s in g["sets"] for e in s] for g in got])
    if problem is None and any([len(s) for s in g["sets"]] != [len(s) for s in proposal] for g in got):
        problem = (f"plan mismatch: the ranks group their tensors into different collectives "
                   f"({[[len(s) for s in g['sets']] for g in got]} tensors per collective, by rank)")
    if problem is None and len(set(numbers)) > 1:
        problem = (f"plan mismatch: the ranks' collectives are out of step (call number {numbers}, by "
                   f"rank): an earlier collective ran on some ranks only; rank {rank} calls "
                   f"{describe(proposal[0] if proposal else [])}")
    return problem
