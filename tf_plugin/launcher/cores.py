"""TensorFlow's intra-op thread pool sized to this rank's share of the cores.

TensorFlow sizes its intra-op pool to every core of the machine, in every
process: N ranks on one host run N times as many compute threads as there are
cores, and each synchronous step then waits for whichever rank the scheduler
starved. As MPI launchers do for OpenMP codes, a rank started by
`rdmatensor-run` or `rdmatensor-train` (RDMATENSOR_LOCAL_SIZE > 1) gets
cores // local ranks intra-op threads (at least one), unless the user chose a
number: TF_NUM_INTRAOP_THREADS set, 0 included (TensorFlow's own default).

TensorFlow reads the variable when its runtime starts, so this applies when
tf_plugin is imported before the first TensorFlow op runs, as `import
tf_plugin as hvd` at the top of a script does.
"""
from __future__ import annotations

import os

INTRA_OP = "TF_NUM_INTRAOP_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_cores(env=os.environ) -> int | None:
    """Set TF_NUM_INTRAOP_THREADS to this rank's share of the cores; the number set, or
    None when the user chose one or the rank is alone on its host."""
    if INTRA_OP in env:
        return None
    try:
        local_size = int(env.get("RDMATENSOR_LOCAL_SIZE", "1"))
    except ValueError:
        return None          # world.init() names the bad value
    if local_size <= 1:
        return None
    threads = max(1, usable_cores() // local_size)
    env[INTRA_OP] = str(threads)
    return threads
