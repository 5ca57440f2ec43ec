"""The soak's short version (`make soak` runs 100,000 steps on shm and tcp): a
training job of two processes over shm for 1,000 steps, each rank sampling
itself every 100; after the warm-up its descriptors, threads, shared-memory
mappings and control calls stay exactly flat, RSS within 8 MiB."""
from bench import soak


def test_a_short_soak_over_shm_stays_flat():
    samples = soak.run_job("shm", steps=1000, every=100, timeout=300)
    result = soak.verdict(samples, warmup=3, rss_bound_mib=8.0)
    print("\n" + soak.table({"shm": result}))
    assert sorted({s["rank"] for s in samples}) == [0, 1] and len(samples) == 20
    for rank, r in result["ranks"].items():
        assert r["flat"], (rank, r["grew"], r["rss_growth_mib"])
        assert r["last"]["shm_maps"] > 0                    # the job really runs over shm segments
