"""The ring over 2 and 3 ranks, and the hierarchical all-reduce over 4 and 6 ranks on
2 or 3 hosts (ranks as threads, real shm sessions): sums and averages as numpy
computes them, bit-identical on every rank, whether the buckets run on the
communication thread (launch/collect) or in lockstep on the caller's (allreduce_arrays)."""
import numpy as np
import pytest

from rdmatensor import Plan
from tf_plugin.core.layout import Analysis, Hierarchy, VarInfo, buckets_of, hierarchical_specs, ring_specs

from ..support.ranks import check, run_ranks

# a fused float bucket (divided by N while copied in), a float gradient alone in its bucket (its
# sum divided block by block: several blocks per chunk), an integer bucket (truncated toward zero, as Horovod), sizes
# not divisible by N
VARIABLES = [VarInfo("w", (7, 5), np.dtype(np.float32), False, {}),
             VarInfo("b", (5,), np.dtype(np.float32), False, {}),
             VarInfo("big", (150001,), np.dtype(np.float32), False, {}),
             VarInfo("count", (11,), np.dtype(np.int64), False, {})]


def analysis(n: int, hosts=None) -> Analysis:
    buckets = buckets_of(VARIABLES, fusion=True, threshold=4096)
    hierarchy = Hierarchy.of(hosts) if hosts else None
    assert (hierarchy is None) == (hosts is None)
    specs = hierarchical_specs(buckets, hierarchy) if hierarchy else ring_specs(buckets, n)
    return Analysis(Plan([s for s, _ in specs]), "allreduce", n, 0, VARIABLES, buckets=buckets, hierarchy=hierarchy)


def values(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f"
            else rng.integers(-50, 50, v.shape).astype(v.dtype) for v in VARIABLES]


@pytest.mark.parametrize("n,hosts", [(2, None), (3, None), (4, "aabb"), (6, "abcabc")])
@pytest.mark.parametrize("average", [True, False])
def test_ring_sums_and_averages_on_every_rank(n, hosts, average):
    from tf_plugin.executor.ring import RingAllReduce
    a = analysis(n, list(hosts) if hosts else None)
    assert [[m[0] for m in b.members] for b in a.buckets] == [["count"], ["big"], ["b", "w"]]
    keys = [v.key for v in VARIABLES]

    def body(session, rank):
        ring = RingAllReduce(session, a, average=average)
        got = []
        try:
            for step in range(3):
                mine = dict(zip(keys, values(rank, step), strict=True))
                if step % 2:
                    got.append(ring.allreduce_arrays(keys, [mine[k] for k in keys], average))
                    continue
                for j, b in enumerate(a.buckets):
                    ring.launch(j, [mine[key] for key, _, _ in b.members])
                out = {}
                for j, b in enumerate(a.buckets):
                    members = b.split(ring.collect(j), ring.shapes)
                    out.update(zip((key for key, _, _ in b.members), members, strict=True))
                got.append([np.array(out[k]) for k in keys])
        finally:
            ring.close()
        return got

    results = check(run_ranks(n, a.plan, "shm", body))
    for step in range(3):
        everyone = [values(r, step) for r in range(n)]
        for t, v in enumerate(VARIABLES):
            total = sum(e[t] for e in everyone)
            want = total if not average else np.trunc(total * (1.0 / n)).astype(v.dtype) if v.dtype.kind == "i" \
                else total / n
            for r in range(n):
                assert results[r][step][t].shape == v.shape and results[r][step][t].dtype == v.dtype
                assert results[r][step][t].tobytes() == results[0][step][t].tobytes()     # bit-identical
                np.testing.assert_allclose(results[r][step][t], want, rtol=1e-6, atol=1e-6)


def test_a_hierarchy_needs_several_hosts_with_the_same_number_of_ranks_each():
    assert Hierarchy.of(list("aaaa")) is None and Hierarchy.of(list("abcd")) is None
    assert Hierarchy.of(list("aabbb")) is None
    h = Hierarchy.of(list("abab"))
    assert h.hosts == ((0, 2), (1, 3)) and h.local(3) == (1, 3) and h.cross(3) == (2, 3)


def test_the_hierarchical_all_reduce_crosses_hosts_in_fewer_steps_and_bytes():
    """4 ranks on 2 hosts: the flat ring's boundary ranks write across hosts at each
    of its 2(N-1) steps; the hierarchy's cross-host ring has 2(H-1) steps, and
    moves a third less across hosts."""
    hosts = list("aabb")
    buckets = buckets_of(VARIABLES, fusion=True, threshold=4096)

    def across(specs):
        crossing = [s for s, _ in specs if hosts[s.src] != hosts[s.dst]]
        steps = {s.name.rsplit("/", 2)[-2] for s in crossing}       # phase and step of each write
        return len(steps), sum(s.nbytes for s in crossing)
    flat_steps, flat_bytes = across(ring_specs(buckets, 4))
    tree_steps, tree_bytes = across(hierarchical_specs(buckets, Hierarchy.of(hosts)))
    assert (flat_steps, tree_steps) == (6, 2)
    assert tree_bytes == pytest.approx(flat_bytes * 2 / 3, rel=0.01)


def test_a_bucket_view_reads_its_members_in_place_with_padding_as_zeros():
    from rdmatensor import HeldPieces
    from tf_plugin.executor.ring import BucketView
    a, b = np.arange(5, dtype=np.float32), np.arange(3, dtype=np.float32) + 10
    view = BucketView(200, np.float32, [(0, a), (100, b)])     # padding wider than 64 bytes is zeros too
    flat = np.concatenate([a, np.zeros(95), b, np.zeros(97)]).astype(np.float32)
    for lo, hi in [(0, 200), (3, 150), (101, 200), (5, 100), (0, 1), (102, 103)]:
        pieces = view.cover(lo, hi)
        assert [at for at, _ in pieces] == list(np.cumsum([0] + [p.size for _, p in pieces[:-1]]))
        assert np.concatenate([p for _, p in pieces]).tobytes() == flat[lo:hi].tobytes(), (lo, hi)
    assert np.shares_memory(view.cover(1, 4)[0][1], a)                 # a member is read, not copied
    one, several = view.source(1, 4), view.source(3, 150)
    assert isinstance(one, HeldPieces) and len(one) == 1 and one[0].base is a        # held: the ring waits for it
    assert isinstance(several, HeldPieces) and len(several) == len(view.cover(3, 150)) > 1
