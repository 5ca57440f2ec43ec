"""`rdmatensor-bench predict | fit | validate`: the step-time model's commands
(bench/step_model.py has the formulas; docs/step-model.md the figures).

    rdmatensor-bench fit                       # constants from this host's micro-benchmarks
    rdmatensor-bench predict --model resnet50_224 --ranks 64 --ranks-per-host 8 --link 100gbit \\
        --latency 2us --compute-ms 250 [--hierarchical] [--fusion-threshold 64M] [--rails 2]
    rdmatensor-bench predict --model vgg16_224 --ranks 16 --ranks-per-host 4 \\
        --perftest-bw ib_write_bw.txt --perftest-lat ib_write_lat.txt --compute-ms 415
    rdmatensor-bench validate --predict-only --json docs/step-model/predictions.json
    rdmatensor-bench validate --json docs/step-model/validation.json

predict: every constant not given comes from --constants (the cross-host link
from --provider's fit, the link within a host from --local-provider's, the
reduction rates), and the output names where each came from.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from . import step_model as sm

DEFAULT_CONSTANTS = "docs/step-model/constants-host.json"


def _arg(parser_fn):
    def wrap(text):
        try:
            return parser_fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return wrap


def predict_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdmatensor-bench predict",
                                description="Predicted step time, scaling efficiency and what bounds it.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", choices=sm.model_names(), help="a gradient set (bench/model_grads*.json)")
    what.add_argument("--tensors", help="COUNTxSIZE,... float32 gradients (as rdmatensor-bench step)")
    p.add_argument("--ranks", type=int, required=True, help="ranks in the job")
    p.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (default %(default)s)")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="compute per step on one rank (forward and backward), ms; 0: communication only")
    p.add_argument("--backprop-fraction", type=float, default=sm.DEFAULT_BACKPROP,
                   help="the share of compute that is backprop, over which gradients become ready "
                        "(an assumption; default %(default).2f)")
    p.add_argument("--no-overlap", action="store_true", help="all-reduce after compute, every bucket in lockstep")
    p.add_argument("--hierarchical", action="store_true",
                   help="hierarchical all-reduce (HOROVOD_HIERARCHICAL_ALLREDUCE)")
    p.add_argument("--fusion-threshold", type=_arg(sm.parse_size), default=None,
                   help="bytes per fusion bucket (0: none; default: tf_plugin's, 64M)")
    p.add_argument("--constants", default=DEFAULT_CONSTANTS, help="fitted constants (default %(default)s)")
    p.add_argument("--provider", default="tcp", help="fitted link for what --link etc. leave out (default %(default)s)")
    p.add_argument("--local-provider", default="shm", help="fitted link within a host (default %(default)s)")
    p.add_argument("--link", type=_arg(sm.parse_rate), help="cross-host bandwidth of one rail: 100gbit, 25Gb/s, 12GB/s")
    p.add_argument("--latency", type=_arg(sm.parse_time), help="cross-host latency: 2us, 800ns")
    p.add_argument("--per-tensor", type=_arg(sm.parse_time), help="cost of issuing (and of receiving) one write")
    p.add_argument("--ring-step", type=_arg(sm.parse_time),
                   help="the ring's bookkeeping per bucket and step on a host (default: fitted, --provider's)")
    p.add_argument("--rails", type=int, default=1, help="NICs per host a large write is striped over")
    p.add_argument("--perftest-bw", metavar="FILE", help="ib_write_bw output: the link's bandwidth")
    p.add_argument("--perftest-lat", metavar="FILE", help="ib_write_lat output: the link's latency")
    p.add_argument("--reduce-gbs", type=float, help="sum and copy rate, GB/s (default: fitted)")
    p.add_argument("--json", help="also write the prediction here")
    return p


def cluster_from(a) -> sm.Cluster:
    constants = sm.load_constants(a.constants)
    cross = sm.link_of(constants, a.provider, a.rails)
    given = []
    if a.link is not None:
        # a NIC's rate, both directions at once (full duplex): not the fitted link's β₂
        cross, _ = replace(cross, beta=1 / a.link, duplex_beta=None), given.append(f"{a.link * 8 / 1e9:g} Gbit/s")
    if a.latency is not None:
        cross, _ = replace(cross, alpha=a.latency), given.append(f"latency {a.latency * 1e6:g} us")
    if a.per_tensor is not None:
        cross, _ = replace(cross, per_tensor=a.per_tensor), given.append(f"per tensor {a.per_tensor * 1e6:g} us")
    if a.ring_step is not None:
        cross, _ = replace(cross, ring_step=a.ring_step), given.append(f"ring step {a.ring_step * 1e6:g} us")
    if given:
        cross = replace(cross, source=f"given: {', '.join(given)}; the rest fitted: {a.provider}")
    if a.perftest_bw or a.perftest_lat:
        read = lambda f: open(f).read() if f else None    # noqa: E731
        cross = sm.link_from_perftest(read(a.perftest_bw), read(a.perftest_lat), cross)
    red = sm.reduce_of(constants, shared=a.ranks_per_host > 1)     # a host's ranks sum at once
    if a.reduce_gbs:
        red = sm.Reduce(1 / (a.reduce_gbs * 1e9), 1 / (a.reduce_gbs * 1e9), f"given: {a.reduce_gbs:g} GB/s")
    local = sm.link_of(constants, a.local_provider)
    if a.ring_step is not None:
        local = replace(local, ring_step=a.ring_step)
    return sm.Cluster(a.ranks, a.ranks_per_host, cross, local, red, a.hierarchical)


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x >= 1e-3 else f"{x * 1e6:.3g} us"


def predict_main(argv: list[str]) -> int:
    p = predict_parser()
    a = p.parse_args(argv)
    if a.ranks < 1 or a.ranks_per_host < 1 or a.ranks % a.ranks_per_host and a.ranks > a.ranks_per_host:
        p.error("--ranks must be a multiple of --ranks-per-host")
    if a.rails < 1:
        p.error("--rails takes 1 or more")
    if a.tensors:
        grads, name = sm.synthetic_set(sm.parse_tensors(a.tensors)), a.tensors
    else:
        grads, name = sm.gradient_set(a.model), a.model
    cluster = cluster_from(a)
    pr = sm.predict(grads, cluster, a.compute_ms / 1e3, a.fusion_threshold, a.backprop_fraction, not a.no_overlap)
    algo = "hierarchical all-reduce" if a.hierarchical and cluster.hosts > 1 and a.ranks_per_host > 1 else "flat ring"
    print(f"{name}: {pr.tensors} gradients, {pr.bytes / 1e6:.1f} MB in {pr.buckets} bucket(s) "
          f"(fusion threshold {'tf_plugin default' if a.fusion_threshold is None else a.fusion_threshold})")
    print(f"{a.ranks} ranks, {a.ranks_per_host} per host ({cluster.hosts} host(s)), {algo}, "
          f"{'overlapped with backprop' if not a.no_overlap else 'after compute'}")
    if cluster.hosts > 1:
        print(f"  across hosts: {cluster.cross.describe()}")
    if a.ranks_per_host > 1:
        print(f"  within a host: {cluster.local.describe()}")
    print(f"  reduction: sum {1 / cluster.reduce.add / 1e9:.2f} GB/s, copy {1 / cluster.reduce.copy / 1e9:.2f} GB/s "
          f"({cluster.reduce.source})")
    print("all-reduce terms: " + ", ".join(f"{t.replace('_', '-')} {_ms(getattr(pr.comm, t))}" for t in sm.TERMS)
          + f" (total {_ms(pr.comm.total)})")
    if pr.compute_s:
        print(f"compute {_ms(pr.compute_s)} (given; backprop {a.backprop_fraction:.0%} of it, assumed)")
        print(f"predicted step {_ms(pr.step_s)} (communication exposed {_ms(pr.exposed_s)}), "
              f"scaling efficiency {pr.efficiency:.1%}, bound by {pr.bound}")
    else:
        print(f"predicted all-reduce per step {_ms(pr.step_s)} (no --compute-ms: no efficiency), "
              f"bound by {pr.bound}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "rdmatensor-bench predict " + " ".join(argv), "prediction": pr.as_dict()}, f,
                      indent=1)
    return 0


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "predict":
        return predict_main(rest)
    if mode == "fit":
        from .step_fit import main as fit_main
        return fit_main(rest)
    from .step_validate import main as validate_main
    return validate_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
