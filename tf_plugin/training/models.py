"""The models, their synthetic data, and single-process training as the reference.

Everything is a function of the seed, so every rank (process or thread)
builds the same data without talking, and layers get explicit names
(variable paths, hence tensor names, match across ranks).

Small models (initializers with explicit seeds: no global RNG shared by
threads, so every rank builds the same initial weights):

- mlp:   784 -> 64 (relu) -> 10, on random vectors labelled by a random teacher
- cnn:   28x28x1 -> conv 3x3x8 (relu) -> maxpool 2 -> 10
- embed: 16 token ids (vocabulary 1000) -> embedding 16 -> mean -> 10; its
         embedding gradient is sparse, with a dynamic number of rows

Real models (built after keras.utils.set_random_seed(seed), the global RNG,
one build at a time so that ranks sharing a process build the same weights):

- resnet50, vgg16, densenet121, mobilenetv2: keras.applications, weights=None,
  10 classes, image_size x image_size x 3 synthetic images (default 32)
- lm:    a small Transformer language model: 32 tokens (vocabulary 8000) ->
         token embedding 128 + learned positions -> 2 causal self-attention
         blocks (4 heads, feed-forward 512) -> next-token logits; its token
         embedding gradient is sparse (the rows of the batch's tokens)
"""
from __future__ import annotations

import threading

import numpy as np

APPLICATIONS = {"resnet50": "ResNet50", "vgg16": "VGG16", "densenet121": "DenseNet121",
                "mobilenetv2": "MobileNetV2"}
MODELS = ("mlp", "cnn", "embed", *APPLICATIONS, "lm")
SAMPLES = 1024
IMAGE_SAMPLES = 256           # 154 MB of images at 224 x 224
MIN_IMAGE_SIZE = 32           # the smallest input keras.applications accepts
VOCAB = 1000
LM_VOCAB, LM_SEQ, LM_DIM, LM_HEADS, LM_FF, LM_BLOCKS = 8000, 32, 128, 4, 512, 2
_GLOBAL_RNG = threading.Lock()    # seeding and drawing from Keras' global RNG, one build at a time


def _init(seed: int, i: int):
    import keras
    return keras.initializers.GlorotUniform(seed=seed * 100 + i)


def build(name: str, seed: int = 0, image_size: int = 32):
    """A built Keras model (explicit layer names; seeded)."""
    import keras
    L = keras.layers
    if name in APPLICATIONS or name == "lm":
        with _GLOBAL_RNG:
            keras.utils.set_random_seed(seed)
            if name == "lm":
                return _transformer_lm()
            return getattr(keras.applications, APPLICATIONS[name])(
                weights=None, input_shape=(image_size, image_size, 3), classes=10)
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


def _transformer_lm():
    import keras
    L = keras.layers

    class AddPositions(L.Layer):
        """A learned position vector added to each token's embedding."""

        def build(self, shape):
            self.positions = self.add_weight(shape=shape[1:], initializer="random_normal", name="positions")

        def call(self, x):
            return x + self.positions

    x = keras.Input((LM_SEQ,), dtype="int32", name="x")
    h = AddPositions(name="positions")(L.Embedding(LM_VOCAB, LM_DIM, name="tokens")(x))
    for b in range(LM_BLOCKS):
        a = L.MultiHeadAttention(LM_HEADS, LM_DIM // LM_HEADS, name=f"block{b}_attention")(
            h, h, use_causal_mask=True)
        h = L.LayerNormalization(name=f"block{b}_norm1")(L.Add(name=f"block{b}_add1")([h, a]))
        f = L.Dense(LM_FF, activation="relu", name=f"block{b}_ff1")(h)
        f = L.Dense(LM_DIM, name=f"block{b}_ff2")(f)
        h = L.LayerNormalization(name=f"block{b}_norm2")(L.Add(name=f"block{b}_add2")([h, f]))
    return keras.Model(x, L.Dense(LM_VOCAB, name="logits")(h), name="lm")


def optimizer(lr: float = 0.05):
    import keras
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def loss_fn(y, logits):
    """Mean cross-entropy: equal shards averaged over workers give the global batch's loss
    (for the language model, over every position of every sequence)."""
    import tensorflow as tf
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def dataset(name: str, seed: int = 0, samples: int | None = None,
            image_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic inputs and labels a model can learn (a random teacher labels them;
    the language model's sequences mostly follow a fixed next-token rule)."""
    rng = np.random.default_rng(seed + 12345)
    samples = samples or (IMAGE_SAMPLES if name in APPLICATIONS else SAMPLES)
    if name in APPLICATIONS:
        x = rng.standard_normal((samples, image_size, image_size, 3)).astype(np.float32)
        teacher = rng.standard_normal((3, 10)).astype(np.float32)
        return x, np.argmax(x.mean(axis=(1, 2)) @ teacher, axis=1).astype(np.int32)
    if name == "lm":
        seq = np.empty((samples, LM_SEQ + 1), np.int64)
        seq[:, 0] = rng.integers(0, LM_VOCAB, samples)
        for t in range(LM_SEQ):
            noise = rng.random(samples) < 0.2
            seq[:, t + 1] = np.where(noise, rng.integers(0, LM_VOCAB, samples), (seq[:, t] * 7 + 3) % LM_VOCAB)
        return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)
    if name == "embed":
        x = rng.integers(0, VOCAB, (samples, 16)).astype(np.int32)
        return x, (x % 10 == 3).sum(axis=1).clip(0, 9).astype(np.int32)
    shape = (784,) if name == "mlp" else (28, 28, 1)
    x = rng.standard_normal((samples, *shape)).astype(np.float32)
    teacher = rng.standard_normal((784, 10)).astype(np.float32)
    return x, np.argmax(x.reshape(samples, -1) @ teacher, axis=1).astype(np.int32)


def input_specs(name: str, image_size: int = 32):
    """tf.TensorSpec of (x, y), batch dimension dynamic."""
    import tensorflow as tf
    if name == "lm":
        return tf.TensorSpec((None, LM_SEQ), tf.int32, name="x"), tf.TensorSpec((None, LM_SEQ), tf.int32, name="y")
    x = {"mlp": ((None, 784), tf.float32), "cnn": ((None, 28, 28, 1), tf.float32),
         "embed": ((None, 16), tf.int32)}.get(name, ((None, image_size, image_size, 3), tf.float32))
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


def train_local(name: str, steps: int, seed: int = 0, global_batch: int = 64, lr: float = 0.05,
                image_size: int = 32):
    """Single-process training on the global batch: the reference losses, one per step."""
    import tensorflow as tf
    model, opt = build(name, seed, image_size), optimizer(lr)
    data = dataset(name, seed, image_size=image_size)
    x_spec, y_spec = input_specs(name, image_size)

    @tf.function(input_signature=[x_spec, y_spec])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True))
        return loss

    return [float(step(*batch(data, k, global_batch))) for k in range(steps)]
