"""The job's settings from the environment, under this project's names and
under Horovod's: a script a Horovod user already runs with HOROVOD_* set
behaves as the user asked. Where both are set, the RDMATENSOR_* one wins.

Horovod variables that mean nothing here (there is no coordinator cycle, no
GPU, no autotuner) are listed in IGNORED; one a user set is named in one
warning at init(). Those that launchers set for their own use (horovodrun's
HOROVOD_GLOO_*, HOROVOD_CONTROLLER, ...) are not worth a warning (SET_BY_LAUNCHERS),
nor are those that ask for what is always so here (NEEDLESS).
A variable set to "" is unset (rdmatensor.environment).
docs/environment.md lists every variable the project reads.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from rdmatensor import environment

from ..errors import SettingError

log = logging.getLogger("rdmatensor")


@dataclass(frozen=True)
class Setting:
    name: str                 # RDMATENSOR_*
    horovod: str | None       # Horovod's name for the same thing
    default: str
    meaning: str

    def raw(self, env=os.environ) -> tuple[str, str]:
        """(value, the variable it came from); the default's name is 'default'."""
        for var in (self.name, self.horovod):
            value = environment.get(var, None, env) if var else None
            if value is not None:
                return value, var
        return self.default, "default"


FUSION_THRESHOLD = Setting(
    "RDMATENSOR_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", str(64 << 20),
    "bytes per all-reduce bucket, 0: no fusion. 64 MiB by default, where Horovod's is 128 MiB: every bucket is "
    "one ring, and here 64 MiB let large gradients start their rings during backprop")
TIMELINE = Setting(
    "RDMATENSOR_TIMELINE", "HOROVOD_TIMELINE", "",
    "a Chrome trace of the all-reduce written by rank 0, or by every rank where the path holds {rank}")
HIERARCHICAL_ALLREDUCE = Setting(
    "RDMATENSOR_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE", "1",
    "1: hierarchical all-reduce wherever several hosts hold the same number (> 1) of ranks each; 0: one flat ring. "
    "On by default, where Horovod's is off: it measured faster here (make bench-hierarchical)")
LOG_LEVEL = Setting(
    "RDMATENSOR_LOG_LEVEL", "HOROVOD_LOG_LEVEL", "warning",
    "trace, debug, info, warning, error or fatal (Horovod's names, any case): the 'rdmatensor' logger's level")
STALL_CHECK_TIME = Setting(
    "RDMATENSOR_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS", "60",
    "seconds a collective may wait for other ranks before each waiting rank warns, naming the tensor and the "
    "ranks that have not called it")
STALL_SHUTDOWN_TIME = Setting(
    "RDMATENSOR_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0",
    "seconds after which a stalled collective fails with an error naming them (0: it waits until the timeout)")
STALL_CHECK_DISABLE = Setting(
    "RDMATENSOR_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE", "0", "1: no stall warning")
TIMEOUT = Setting(
    "RDMATENSOR_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS", "120",
    "seconds a rank waits for the others at init() and in a collective before it raises (Horovod's gloo "
    "timeout, whose default is 30)")
ELASTIC_TIMEOUT = Setting(
    "RDMATENSOR_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT", "600",
    "seconds an elastic job waits for enough workers; a worker waits this long, and 60 more, to join a round")
EXECUTOR_NICE = Setting(
    "RDMATENSOR_EXECUTOR_NICE", None, "-5",
    "added to the process's nice value for the native all-reduce's executor thread (-20 to 19; 0: as the "
    "process), which shares its rank's core with TensorFlow's threads: below their priority it keeps pace with "
    "backprop. Where raising a priority is not permitted (no CAP_SYS_NICE, RLIMIT_NICE) it keeps the process's")
SETTINGS = (FUSION_THRESHOLD, TIMELINE, HIERARCHICAL_ALLREDUCE, LOG_LEVEL, STALL_CHECK_TIME, STALL_SHUTDOWN_TIME,
            STALL_CHECK_DISABLE, TIMEOUT, ELASTIC_TIMEOUT)       # Horovod's, under both names

IGNORED = {
    "HOROVOD_CYCLE_TIME": "there is no coordinator cycle: a collective starts when every rank calls it",
    "HOROVOD_CACHE_CAPACITY": "there is no response cache: a tensor set, once planned, costs no control call",
    "HOROVOD_TIMELINE_MARK_CYCLES": "there are no cycles to mark",
    "HOROVOD_AUTOTUNE": "nothing is autotuned",
    "HOROVOD_AUTOTUNE_LOG": "nothing is autotuned",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "the all-gather is always direct, rank to rank",
    "HOROVOD_TORUS_ALLREDUCE": "no NCCL",
    "HOROVOD_MPI_THREADS_DISABLE": "no MPI",
    "HOROVOD_NUM_NCCL_STREAMS": "no NCCL",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "no GPU",
    "HOROVOD_THREAD_AFFINITY": "ranks are bound by rdmatensor-run --bind-to (RDMATENSOR_BIND_TO)",
    "HOROVOD_DISABLE_GROUP_FUSION": "a grouped call is one tensor set, fused by the fusion threshold",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "Adasum runs over rdmatensor, not MPI",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "no GPU",
    "HOROVOD_ENABLE_XLA_OPS": "no XLA ops",
    "HOROVOD_LOG_HIDE_TIME": "the 'rdmatensor' logger's format is the application's",
    "HOROVOD_START_TIMEOUT": "horovodrun's own bound on starting the processes; ranks have RDMATENSOR_TIMEOUT to "
                             "find each other",
}
# Asks for what is always so here: accepted silently
NEEDLESS = {
    "HOROVOD_DYNAMIC_PROCESS_SETS": "process sets may be added and removed after init() without it",
}
SET_BY_LAUNCHERS = {
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE",
    "HOROVOD_ELASTIC", "HOROVOD_SECRET_KEY", "HOROVOD_MPI",
}

LOG_LEVELS = {"trace": logging.DEBUG - 5, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "fatal": logging.CRITICAL}


def _bad(setting: Setting, var: str, value: str, expected: str) -> SettingError:
    return SettingError(f"{var}={value!r}: expected {expected} ({setting.meaning})")


def integer(setting: Setting, env=os.environ, minimum: int = 0) -> int:
    value, var = setting.raw(env)
    try:
        number = int(value)
    except ValueError:
        raise _bad(setting, var, value, "a whole number") from None
    if number < minimum:
        raise _bad(setting, var, value, f"a number >= {minimum}")
    return number


def executor_nice(env=os.environ) -> int:
    value, var = EXECUTOR_NICE.raw(env)
    try:
        nice = int(value)
    except ValueError:
        raise _bad(EXECUTOR_NICE, var, value, "a whole number") from None
    if not -20 <= nice <= 19:
        raise _bad(EXECUTOR_NICE, var, value, "-20 to 19")
    return nice


def seconds(setting: Setting, env=os.environ) -> float:
    value, var = setting.raw(env)
    try:
        number = float(value)
    except ValueError:
        raise _bad(setting, var, value, "seconds") from None
    if number < 0:
        raise _bad(setting, var, value, "seconds >= 0")
    return number


def flag(setting: Setting, env=os.environ) -> bool:
    value, var = setting.raw(env)
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise _bad(setting, var, value, "1 or 0")


def text(setting: Setting, env=os.environ) -> str:
    return setting.raw(env)[0]


def apply_log_level(env=os.environ) -> int:
    """Set the 'rdmatensor' logger's level from RDMATENSOR_LOG_LEVEL / HOROVOD_LOG_LEVEL; the level."""
    value, var = LOG_LEVEL.raw(env)
    level = LOG_LEVELS.get(value.strip().lower())
    if level is None:
        raise _bad(LOG_LEVEL, var, value, " or ".join(LOG_LEVELS))
    log.setLevel(level)
    if var != "default" and not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()           # asked for messages: they reach stderr without an app config
        handler.setFormatter(logging.Formatter("[%(asctime)s rdmatensor %(levelname)s] %(message)s"))
        log.addHandler(handler)
    return level


def ignored_in(env=os.environ) -> dict[str, str]:
    """The HOROVOD_* variables set here that mean nothing to this project, and why."""
    known = {s.horovod for s in SETTINGS} | SET_BY_LAUNCHERS | set(NEEDLESS)
    out = {}
    for var in sorted(env):
        if not var.startswith("HOROVOD_") or var in known or environment.get(var, None, env) is None:
            continue
        out[var] = IGNORED.get(var, "not a setting of this project")
    return out


_warned = False


def warn_ignored(env=os.environ) -> dict[str, str]:
    """Once per process: one warning naming every HOROVOD_* variable set that does nothing here."""
    global _warned
    found = ignored_in(env)
    if found and not _warned:
        _warned = True
        log.warning("these Horovod variables have no effect here: " +
                    "; ".join(f"{var} ({why})" for var, why in found.items()))
    return found
