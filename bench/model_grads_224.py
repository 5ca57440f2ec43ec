"""ImageNet-sized gradient sets for the step-time model (bench/step_model.py).

bench/model_grads.json holds the gradient sets the host's benchmarks train
(32x32 inputs, 10 classes). Published scaling figures (Horovod's benchmarks
page, TensorFlow's tf_cnn_benchmarks) are for 224x224 (InceptionV3: 299x299)
ImageNet models with 1000 classes, whose last layers are far larger, so the
comparison reads these sets instead. Kept in model_grads_224.json so that a
prediction needs no TensorFlow.

    python -m bench.model_grads_224      # regenerate model_grads_224.json (needs TensorFlow)
"""
from __future__ import annotations

from pathlib import Path

from .model_grads import variables_of, write

FILE = Path(__file__).with_name("model_grads_224.json")
CLASSES = 1000
# keras.applications' own default input sizes: InceptionV3 is built for 299x299
APPLICATIONS = {"resnet50_224": ("ResNet50", 224), "resnet101_224": ("ResNet101", 224),
                "inceptionv3_224": ("InceptionV3", 299), "vgg16_224": ("VGG16", 224)}


def generate() -> dict:
    import keras
    models = {}
    for name, (cls, side) in APPLICATIONS.items():
        model = getattr(keras.applications, cls)(weights=None, input_shape=(side, side, 3), classes=CLASSES)
        models[name] = variables_of(model)
        keras.backend.clear_session()
    return {"classes": CLASSES, "input": {n: [s, s, 3] for n, (_, s) in APPLICATIONS.items()}, "models": models}


if __name__ == "__main__":
    write(generate(), FILE)
