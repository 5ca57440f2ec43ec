"""One rank of the four-host check (four_hosts_check.py): the Horovod API over
verbs between hosts and shm within one, started by a launcher.

    python tests/vm/four_hosts_script.py

1. Bytes: one float32 all-reduce of ELEMENTS (a multiple of every ring's
   chunk count, so the algorithms' counts are exact), flat then
   hierarchical; each rank reports the payload bytes it wrote to each peer
   during the second call of each (the first plans), and the result is
   checked against the exact sum.
2. Training: an MLP, each rank its shard of the global batch, through
   DistributedGradientTape inside tf.function, with the hierarchical
   all-reduce off then on; beside it, the same model trained by this process
   alone on the global batch. Each rank reports its weights' digest, whether
   they moved, and how far they are from the single process's.

One JSON line per rank: {"rank", "cross_rank" (its host's index), "bytes": {mode: {peer: bytes}},
"train": {mode: {...}}}.
"""
import faulthandler
import hashlib
import json
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tf_plugin as hvd
from tests.tf.reference_steps import distributed_and_local
from tf_plugin.core.world import world

HIERARCHICAL = "HOROVOD_HIERARCHICAL_ALLREDUCE"
ELEMENTS = 1 << 18           # 1 MiB of float32: divisible by 8 ranks and by 2 positions x 4 hosts
GLOBAL_BATCH, STEPS, FEATURES, CLASSES = 64, 3, 16, 4


def payload_to() -> dict:
    """Payload bytes this rank has written to each peer, in the current plan."""
    return dict(world().collectives.session.stats()["bytes_sent_to"])


def byte_counts() -> dict:
    out = {}
    n, rank = hvd.size(), hvd.rank()
    x = tf.constant(np.full(ELEMENTS, rank + 1, np.float32))
    for mode in ("flat", "hierarchical"):
        os.environ[HIERARCHICAL] = "1" if mode == "hierarchical" else "0"
        hvd.allreduce(x, op=hvd.Sum, name=f"bytes_{mode}")             # plans (the session may grow)
        generation, before = hvd.stats()["generations"], payload_to()
        got = hvd.allreduce(x, op=hvd.Sum, name=f"bytes_{mode}").numpy()
        after = payload_to()
        assert hvd.stats()["generations"] == generation, "the plan grew during the counted call"
        assert (got == n * (n + 1) / 2).all(), f"rank {rank}: {mode} all-reduce gave {got[:4]}"
        out[mode] = {str(p): after.get(p, 0) - before.get(p, 0) for p in after}
    return out


def digest(variables) -> str:
    return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in variables)).hexdigest()


def train(mode: str) -> dict:
    os.environ[HIERARCHICAL] = "1" if mode == "hierarchical" else "0"
    rng = np.random.default_rng(7)                   # the same data everywhere; each rank takes its shard
    x = rng.standard_normal((STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, (STEPS, GLOBAL_BATCH)).astype(np.int32)

    def mlp():
        keras.utils.set_random_seed(11)
        return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(32, activation="relu"), keras.layers.Dense(CLASSES)])

    model, reference = mlp(), mlp()
    initial = [v.numpy().copy() for v in model.variables]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dist_step, local_step = distributed_and_local(hvd, model, reference, keras.optimizers.SGD(0.1),
                                                  keras.optimizers.SGD(0.1), loss_fn)
    dist_step = tf.function(dist_step)
    per = GLOBAL_BATCH // hvd.size()
    lo = hvd.rank() * per
    for k in range(STEPS):
        if k < 2:
            phase(f"step {k} ({mode}) starts")        # the first traces the step
        dist_step(x[k, lo:lo + per], y[k, lo:lo + per])
        local_step(x[k], y[k])
    digests = hvd.allgather_object(digest(model.variables))
    return {"weights": digests[hvd.rank()], "ranks_bit_identical": len(set(digests)) == 1,
            "moved": max(float(np.abs(v.numpy() - w).max()) for v, w in zip(model.variables, initial, strict=True)),
            "from_one_process": max(float(np.abs(v.numpy() - r.numpy()).max())
                                    for v, r in zip(model.variables, reference.variables, strict=True)),
            "hierarchy": hvd.stats()["hierarchy"], "provider": hvd.stats()["provider"]}


def phase(what: str) -> None:
    """When each part starts, and the CPU time this rank used until then, on stderr: in
    emulated VMs a part takes minutes, and a rank that falls behind its peers shows whether
    it ran slower (its CPU time) or waited."""
    print(f"rank {hvd.rank()}: {what} at {time.strftime('%H:%M:%S')}, cpu {time.process_time():.0f} s",
          file=sys.stderr, flush=True)


def main() -> None:
    faulthandler.dump_traceback_later(900, repeat=True)     # where every thread is, every 15 minutes
    hvd.init()
    phase("init done")
    report = {"rank": hvd.rank(), "size": hvd.size(), "cross_rank": hvd.cross_rank(),
              "local_size": hvd.local_size()}
    report["bytes"] = byte_counts()
    report["train"] = {}
    for mode in ("flat", "hierarchical"):
        phase(f"training, {mode}")
        report["train"][mode] = train(mode)
    phase("done")
    print(json.dumps(report), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
