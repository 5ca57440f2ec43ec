"""The demo models, their synthetic data, and single-process training as the reference.

Everything is a function of the seed, so every rank (process or thread)
builds the same initial weights and the same data without talking: layers
get explicit names (variable paths, hence tensor names, match across ranks)
and initializers get explicit seeds (no global RNG shared by threads).

- mlp:   784 -> 64 (relu) -> 10, on random vectors labelled by a random teacher
- cnn:   28x28x1 -> conv 3x3x8 (relu) -> maxpool 2 -> 10
- embed: 16 token ids (vocabulary 1000) -> embedding 16 -> mean -> 10; its
         embedding gradient is sparse, with a dynamic number of rows
"""
from __future__ import annotations

import numpy as np

MODELS = ("mlp", "cnn", "embed")
SAMPLES = 1024
VOCAB = 1000


def _init(seed: int, i: int):
    import keras
    return keras.initializers.GlorotUniform(seed=seed * 100 + i)


def build(name: str, seed: int = 0):
    """A built Keras model (explicit layer names, seeded initializers)."""
    import keras
    L = keras.layers
    if name == "mlp":
        layers = [keras.Input((784,), name="x"),
                  L.Dense(64, activation="relu", kernel_initializer=_init(seed, 0), name="hidden"),
                  L.Dense(10, kernel_initializer=_init(seed, 1), name="logits")]
    elif name == "cnn":
        layers = [keras.Input((28, 28, 1), name="x"),
                  L.Conv2D(8, 3, activation="relu", kernel_initializer=_init(seed, 0), name="conv"),
                  L.MaxPooling2D(2, name="pool"), L.Flatten(name="flat"),
                  L.Dense(10, kernel_initializer=_init(seed, 1), name="logits")]
    elif name == "embed":
        layers = [keras.Input((16,), dtype="int32", name="x"),
                  L.Embedding(VOCAB, 16, embeddings_initializer=keras.initializers.RandomUniform(
                      -0.05, 0.05, seed=seed * 100), name="embedding"),
                  L.GlobalAveragePooling1D(name="mean"),
                  L.Dense(10, kernel_initializer=_init(seed, 1), name="logits")]
    else:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    return keras.Sequential(layers, name=name)


def optimizer(lr: float = 0.05):
    import keras
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def loss_fn(y, logits):
    """Mean cross-entropy: equal shards averaged over workers give the global batch's loss."""
    import tensorflow as tf
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def dataset(name: str, seed: int = 0, samples: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic inputs and labels a model can learn (a random teacher labels them)."""
    rng = np.random.default_rng(seed + 12345)
    if name == "embed":
        x = rng.integers(0, VOCAB, (samples, 16)).astype(np.int32)
        return x, (x % 10 == 3).sum(axis=1).clip(0, 9).astype(np.int32)
    shape = (784,) if name == "mlp" else (28, 28, 1)
    x = rng.standard_normal((samples, *shape)).astype(np.float32)
    teacher = rng.standard_normal((784, 10)).astype(np.float32)
    return x, np.argmax(x.reshape(samples, -1) @ teacher, axis=1).astype(np.int32)


def input_specs(name: str):
    """tf.TensorSpec of (x, y), batch dimension dynamic."""
    import tensorflow as tf
    x = {"mlp": ((None, 784), tf.float32), "cnn": ((None, 28, 28, 1), tf.float32),
         "embed": ((None, 16), tf.int32)}[name]
    return tf.TensorSpec(*x, name="x"), tf.TensorSpec((None,), tf.int32, name="y")


def batch(data, step: int, global_batch: int, shard: int = 0, shards: int = 1):
    """Rows of step `step`'s global batch that belong to shard `shard` of `shards`."""
    x, y = data
    if global_batch % shards:
        raise ValueError(f"global batch {global_batch} does not split into {shards} equal shards")
    start = (step * global_batch) % len(x)
    per = global_batch // shards
    rows = (np.arange(per) + start + shard * per) % len(x)
    return x[rows], y[rows]


def train_local(name: str, steps: int, seed: int = 0, global_batch: int = 64, lr: float = 0.05):
    """Single-process training on the global batch: the reference losses, one per step."""
    import tensorflow as tf
    model, opt, data = build(name, seed), optimizer(lr), dataset(name, seed)
    x_spec, y_spec = input_specs(name)

    @tf.function(input_signature=[x_spec, y_spec])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                strict=False))
        return loss

    return [float(step(*batch(data, k, global_batch))) for k in range(steps)]
