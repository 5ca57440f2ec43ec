"""Adasum, Horovod's `hvd.Adasum` reduction (Maleki et al., "Scaling Distributed
Training with Adaptive Summation"): the ranks' values combined in a binary tree,
each pair a, b as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b     (a zero vector's coefficient: 1)

pairing ranks 0 and 1, 2 and 3, ..., then those results, up to one, as Horovod's
recursive halving and doubling does. Here every rank computes the same tree from
every rank's values (collectives.py gathers them): dot products and the sum in
float64, rounded to the tensor's dtype after each level, as Horovod's buffers are.
Defined, as in Horovod, for float tensors on a power-of-two number of ranks."""
from __future__ import annotations

import numpy as np

DTYPES = (np.float16, np.float32, np.float64)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def combine(rows: np.ndarray) -> np.ndarray:
    """rows[k]: rank k's values, flat (a power of two of them); their Adasum."""
    level = list(rows)
    while len(level) > 1:
        level = [_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot, a_sq, b_sq = a64 @ b64, a64 @ a64, b64 @ b64
    a_coeff = 1.0 - dot / a_sq * 0.5 if a_sq else 1.0
    b_coeff = 1.0 - dot / b_sq * 0.5 if b_sq else 1.0
    return (a_coeff * a64 + b_coeff * b64).astype(a.dtype)
