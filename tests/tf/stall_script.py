"""Every worker: one all-reduce of 'late'; rank 1 calls it SLEEP seconds after the
others (argv[1]). Prints the result, or the error the call raised, as one line."""
import sys
import time

import numpy as np
import tensorflow as tf

import tf_plugin as hvd

hvd.init()
hvd.broadcast_object(0, name="ready")            # every rank is up before the clock starts
if hvd.rank() == 1:
    time.sleep(float(sys.argv[1]))
try:
    out = hvd.allreduce(tf.constant(np.ones(4, np.float32)), op=hvd.Sum, name="late")
    print("RESULT", float(out.numpy().sum()), flush=True)
except Exception as exc:  # noqa: BLE001 - what the call raised is the test's to judge
    print("RAISED", type(exc).__name__, str(exc)[:400], flush=True)
hvd.shutdown()
