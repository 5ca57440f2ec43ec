"""A rank that dies while the ranks extend the plan: after they agreed on a new
tensor set, before the new generation's session is connected. Started by
rdmatensor-run on every rank:

    python extend_death_script.py OUT_DIR VICTIM

The victim exits (status 3) in place of connecting; every other rank prints
`failed SECONDS TYPE: MESSAGE` (seconds since the victim died) and exits 1.
"""
import os
import sys
import time
from pathlib import Path

import tensorflow as tf

import tf_plugin as hvd
from tf_plugin.core import collectives

out_dir, victim = Path(sys.argv[1]), int(sys.argv[2])
hvd.init()
hvd.allreduce(tf.ones(4), name="first")          # the first generation: connected by every rank
if hvd.rank() == victim:
    def die(*args, **kwargs):
        (out_dir / "killed").write_text(repr(time.time()))
        os._exit(3)
    collectives.connect = die
try:
    hvd.allreduce(tf.ones(8), name="second")     # a new tensor set: the plan is extended
    print("no error", flush=True)
except Exception as exc:  # noqa: BLE001 - reported for the test
    killed = float((out_dir / "killed").read_text())
    print(f"failed {time.time() - killed:.2f} {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
