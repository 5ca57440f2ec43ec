"""Parameter-server training of a Keras model of your own, started by rdmatensor-run:

    rdmatensor-run -np 2 --ps 1 python examples/ps_train.py [--steps 50]

Every task runs this script; TF_CONFIG (set by rdmatensor-run, Kubeflow's
TFJob, or `python -m rdmatensor.runner.cluster --slurm`) tells it whether it is a
worker or a parameter server. The model has an embedding, whose gradients
cross as deduplicated rows. Each worker prints its losses and a digest of its
trained weights: every worker ends with the same model.
"""
import argparse
import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_plugin.parameter_server as ps  # noqa: E402
from rdmatensor.runner.cluster import Cluster  # noqa: E402

VOCAB, WORDS, CLASSES = 100, 8, 4


def build_model():
    keras.utils.set_random_seed(7)
    words = keras.Input((WORDS,), dtype="int32", name="words")
    h = keras.layers.Embedding(VOCAB, 32, name="embedding")(words)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
    return keras.Model(words, keras.layers.Dense(CLASSES, name="logits")(h))


def loss(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def batches(shard: int, shards: int, batch: int = 32):
    """This worker's shard of a synthetic task: the first word's id decides the class."""
    rng = np.random.default_rng(1234)
    x = rng.integers(0, VOCAB, (4096, WORDS)).astype(np.int32)
    y = x[:, 0] % CLASSES
    ds = tf.data.Dataset.from_tensor_slices((x, y.astype(np.int32))).shard(shards, shard)
    return ds.repeat().batch(batch, drop_remainder=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1.0)
    args = p.parse_args()
    cluster = Cluster.from_env()
    model = build_model()
    result = ps.run(model, loss, keras.optimizers.SGD(args.lr), batches(cluster.task_index, cluster.num_workers),
                    args.steps)
    if result.role == "worker":
        digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in model.trainable_variables)).hexdigest()
        print(f"worker {cluster.task_index}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} "
              f"in {args.steps} steps, {args.steps / result.seconds:.1f} steps/s; "
              f"{result.stats['dynamic']} dynamic sends; weights {digest[:16]}")
    else:
        print(f"ps {cluster.task_index}: served {args.steps} steps over {result.stats['provider']}")


if __name__ == "__main__":
    main()
