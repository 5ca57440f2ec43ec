"""Real models' gradient sets, for the `step` and `paper` modes.

A training step moves one tensor per trainable variable. The sets here are
taken from `keras.applications` (weights=None, 32x32x3 inputs, 10 classes, as
`rdmatensor-train --model` builds them) and a small LSTM language model, and
kept in `model_grads.json` so a benchmark needs no TensorFlow (its import
alone takes most of a minute inside the SoftRoCE VM).

    python -m bench.model_grads          # regenerate model_grads.json (needs TensorFlow)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FILE = Path(__file__).with_name("model_grads.json")
INPUT, CLASSES = (32, 32, 3), 10
APPLICATIONS = {"resnet50": "ResNet50", "vgg16": "VGG16", "densenet121": "DenseNet121",
                "mobilenetv2": "MobileNetV2"}


def names() -> list[str]:
    return sorted(json.loads(FILE.read_text())["models"])


def gradient_set(model: str) -> list[dict]:
    """[{"name", "shape", "dtype"}, ...] of `model`'s trainable variables, in order."""
    models = json.loads(FILE.read_text())["models"]
    if model not in models:
        raise ValueError(f"unknown model {model!r}: choose from {', '.join(sorted(models))}")
    return models[model]


def tensor_sizes(model: str) -> tuple[int, ...]:
    """Bytes of each gradient of `model`."""
    return tuple(int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize
                 for t in gradient_set(model))


def _lstm_lm():
    import keras
    vocab, width = 10000, 256
    return keras.Sequential([keras.Input((35,), dtype="int32"), keras.layers.Embedding(vocab, width),
                             keras.layers.LSTM(512), keras.layers.Dense(vocab)])


def variables_of(model) -> list[dict]:
    """[{"name", "shape", "dtype"}, ...] of a built Keras model's trainable variables."""
    return [{"name": v.path, "shape": list(v.shape), "dtype": str(v.dtype)} for v in model.trainable_variables]


def write(doc: dict, file: Path) -> None:
    """Save a generated document, and say what each set holds."""
    file.write_text(json.dumps(doc, indent=0) + "\n")
    for name, grads in doc["models"].items():
        total = sum(int(np.prod(g["shape"])) * 4 for g in grads)
        print(f"{name:16} {len(grads):4} gradients  {total / 1e6:8.1f} MB", file=sys.stderr)


def generate() -> dict:
    import keras
    built = {name: getattr(keras.applications, cls)(weights=None, input_shape=INPUT, classes=CLASSES)
             for name, cls in APPLICATIONS.items()}
    built["lstm_lm"] = _lstm_lm()
    return {"input": list(INPUT), "classes": CLASSES,
            "models": {name: variables_of(model) for name, model in built.items()}}


if __name__ == "__main__":
    write(generate(), FILE)
