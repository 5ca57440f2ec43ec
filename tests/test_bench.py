"""rdmatensor-bench: arguments, a short real run with JSON and plot, target checks."""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.perftest import parse_write_bw
from bench.cli import _cpus, build_parser, evaluate_targets, parse_size, parse_step, points_for

ROOT = Path(__file__).resolve().parents[1]


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_sizes_and_steps_parse():
    assert parse_size("8") == 8 and parse_size("4K") == 4096 and parse_size("64MiB") == 64 << 20
    assert parse_step("2x4K,1x1M") == (4096, 4096, 1 << 20)
    for bad in ("0", "-1", "12Q", "8G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_unknown_provider_is_refused():
    res = bench("bw", "--providers", "tcp,pigeon")
    assert res.returncode == 2 and "pigeon" in res.stderr


def test_short_run_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = bench("all", "--providers", "shm,tcp,grpc", "--sizes", "4K", "--lat-sizes", "4K", "--seconds", "0.1",
                "--setup-counts", "10", "--json", str(out), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert "latency: half round trip" in res.stdout and "bandwidth" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "rdmatensor-bench/1"
    modes = {(r["mode"], r["provider"]) for r in doc["rows"]}
    assert modes == {(m, p) for m in ("lat", "bw") for p in ("shm", "tcp", "grpc")}
    for r in doc["rows"]:
        assert r["size"] == 4096 and r["iterations"] >= 3
        if r["provider"] != "grpc":
            assert r["ratio_to_grpc"] > 0
            assert r["reference"]["name"] in ("memcpy", "socket")
        if r["mode"] == "lat":
            lat = r["lat_us"]
            assert 0 < lat["min"] <= lat["median"] <= lat["p99"] <= lat["max"]
        else:
            assert r["mb_per_s"] > 0 and r["msg_per_s"] > 0
    assert {s["provider"] for s in doc["setup"]} == {"shm", "tcp", "grpc"}
    assert all(s["control_calls"] == 2 for s in doc["setup"])       # Hello, then the Exchange
    assert png.stat().st_size > 10000
    if "verbs" in doc["skipped"]:
        assert "verbs" in res.stdout.split("skipped")[-1]


def test_rounds_interleave_each_point_with_its_reference_and_report_medians(tmp_path):
    out = tmp_path / "r.json"
    res = bench("bw", "--providers", "tcp", "--sizes", "4K", "--seconds", "0.1", "--rounds", "3", "--json", str(out))
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rounds"] == 3 and len(row["per_round"]) == 3
    ratios = sorted(r["ratio_to_reference"] for r in row["per_round"])
    assert row["ratio_to_reference"] == ratios[1] and row["ratio_range"] == [ratios[0], ratios[2]]
    assert row["mb_per_s"] == sorted(r["mb_per_s"] for r in row["per_round"])[1]
    assert len({r["reference"]["mb_per_s"] for r in row["per_round"]}) == 3      # a reference measured per round
    assert [r["reference_ran"] for r in row["per_round"]] == ["after", "before", "after"]   # neither always first
    assert f"({ratios[0]:.2f}-{ratios[2]:.2f})" in res.stdout
    assert bench("bw", "--providers", "tcp", "--rounds", "0").returncode == 2


def test_both_local_ranks_are_bound_to_their_own_cpus_unless_asked_not_to():
    cpus = sorted(os.sched_getaffinity(0))
    local = build_parser().parse_args(["bw"])
    assert _cpus(local) == ((cpus[0], cpus[1]) if len(cpus) >= 2 else None)
    assert _cpus(build_parser().parse_args(["bw", "--bind", "none"])) is None
    assert _cpus(build_parser().parse_args(["bw", "--rank", "0", "--peers", "a:1,b:1"])) is None   # across hosts


def test_step_mode_moves_a_whole_step():
    res = bench("step", "--providers", "tcp", "--step-tensors", "3x4K,1x64K", "--seconds", "0.1")
    assert res.returncode == 0, res.stderr
    assert "step  tcp" in res.stdout


def test_send_many_is_measured_beside_send_in_step_and_bw_modes(tmp_path):
    out = tmp_path / "m.json"
    res = bench("bw", "--providers", "tcp", "--sizes", "64K", "--seconds", "0.1", "--send-many", "both",
                "--no-references", "--json", str(out))
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["provider"] for r in rows] == ["tcp", "tcp+many"] and all(r["mb_per_s"] > 0 for r in rows)
    res = bench("step", "--providers", "shm", "--step-tensors", "40x4K", "--seconds", "0.1", "--send-many", "on")
    assert res.returncode == 0, res.stderr
    assert "step  shm+many" in res.stdout


def test_targets_are_judged_from_the_rows():
    rows = [
        {"mode": "bw", "provider": "tcp", "size": 64 << 20, "mb_per_s": 900.0, "ratio_to_reference": 0.9,
         "ratio_to_grpc": 3.0},
        {"mode": "lat", "provider": "shm", "size": 4096, "lat_us": {"median": 10.0}, "ratio_to_grpc": 0.04},
        {"mode": "lat", "provider": "shm", "size": 8, "lat_us": {"median": 9.5}},
        {"mode": "lat", "provider": "tcp", "size": 8, "lat_us": {"median": 20.5}},
        {"mode": "step", "provider": "shm", "size": 8000, "msg_per_s": 250000.0, "extra": {"tensors": 1000}},
    ]
    setup = [{"provider": "tcp", "tensors": 10000, "setup_s": 1.5}]
    got = {t["target"]: t["met"] for t in evaluate_targets(rows, setup)}
    assert got["tcp 64 MiB >= 0.8x reference"] is True
    assert got["tcp 64 MiB >= 4x grpc"] is False
    assert got["shm 4 KiB latency <= 1/20 of grpc"] is True
    assert got["setup of 10,000 tensors on tcp < 1 s"] is False
    assert got["shm 8 B half round trip <= 10 us"] is True
    assert got["tcp 8 B half round trip <= 20 us"] is False
    assert got["shm 1,000-tensor step (1000x8) <= 5 us per tensor"] is True


def test_verbs_targets_are_judged_per_endpoint():
    def bw(provider, size, ratio):
        return {"mode": "bw", "provider": provider, "size": size, "mb_per_s": 50.0, "ratio_to_reference": ratio}
    rows = [bw("verbs/native", 64 << 10, 0.97), bw("verbs/native", 1 << 20, 0.94), bw("verbs/pyverbs", 4 << 20, 0.5),
            bw("verbs/native+crc", 4 << 20, 0.2), bw("verbs+many", 1 << 20, 1.1),
            {"mode": "lat", "provider": "verbs/native", "size": 8, "lat_us": {"median": 60.0},
             "ratio_to_reference": 2.4},
            {"mode": "lat", "provider": "verbs/pyverbs", "size": 8, "lat_us": {"median": 900.0},
             "ratio_to_reference": 66.0}]
    got = {t["target"]: t["met"] for t in evaluate_targets(rows, [])}
    assert got == {"verbs/native bw >= 0.95x ib_write_bw at 64 KiB": True,
                   "verbs/native bw >= 0.95x ib_write_bw at 1 MiB": False,
                   "verbs/native 8 B half round trip <= 3x ib_write_lat": True,
                   "verbs/pyverbs bw >= 0.95x ib_write_bw at 4 MiB": False,
                   "verbs/pyverbs 8 B half round trip <= 3x ib_write_lat": False,
                   "verbs+many bw >= 0.95x ib_write_bw at 1 MiB": True}


def test_verbs_endpoints_are_measured_side_by_side():
    a = build_parser().parse_args(["lat", "--providers", "verbs,tcp", "--lat-sizes", "8",
                                   "--verbs-endpoint", "pyverbs,native"])
    assert [p.label for p in points_for(a, ["verbs", "tcp"])] == ["verbs/pyverbs", "verbs/native", "tcp"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["lat", "--verbs-endpoint", "fast"])


@pytest.mark.rdma
def test_verbs_bandwidth_and_latency_against_perftest(tmp_path):
    out = tmp_path / "v.json"
    res = bench("all", "--providers", "verbs", "--sizes", "1M", "--lat-sizes", "8", "--seconds", "0.3",
                "--setup-counts", "100", "--json", str(out), timeout=600)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["rows"]}
    assert rows["bw"]["reference"]["name"] == "ib_write_bw" and rows["bw"]["ratio_to_reference"] > 0
    assert rows["lat"]["reference"]["name"] == "ib_write_lat"
    print(res.stdout)


def ring_cpu_row(tmp_path, provider: str):
    """bench.ring_cpu, one round of one call on MobileNetV2's gradients: its row and the process."""
    out = tmp_path / "ring.json"
    res = subprocess.run([sys.executable, "-m", "bench.ring_cpu", "--models", "mobilenetv2", "--providers", provider,
                          "--rounds", "1", "--calls", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    return row, res


@pytest.mark.rdma
def test_verbs_benchmarks(tmp_path):
    """Over verbs: bench.ring_cpu's ways, the outputs written from where they are and staged, each
    result checked bit for bit; bench.cpu_split's per-write CPU beside ib_write_bw's; --tx-depth;
    bench.registration_cost."""
    row, _ = ring_cpu_row(tmp_path, "verbs")
    assert row["staged_wall_ms"] > 0 and row["wall_staged_over_stream"] > 0
    res = subprocess.run([sys.executable, "-m", "bench.cpu_split", "--size", "64K", "--seconds", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rates = dict(re.findall(r"^\| (rdmatensor verbs|ib_write_bw) \| ([\d.]+) \|", res.stdout, re.M))
    assert set(rates) == {"rdmatensor verbs", "ib_write_bw"} and all(float(r) > 0 for r in rates.values())
    res = bench("bw", "--providers", "verbs", "--sizes", "64K", "--seconds", "0.3", "--tx-depth", "64",
                "--no-references", "--json", str(tmp_path / "d.json"), timeout=600)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "d.json").read_text())["rows"][0]["window"] == 64
    res = subprocess.run([sys.executable, "-m", "bench.registration_cost", "--sizes", "64K,1M", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    costs = re.findall(r"^\| (\d+) KiB \| (\d+) \| (\d+) \|", res.stdout, re.M)
    assert [c[0] for c in costs] == ["64", "1024"] and all(int(r) > 0 and int(c) > 0 for _, r, c in costs)


def test_ring_cpu_measures_every_way_with_results_checked(tmp_path):
    """bench.ring_cpu, short: two ranks all-reduce MobileNetV2's gradients every way,
    each way's result checked bit for bit against numpy's mean before it is timed."""
    row, res = ring_cpu_row(tmp_path, "shm")
    assert "staged_wall_ms" not in row                        # measured only where writes need registration
    assert row["model"] == "mobilenetv2" and row["provider"] == "shm" and row["fused_buckets"] >= 1
    assert all(row[f"{way}_cpu_ms"] > 0 and row[f"{way}_wall_ms"] > 0
               for way in ("stream", "gather", "copy", "traffic"))
    assert row["wall_stream_over_traffic"] > 0
    assert "| mobilenetv2 | shm |" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.ring_cpu", "--rounds", "0"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--rounds and --calls must be at least 1" in bad.stderr


def test_graph_boundary_times_every_way_with_the_flat_result_checked():
    """bench.graph_boundary, short: MobileNetV2's gradients out of and back into a
    tf.function every way, the flat way's members checked against the buffer first."""
    res = subprocess.run([sys.executable, "-m", "bench.graph_boundary", "--models", "mobilenetv2",
                          "--rounds", "1", "--calls", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = [line.split() for line in res.stdout.splitlines() if line.startswith("mobilenetv2")]
    assert row[1] == "158" and all(float(ms) > 0 for ms in row[3:6])
    bad = subprocess.run([sys.executable, "-m", "bench.graph_boundary", "--models", "alexnet"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "unknown model 'alexnet'" in bad.stderr


def test_perftest_bandwidth_is_read_in_mib_to_four_digits():
    """ib_write_bw's own output (SoftRoCE VM, 64 KiB): its "MB/sec" are MiB/s, as
    its message rate in the same row shows; read to 0.01, not Gb/s to 0.01."""
    out = (" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
           " 65536      3000             85.46              84.48  \t\t   0.001352\n")
    r = parse_write_bw(out)
    assert r.iterations == 3000 and r.avg_mib_s == 84.48
    assert r.mb_per_s == pytest.approx(r.msg_rate_mpps * 1e6 * 65536 / 1e6, rel=1e-3)


def test_shm_executor_pairs_the_ways_and_refuses_bad_sizes(tmp_path):
    """bench.shm_executor, short: the C executor, its build that always yields and the twin
    between two processes with a spinning one beside, a row per size with positive times and
    the paired ratios to the first way."""
    out = tmp_path / "exec.json"
    ways = ("c", "c-always-yield", "twin")
    res = subprocess.run([sys.executable, "-m", "bench.shm_executor", "--sizes", "4,4096", "--ways", ",".join(ways),
                          "--rounds", "2", "--calls", "20", "--busy", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "1 spinning process beside them" in res.stdout, res.stdout
    rows = json.loads(out.read_text())["sizes"]
    assert [r["bytes"] for r in rows] == [4, 4096], rows
    for r in rows:
        assert all(len(r[w]["rounds_us"]) == 2 and r[w]["median_us"] > 0 for w in ways), r
        assert r["c-always-yield/c"]["median"] > 0 and r["twin/c"]["median"] > 0, r
    assert re.search(r"^\| 4,096 \| [\d,.]+ \(", res.stdout, re.M), res.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.shm_executor", "--sizes", "6"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "each a multiple of 4" in bad.stderr


def test_native_step_binds_each_rank_to_a_core_and_times_every_path(tmp_path):
    """bench.native_step, short: two ranks, each bound to a core of its own as the launcher
    binds them (the default), the plain and native tape steps timed, the binding recorded."""
    out = tmp_path / "step.json"
    res = subprocess.run([sys.executable, "-m", "bench.native_step", "--sizes", "2,4", "--rounds", "3", "--steps",
                          "2", "--warmup", "1", "--first-warmup", "5", "--paths", "tape-none,tape-native",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["bind"] == "core" and "each bound to its own core" in res.stdout
    assert (data["warmup"], data["first_warmup"]) == (1, 5) and "5 before a step's first" in res.stdout
    for path in ("tape-none", "tape-native"):
        assert all(us > 0 for us in data["paths"][path]["median_us"].values()), data["paths"][path]
    bad = subprocess.run([sys.executable, "-m", "bench.native_step", "--bind", "numa"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--bind" in bad.stderr
