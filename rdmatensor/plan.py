"""What moves where: tensor specs, and the slots they get in receive arenas.

A `Plan` is prepared once, before the first step. For every directed pair of
ranks (src -> dst) it lays out the tensors dst receives from src in arenas of
registered memory; the sender's staging memory has the same layout, so a
tensor's (arena, offset) is the same on both sides. Both sides compare the
plan's digest at setup: they must agree on every byte of the layout.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from .errors import PlanError

MAX_SLOTS = 1 << 18     # per ordered pair of ranks: the slot-index bits of an immediate (providers/contract.py)

ALIGN = 64                    # every slot starts on a cache line
MAX_ARENA_BYTES = 4 << 30     # one registered region at most
DEFAULT_DYNAMIC_CAPACITY = 4096
_NAME = re.compile(r"^[A-Za-z0-9_.:/\-]{1,200}$")
SUPPORTED_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSpec:
    """A tensor that crosses from rank `src` to rank `dst` every step.

    A `None` dimension is dynamic: its size is known only when it is sent.
    `capacity` is the initial payload room of a dynamic tensor's slot (it
    grows on demand).
    """
    name: str
    shape: tuple
    dtype: np.dtype
    src: int
    dst: int
    capacity: int | None = None

    def __init__(self, name: str, shape: Sequence[int | None], dtype, src: int, dst: int,
                 capacity: int | None = None):
        if not isinstance(name, str) or not _NAME.match(name):
            raise PlanError(f"tensor name {name!r} must be 1-200 characters of [A-Za-z0-9_.:/-]")
        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise PlanError(f"tensor {name!r}: {dtype!r} is not a numpy dtype") from exc
        if dt not in SUPPORTED_DTYPES:
            raise PlanError(f"tensor {name!r}: dtype {dt} is not supported "
                            f"(numeric and bool dtypes only)")
        try:
            shape = tuple(None if d is None else int(d) for d in shape)
        except TypeError as exc:
            raise PlanError(f"tensor {name!r}: shape {shape!r} must be a sequence") from exc
        if any(d is not None and d < 0 for d in shape):
            raise PlanError(f"tensor {name!r}: negative dimension in {shape}")
        if len(shape) > 32:
            raise PlanError(f"tensor {name!r}: rank {len(shape)} exceeds 32")
        for role, rank in (("src", src), ("dst", dst)):
            if not isinstance(rank, (int, np.integer)) or rank < 0:
                raise PlanError(f"tensor {name!r}: {role} must be a rank >= 0, not {rank!r}")
        if src == dst:
            raise PlanError(f"tensor {name!r}: src and dst are both rank {src}")
        if capacity is not None and capacity <= 0:
            raise PlanError(f"tensor {name!r}: capacity must be positive")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "src", int(src))
        object.__setattr__(self, "dst", int(dst))
        object.__setattr__(self, "capacity", capacity)

    @cached_property                 # the spec never changes; these are asked once per tensor sent
    def is_static(self) -> bool:
        return None not in self.shape

    @cached_property
    def nbytes(self) -> int | None:
        """Payload bytes of a static tensor; None when dynamic."""
        if not self.is_static:
            return None
        return math.prod(self.shape) * self.dtype.itemsize

    def header_bytes(self) -> int:
        """Room before a dynamic tensor's payload for its actual shape."""
        return 0 if self.is_static else _align(8 * (1 + len(self.shape)))

    def matches(self, array: np.ndarray) -> bool:
        if array.dtype != self.dtype:
            return False
        return array.shape == self.shape or len(array.shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, array.shape, strict=False))

    def canonical(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.str,
                "src": self.src, "dst": self.dst, "capacity": self.capacity}


@dataclass(frozen=True)
class Slot:
    """Where one tensor lands: arena `arena` of its (src, dst) pair, at `offset`."""
    index: int          # position among the pair's slots; travels in immediates
    spec: TensorSpec
    arena: int
    offset: int
    size: int           # bytes reserved: header + payload (initial capacity if dynamic)


@dataclass(frozen=True)
class PairLayout:
    src: int
    dst: int
    slots: tuple
    arena_sizes: tuple  # bytes of each arena, page-rounded


class Plan:
    """The analyzer's output: every tensor spec, and every slot in every arena."""

    def __init__(self, specs: Iterable[TensorSpec], max_arena_bytes: int = MAX_ARENA_BYTES,
                 checksum: bool = False):
        """`checksum`: every tensor carries a CRC32 of its payload, checked on
        receipt (costs a copy into staging and a pass over the data on each side)."""
        self.checksum = bool(checksum)
        self.specs: dict[str, TensorSpec] = {}
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise PlanError(f"a plan holds TensorSpec objects, not {type(spec).__name__}")
            if spec.name in self.specs:
                raise PlanError(f"tensor name {spec.name!r} appears twice in the plan")
            self.specs[spec.name] = spec
        if max_arena_bytes <= 0 or max_arena_bytes > MAX_ARENA_BYTES:
            raise PlanError(f"max_arena_bytes must be in 1..{MAX_ARENA_BYTES}")
        self.max_arena_bytes = max_arena_bytes
        self.pairs: dict[tuple[int, int], PairLayout] = {}
        self.slots: dict[str, Slot] = {}
        by_pair: dict[tuple[int, int], list[TensorSpec]] = {}
        for spec in self.specs.values():
            by_pair.setdefault((spec.src, spec.dst), []).append(spec)
        for (src, dst), specs in sorted(by_pair.items()):
            self.pairs[(src, dst)] = self._layout(src, dst, specs)
            for slot in self.pairs[(src, dst)].slots:
                self.slots[slot.spec.name] = slot
        self.digest = hashlib.sha256(json.dumps(
            {"specs": [s.canonical() for s in self.specs.values()],
             "max_arena_bytes": max_arena_bytes, "checksum": self.checksum}, sort_keys=True).encode()).hexdigest()

    def _layout(self, src: int, dst: int, specs: list[TensorSpec]) -> PairLayout:
        if len(specs) > MAX_SLOTS:
            raise PlanError(f"rank {src} sends rank {dst} {len(specs)} tensors: an immediate numbers at most "
                            f"{MAX_SLOTS} slots per pair of ranks")
        slots, sizes = [], [0]
        for index, spec in enumerate(specs):
            payload = spec.nbytes if spec.is_static else (spec.capacity or DEFAULT_DYNAMIC_CAPACITY)
            size = _align(max(self.trailer_offset(spec.header_bytes() + payload) + self.trailer_bytes, 1))
            if size > self.max_arena_bytes:
                raise PlanError(f"tensor {spec.name!r} needs {size} bytes, more than one arena "
                                f"({self.max_arena_bytes} bytes) holds")
            if sizes[-1] + size > self.max_arena_bytes:
                sizes.append(0)
            slots.append(Slot(index, spec, len(sizes) - 1, sizes[-1], size))
            sizes[-1] += size
        return PairLayout(src, dst, tuple(slots), tuple(_align(s, 4096) for s in sizes))

    @property
    def trailer_bytes(self) -> int:
        return 8 if self.checksum else 0

    @staticmethod
    def trailer_offset(end_of_payload: int) -> int:
        """Where a checksum trailer goes after `end_of_payload` bytes of header + payload."""
        return (end_of_payload + 7) // 8 * 8

    def ranks(self) -> set[int]:
        return {r for pair in self.pairs for r in pair}

    def peers_of(self, rank: int) -> set[int]:
        return {b if a == rank else a for a, b in self.pairs if rank in (a, b)}

    def to_json(self) -> str:
        return json.dumps({"specs": [s.canonical() for s in self.specs.values()],
                           "max_arena_bytes": self.max_arena_bytes, "checksum": self.checksum})

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        doc = json.loads(text)
        return cls([TensorSpec(s["name"], s["shape"], np.dtype(s["dtype"]), s["src"], s["dst"],
                               s.get("capacity")) for s in doc["specs"]], doc["max_arena_bytes"],
                   doc.get("checksum", False))

    def first_difference(self, other_specs: list[dict]) -> str:
        """Name the first tensor on which this plan and a peer's disagree."""
        mine = [s.canonical() for s in self.specs.values()]
        for a, b in zip(mine, other_specs, strict=False):
            if a != b:
                diff = [k for k in a if a.get(k) != b.get(k)]
                return f"tensor {a['name']!r} differs ({', '.join(diff)}: {a} vs {b})"
        if len(mine) != len(other_specs):
            extra = (mine[len(other_specs):] or other_specs[len(mine):])[0]
            return f"tensor {extra['name']!r} is only in one plan ({len(mine)} vs {len(other_specs)} tensors)"
        return "arena limits or checksum settings differ"

    def __len__(self) -> int:
        return len(self.specs)

    def __repr__(self) -> str:
        return f"Plan({len(self.specs)} tensors, {len(self.pairs)} pairs, digest {self.digest[:12]})"
