"""Five ways a sequence of eager collectives once handed a caller a wrong value or
no error (Horovod API, 2 ranks, one process per rank, started by rdmatensor-run).
Each case runs on its own names and ends with an agreeing call, so one case's
failure cannot spill into the next. Writes OUT_DIR/rank{R}.json: per case, what
each call returned or raised.

    python five_cases_script.py OUT_DIR
"""
import json
import sys

import numpy as np
import tensorflow as tf

import tf_plugin as hvd

out_dir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
report = {"rank": rank}


def outcome(fn):
    """What a call gave: its values as lists, or the error's class and message."""
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 - the point of each case
        return {"error": type(exc).__name__, "message": str(exc)[:400],
                "failed_precondition": isinstance(exc, tf.errors.FailedPreconditionError),
                "invalid_argument": isinstance(exc, tf.errors.InvalidArgumentError)}
    got = got if isinstance(got, (list, tuple)) else [got]
    return {"values": [np.asarray(t).tolist() for t in got]}


# 1. A grouped all-reduce of two dtypes (two buckets): a mismatch on one bucket must
#    never leave the other bucket's result, or its error, to a later call.
def grouped(k):
    v = (1 if rank == 0 else 3) * k
    return hvd.grouped_allreduce([tf.fill([3, 38], np.float32(v)), tf.fill([7], np.float64(v))], op=hvd.Average,
                                 name="w")


def firsts(values):
    return [float(np.asarray(t).reshape(-1)[0]) for t in values]


case = []
case.append(outcome(lambda: firsts(grouped(1))))
if rank == 0:
    case.append(outcome(lambda: firsts(grouped(10))))
else:
    case.append(outcome(lambda: hvd.allgather(tf.fill([3, 38], np.float32(10)), name="w")))
case.append(outcome(lambda: firsts(grouped(100))))
case.append(outcome(lambda: firsts(grouped(1000))))
report["grouped"] = case

# 2. An all-reduce of an empty tensor on one rank only is a mismatch; the calls after it
#    get their own values.
base = np.array([10, 20, 30], np.float32) * (rank + 1)
case = []
case.append(outcome(lambda: hvd.allreduce(tf.zeros([0]) if rank == 0 else tf.constant(base + 1), op=hvd.Sum,
                                          name="a")))
case.append(outcome(lambda: hvd.allreduce(tf.constant(base), op=hvd.Sum, name="b")))
case.append(outcome(lambda: hvd.allreduce(tf.constant(base * 2), op=hvd.Sum, name="b")))
case.append(outcome(lambda: hvd.allreduce(tf.zeros([0, 3]), op=hvd.Sum, name="e")))    # empty on both: fine
report["empty"] = case

# 3. Different kinds of collective under one name: reducescatter against allreduce.
x = tf.constant([1, 2, 3, 4], tf.int32) * (rank + 1)
case = []
case.append(outcome(lambda: hvd.reducescatter(x, op=hvd.Sum, name="g") if rank == 0 else
                    hvd.allreduce(x, op=hvd.Sum, name="g")))
case.append(outcome(lambda: hvd.reducescatter(x, op=hvd.Sum, name="g")))
case.append(outcome(lambda: hvd.allreduce(x, op=hvd.Sum, name="g")))
report["kinds"] = case

# 4. Integer scaling as Horovod: float32 factors, Average folded into the postscale,
#    one truncation after the sum.
report["scaling"] = [
    outcome(lambda: hvd.allreduce(tf.constant([-11 if rank == 0 else -12], tf.int64), op=hvd.Average,
                                  postscale_factor=1.5, name="s")),
    outcome(lambda: hvd.allreduce(tf.constant([100], tf.int32), op=hvd.Sum, prescale_factor=0.19, name="s")),
]

# 5. Scale factors that differ between ranks raise on every rank; the next call works.
y = tf.constant([1.0, 2.0, 3.0], tf.float32)
report["factors"] = [
    outcome(lambda: hvd.allreduce(y, op=hvd.Sum, prescale_factor=2.0 if rank == 0 else 3.0, name="f")),
    outcome(lambda: hvd.allreduce(y, op=hvd.Sum, postscale_factor=1.0 if rank == 0 else 0.5, name="f")),
    outcome(lambda: hvd.allreduce(y, op=hvd.Sum, prescale_factor=2.0, name="f")),
]

# And a broadcast whose ranks disagree on the root, each taking itself for it (no value to
# write: the tensor is empty) or each the other: a mismatch on both ranks, at once.
empty, small = tf.zeros([2, 0], tf.bool), tf.constant([1, 2, 3], tf.int32) * (rank + 1)
report["roots"] = [
    outcome(lambda: hvd.broadcast(empty, root_rank=rank, name="r")),
    outcome(lambda: hvd.broadcast(small, root_rank=1 - rank, name="r")),
    outcome(lambda: hvd.broadcast(small, root_rank=1, name="r")),
]

with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(report, f)
hvd.shutdown()
