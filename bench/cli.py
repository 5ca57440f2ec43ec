"""rdmatensor-bench: bandwidth of every provider side by side, with ratios to gRPC.

    rdmatensor-bench [--providers verbs,shm,tcp,grpc] [--sizes 1M,64M] [--json FILE]

Providers that cannot run here are skipped, with the reason. To measure
verbs on a host without RDMA, run it inside SoftRoCE:
    rdmatensor softroce vm -- rdmatensor-bench
"""
from __future__ import annotations

import argparse
import json
import sys

from rdmatensor.providers import NAMES, provider_class

from .bw import measure

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    try:
        value = int(text[:-1] if unit else text) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 8, 4K, 1M, 64M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("sizes must be positive")
    return value


def human(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rdmatensor-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--providers", default=",".join(NAMES))
    p.add_argument("--sizes", default="1M,64M", type=lambda s: [parse_size(x) for x in s.split(",")])
    p.add_argument("--bytes-per-point", type=parse_size, default=parse_size("512M"),
                   help="data moved per provider and size (sets the iterations)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    providers = []
    for name in a.providers.split(","):
        try:
            ok, why = provider_class(name).viable()
        except Exception as exc:  # noqa: BLE001 - unknown name: say so
            ok, why = False, str(exc)
        if ok:
            providers.append(name)
        else:
            print(f"skipping {name}: {why}", file=sys.stderr)
    rows = []
    for size in a.sizes:
        for name in providers:
            iters = max(5, min(2000, a.bytes_per_point // size))
            if name == "grpc":
                iters = max(3, iters // 8)     # the baseline is slow; keep the run short
            print(f"  {name:5} {human(size):>8} x {iters} ...", file=sys.stderr, flush=True)
            rows.append(measure(name, size, iters))
    base = {r.size: r.mb_per_s for r in rows if r.provider == "grpc"}
    print(f"{'provider':8} {'size':>8} {'iters':>6} {'MB/s':>10} {'x grpc':>7} {'copies':>6}")
    out = []
    for r in rows:
        ratio = r.mb_per_s / base[r.size] if r.size in base else None
        print(f"{r.provider:8} {human(r.size):>8} {r.iterations:>6} {r.mb_per_s:>10.1f} "
              f"{(f'{ratio:.1f}' if ratio else '-'):>7} {r.copies:>6}")
        out.append({**r.to_dict(), "ratio_to_grpc": ratio})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mode": "bw", "rows": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
