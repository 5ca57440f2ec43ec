"""tf_plugin.training.job: the job description refuses what cannot run; summaries and the
side-by-side comparison (floor efficiency, ratio to TensorFlow's own) come out of
real runs, including the real models' smallest members."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_plugin.errors import JobError
from tf_plugin.training.job import BACKENDS, JobConfig, RankResult, combine, compare, summarize


@pytest.mark.parametrize("fields, message", [
    (dict(model="alexnet"), "model 'alexnet': choose one of"),
    (dict(provider="pigeon"), "provider 'pigeon': choose one of"),
    (dict(provider="tf-grpc", mode="ps", ps=1), "has no ps mode"),
    (dict(mode="ps"), "the ps mode needs at least one parameter server"),
    (dict(ps=1), "the allreduce mode none"),
    (dict(batch=63), "batch 63 (global) does not split evenly over 2 workers"),
    (dict(steps=1), "need at least 2"),
    (dict(model="resnet50", image_size=16), "image_size 16: resnet50 needs at least 32"),
    (dict(workers=0), "workers 0"),
    (dict(bind_to="socket"), "bind_to 'socket': choose one of core, none"),
    (dict(provider="none", paired=True), "paired with provider 'none'"),
    (dict(provider="shm", workers=1, batch=64, paired=True), "1 worker(s)"),
    (dict(provider="shm", mode="ps", ps=1, paired=True), "mode ps"),
    (dict(provider="shm", steps=3, paired=True), "steps 3: a paired job needs at least 4"),
])
def test_a_job_that_cannot_run_is_refused_naming_the_field(fields, message):
    with pytest.raises(JobError, match=message.replace("(", "\\(").replace(")", "\\)")):
        JobConfig(**fields)


def test_backends_are_the_providers_plus_tensorflow_horovod_and_the_floor():
    from rdmatensor.providers import REGISTRY
    assert set(BACKENDS) == {"auto", *REGISTRY, "tf-grpc", "horovod", "hvd", "hvd-python", "none", "sync"}
    for name in ("tf-grpc", "horovod", "hvd", "hvd-python"):
        assert BACKENDS[name].modes == ("allreduce",) and not BACKENDS[name].threads
    assert BACKENDS["sync"].modes == ("allreduce",) and BACKENDS["sync"].threads
    config = JobConfig(model="lm", batch=16, image_size=64)
    assert JobConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(JobError, match="unknown job field"):
        JobConfig.from_dict({"modle": "mlp"})


def test_summary_and_comparison_arithmetic():
    def job(provider, step_ms):
        results = [RankResult(r, "worker", provider, losses=[1.0 + r, 0.5 + r], step_seconds=[step_ms / 1e3] * 2,
                              comm_seconds=0.0 if provider == "none" else None) for r in range(2)]
        return summarize(JobConfig(provider=provider, steps=3), results)
    floor, tf, shm = job("none", 100.0), job("tf-grpc", 400.0), job("shm", 125.0)
    assert floor.losses == [1.5, 1.0] and floor.median_step_ms == pytest.approx(100.0)
    assert floor.steps_per_s == pytest.approx(10.0) and floor.comm_ms_per_step == 0.0
    assert tf.comm_ms_per_step is None                       # not measured: stays None, not 0
    baseline, rows = compare([floor, shm, tf])
    assert baseline == "tf-grpc"
    by = {r.provider: r for r in rows}
    assert by["shm"].efficiency == pytest.approx(0.8) and by["shm"].ratio == pytest.approx(3.2)
    assert by["tf-grpc"].efficiency == pytest.approx(0.25) and by["tf-grpc"].ratio == pytest.approx(1.0)
    grpc = job("grpc", 250.0)
    assert compare([shm, grpc])[0] == "grpc" and compare([shm, grpc])[1][0].ratio == pytest.approx(2.0)
    baseline, alone = compare([shm])
    assert baseline is None and alone[0].efficiency is None and alone[0].ratio is None
    assert alone[0].vs_horovod is None
    _, rows = compare([floor, shm, job("horovod", 200.0)])
    assert [r.vs_horovod for r in rows] == [pytest.approx(2.0), pytest.approx(1.6), pytest.approx(1.0)]
    _, rows = compare([floor, job("sync", 110.0), shm])
    assert [r.of_sync for r in rows] == [pytest.approx(1.1), pytest.approx(1.0), pytest.approx(0.88)]
    assert rows[0].of_sync is not None and compare([floor, shm])[1][1].of_sync is None


def test_rounds_combine_ratios_taken_within_each_round():
    """A slow round slows both jobs alike: the ratio within a round, not across."""
    def job(provider, step_ms):
        results = [RankResult(r, "worker", provider, losses=[1.0], step_seconds=[step_ms / 1e3]) for r in range(2)]
        return summarize(JobConfig(provider=provider, steps=3), results)
    fast = compare([job("none", 100.0), job("shm", 110.0)])[1]
    slow = compare([job("none", 200.0), job("shm", 250.0)])[1]
    middle = compare([job("none", 150.0), job("shm", 150.0)])[1]
    floor, shm = combine([fast, slow, middle])
    assert (floor.provider, shm.provider, shm.rounds) == ("none", "shm", 3)
    assert shm.efficiency.median == pytest.approx(100 / 110)
    assert (shm.efficiency.low, shm.efficiency.high) == (pytest.approx(0.8), pytest.approx(1.0))
    assert shm.median_step_ms.median == pytest.approx(150.0) and shm.steps_per_s.low == pytest.approx(4.0)
    assert shm.vs_horovod.median is None and shm.of_sync.median is None


def test_horovod_without_its_build_is_refused_saying_how_to_build_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--provider", "shm,horovod"],
                          env={**os.environ, "RDMATENSOR_HOROVOD_VENV": str(tmp_path / "none")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "provider horovod needs real Horovod" in proc.stderr \
        and "make horovod-reference" in proc.stderr, proc.stderr[-2000:]


def test_floor_beside_tcp_in_one_run(tmp_path, close_to_reference):
    """rdmatensor-train --provider none,tcp: the floor moves nothing, tcp learns the reference."""
    out = tmp_path / "cmp.json"
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--workers", "2",
                           "--provider", "none,tcp",
                           "--model", "mlp", "--steps", "20", "--json", str(out),
                           "--timeline", str(tmp_path / "trace.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "efficiency" in proc.stdout and "median step" in proc.stdout
    doc = json.loads(out.read_text())
    floor, tcp = (job["summary"] for job in doc["jobs"])
    assert floor["bytes_per_step"] == 0 and floor["writes_per_step"] == 0
    assert tcp["bytes_per_step"] > 0 and len(doc["jobs"][1]["ranks"][0]["step_seconds"]) == 19
    assert doc["comparison"]["efficiency"]["none"] == 1.0 and 0 < doc["comparison"]["efficiency"]["tcp"]
    assert floor["overlap"] is None and 0.0 <= tcp["overlap"] <= 1.0     # the rings ran on the comm thread
    assert floor["ring_cpu_ms_per_step"] is None and tcp["ring_cpu_ms_per_step"] > 0
    assert "overlap" in proc.stdout
    for rank in (0, 1):                    # the floor has no rings, so no time line
        events = json.loads((tmp_path / f"trace-tcp-{rank}.json").read_text())
        assert sum(e["name"].startswith("ring ") for e in events) >= 19, events[-3:]
    assert not list(tmp_path.glob("trace-none-*"))
    close_to_reference("mlp", tcp["losses"])
    assert doc["command"].startswith("rdmatensor-train --workers 2")


def buckets(model: str) -> int:
    """How many buckets the all-reduce cuts the model's gradients into (the fusion threshold)."""
    from tf_plugin.training import models
    from tf_plugin.core.layout import VarInfo, buckets_of
    variables = models.build(model).trainable_variables
    return len(buckets_of([VarInfo(str(j), tuple(v.shape), np.dtype(v.dtype), False, {})
                           for j, v in enumerate(variables)], fusion=True))


def test_transformer_lm_two_workers_match_one_process_on_the_global_batch(monkeypatch):
    """The LM's sparse embedding gradient, all-reduced as dense, trains as one process does."""
    from tf_plugin.training import models
    from tf_plugin.training import runner
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", str(4 << 20))      # several buckets
    config = JobConfig(model="lm", provider="tcp", steps=4, batch=8)
    s = summarize(config, runner.run_threads(config))
    want = models.train_local("lm", 4, global_batch=8)
    np.testing.assert_allclose(s.losses, want, rtol=1e-4)
    assert buckets("lm") > 1                                 # 9.8 MB of gradients over 4 MiB buckets
    assert s.writes_per_step == 2 * 2 * buckets("lm")        # per fused float32 bucket, rs + ag per rank


def test_transformer_lm_in_graph_over_processes_matches_one_process(tmp_path, monkeypatch):
    """rdmatensor-train's default: ranks as processes, the ring inside the step's
    tf.function. The embedding's gradient, made dense, has a shape the graph only
    partly knows (the plan knows it whole); every bucket's members come back in the
    plan's shapes and the losses are those of one process on the global batch."""
    from tf_plugin.training import models
    monkeypatch.setenv("RDMATENSOR_FUSION_THRESHOLD", str(4 << 20))      # several buckets
    out = tmp_path / "lm.json"
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--workers", "2", "--provider", "tcp",
                           "--model", "lm", "--steps", "4", "--batch", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job,) = json.loads(out.read_text())["jobs"]
    np.testing.assert_allclose(job["summary"]["losses"], models.train_local("lm", 4, global_batch=8), rtol=1e-4)
    assert job["summary"]["writes_per_step"] == 2 * 2 * buckets("lm")
    # every gradient reached TensorFlow as a view of its bucket's output, on both ranks
    assert job["summary"]["zero_copy_ingest_per_step"] == 2 * len(models.build("lm").trainable_variables)
    assert job["summary"]["copies_per_step"] == 0


def test_mobilenetv2_trains_over_shm():
    """The smallest keras.applications model, 32x32: its ~160 gradients go as a few fused buckets."""
    from tf_plugin.training import runner
    config = JobConfig(model="mobilenetv2", provider="shm", steps=2, batch=4)
    s = summarize(config, runner.run_threads(config))
    assert s.writes_per_step == 2 * 2 * buckets("mobilenetv2") and np.isfinite(s.final_loss)
    # each rank sends half of every float32 bucket twice (reduce-scatter, all-gather)
    assert s.bytes_per_step == pytest.approx(2 * 2_236_682 * 4, rel=0.01)


def test_the_sync_floor_meets_once_per_step_and_rounds_interleave(tmp_path):
    """rdmatensor-train --provider none,sync --rounds 2: the sync floor writes 4 bytes to the
    other worker per step and trains exactly as the floor; the rounds alternate the jobs."""
    out = tmp_path / "rounds.json"
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--workers", "2",
                           "--provider", "none,sync", "--rounds", "2", "--model", "mlp", "--steps", "5",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rounds, interleaved" in proc.stdout and "of sync" in proc.stdout
    doc = json.loads(out.read_text())
    assert [(j["round"], j["config"]["provider"]) for j in doc["jobs"]] == \
        [(0, "none"), (0, "sync"), (1, "none"), (1, "sync")]
    floor, sync = doc["jobs"][0]["summary"], doc["jobs"][1]["summary"]
    assert sync["writes_per_step"] == 2 and sync["bytes_per_step"] == 8 and floor["writes_per_step"] == 0
    assert sync["losses"] == floor["losses"]            # meeting moves nothing of the model
    cmp = doc["comparison"]
    assert cmp["rounds"] == 2 and cmp["of_sync"]["sync"] == 1.0 and cmp["efficiency"]["none"] == 1.0
    low, high = cmp["efficiency_range"]["sync"]
    assert 0 < low <= cmp["efficiency"]["sync"] <= high
    bad = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--provider", "none,shm,none",
                          "--rounds", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "name each provider once" in bad.stderr, bad.stderr[-1000:]


def test_paired_turns_hold_every_kind_once_per_cycle_in_varying_orders():
    from tf_plugin.training.runner import turns
    assert turns(["shm"], 4, 0) == ["shm"] * 4
    kinds = ["none", "sync", "shm"]
    got = turns(kinds, 3 * 20 + 2, 7)
    assert len(got) == 60 and turns(kinds, 62, 7) == got            # a partial cycle dropped; every rank draws alike
    cycles = [tuple(got[i:i + 3]) for i in range(0, 60, 3)]
    assert all(sorted(c) == sorted(kinds) for c in cycles) and len(set(cycles)) > 1


def test_paired_shares_are_medians_of_ratios_within_cycles():
    def worker(rank, shm, none, sync):
        return RankResult(rank, "worker", "shm", [1.0] * 4, shm, paired_seconds={"none": none, "sync": sync})
    # each cycle's slowest worker: floor 1, 2, 4; sync 1.25, 2.5, 5; shm 2, 4, 8 (the host slowed between cycles)
    ranks = [worker(0, [2.0, 3.0, 8.0], [1.0, 2.0, 3.0], [1.25, 2.5, 5.0]),
             worker(1, [1.0, 4.0, 7.0], [0.5, 1.0, 4.0], [1.0, 2.0, 5.0])]
    p = summarize(JobConfig(provider="shm", paired=True), ranks).paired
    assert p["cycles"] == 3 and (p["none_ms"], p["sync_ms"], p["provider_ms"]) == (2000.0, 2500.0, 4000.0)
    assert (p["of_floor"], p["of_sync"], p["sync_of_floor"]) == (0.5, 0.625, 0.8)
    assert summarize(JobConfig(provider="shm"), [worker(0, [1.0], [], [])]).paired is None


def _train(*args: str) -> str:
    """rdmatensor-train on 2 workers of the mlp with `args`; what it printed."""
    proc = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--workers", "2", "--model", "mlp", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_kind_timed_beside_the_provider_gets_its_shares_and_its_ratio():
    ranks = [RankResult(r, "worker", "hvd", [1.0] * 3, [2.0, 4.0],
                        paired_seconds={"none": [1.0, 2.0], "sync": [1.0, 4.0], "hvd-python": [4.0, 2.0]})
             for r in range(2)]
    p = summarize(JobConfig(provider="hvd", paired=True), ranks).paired
    assert p["hvd-python_ms"] == 3000.0 and p["hvd-python_of_floor"] == 0.625
    assert p["hvd-python_of_sync"] == 1.125 and p["of_hvd-python"] == 1.25 and p["of_floor"] == 0.5


def test_the_horovod_api_trains_as_the_reference_on_both_paths_and_pairs_them(tmp_path, close_to_reference):
    """rdmatensor-train --provider hvd,hvd-python: the Horovod API's tape step, as it runs
    by default (the native ops) and on the Python path, learns what one process learns,
    the same losses on both; the native job reports the executor's bytes and overlap.
    Paired, the Python path's step is timed in the same turns as the native one."""
    out = tmp_path / "hvd.json"
    _train("--provider", "hvd,hvd-python", "--steps", "6", "--json", str(out))
    native, python = (job["summary"] for job in json.loads(out.read_text())["jobs"])
    close_to_reference("mlp", native["losses"], 6)
    assert native["losses"] == python["losses"]
    assert native["bytes_per_step"] == 2 * 4 * (784 * 64 + 64 + 64 * 10 + 10)      # each rank's bucket, each way
    assert 0 <= native["overlap"] <= 1 and native["comm_ms_per_step"] > 0
    assert python["bytes_per_step"] is None and python["overlap"] is None          # not measured there
    out = tmp_path / "paired.json"
    assert "paired, hvd-python" in _train("--provider", "hvd", "--paired", "--steps", "9", "--json", str(out))
    p = json.loads(out.read_text())["jobs"][0]["summary"]["paired"]
    assert p["cycles"] == 2 and all(p[k] > 0 for k in ("hvd-python_ms", "hvd-python_of_floor", "of_hvd-python"))


def test_a_paired_job_times_both_floors_beside_the_provider_in_one_run(tmp_path):
    """rdmatensor-train --provider shm --paired: floor, sync floor and shm steps in turn in the
    same processes; the provider's counters leave the meetings out."""
    out = tmp_path / "paired.json"
    printed = _train("--provider", "shm", "--paired", "--steps", "8", "--json", str(out))
    assert "2 cycles of floor, sync floor, shm in turn" in printed
    job = json.loads(out.read_text())["jobs"][0]
    p, summary = job["summary"]["paired"], job["summary"]
    assert p["cycles"] == 2 and all(p[k] > 0 for k in ("none_ms", "sync_ms", "provider_ms", "of_floor", "of_sync"))
    assert summary["timed_steps"] == 2 and len(summary["losses"]) == 3       # the warm-up step's loss, then shm's
    assert summary["writes_per_step"] == 4          # the ring's two writes per worker, not the meetings'
    for rank in job["ranks"]:
        assert len(rank["paired_seconds"]["none"]) == len(rank["paired_seconds"]["sync"]) == 2
    bad = subprocess.run([sys.executable, "-m", "tf_plugin.training.cli", "--provider", "none", "--paired"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "paired with provider 'none'" in bad.stderr, bad.stderr[-1000:]
