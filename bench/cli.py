"""rdmatensor-bench: latency and bandwidth of every provider, side by side with
gRPC and with each provider's physical reference, in one run.

    rdmatensor-bench                         # lat + bw sweeps + setup, every viable provider
    rdmatensor-bench bw --providers verbs    # verbs here has no RDMA: runs in a SoftRoCE VM
    rdmatensor-bench lat --sizes 8,4K --seconds 2 --json out.json --plot out.png
    rdmatensor-bench step --step-tensors 20x256K,4x4M
    rdmatensor-bench step --model resnet50   # a real model's gradient set (bench/model_grads.json)
    rdmatensor-bench paper --json paper.json # one-sided writes against gRPC and an RDMA-optimized RPC
    rdmatensor-bench lat --providers verbs --verbs-endpoint pyverbs,native   # both RC endpoints, side by side
    # across two machines, like perftest (same command on both, rank 1 first):
    rdmatensor-bench bw --providers verbs --rank 1 --peers HOST0:47500,HOST1:47500
    rdmatensor-bench bw --providers verbs --rank 0 --peers HOST0:47500,HOST1:47500

Modes: lat (ping-pong; half the round trip: min, median, p99, max), bw (a
window of writes in flight; MB/s, Gb/s, messages/s), step (a training step's
tensors per iteration), setup (connect cost against the number of tensors),
all (lat, bw and setup), paper (lat, bw and real models' steps for verbs,
verbs-rpc and grpc on one SoftRoCE device, with the research paper's two
ratios: one-sided over gRPC, one-sided over RDMA-optimized RPC). Every row carries its ratio to gRPC and to its
reference (perftest for verbs, memcpy for shm, raw sockets for tcp).

The step-time model (bench/step_model.py, docs/step-model.md): what a
synchronous training step costs on a cluster, from constants fitted to these
micro-benchmarks or a fabric's own figures.

    rdmatensor-bench fit --json docs/step-model/constants-host.json    # alpha, beta, per-tensor cost, sum rate
    rdmatensor-bench predict --model resnet50_224 --ranks 64 --ranks-per-host 8 --link 100gbit \\
        --latency 2us --compute-ms 250 [--hierarchical] [--fusion-threshold 64M] [--constants FILE]
    rdmatensor-bench predict --model vgg16_224 --ranks 16 --ranks-per-host 4 --perftest-bw bw.txt --perftest-lat lat.txt
    rdmatensor-bench validate --json docs/step-model/validation.json   # predicted against measured, paired rounds

predict prints the predicted step time, the scaling efficiency (compute / step)
and what bounds it (latency, bandwidth, per-tensor cost, reduction or compute);
`rdmatensor-bench predict --help` lists its flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import subprocess
import sys
from dataclasses import asdict

from rdmatensor.providers import NAMES, provider_class
from rdmatensor.providers.verbs.choose_endpoint import ENDPOINTS
from rdmatensor.runner.cores import pin_threads

from . import model_grads, report, step_model
from .points import Point, run_point
from .references import reference
from .setup_cost import run_setup

DEFAULT_BW_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M"
DEFAULT_LAT_SIZES = "8,64,512,4K,32K,256K,1M"
DEFAULT_STEP = "8x4K,8x64K,4x1M,2x4M"      # a small model's gradients
DEFAULT_SETUP = "10,100,1000,10000"
PAPER_PROVIDERS = "verbs,verbs-rpc,grpc"
PAPER_LAT_SIZES = "8,4K,64K,1M"
PAPER_BW_SIZES = "4K,64K,1M,4M,16M"
PAPER_MODELS = ("resnet50", "vgg16", "densenet121", "lstm_lm")


def parse_size(text: str) -> int:
    """A benchmark's size in bytes: 1 byte to 4 GiB (the model's parser, which also allows 0)."""
    try:
        value = step_model.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0 or value > (1 << 32):
        raise argparse.ArgumentTypeError(f"size {text!r} must be 1 byte to 4 GiB")
    return value


def parse_sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def parse_step(text: str) -> tuple:
    try:
        return tuple(step_model.parse_tensors(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad step tensors: {exc}") from None


def parse_endpoints(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ENDPOINTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown endpoint(s) {', '.join(bad)}: choose from {', '.join(ENDPOINTS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdmatensor-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="all", choices=("all", "lat", "bw", "step", "setup", "paper"))
    p.add_argument("--providers", help=f"comma-separated (default {','.join(NAMES)}; "
                                       f"paper: {PAPER_PROVIDERS})")
    p.add_argument("--sizes", type=parse_sizes, help=f"bw sizes (default {DEFAULT_BW_SIZES})")
    p.add_argument("--lat-sizes", type=parse_sizes, help=f"lat sizes (default {DEFAULT_LAT_SIZES}; "
                                                          "--sizes sets both when only it is given)")
    p.add_argument("--seconds", type=float, default=0.5,
                   help="time budget per point (default %(default)s); a latency point measures at least this long, "
                        "1 s and 200 round trips, after a warm-up of 0.5 s or a fifth of it")
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations per point")
    p.add_argument("--max-iters", type=int, default=100000)
    p.add_argument("--step-tensors", type=parse_step, default=parse_step(DEFAULT_STEP),
                   help=f"step mode: COUNTxSIZE,... (default {DEFAULT_STEP})")
    p.add_argument("--model", choices=model_grads.names(),
                   help="step mode: the gradient set of this model instead of --step-tensors")
    p.add_argument("--setup-counts", default=DEFAULT_SETUP, help="setup mode: tensor counts")
    p.add_argument("--setup-bytes", type=parse_size, default=parse_size("1K"), help="bytes per tensor (setup)")
    p.add_argument("--verbs-endpoint", type=parse_endpoints, default=[],
                   help="verbs providers: measure each point on these RC endpoints, side by side "
                        f"({','.join(ENDPOINTS)}; default: the one the provider opens)")
    p.add_argument("--no-references", action="store_true", help="skip perftest/memcpy/socket references")
    p.add_argument("--checksum", choices=("off", "on", "both"), default="off",
                   help="CRC32 on every tensor; `both` measures each point with and without")
    p.add_argument("--send-many", choices=("off", "on", "both"), default="off",
                   help="step and bw modes: send a step's tensors (bw: a window's) with one send_many() "
                        "call (verbs: up to 32 writes per doorbell); `both` measures each point with and without")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure each point N times, each time next to its reference (after it in odd rounds, "
                        "before it in even ones: interleaved, as the machine's load changes); the table shows "
                        "medians, and the ratio's range over the rounds")
    p.add_argument("--bind", choices=("core", "none"), default="core",
                   help="both ranks on this host: rank 0 and the reference's client on one CPU, rank 1 and its "
                        "server on another, as rdmatensor-run binds ranks (default core; none: unbound)")
    p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)     # the CPU the serving rank is bound to
    p.add_argument("--tx-depth", type=int, default=0, metavar="N",
                   help="bw mode: writes in flight, as perftest's -t (default: 16, fewer above 1 MiB)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON (schema in docs/results.md)")
    p.add_argument("--plot", metavar="FILE.png", help="bandwidth and latency against size")
    p.add_argument("--rank", type=int, choices=(0, 1), help="server/client mode: this side's rank")
    p.add_argument("--peers", help="server/client mode: HOST0:PORT,HOST1:PORT (point i uses PORT+i)")
    p.add_argument("--softroce-vm", action="store_true",
                   help="run inside a SoftRoCE VM (automatic when verbs is asked for and absent)")
    p.add_argument("--in-vm", action="store_true", help=argparse.SUPPRESS)
    return p


def points_for(a, providers: list[str]) -> list[Point]:
    bw_sizes = a.sizes or parse_sizes(DEFAULT_BW_SIZES)
    lat_sizes = a.lat_sizes or ([s for s in a.sizes] if a.sizes else parse_sizes(DEFAULT_LAT_SIZES))
    common = dict(seconds=a.seconds, warmup=a.warmup, max_iters=a.max_iters)
    crcs = {"off": (False,), "on": (True,), "both": (False, True)}[a.checksum]
    pts = []
    if a.mode in ("all", "lat"):
        pts += [Point("lat", pr, s, checksum=c, **common) for s in lat_sizes for pr in providers for c in crcs]
    manys = {"off": (False,), "on": (True,), "both": (False, True)}[a.send_many]
    if a.mode in ("all", "bw"):
        pts += [Point("bw", pr, s, checksum=c, send_many=m, tx_depth=a.tx_depth, **common)
                for s in bw_sizes for pr in providers for c in crcs for m in manys]
    if a.mode == "step":
        tensors = model_grads.tensor_sizes(a.model) if a.model else a.step_tensors
        pts += [Point("step", pr, sum(tensors), tensors=tensors, checksum=c, model=a.model or "", send_many=m,
                      **common) for pr in providers for c in crcs for m in manys]
    if a.mode == "paper":
        pts += [Point("lat", pr, s, **common) for s in parse_sizes(PAPER_LAT_SIZES) for pr in providers]
        pts += [Point("bw", pr, s, **common) for s in parse_sizes(PAPER_BW_SIZES) for pr in providers]
        for model in PAPER_MODELS:       # whole steps of real models: one warm-up, a few measured
            tensors = model_grads.tensor_sizes(model)
            pts += [Point("step", pr, sum(tensors), tensors=tensors, model=model, seconds=a.seconds,
                          warmup=1, max_iters=a.max_iters) for pr in providers]
    if a.verbs_endpoint:     # each verbs point once per endpoint, next to each other
        pts = [dataclasses.replace(p, endpoint=e) if p.provider.startswith("verbs") else p
               for p in pts for e in (a.verbs_endpoint if p.provider.startswith("verbs") else [""])]
    return [p for p in pts for _ in range(a.rounds)]     # a point's rounds one after another


def setup_points(a, providers: list[str]) -> list[tuple[str, int]]:
    if a.mode not in ("all", "setup"):
        return []
    counts = [int(c) for c in a.setup_counts.split(",")]
    return [(pr, c) for c in counts for pr in providers if pr != "grpc" or c <= 1000]


def _peers(a, index: int) -> dict:
    hosts = a.peers.split(",")
    out = {}
    for r, hp in enumerate(hosts):
        host, port = hp.rsplit(":", 1)
        out[r] = f"{host}:{int(port) + index}"
    return out


def _viable(names: list[str]) -> tuple[list[str], dict]:
    ok, skipped = [], {}
    for name in names:
        try:
            good, why = provider_class(name).viable()
        except Exception as exc:  # noqa: BLE001 - an unknown name is reported like the rest
            good, why = False, str(exc)
        if good:
            ok.append(name)
        else:
            skipped[name] = why
    return ok, skipped


def _device():
    from rdmatensor.devices import active_port
    found = active_port()
    if not found:
        return None
    gid = found[1].roce_v2_gid()
    return found[0].name, gid.index if gid else 0


def _in_vm(argv: list[str], a) -> int:
    """Run this same benchmark inside a SoftRoCE VM, results written to shared dirs."""
    from rdmatensor.softroce import run as vm_run
    argv = [x for x in argv if x != "--softroce-vm"]
    shares = sorted({os.path.dirname(os.path.abspath(f)) for f in (a.json, a.plot) if f})
    for flag in ("--json", "--plot"):
        value = getattr(a, flag[2:])
        if value:
            argv = [os.path.abspath(value) if x == value else x for x in argv]
    print("rdmatensor-bench: verbs needs RDMA; running inside a SoftRoCE VM", file=sys.stderr)
    command = [sys.executable, "-m", f"{__package__}.cli", *argv, "--in-vm"]
    return vm_run(command, timeout=7200, shares=shares).returncode


STEP_MODEL_MODES = ("predict", "fit", "validate")     # the step-time model: bench/step_cli.py


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in STEP_MODEL_MODES:
        from .step_cli import main as step_main
        return step_main(argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    if not 0 <= a.tx_depth <= 4096:
        parser.error(f"--tx-depth takes 1..4096 writes in flight (0: automatic), not {a.tx_depth}")
    if not 1 <= a.rounds <= 100:
        parser.error(f"--rounds takes 1..100, not {a.rounds}")
    a.providers = a.providers or (PAPER_PROVIDERS if a.mode == "paper" else ",".join(NAMES))
    asked = [x.strip() for x in a.providers.split(",") if x.strip()]
    unknown = [x for x in asked if x not in NAMES]
    if unknown:
        print(f"rdmatensor-bench: unknown provider(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    providers, skipped = _viable(asked)
    explicit_verbs = any(n.startswith("verbs") for n in asked) and a.providers != ",".join(NAMES)
    needs_vm = any(n.startswith("verbs") for n in skipped)
    if not a.in_vm and a.rank is None and needs_vm and (a.softroce_vm or explicit_verbs):
        return _in_vm(argv, a)
    for name, why in skipped.items():
        print(f"rdmatensor-bench: skipping {name}: {why}", file=sys.stderr)
    if not providers:
        print("rdmatensor-bench: no provider can run here", file=sys.stderr)
        return 1

    points = points_for(a, providers)
    setups = setup_points(a, providers)
    if a.rank == 1:
        return _serve(a, points, setups)
    return _measure(a, argv, points, setups, providers, skipped)


def _cpus(a) -> tuple[int, int] | None:
    """(rank 0's CPU, rank 1's CPU) when both ranks run here bound, else None."""
    if a.bind != "core" or a.rank is not None:
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:                   # no affinity on this platform
        return None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def _serve(a, points, setups) -> int:
    if a.cpu is not None:
        pin_threads({a.cpu})
    for i, point in enumerate(points):
        run_point(1, _peers(a, i), point)
    for j, (provider, count) in enumerate(setups):
        run_setup(1, _peers(a, len(points) + j), provider, count, a.setup_bytes)
    return 0


def _measure(a, argv, points, setups, providers, skipped) -> int:
    child = None
    if a.rank is None:          # local mode: spawn rank 1 with the same arguments
        # Below the kernel's ephemeral range, so no outgoing connection takes them.
        span = len(points) + len(setups) + 1
        base = random.randint(20000, 32000 - 2 * span)
        a.peers = f"127.0.0.1:{base},127.0.0.1:{base + span}"
        cpus = _cpus(a)
        child = subprocess.Popen([sys.executable, "-m", f"{__package__}.cli", *argv, "--rank", "1", "--peers", a.peers,
                                  "--providers", ",".join(providers), *(["--in-vm"] if a.in_vm else []),
                                  *(["--cpu", str(cpus[1])] if cpus else [])])
        if cpus:
            pin_threads({cpus[0]})
    else:
        cpus = None
    device = _device() if "verbs" in providers and not a.no_references else None
    rows, setup_rows, references = [], [], {}
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(points) + len(setups), desc="rdmatensor-bench", unit="point",
                   file=sys.stderr, delay=2, dynamic_ncols=True)
        for i, point in enumerate(points):
            bar.set_postfix_str(f"{point.mode} {point.label} {report.human(point.size)}")
            # one reference for every endpoint's row; with rounds, one per round, run after the
            # point in odd rounds and before it in even ones, so that neither always goes first
            key = point.provider, point.mode, point.size, (i if a.rounds > 1 else 0)
            wants = not a.no_references and point.mode in ("lat", "bw")
            order = "after"
            if wants and a.rounds > 1 and i % a.rounds % 2 == 1 and key not in references:
                references[key], order = reference(point.provider, point.mode, point.size, device, cpus), "before"
            row = asdict(run_point(0, _peers(a, i), point))
            if wants:
                if key not in references:
                    references[key] = reference(point.provider, point.mode, point.size, device, cpus)
                row["reference"], row["reference_ran"] = references[key], order
            rows.append(row)
            bar.update()
        for j, (provider, count) in enumerate(setups):
            bar.set_postfix_str(f"setup {provider} {count}")
            setup_rows.append(run_setup(0, _peers(a, len(points) + j), provider, count, a.setup_bytes))
            bar.update()
        bar.close()
    except BaseException:
        if child:
            if child.poll() is not None:
                print(f"rdmatensor-bench: the serving rank exited ({child.returncode})", file=sys.stderr)
            child.kill()
        raise
    if child and child.wait(120) != 0:
        print("rdmatensor-bench: the serving rank failed", file=sys.stderr)
        return 1
    _ratios(rows)
    rows = report.medians(rows, a.rounds)
    targets = evaluate_targets(rows, setup_rows)
    print(report.table(rows))
    if a.mode == "paper":
        print()
        print(report.paper_table(rows))
    if setup_rows:
        print()
        print(report.setup_table(setup_rows))
    if targets:
        print()
        print("targets")
        for t in targets:
            print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {t['measured']}")
    if skipped:
        print()
        for name, why in skipped.items():
            print(f"skipped {name}: {why}")
    if a.json:
        report.write_json(a.json, rows, setup_rows, skipped, targets)
    if a.plot:
        report.plot(a.plot, rows)
    return 0


def _ratios(rows: list[dict]) -> None:
    """Each row against the baselines measured at the same point (gRPC, and the
    RDMA-optimized RPC when it ran): above 1 means faster than the baseline."""
    def key(r):
        return r["mode"], r["size"], r.get("extra", {}).get("model", "")
    for baseline in ("grpc", "verbs-rpc"):
        base = {key(r): r for r in rows if r["provider"] == baseline}
        field = "ratio_to_" + baseline.replace("-", "_")
        for r in rows:
            b = base.get(key(r))
            if r["mode"] == "lat":     # kept as a time ratio: below 1 is faster
                r[field] = r["lat_us"]["median"] / b["lat_us"]["median"] if b else None
            else:
                r[field] = r["mb_per_s"] / b["mb_per_s"] if b else None
    for r in rows:
        ref = r.get("reference") or {}
        if r["mode"] == "lat":
            r["ratio_to_reference"] = (r["lat_us"]["median"] / ref["lat_us"]) if ref.get("lat_us") else None
        else:
            r["ratio_to_reference"] = (r["mb_per_s"] / ref["mb_per_s"]) if ref.get("mb_per_s") else None


def evaluate_targets(rows: list[dict], setup_rows: list[dict]) -> list[dict]:
    """The transport's published targets, checked against this run."""
    def row(mode, provider, size):
        return next((r for r in rows if (r["mode"], r["provider"], r["size"]) == (mode, provider, size)), None)
    out = []

    def check(target, ok, measured):
        out.append({"target": target, "met": bool(ok), "measured": measured})

    # verbs against perftest on the same device (each RC endpoint's rows, when measured side by
    # side; with --send-many, the batched rows too)
    for name in sorted({r["provider"] for r in rows if r["provider"].split("+")[0].split("/")[0] == "verbs"
                        and "+crc" not in r["provider"]}):
        for size, label in ((64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (4 << 20, "4 MiB")):
            r = row("bw", name, size)
            if r and r.get("ratio_to_reference"):
                check(f"{name} bw >= 0.95x ib_write_bw at {label}", r["ratio_to_reference"] >= 0.95,
                      f"{r['mb_per_s']:.1f} MB/s = {r['ratio_to_reference']:.2f}x")
        r = row("lat", name, 8)
        if r and r.get("ratio_to_reference"):
            check(f"{name} 8 B half round trip <= 3x ib_write_lat", r["ratio_to_reference"] <= 3,
                  f"{r['lat_us']['median']:.1f} us = {r['ratio_to_reference']:.2f}x")
    for provider, ref_min, grpc_min in (("shm", 0.7, 15), ("tcp", 0.8, 4)):
        r = row("bw", provider, 64 << 20)
        if r and r.get("ratio_to_reference") is not None:
            check(f"{provider} 64 MiB >= {ref_min}x reference", r["ratio_to_reference"] >= ref_min,
                  f"{r['mb_per_s']:.0f} MB/s = {r['ratio_to_reference']:.2f}x")
        if r and r.get("ratio_to_grpc"):
            check(f"{provider} 64 MiB >= {grpc_min}x grpc", r["ratio_to_grpc"] >= grpc_min,
                  f"{r['ratio_to_grpc']:.1f}x")
    for provider, frac in (("shm", 20), ("tcp", 5)):
        r = row("lat", provider, 4096)
        if r and r.get("ratio_to_grpc"):
            check(f"{provider} 4 KiB latency <= 1/{frac} of grpc", r["ratio_to_grpc"] <= 1 / frac,
                  f"{r['lat_us']['median']:.1f} us = 1/{1 / r['ratio_to_grpc']:.1f}")
    for s in setup_rows:
        if s["tensors"] == 10000 and s["provider"] in ("shm", "tcp"):
            check(f"setup of 10,000 tensors on {s['provider']} < 1 s", s["setup_s"] < 1.0,
                  f"{s['setup_s']:.3f} s")
    # Per-message overhead on the host: a tiny tensor's half round trip, and a
    # step of 1,000 tiny tensors (sent, then received) per tensor.
    for provider, bound in (("shm", 10.0), ("tcp", 20.0)):
        r = row("lat", provider, 8)
        if r:
            check(f"{provider} 8 B half round trip <= {bound:.0f} us", r["lat_us"]["median"] <= bound,
                  f"{r['lat_us']['median']:.1f} us")
    r = row("step", "shm", 1000 * 8)
    if r and r.get("extra", {}).get("tensors") == 1000 and r.get("msg_per_s"):
        check("shm 1,000-tensor step (1000x8) <= 5 us per tensor", 1e6 / r["msg_per_s"] <= 5.0,
              f"{1e6 / r['msg_per_s']:.1f} us per tensor")
    return out


if __name__ == "__main__":
    sys.exit(main())
