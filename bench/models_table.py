"""The README's table of real models, from the JSON `make bench-models` writes.

    python -m bench.models_table docs/models/{resnet50,vgg16,densenet121,mobilenetv2,lm}.json

One row per file (one run each): steps/s of every backend that ran, shm's
share of the floor (efficiency), and shm's steps/s over TensorFlow's own
strategy and over real Horovod's. Missing backends show as "–".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {"resnet50": "ResNet50", "vgg16": "VGG16", "densenet121": "DenseNet121", "mobilenetv2": "MobileNetV2",
         "lm": "Transformer LM"}
COLUMNS = [("none", "floor"), ("shm", "rdmatensor shm"), ("tcp", "rdmatensor tcp"), ("grpc", "gRPC baseline"),
           ("tf-grpc", "TensorFlow's own"), ("horovod", "Horovod (gloo)")]


def _steps(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def row(doc: dict) -> list[str]:
    by = {job["config"]["provider"]: job["summary"] for job in doc["jobs"]}
    model = doc["jobs"][0]["config"]["model"]
    cells = [NAMES.get(model, model)]
    cells += [_steps(by[p]["steps_per_s"]) if p in by else "–" for p, _ in COLUMNS]
    shm = by.get("shm")
    floor = by.get("none")
    cells.append(f"{100 * floor['median_step_ms'] / shm['median_step_ms']:.0f}%" if shm and floor else "–")
    for other in ("tf-grpc", "horovod"):
        cells.append(f"{shm['steps_per_s'] / by[other]['steps_per_s']:.2f}x" if shm and other in by else "–")
    return cells


def table(paths: list[str]) -> str:
    header = ["model", *(title for _, title in COLUMNS), "shm: of floor", "shm vs TF's own", "shm vs Horovod"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row(json.loads(Path(p).read_text()))) + " |" for p in paths]
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(table(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
