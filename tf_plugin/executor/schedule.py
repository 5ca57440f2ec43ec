"""The ring's schedule: which chunk of a bucket each rank writes at each step
of a ring, where each chunk starts and ends, and the name each write carries.

It is the one rule both sides follow: the planner (core/layout.py) turns it
into the Plan's tensors, so every write has a slot preallocated for it, and
the executor (ring.py, and a compiled executor later) runs it, so the two
can never disagree about a chunk. No TensorFlow, no numpy arrays: integers
and names only.
"""
from __future__ import annotations


def ring_name(var: str, phase: str, step: int, src: int) -> str:
    """Chunk written by `src` at ring step `step` of phase rs (reduce-scatter) or ag (all-gather)."""
    return f"ring/{var}/{phase}{step}/r{src}"


def ring_bounds(n: int, ranks: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `ranks` chunks of a flat gradient of n elements."""
    sizes = [n // ranks + (1 if i < n % ranks else 0) for i in range(ranks)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def ring_chunk(phase: str, step: int, rank: int, ranks: int, receiving: bool = False) -> int:
    """Which chunk `rank` sends (or receives) at a ring step. Reduce-scatter:
    send (r - s), receive (r - s - 1) and add; after N-1 steps rank r holds
    chunk r + 1 fully reduced. All-gather: send (r + 1 - s), receive (r - s)."""
    src = rank - 1 if receiving else rank
    return (src - step) % ranks if phase == "rs" else (src + 1 - step) % ranks
