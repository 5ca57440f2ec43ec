"""A native all-reduce that fails, and what follows. Rank 0 runs a step traced
over a native group while rank 1 makes another collective (a reducescatter, on
the Python path): a mismatch the native op alone could only see as its wait
timing out; rank 1's watchdog sees rank 0 waiting in the native group. Both
ranks must raise; then a new trace, the step traced before the failure and an
eager collective must work again on both ranks, with the right values. Run as
every worker of a 2-rank job on one host; writes OUT_DIR/rank{r}.json.

    python native_recovery_script.py OUT_DIR
"""
import json
import sys
import time

import numpy as np
import tensorflow as tf

import tf_plugin as hvd

hvd.init()
r = hvd.rank()
x = tf.constant(np.arange(6, dtype=np.float32).reshape(3, 2) + r)
step = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="a"))
report = {"before": step(x).numpy().tolist()}
other = step if r == 0 else tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum, name="a"))
t0 = time.monotonic()
try:
    report["mismatch"] = f"returned {other(x).numpy().tolist()}"
except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
    report["mismatch"] = type(exc).__name__
report["mismatch_seconds"] = time.monotonic() - t0
report["retraced"] = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="b"))(x).numpy().tolist()
report["after"] = step(x).numpy().tolist()
report["allgather"] = hvd.allgather(x).numpy().tolist()
report["generations"] = hvd.stats()["generations"]
hvd.shutdown()
with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
    json.dump(report, f)
