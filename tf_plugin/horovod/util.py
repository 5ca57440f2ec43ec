"""horovod.tensorflow.util's helpers that scripts call (`hvd.util._executing_eagerly()`)."""
from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    return tf.executing_eagerly()
