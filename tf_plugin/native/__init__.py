"""The native all-reduce for ranks on one host, over shared memory: "Python plans,
C executes", with a Python twin behind one contract (docs/native-ops.md).

    contract     what both twins do: ShmGroup (allreduce, abort, close), codes, errors
    segment      a rank's memfd segment (its layout, header and seals), fds between processes
                 (offered and taken as the shm provider's arenas, in a job)
    shm_twin     the Python twin: numpy over the same segments, the same protocol
    shm_c        the C executor (shm_allreduce.c, shm_allreduce.h) behind the contract, through ctypes
    build        builds the C library and the TensorFlow op library (kernels.cc: the ops;
                 xla_ops.cc: their XLA kernel and FFI handler; groups.h: what they share)
                 on first use, into a cache (build/ beside this file, else $XDG_CACHE_HOME/rdmatensor)
    ops          TensorFlow: groups for the ops (local_group: made over a job's channel),
                 allreduce / launch / complete / fused, inside XLA too, the gradients

Only ops.py imports TensorFlow (build.py, lazily, to build the op library);
importing this package builds nothing.
"""
