"""Output: a perftest-like table, JSON (schema in docs/results.md), a PNG plot."""
from __future__ import annotations

import functools
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


def _latency(key: str, r: dict) -> str:
    return f"{r['lat_us'][key]:.1f}"


def _reference(r: dict, field: str) -> str:
    ref = r.get("reference") or {}
    return (ref.get("name", "") + " " + _f(ref.get(field))) if ref else "-"


# (heading, width, cell) per column; a width below zero aligns left.
_LAT_COLUMNS = [
    ("provider", -13, lambda r: r["provider"]), ("size", 7, lambda r: human(r["size"])),
    ("iters", 7, lambda r: r["iterations"]),
    *[(k, 9, functools.partial(_latency, k)) for k in ("min", "median", "p99", "max")],
    ("x grpc", 7, lambda r: _f(r.get("ratio_to_grpc"), ".3f")), ("reference", 16, lambda r: _reference(r, "lat_us")),
    ("x ref", 6, lambda r: _ratio(r, ".2f"))]
_BW_COLUMNS = [
    ("mode", -5, lambda r: r["mode"]), ("provider", -13, lambda r: r["provider"]),
    ("size", 7, lambda r: human(r["size"])), ("iters", 7, lambda r: r["iterations"]),
    ("MB/s", 10, lambda r: f"{r['mb_per_s']:.1f}"), ("Gb/s", 8, lambda r: f"{r['gb_per_s']:.3f}"),
    ("msg/s", 10, lambda r: f"{r['msg_per_s']:.0f}"), ("x grpc", 7, lambda r: _f(r.get("ratio_to_grpc"), ".2f")),
    ("reference", 20, lambda r: _reference(r, "mb_per_s")),
    ("x ref", 6, lambda r: _ratio(r, ".2f")), ("copies", 6, lambda r: r.get("copies", 0))]


def _render(columns, rows: list[dict]) -> list[str]:
    cells = [[h for h, _, _ in columns]] + [[str(cell(r)) for _, _, cell in columns] for r in rows]
    widths = [max(abs(w), *(len(c[i]) for c in cells)) * (-1 if w < 0 else 1)
              for i, (_, w, _) in enumerate(columns)]       # a wider cell widens its column

    def line(row):
        return " ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(row, widths, strict=True))
    return [line(row) for row in cells]


def medians(rows: list[dict], rounds: int) -> list[dict]:
    """Each point's `rounds` consecutive rows as one: its median figures, and the
    median of the rounds' ratios with their range (`ratio_range`), every round
    kept in `per_round`."""
    if rounds <= 1:
        return rows
    out = []
    for k in range(0, len(rows), rounds):
        group = rows[k:k + rounds]
        row = dict(group[0], rounds=len(group), per_round=group)
        if row["mode"] == "lat":
            row["lat_us"] = {q: _median([r["lat_us"][q] for r in group]) for q in group[0]["lat_us"]}
        else:
            for f in ("mb_per_s", "gb_per_s", "msg_per_s"):
                row[f] = _median([r[f] for r in group])
        refs = [r.get("reference") for r in group]
        if all(refs):
            row["reference"] = dict(refs[0], **{f: _median([x[f] for x in refs])
                                               for f in ("mb_per_s", "lat_us") if f in refs[0]})
        for field in [f for f in group[0] if f.startswith("ratio_to_")]:
            values = [r[field] for r in group]
            if all(v is not None for v in values):
                row[field] = _median(values)
                if field == "ratio_to_reference":
                    row["ratio_range"] = [min(values), max(values)]
        out.append(row)
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _ratio(r: dict, fmt: str) -> str:
    value = _f(r.get("ratio_to_reference"), fmt)
    span = r.get("ratio_range")
    return f"{value} ({span[0]:{fmt}}-{span[1]:{fmt}})" if span else value


def table(rows: list[dict]) -> str:
    out = []
    lat = [r for r in rows if r["mode"] == "lat"]
    if lat:
        out += ["latency: half round trip, microseconds", *_render(_LAT_COLUMNS, lat)]
    bw = [r for r in rows if r["mode"] in ("bw", "step")]
    if bw:
        out += ["", "bandwidth", *_render(_BW_COLUMNS, bw)]
    return "\n".join(out)


def paper_table(rows: list[dict]) -> str:
    """The research paper's two comparisons: each one-sided provider's speed-up
    over gRPC and over the RDMA-optimized RPC (verbs-rpc), point by point."""
    baselines = ("grpc", "verbs-rpc")
    fast = sorted({r["provider"] for r in rows if r["provider"] not in baselines})
    points: dict = {}
    for r in rows:
        label = r.get("extra", {}).get("model") or human(r["size"])
        points.setdefault((r["mode"], label), {})[r["provider"]] = r

    def figure(r):
        return r["lat_us"]["median"] if r["mode"] == "lat" else r["mb_per_s"]

    providers = fast + [b for b in baselines if any(b in p for p in points.values())]
    head = f"{'mode':5} {'point':>11} " + " ".join(f"{p:>10}" for p in providers)
    for f in fast:
        head += " " + " ".join(f"{f + '/' + b:>16}" for b in baselines if b in providers)
    out = ["speed-up of one-sided writes (lat: us, half round trip; bw and step: MB/s;",
           "speed-up = baseline time / provider time, above 1 is faster)", head]
    for (mode, label), by in points.items():
        line = f"{mode:5} {label:>11} " + " ".join(f"{_f(figure(by[p]) if p in by else None):>10}"
                                                   for p in providers)
        for f in fast:
            for b in (b for b in baselines if b in providers):
                if f in by and b in by:
                    x, y = figure(by[f]), figure(by[b])
                    speedup = y / x if mode == "lat" else x / y
                    line += f" {speedup:>15.2f}x"
                else:
                    line += f" {'-':>16}"
        out.append(line)
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
    colors = {"verbs": "tab:red", "verbs/native": "tab:red", "verbs/pyverbs": "tab:purple",
              "verbs-rpc": "tab:orange", "shm": "tab:green", "tcp": "tab:blue", "grpc": "tab:gray"}
    for provider, color in colors.items():
        for ax, mode, value, ref_field in ((ax_bw, "bw", lambda r: r["mb_per_s"], "mb_per_s"),
                                           (ax_lat, "lat", lambda r: r["lat_us"]["median"], "lat_us")):
            points = sorted((r["size"], value(r), (r.get("reference") or {}).get(ref_field))
                            for r in rows if r["mode"] == mode and r["provider"] == provider)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=color, label=provider)
            refs = [(p[0], p[2]) for p in points if p[2]]
            if refs:
                ax.plot(*zip(*refs, strict=True), "--", color=color, alpha=0.6, label=f"{provider} reference")
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
