"""Plans: validation, slot layout, digests."""
import numpy as np
import pytest

from rdmatensor import Plan, PlanError, TensorSpec
from rdmatensor.plan import ALIGN


def test_slots_are_aligned_and_disjoint():
    plan = Plan([TensorSpec(f"t{i}", (i + 1, 3), np.float32, 0, 1) for i in range(50)]
                + [TensorSpec("d", (None,), np.int8, 0, 1)])
    slots = sorted(plan.pairs[(0, 1)].slots, key=lambda s: s.offset)
    for a, b in zip(slots, slots[1:], strict=False):
        assert a.offset % ALIGN == 0 and a.offset + a.size <= b.offset
    assert plan.slots["t9"].size >= 10 * 3 * 4
    assert plan.slots["d"].size >= plan.specs["d"].header_bytes() + 4096


def test_arenas_split_at_the_region_limit():
    plan = Plan([TensorSpec(f"t{i}", (1000,), np.uint8, 0, 1) for i in range(10)], max_arena_bytes=4096)
    layout = plan.pairs[(0, 1)]
    assert len(layout.arena_sizes) == 3
    assert all(size <= 4096 for size in layout.arena_sizes)
    with pytest.raises(PlanError, match="more than one arena"):
        Plan([TensorSpec("big", (5000,), np.uint8, 0, 1)], max_arena_bytes=4096)


def test_digest_is_stable_and_sensitive():
    def make(shape=(3, 3), dtype=np.float32):
        return Plan([TensorSpec("a", shape, dtype, 0, 1), TensorSpec("b", (2,), np.int8, 1, 0)])
    assert make().digest == make().digest
    assert make().digest != make((3, 4)).digest
    assert make().digest != make(dtype=np.float64).digest
    assert Plan.from_json(make().to_json()).digest == make().digest
    other = [s.canonical() for s in make((3, 4)).specs.values()]
    assert "'a'" in make().first_difference(other)


@pytest.mark.parametrize("args, match", [
    (("", (1,), np.float32, 0, 1), "name"),
    (("a b", (1,), np.float32, 0, 1), "name"),
    (("a", (1,), object, 0, 1), "not supported"),
    (("a", (1,), "nonsense", 0, 1), "not a numpy dtype"),
    (("a", (-1,), np.float32, 0, 1), "negative"),
    (("a", 5, np.float32, 0, 1), "sequence"),
    (("a", (1,), np.float32, 0, 0), "both rank"),
    (("a", (1,), np.float32, -1, 1), "src"),
])
def test_bad_specs_are_refused_with_a_reason(args, match):
    with pytest.raises(PlanError, match=match):
        TensorSpec(*args)


def test_duplicate_names_are_refused():
    with pytest.raises(PlanError, match="twice"):
        Plan([TensorSpec("a", (1,), np.float32, 0, 1), TensorSpec("a", (2,), np.float32, 1, 0)])
