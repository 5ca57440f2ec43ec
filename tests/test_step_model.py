"""The step-time model (bench/step_model.py): its formulas against hand-computed
values, its buckets against tf_plugin's layout, its fit against known
constants, perftest output into a link, and `rdmatensor-bench predict` end to
end. No benchmark runs here."""
import json

import numpy as np
import pytest

from bench import step_cli, step_fit
from bench import step_model as sm

LINK = sm.Link(alpha=1e-6, beta=1e-9, per_tensor=0.5e-6)
RED = sm.Reduce(add=1e-10, copy=2e-10)


def test_ring_allreduce_by_hand():
    t = sm.ring_allreduce([4000], 4, LINK, RED)
    # 6 steps: 6 us of latency, 6 x 1000 B at 1 ns/B, 6 writes and 6 receives at 0.5 us,
    # 3 chunks of 1000 B summed (0.1 ns/B) and 3 copied (0.2 ns/B)
    assert t.latency == pytest.approx(6e-6)
    assert t.bandwidth == pytest.approx(6e-6)
    assert t.per_tensor == pytest.approx(6e-6)
    assert t.reduction == pytest.approx(3000 * 3e-10)
    # two buckets each alone pay two latencies; in lockstep one per step
    assert sm.ring_allreduce([4000, 4000], 4, LINK, RED).latency == pytest.approx(12e-6)
    assert sm.ring_allreduce([4000, 4000], 4, LINK, RED, lockstep=True).latency == pytest.approx(6e-6)
    assert sm.ring_allreduce([4000], 1, LINK, RED).total == 0


def test_ring_moves_its_bytes_at_the_duplex_rate():
    loopback = sm.Link(alpha=1e-6, beta=1e-9, per_tensor=0.5e-6, duplex_beta=2e-9)
    t = sm.ring_allreduce([4000], 4, loopback, RED)
    assert t.bandwidth == pytest.approx(6 * 1000 * 2e-9)      # every rank sends and receives at once
    assert sm.point_to_point([4000], loopback).bandwidth == pytest.approx(4000 * 1e-9)   # one direction
    assert LINK.duplex_eff == LINK.beta_eff                    # a NIC: full duplex


def test_reduction_calls_per_chunk_and_gradient():
    red = sm.Reduce(add=0.0, copy=0.0, add_call=1e-6, copy_call=0.5e-6)
    # 2 ranks, one bucket of 9 gradients: one chunk summed (1 + 8/2 = 5 adds), one copied out
    t = sm.ring_allreduce([4000], 2, LINK, red, tensors=[9])
    assert t.reduction == pytest.approx(5e-6 + 0.5e-6)
    # 4 ranks, two single-gradient buckets: 3 adds and 3 copies each
    assert sm.ring_allreduce([4000, 4000], 4, LINK, red).reduction == pytest.approx(2 * 3 * 1.5e-6)
    with pytest.raises(ValueError):
        sm.ring_allreduce([4000], 2, LINK, red, tensors=[1, 2])


def test_rails_divide_bandwidth_only():
    two = sm.Link(1e-6, 1e-9, 0.5e-6, rails=2)
    one, both = sm.ring_allreduce([1 << 20], 8, LINK, RED), sm.ring_allreduce([1 << 20], 8, two, RED)
    assert both.bandwidth == pytest.approx(one.bandwidth / 2)
    assert (both.latency, both.per_tensor) == (one.latency, one.per_tensor)


@pytest.mark.parametrize("ranks", [2, 3, 5, 8])
def test_ring_bytes_are_what_the_plan_writes(ranks):
    layout = sm._layout()
    elements = 1001                        # not a multiple of any rank count: uneven chunks
    specs = layout.group_specs("b", elements, np.dtype(np.float32), tuple(range(ranks)), "")
    total = sum(s.nbytes for s, _ in specs)
    assert total == 2 * (ranks - 1) * elements * 4                       # exact over all ranks
    assert total / ranks == pytest.approx(sm.ring_bytes_per_rank(elements * 4, ranks))
    for r in range(ranks):                 # each rank within a few elements of 2(N-1)/N S
        mine = sum(s.nbytes for s, _ in specs if s.src == r)
        assert abs(mine - sm.ring_bytes_per_rank(elements * 4, ranks)) <= 2 * (ranks - 1) * 4


def test_hierarchical_by_hand():
    local = sm.Link(alpha=0.1e-6, beta=0.1e-9, per_tensor=0.2e-6)
    t = sm.hierarchical_allreduce([8000], 2, 2, LINK, local, RED)
    # local: 2 steps of 4000 B; cross: 2 steps, S/H = 4000 B through each host's NIC
    assert t.latency == pytest.approx(2 * 0.1e-6 + 2 * 1e-6)
    assert t.bandwidth == pytest.approx(8000 * 0.1e-9 + 8000 * 1e-9)
    assert t.per_tensor == pytest.approx(2 * 2 * 0.2e-6 + 2 * 2 * 0.5e-6)
    assert t.reduction == pytest.approx((4000 + 2000) * 3e-10)
    # one host or one rank per host: the flat ring
    assert sm.hierarchical_allreduce([8000], 1, 4, LINK, local, RED) == sm.ring_allreduce([8000], 4, local, RED)
    assert sm.hierarchical_allreduce([8000], 4, 1, LINK, local, RED) == sm.ring_allreduce([8000], 4, LINK, RED)
    # fewer latencies across hosts than the flat ring over all 16 ranks
    flat = sm.ring_allreduce([8000], 16, LINK, RED)
    assert sm.hierarchical_allreduce([8000], 4, 4, LINK, local, RED).latency < flat.latency


def test_broadcast_and_allgather_by_hand():
    t = sm.broadcast([1000, 3000], 4, 4, LINK, LINK)
    assert t.bandwidth == pytest.approx(3 * 4000 * 1e-9)          # the root writes it 3 times
    assert t.per_tensor == pytest.approx((3 * 2 + 3) * 0.5e-6)
    g = sm.allgather([1000], 4, 2, LINK, LINK, RED)
    # two hosts of two: each host's NIC carries 2 ranks x 2 remote peers x 1000 B
    assert g.bandwidth == pytest.approx(4000 * 1e-9)
    assert g.reduction == pytest.approx(4 * 1000 * 2e-10)


@pytest.mark.parametrize("threshold", [0, 1 << 20, 4 << 20, None])
def test_buckets_are_tf_plugins(threshold):
    layout = sm._layout()
    grads = sm.gradient_set("resnet50")
    infos = sm.var_infos(grads)
    fusion = threshold != 0
    want = layout.buckets_of(infos, fusion, threshold if fusion else None)
    got = sm.buckets(grads, threshold)
    assert len(got) == len(want)
    assert [b.bytes for b in got] == [b.size * b.dtype.itemsize for b in want]
    assert sum(b.tensors for b in got) == len(grads)
    assert [b.last for b in got] == sorted(b.last for b in got)      # complete in backprop order
    if threshold == 0:
        assert len(got) == len(grads)


def test_overlap_hides_communication_until_it_cannot():
    grads = sm.synthetic_set([4 << 20] * 4)
    fast = sm.Cluster(8, 1, LINK, LINK, RED)
    p = sm.predict(grads, fast, compute_s=1.0, threshold=0)
    # every bucket's ring ends before the next is ready, but the last is ready only when compute ends
    last = sm.ring_allreduce([4 << 20], 8, LINK, RED).total
    assert p.step_s == pytest.approx(1.0 + last) and p.bound == "compute"
    assert p.efficiency == pytest.approx(1 / (1 + last))
    slow = sm.Cluster(8, 1, sm.Link(1e-6, 1e-6, 0.5e-6), LINK, RED)     # 1 MB/s: 4 MiB takes seconds
    q = sm.predict(grads, slow, compute_s=1.0, threshold=0)
    # the first bucket is ready after the forward pass and 1/4 of backprop; then the rings queue
    first_ready = 1 / 3 + 2 / 3 / 4
    per_bucket = sm.ring_allreduce([4 << 20], 8, slow.cross, RED).total
    assert q.step_s == pytest.approx(first_ready + 4 * per_bucket)
    assert q.bound == "bandwidth" and q.efficiency == pytest.approx(1.0 / q.step_s)
    eager = sm.predict(grads, slow, compute_s=1.0, threshold=0, overlap=False)
    assert eager.step_s == pytest.approx(1.0 + sm.ring_allreduce([4 << 20] * 4, 8, slow.cross, RED, True).total)


def _points(alpha, beta, c, duplex=None):
    spec = [("lat", 8, 1), ("lat", 65536, 1), ("bw", 4096, 1), ("bw", 1 << 23, 1), ("step", 256 * 64, 256),
            ("step", 32 << 14, 32), ("step", 4 << 22, 4)]
    spec += [("duplex", 1 << 16, 1), ("duplex", 1 << 23, 1)] if duplex else []
    points = [{"kind": k, "bytes": s, "tensors": n} for k, s, n in spec]
    for p in points:
        p["seconds"] = float(np.dot(step_fit.design_row(p["kind"], p["bytes"], p["tensors"]),
                                    [alpha, beta, c, duplex or 0.0]))
    return points


def test_fit_recovers_known_constants():
    alpha, beta, c, duplex = 7e-6, 0.4e-9, 1.3e-6, 0.7e-9
    fitted, rows = step_fit.fit_link(_points(alpha, beta, c, duplex))
    assert fitted["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fitted["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fitted["per_tensor_s"] == pytest.approx(c, rel=1e-6)
    assert fitted["duplex_beta_s_per_byte"] == pytest.approx(duplex, rel=1e-6)
    assert max(abs(r["residual"]) for r in rows) < 1e-9
    # the naive model reads the smallest latency point and the largest bandwidth point
    assert fitted["naive"]["alpha_s"] == rows[0]["seconds"]
    # without a duplex point: no β₂ (the ring then uses β)
    fitted, _ = step_fit.fit_link(_points(alpha, beta, c))
    assert fitted["duplex_beta_s_per_byte"] is None and fitted["per_tensor_s"] == pytest.approx(c, rel=1e-6)


def test_each_constant_comes_from_its_own_point():
    alpha, beta, c, duplex = 7e-6, 0.4e-9, 1.3e-6, 0.7e-9
    points = _points(alpha, beta, c, duplex)
    # a disturbed point that determines nothing (a slow 8 MiB window, a slow 64 KiB round trip,
    # 256 writes waiting for credits) moves no constant, and shows up as its own residual only
    for p in points:
        if (p["kind"], p["bytes"]) in (("bw", 1 << 23), ("lat", 65536), ("step", 256 * 64)):
            p["seconds"] *= 5
    fitted, rows = step_fit.fit_link(points)
    assert (fitted["alpha_s"], fitted["per_tensor_s"]) == (pytest.approx(alpha), pytest.approx(c))
    assert fitted["beta_s_per_byte"] == pytest.approx(beta)
    determines = {(r["kind"], r["bytes"]) for r in rows if r["determines"]}
    # α: the 8-byte round trip; β: the step of the most bytes; c: the step of the most tensors
    # within what a receiver takes in flight (256 are more); β₂: the largest duplex point
    assert determines == {("lat", 8), ("step", 4 << 22), ("step", 32 << 14), ("duplex", 1 << 23)}
    disturbed = [r["residual"] for r in rows if (r["kind"], r["bytes"]) in
                 (("bw", 1 << 23), ("lat", 65536), ("step", 256 * 64))]
    assert disturbed == [pytest.approx(-0.8)] * 3
    assert fitted["rms_relative_residual"] == pytest.approx(np.sqrt(3 * 0.64 / 5))     # over the 5 checks


def test_reduction_fit_takes_rate_from_the_largest_and_call_from_the_smallest():
    call, per_byte = 1e-6, 1e-9
    points = [{"kind": k, "bytes": b, "seconds": call + per_byte * b} for k in ("add", "copy")
              for b in (256, 1 << 16, 1 << 25)]
    for p in points:
        if p["bytes"] == 1 << 16:
            p["seconds"] /= 4                      # in cache: faster than the memory-bound rate
    r, rows = step_fit.fit_reduction(points)
    assert r["add_s_per_byte"] == pytest.approx(per_byte) and r["add_call_s"] == pytest.approx(call)
    assert r["copy_s_per_byte"] == pytest.approx(per_byte) and r["copy_call_s"] == pytest.approx(call)


def test_fit_never_returns_a_negative_constant():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    x = step_fit.nonnegative_lstsq(a, np.array([3.0, 2.0, 1.0]))      # the slope would be -1
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_rates_and_times():
    assert sm.parse_rate("100gbit") == 12.5e9
    assert sm.parse_rate("25Gb/s") == sm.parse_rate("25gbps") == 3.125e9
    assert sm.parse_rate("12.5GB/s") == 12.5e9
    assert sm.parse_time("2us") == 2e-6 and sm.parse_time("1.5ms") == 1.5e-3
    with pytest.raises(ValueError):
        sm.parse_rate("fast")


BW = (" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
      " 65536      3000             2985.46              2980.00  \t\t   0.047680\n")
LAT = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   "
       "99% percentile[usec]   99.9% percentile[usec] \n"
       " 8       1000          1.52           5.41         1.60     	       1.58        	0.10   		1.91"
       "    		5.41\n")


def test_perftest_output_into_the_link():
    link = sm.link_from_perftest(BW, LAT, LINK)
    bytes_per_s = 2980.00 * (1 << 20)           # perftest's MB/sec are MiB/s
    assert link.beta == pytest.approx(1 / bytes_per_s)
    assert link.alpha == pytest.approx(1.60e-6 - 8 / bytes_per_s)
    assert link.per_tensor == LINK.per_tensor and "perftest" in link.source


@pytest.fixture
def constants(tmp_path):
    link = {"alpha_s": 10e-6, "beta_s_per_byte": 1e-9, "per_tensor_s": 2e-6, "duplex_beta_s_per_byte": 3e-9,
            "naive": {"alpha_s": 12e-6, "beta_s_per_byte": 1e-9}}
    doc = {"links": {"shm": link, "tcp": link},
           "reduction": {"add_s_per_byte": 1e-10, "copy_s_per_byte": 1e-10, "add_call_s": 1e-6, "copy_call_s": 0.0,
                         "shared": {"add_s_per_byte": 2e-10, "copy_s_per_byte": 3e-10}}}
    path = tmp_path / "constants.json"
    path.write_text(json.dumps(doc))
    return path


def test_predict_end_to_end(constants, tmp_path, capsys):
    from bench.cli import main
    out = tmp_path / "p.json"
    assert main(["predict", "--model", "resnet50", "--ranks", "16", "--ranks-per-host", "4", "--link", "10gbit",
                 "--latency", "5us", "--compute-ms", "100", "--constants", str(constants), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "scaling efficiency" in text and "bound by" in text and "10 Gbit/s" in text
    p = json.loads(out.read_text())["prediction"]
    grads = sm.gradient_set("resnet50")
    assert p["buckets"] == len(sm.buckets(grads, None)) and p["tensors"] == len(grads)
    # the bandwidth term is the flat ring's across 10 Gbit/s, both ways at once (a NIC: the fitted
    # link's duplex β does not apply to the link given)
    assert p["comm"]["bandwidth"] == pytest.approx(2 * 15 / 16 * p["bytes"] * 8 / 10e9)
    assert p["efficiency"] == pytest.approx(0.1 / p["step_s"])
    # hierarchical: fewer latencies across hosts
    assert main(["predict", "--model", "resnet50", "--ranks", "16", "--ranks-per-host", "4", "--link", "10gbit",
                 "--hierarchical", "--fusion-threshold", "0", "--constants", str(constants), "--json", str(out)]) == 0
    h = json.loads(out.read_text())["prediction"]
    assert h["buckets"] == len(grads)


def test_predict_rejects_ranks_that_do_not_fill_hosts(constants):
    with pytest.raises(SystemExit):
        step_cli.main(["predict", "--model", "resnet50", "--ranks", "6", "--ranks-per-host", "4",
                       "--constants", str(constants)])


def test_imagenet_sets_are_the_published_models():
    # parameter counts of keras.applications at 1000 classes: ResNet-101 44.7M, InceptionV3 23.9M, VGG16 138.4M
    for model, params in (("resnet101_224", 44.7e6), ("inceptionv3_224", 23.9e6), ("vgg16_224", 138.4e6)):
        total = sum(int(np.prod(g["shape"])) for g in sm.gradient_set(model))
        assert total == pytest.approx(params, rel=0.01)


def test_fitted_constants_into_links_and_rates(constants):
    doc = sm.load_constants(constants)
    assert sm.link_of(doc, "tcp").duplex_eff == 3e-9
    shared, alone = sm.reduce_of(doc), sm.reduce_of(doc, shared=False)
    assert (shared.add, shared.copy, shared.add_call) == (2e-10, 3e-10, 1e-6)
    assert (alone.add, alone.copy) == (1e-10, 1e-10)
    # an older constants file (no duplex point, no shared rates) still loads
    del doc["links"]["tcp"]["duplex_beta_s_per_byte"], doc["reduction"]["shared"]
    assert sm.link_of(doc, "tcp").duplex_eff == 1e-9 and sm.reduce_of(doc).add == 1e-10


def test_validation_predicts_the_ring_with_duplex_and_shared_rates(constants):
    from bench import step_validate
    preds = {(p["provider"], p["case"]): p for p in step_validate.predictions(sm.load_constants(constants), ["tcp"])}
    ring = preds[("tcp", "ring 16x2M, no fusion")]
    # 2 ranks: S bytes each way at β₂ = 3 ns/B; S/2 summed and S/2 copied at the shared rates; 16 adds
    s = 16 * (2 << 20)
    assert ring["terms_ms"]["bandwidth"] == pytest.approx(s * 3e-9 * 1e3)
    assert ring["terms_ms"]["reduction"] == pytest.approx((s / 2 * 5e-10 + 16 * 1e-6) * 1e3)
    p2p = preds[("tcp", "p2p 2x12M")]
    assert p2p["terms_ms"]["bandwidth"] == pytest.approx(2 * (12 << 20) * 1e-9 * 1e3)


def test_ring_bookkeeping_from_the_ring_point():
    link = {"alpha_s": 10e-6, "beta_s_per_byte": 1e-9, "per_tensor_s": 2e-6, "duplex_beta_s_per_byte": 3e-9}
    reduction = {"add_s_per_byte": 0.0, "copy_s_per_byte": 0.0, "add_call_s": 1e-6, "copy_call_s": 1e-6}
    # 256 buckets of 64 B on 2 ranks: 2 latencies, 4 x 256 c, 256 adds and copies, 2 x 256 r
    r = 3e-6
    seconds = 2 * 10e-6 + 256 * 64 * 3e-9 + 4 * 256 * 2e-6 + 256 * 2e-6 + 2 * 256 * r
    point = {"bytes": 256 * 64, "buckets": 256, "seconds": seconds}
    assert step_fit.fit_ring_step(point, link, reduction) == pytest.approx(r)
    # and the ring charges it per bucket and step
    lk = sm.Link(10e-6, 1e-9, 2e-6, duplex_beta=3e-9, ring_step=r)
    red = sm.Reduce(0.0, 0.0, add_call=1e-6, copy_call=1e-6)
    assert sm.ring_allreduce([64] * 256, 2, lk, red, lockstep=True).total == pytest.approx(seconds)
