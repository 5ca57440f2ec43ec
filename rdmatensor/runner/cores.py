"""A rank's share of its host's cores: TensorFlow's intra-op thread pool sized
to it, and the rank bound to it.

- share_cores(): TensorFlow sizes its intra-op pool to every core of the
  machine in every process, so N ranks on one host would run N times as many
  compute threads as there are cores. A rank started with
  RDMATENSOR_LOCAL_SIZE > 1 gets cores // local ranks threads (at least one)
  in TF_NUM_INTRAOP_THREADS, unless the user set it (0 included). TensorFlow
  reads it when its runtime starts: `import tf_plugin` calls this first.
- bind_cores(): as mpirun's `--bind-to core`, a rank with
  RDMATENSOR_BIND_TO=core pins every thread of its process to the I-th of N
  equal blocks of the cores it may use, where RDMATENSOR_HOST_SLOT=I/N (its
  place among its host's tasks; under horovodrun, HOROVOD_LOCAL_RANK of
  HOROVOD_LOCAL_SIZE). Nothing is bound with more tasks than cores, or with
  RDMATENSOR_BIND_TO=none; mpirun and srun bind their ranks themselves.
  Why binding is the default: docs/results.md (ranks that wait for each other
  every step, moved across cores by the scheduler).

The launcher (runner/) sets the variables; it never calls these itself.
"""
from __future__ import annotations

import os

from .. import environment

INTRA_OP = "TF_NUM_INTRAOP_THREADS"
BIND_TO = "RDMATENSOR_BIND_TO"          # core | none
HOST_SLOT = "RDMATENSOR_HOST_SLOT"      # I/N: this task's place among its host's N tasks
BINDINGS = ("core", "none")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_cores(env=os.environ) -> int | None:
    """Set TF_NUM_INTRAOP_THREADS to this rank's share of the cores; the number set, or
    None when the user chose one or the rank is alone on its host."""
    if environment.get(INTRA_OP, env=env) is not None:
        return None
    try:
        local_size = int(environment.get("RDMATENSOR_LOCAL_SIZE", "1", env))
    except ValueError:
        return None          # world.init() names the bad value
    if local_size <= 1:
        return None
    threads = max(1, usable_cores() // local_size)
    env[INTRA_OP] = str(threads)
    return threads


def host_slot(env=os.environ) -> tuple[int, int] | None:
    """(I, N): this task's place among the tasks started on its host, or None unknown."""
    slot = environment.get(HOST_SLOT, env=env)
    if slot is not None:
        try:
            i, n = (int(x) for x in slot.split("/"))
        except ValueError:
            raise ValueError(f"{HOST_SLOT}={slot!r}: expected I/N, this task's place among "
                             "its host's N tasks") from None
    elif environment.get("HOROVOD_LOCAL_RANK", env=env) is not None:
        rank, size = (environment.get(name, env=env) for name in ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"))
        try:
            i, n = int(rank), int(size)
        except (TypeError, ValueError):
            raise ValueError(f"HOROVOD_LOCAL_RANK={rank!r}, HOROVOD_LOCAL_SIZE={size!r}: expected two integers, "
                             "this task's place among its host's tasks") from None
    else:
        return None
    if not 0 <= i < n:
        raise ValueError(f"host slot {i}/{n}: expected 0 <= I < N")
    return i, n


def slot_cores(cores, i: int, n: int) -> list[int] | None:
    """The I-th of N equal blocks of `cores` (in order), None when N tasks cannot each have one."""
    cores = sorted(cores)
    if n <= 1 or n > len(cores):
        return None
    share = len(cores) // n
    return cores[i * share:(i + 1) * share]


def bind_cores(env=os.environ) -> list[int] | None:
    """Pin every thread of this process to its slot's cores when RDMATENSOR_BIND_TO=core;
    the cores, or None when nothing was bound."""
    how = environment.get(BIND_TO, "none", env)
    if how not in BINDINGS:
        raise ValueError(f"{BIND_TO}={how!r}: choose one of {', '.join(BINDINGS)}")
    slot = host_slot(env) if how == "core" else None
    try:
        mine = slot and slot_cores(os.sched_getaffinity(0), *slot)
    except AttributeError:                   # no affinity on this platform
        return None
    if not mine:
        return None
    pin_threads(mine)
    return mine


def pin_threads(cores) -> None:
    """Pin every thread of this process to `cores`, threads started before this call too."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:                      # a thread that ended meanwhile
            pass
