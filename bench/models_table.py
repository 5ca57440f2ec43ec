"""The README's table of real models, from the JSON `make bench-models` writes.

    python -m bench.models_table docs/models/{resnet50,vgg16,densenet121,mobilenetv2,lm}.json

One row per file: steps/s of every backend that ran, shm's share of the
floor (efficiency) and of the sync floor (when `sync` ran: the floor plus one
meeting of the workers per step), and shm's steps/s over TensorFlow's own
strategy and over real Horovod's. A file of several rounds
(`rdmatensor-train --rounds N`) shows each figure as the median over rounds,
and each share or ratio, taken within its round, as median (lowest–highest).
A backend no file ran has no column; one missing from a file shows as "–".

    python -m bench.models_table --paired docs/models/paired/*.json

Files of `rdmatensor-train --paired` jobs instead: per model and provider, the
median step of the floor, the sync floor and the provider, timed in turn in
the same processes, and the provider's shares of both floors (medians over
cycles of the ratio of one cycle's steps).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

NAMES = {"resnet50": "ResNet50", "vgg16": "VGG16", "densenet121": "DenseNet121", "mobilenetv2": "MobileNetV2",
         "lm": "Transformer LM"}
COLUMNS = [("none", "floor"), ("sync", "sync floor"), ("shm", "rdmatensor shm"), ("tcp", "rdmatensor tcp"),
           ("grpc", "gRPC baseline"), ("tf-grpc", "TensorFlow's own"), ("horovod", "Horovod (gloo)")]


def _steps(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _spread(values: list[float], fmt) -> str:
    """The median, and with several rounds the lowest-highest after it."""
    if not values:
        return "–"
    text = fmt(statistics.median(values))
    return text if len(values) == 1 else f"{text} ({fmt(min(values))}–{fmt(max(values))})"


def label(doc: dict, path: str) -> str:
    """The model's name, and what else the file's name says (`mobilenetv2-unbound.json`:
    "MobileNetV2 (unbound)"), so that two runs of one model can be told apart."""
    model = doc["jobs"][0]["config"]["model"]
    rest = Path(path).stem.replace(model, "", 1).strip("-_ ").replace("-", " ").replace("_", " ")
    return NAMES.get(model, model) + (f" ({rest})" if rest else "")


def row(doc: dict, columns: list[str], name: str | None = None) -> list[str]:
    """One model: each backend's median steps/s over the rounds; each of shm's
    shares and ratios taken within its round (the machine drifts between rounds)."""
    rounds: dict[int, dict] = {}
    for job in doc["jobs"]:
        rounds.setdefault(job.get("round", 0), {})[job["config"]["provider"]] = job["summary"]
    model = doc["jobs"][0]["config"]["model"]
    cells = [name or NAMES.get(model, model)]
    for p in columns:
        values = [by[p]["steps_per_s"] for by in rounds.values() if p in by]
        cells.append(_steps(statistics.median(values)) if values else "–")

    def shm_share(other):
        return [by[other]["median_step_ms"] / by["shm"]["median_step_ms"]
                for by in rounds.values() if "shm" in by and other in by]

    def shm_over(other):
        return [by["shm"]["steps_per_s"] / by[other]["steps_per_s"]
                for by in rounds.values() if "shm" in by and other in by]

    pct, times = (lambda v: f"{100 * v:.0f}%"), (lambda v: f"{v:.2f}x")
    cells += [_spread(shm_share(floor), pct) for floor in ("none", "sync") if floor in columns]
    cells += [_spread(shm_over(other), times) for other in ("tf-grpc", "horovod") if other in columns]
    return cells


def table(paths: list[str]) -> str:
    """The table of these files; a backend no file ran has no column."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    ran = {job["config"]["provider"] for doc in docs for job in doc["jobs"]}
    titles = [(p, t) for p, t in COLUMNS if p in ran or p in ("none", "shm")]
    columns = [p for p, _ in titles]
    shares = [t for p, t in (("none", "shm: of floor"), ("sync", "shm: of sync floor")) if p in columns]
    ratios = [t for p, t in (("tf-grpc", "shm vs TF's own"), ("horovod", "shm vs Horovod")) if p in columns]
    header = ["model", *(t for _, t in titles), *shares, *ratios]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row(doc, columns, label(doc, p))) + " |" for doc, p in zip(docs, paths, strict=True)]
    return "\n".join(lines)


def paired_table(paths: list[str]) -> str:
    """The table of these files' paired jobs (rdmatensor-train --paired): one row per
    model and provider, each figure the median over its jobs (rounds), with their
    range when there are several. A kind timed beside the provider in the same
    turns (the Python path beside `hvd`) gets a row of its own, and the
    provider's row its step over the provider's."""
    header = ["model", "provider", "floor ms", "sync floor ms", "provider ms", "of floor", "of sync floor",
              "sync floor: of floor", "cycles", "beside it"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    jobs: dict = {}
    for path in paths:
        for job in json.loads(Path(path).read_text())["jobs"]:
            paired, config = job["summary"].get("paired"), job["config"]
            if paired is not None:
                jobs.setdefault((config["model"], config["provider"]), []).append(paired)
    for (model, provider), runs in jobs.items():
        def cell(key, fmt, runs=runs):
            return _spread([p[key] for p in runs], fmt)
        ms, pct = (lambda v: f"{v:.1f}"), (lambda v: f"{100 * v:.0f}%")
        others = sorted(k[3:] for k in runs[0] if k.startswith("of_") and k[3:] not in ("floor", "sync"))
        floors = [cell("none_ms", ms), cell("sync_ms", ms)]
        tail = [cell("sync_of_floor", pct), "+".join(str(p["cycles"]) for p in runs)]
        rows = [[provider, cell("provider_ms", ms), cell("of_floor", pct), cell("of_sync", pct),
                 ", ".join(f"{o} step {cell('of_' + o, lambda v: f'{v:.2f}x')}" for o in others) or "–"]]
        rows += [[f"{o} (in {provider}'s turns)", cell(o + "_ms", ms), cell(o + "_of_floor", pct),
                  cell(o + "_of_sync", pct), "–"] for o in others]
        for name, step, of_floor, of_sync, beside in rows:
            lines.append("| " + " | ".join([NAMES.get(model, model), name, *floors, step, of_floor, of_sync,
                                            *tail, beside]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    paired = "--paired" in args
    paths = [a for a in args if a != "--paired"]
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(paired_table(paths) if paired else table(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
