"""The native all-reduce in a process set: 3 ranks on this host, the set [0, 2]
all-reducing inside tf.function beside the global set; remove_process_set closes
the set's groups (no segment left open on its members), and its traced graph then
fails with FailedPrecondition while the global set's still runs. Run with
RDMATENSOR_TF_OPS=native as every worker of a 3-rank job; writes what it saw to OUT_DIR.

    python native_sets_script.py OUT_DIR
"""
import json
import sys

import numpy as np
import tensorflow as tf

import tf_plugin as hvd
from tf_plugin.native import segment

out_dir = sys.argv[1]
hvd.init()
rank = hvd.rank()
pair = hvd.add_process_set([0, 2])
member = rank in (0, 2)


x = tf.constant(np.arange(40, dtype=np.float32).reshape(5, 8) * (rank + 1))   # integers: any order sums exactly


@tf.function
def everyone(x):
    return hvd.allreduce(x, op=hvd.Sum)


@tf.function
def in_pair(x):
    return hvd.allreduce(x, op=hvd.Sum, process_set=pair), hvd.grouped_allreduce([x, 2 * x], op=hvd.Max,
                                                                                  process_set=pair)


report = {"rank": rank, "everyone": everyone(x).numpy().tolist(),
          "everyone_ops": sorted({op.type for op in everyone.get_concrete_function(x).graph.get_operations()})}
if member:
    summed, (top, top2) = in_pair(x)
    report.update(pair=summed.numpy().tolist(), pair_max=[top.numpy().tolist(), top2.numpy().tolist()],
                  pair_ops=sorted({op.type for op in in_pair.get_concrete_function(x).graph.get_operations()}))
report["open_before"] = segment.held()
hvd.remove_process_set(pair)
report["open_after_removal"] = segment.held()
if member:
    try:
        in_pair(x)
        report["pair_after_removal"] = "ran"
    except tf.errors.FailedPreconditionError as exc:
        report["pair_after_removal"] = "FailedPrecondition: " + exc.message[:200]
report["everyone_after_removal"] = everyone(x).numpy().tolist()
hvd.shutdown()
report["open_after_shutdown"] = segment.held()
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(report, f)
