"""Output: a perftest-like table, JSON (schema in the README), a PNG plot."""
from __future__ import annotations

import json
import platform
import time


def human(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def _f(x, fmt=".1f"):
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    out = []
    lat = [r for r in rows if r["mode"] == "lat"]
    if lat:
        out.append("latency: half round trip, microseconds")
        out.append(f"{'provider':8} {'size':>7} {'iters':>7} {'min':>9} {'median':>9} {'p99':>9} {'max':>9}"
                   f" {'x grpc':>7} {'reference':>16} {'x ref':>6}")
        for r in lat:
            ref = r.get("reference") or {}
            out.append(f"{r['provider']:8} {human(r['size']):>7} {r['iterations']:>7} "
                       f"{r['lat_us']['min']:>9.1f} {r['lat_us']['median']:>9.1f} {r['lat_us']['p99']:>9.1f} "
                       f"{r['lat_us']['max']:>9.1f} {_f(r.get('ratio_to_grpc'), '.3f'):>7} "
                       f"{(ref.get('name', '') + ' ' + _f(ref.get('lat_us'))) if ref else '-':>16} "
                       f"{_f(r.get('ratio_to_reference'), '.2f'):>6}")
    bw = [r for r in rows if r["mode"] in ("bw", "step")]
    if bw:
        out.append("")
        out.append("bandwidth")
        out.append(f"{'mode':5} {'provider':8} {'size':>7} {'iters':>7} {'MB/s':>10} {'Gb/s':>8} {'msg/s':>10}"
                   f" {'x grpc':>7} {'reference':>20} {'x ref':>6} {'copies':>6}")
        for r in bw:
            ref = r.get("reference") or {}
            out.append(f"{r['mode']:5} {r['provider']:8} {human(r['size']):>7} {r['iterations']:>7} "
                       f"{r['mb_per_s']:>10.1f} {r['gb_per_s']:>8.3f} {r['msg_per_s']:>10.0f} "
                       f"{_f(r.get('ratio_to_grpc'), '.2f'):>7} "
                       f"{(ref.get('name', '') + ' ' + _f(ref.get('mb_per_s'))) if ref else '-':>20} "
                       f"{_f(r.get('ratio_to_reference'), '.2f'):>6} {r.get('copies', 0):>6}")
    return "\n".join(out)


def setup_table(rows: list[dict]) -> str:
    out = ["setup: plan + register + exchange + barrier, one peer",
           f"{'provider':8} {'tensors':>8} {'bytes':>10} {'setup s':>9} {'us/tensor':>10} {'ctl calls':>9}"]
    for r in rows:
        out.append(f"{r['provider']:8} {r['tensors']:>8} {human(r['bytes']):>10} {r['setup_s']:>9.3f} "
                   f"{r['setup_s'] / r['tensors'] * 1e6:>10.1f} {r['control_calls']:>9}")
    return "\n".join(out)


def write_json(path: str, rows: list[dict], setup: list[dict], skipped: dict, targets: list[dict]) -> None:
    doc = {"schema": "rdmatensor-bench/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "host": platform.node(), "python": platform.python_version(),
           "rows": rows, "setup": setup, "skipped": skipped, "targets": targets}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"verbs": "tab:red", "shm": "tab:green", "tcp": "tab:blue", "grpc": "tab:gray"}
    for provider in colors:
        bw = sorted((r["size"], r["mb_per_s"], (r.get("reference") or {}).get("mb_per_s"))
                    for r in rows if r["mode"] == "bw" and r["provider"] == provider)
        if bw:
            ax_bw.plot([b[0] for b in bw], [b[1] for b in bw], "o-", color=colors[provider], label=provider)
            refs = [(b[0], b[2]) for b in bw if b[2]]
            if refs:
                ax_bw.plot(*zip(*refs, strict=False), "--", color=colors[provider], alpha=0.6,
                           label=f"{provider} reference")
        lat = sorted((r["size"], r["lat_us"]["median"], (r.get("reference") or {}).get("lat_us"))
                     for r in rows if r["mode"] == "lat" and r["provider"] == provider)
        if lat:
            ax_lat.plot([x[0] for x in lat], [x[1] for x in lat], "o-", color=colors[provider], label=provider)
            refs = [(x[0], x[2]) for x in lat if x[2]]
            if refs:
                ax_lat.plot(*zip(*refs, strict=False), "--", color=colors[provider], alpha=0.6,
                            label=f"{provider} reference")
    for ax, title, ylabel in ((ax_bw, "bandwidth", "MB/s"), (ax_lat, "latency (half round trip, median)", "µs")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per tensor")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
