"""hvd.load_model: a saved Keras model (and its optimizer's state) back, with
the optimizer combining gradients over the ranks, as horovod.tensorflow.keras'.

A checkpoint of a model compiled with DistributedOptimizer holds the plain
optimizer (its class and config) and its variables (iterations, slots). To
resume, each known optimizer class is deserialized as its distributed
counterpart, so the loaded optimizer keeps the saved state: with the same
data order, training continues exactly where it stopped.
"""
from __future__ import annotations

import keras

from ..horovod.compression import Compression
from .optimizer import distributed_class


def _optimizer_classes() -> dict[str, type]:
    """Keras' own optimizer classes, by the name a saved model records."""
    return {name: cls for name, cls in vars(keras.optimizers).items()
            if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
            and cls is not keras.optimizers.Optimizer}


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """keras.models.load_model(filepath), its optimizer a DistributedOptimizer of
    the saved class with the saved state. `custom_optimizers`: more optimizer
    classes the file may name; `custom_objects`: as for Keras."""
    classes = _optimizer_classes()
    classes.update({cls.__name__: cls for cls in custom_optimizers or ()})
    wrapped = {name: distributed_class(cls, compression=compression) for name, cls in classes.items()}
    return keras.models.load_model(filepath, custom_objects={**wrapped, **(custom_objects or {})})
