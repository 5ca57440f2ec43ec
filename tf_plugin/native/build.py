"""Builds the native all-reduce on first use, into a cache, never at import.

Two libraries, from the sources beside this file:

- "c": the executor alone (shm_allreduce.c), plain C, about a second of gcc;
  framework-free (shm_c.CGroup over ctypes);
- "ops": the TensorFlow ops (kernels.cc, a thin C++ file of AsyncOpKernels,
  and xla_ops.cc, their XLA kernel and FFI handler) linked with the executor,
  built as Horovod builds its ops, with tf.sysconfig.get_compile_flags() /
  get_link_flags() and libtensorflow_cc for XLA (20-60 s of g++).

The cache key is the TensorFlow version, the sha256 of the sources, the
compilers and the flags; the file names carry it, so a change of any of them
builds a new library beside the old one. A library already built is taken from
`build/` beside this package, else from $XDG_CACHE_HOME/rdmatensor (default
~/.cache/rdmatensor), readable is enough; a build goes into the first of them
that is writable. Ranks starting together build once: a file lock
(fcntl.flock) per key, the compiler writing into a temporary file that
os.replace puts in place. The op library records tf.__version__ (compiled in,
and in the JSON beside it), and ops.py refuses one built for another.

RDMATENSOR_TF_OPS chooses: `native` (the default when it builds), `python`
(the twin, shm_twin.py, through tf.numpy_function); any other value is an
error. Without a compiler, or when the build fails, one line on stderr says
what to install and the Python twin runs (unless `native` was asked for).
TensorFlow is imported here only to build the op library.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SettingError

HERE = Path(__file__).resolve().parent
ENV = "RDMATENSOR_TF_OPS"
CHOICES = ("native", "python")
SOURCES = {"c": ("shm_allreduce.c", "shm_allreduce.h"),
           "ops": ("shm_allreduce.c", "shm_allreduce.h", "groups.h", "kernels.cc", "xla_ops.cc")}
# -ftree-loop-vectorize: -O2 leaves the reductions' loops scalar (GCC 12). Each element is
# still reduced alone, in the same order (no reassociation, no FMA): the same bits.
C_FLAGS = ("-O2", "-ftree-loop-vectorize", "-std=c11", "-fPIC", "-ffp-contract=off", "-Wall")
CXX_FLAGS = ("-O2", "-fPIC", "-ffp-contract=off")
WHAT = {"c": "shared-memory all-reduce (C)", "ops": "TensorFlow ops of the shared-memory all-reduce"}


class BuildError(RuntimeError):
    """The library could not be built; the message says what to install or what the compiler said."""


@dataclass(frozen=True)
class Built:
    path: Path
    cached: bool           # found in the cache (no compiler ran in this call)
    seconds: float         # this call's build time (0 when cached)
    key: str
    tensorflow: str | None


def choice() -> str:
    """RDMATENSOR_TF_OPS: 'native' (also when unset or empty) or 'python'."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "native"):
        return "native"
    if value == "python":
        return "python"
    raise SettingError(f"{ENV}={os.environ.get(ENV)!r}: give 'native' (the compiled ops, the default when they "
                       "build) or 'python' (the Python twin)")


def cache_candidates(package_dir: Path = HERE) -> list[Path]:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(package_dir) / "build", Path(xdg) / "rdmatensor"]


def cache_dir(package_dir: Path = HERE) -> Path:
    """The first candidate where a file can be made: beside the package, else the user's cache."""
    tried = []
    for candidate in cache_candidates(package_dir):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=candidate, prefix=".probe-"):
                pass
            return candidate
        except OSError as exc:
            tried.append(f"{candidate}: {exc.strerror or exc}")
    raise BuildError("no writable cache directory (" + "; ".join(tried) + ")")


def _compiler(names: tuple[str, ...], what: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise BuildError(f"no {what} compiler ({' or '.join(names)}): install one, e.g. `apt-get install g++` "
                     "(Debian/Ubuntu) or `dnf install gcc-c++`")


def _tensorflow() -> tuple[str, list[str], list[str]]:
    """TensorFlow's version, and its flags as Horovod builds its ops, plus what the
    XLA kernel needs: the headers XLA's include (in the wheel's include/external)
    and libtensorflow_cc, which exports XLA and its FFI API."""
    import tensorflow as tf
    include = Path(tf.sysconfig.get_include())
    extra = [f"-I{include / 'external' / d}" for d in ("highwayhash", "farmhash_archive/src")
             if (include / "external" / d).is_dir()]
    return (tf.__version__, [*tf.sysconfig.get_compile_flags(), *extra],
            [*tf.sysconfig.get_link_flags(), "-l:libtensorflow_cc.so.2"])


def plan(kind: str, package_dir: Path = HERE) -> dict:
    """What a build of `kind` runs, and its key (nothing is built)."""
    if kind not in SOURCES:
        raise ValueError(f"kind {kind!r}: 'c' or 'ops'")
    cc = _compiler(("gcc", "cc"), "C")
    step = {"kind": kind, "cc": cc, "c_flags": list(C_FLAGS), "tensorflow": None}
    if kind == "ops":
        version, compile_flags, link_flags = _tensorflow()
        step.update(cxx=_compiler(("g++", "c++"), "C++"), tensorflow=version,
                    cxx_flags=[*CXX_FLAGS, *compile_flags, f'-DRDT_TF_VERSION="{version}"'], link_flags=link_flags)
    digest = hashlib.sha256(json.dumps(step, sort_keys=True).encode())
    for name in SOURCES[kind]:
        digest.update(name.encode() + b"\0" + (Path(package_dir) / name).read_bytes())
    step["key"] = digest.hexdigest()
    tag = f"-tf{step['tensorflow']}" if step["tensorflow"] else ""
    step["name"] = f"rdt_shm_{kind}{tag}-{step['key'][:16]}.so"
    return step


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        # the compiler's first diagnostic ("file:line:col: error: ..."), not an include line naming errors.h
        errors = ([line for line in said if " error: " in line or line.startswith("error")]
                  or [line for line in said if "error" in line] or said or ["no output"])
        raise BuildError(f"{Path(cmd[0]).name} failed: {errors[0][:300]}")


def compile_step(step: dict, package_dir: Path, out: Path, scratch: Path) -> None:
    """Compile the library `step` (plan) describes to `out`, its objects in `scratch`."""
    src = Path(package_dir)
    obj = scratch / "shm_allreduce.o"
    _run([step["cc"], *step["c_flags"], "-c", str(src / "shm_allreduce.c"), "-o", str(obj)], scratch)
    if step["kind"] == "c":
        _run([step["cc"], "-shared", str(obj), "-o", str(out), "-lpthread"], scratch)
    else:
        _run([step["cxx"], *step["cxx_flags"], "-shared", str(src / "kernels.cc"), str(src / "xla_ops.cc"), str(obj),
              "-o", str(out), *step["link_flags"], "-lpthread"], scratch)


def _ready(where: Path, step: dict) -> bool:
    """The library of `step` is in `where`, whole (its record is written last)."""
    try:
        meta = where / (step["name"][:-3] + ".json")
        return (where / step["name"]).exists() and json.loads(meta.read_text()).get("key") == step["key"]
    except (OSError, ValueError):
        return False


def build(kind: str = "ops", package_dir: Path = HERE, directory: Path | None = None) -> Built:
    """The library of `kind`, from the cache or built now (once across processes). Without
    `directory`, a library already built in any cache is used, even one this user cannot
    write (`make setup` built it beside the package as root): only a build needs a writable one."""
    step = plan(kind, package_dir)
    if directory is None:
        for candidate in cache_candidates(package_dir):
            if _ready(candidate, step):
                return Built(candidate / step["name"], True, 0.0, step["key"], step["tensorflow"])
    where = Path(directory) if directory is not None else cache_dir(package_dir)
    where.mkdir(parents=True, exist_ok=True)
    path, meta = where / step["name"], where / (step["name"][:-3] + ".json")
    if _ready(where, step):
        return Built(path, True, 0.0, step["key"], step["tensorflow"])
    with open(where / f".lock-{step['key'][:16]}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building it: wait for it
        if _ready(where, step):
            return Built(path, True, 0.0, step["key"], step["tensorflow"])
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=where, prefix=".build-") as scratch:
            tmp = Path(scratch) / step["name"]
            compile_step(step, package_dir, tmp, Path(scratch))
            seconds = time.monotonic() - started
            os.replace(tmp, path)
            record = {k: step[k] for k in ("kind", "key", "tensorflow")}
            record.update(build_seconds=round(seconds, 2), flags=step.get("cxx_flags", step["c_flags"]))
            tmp_meta = Path(scratch) / "meta.json"
            tmp_meta.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp_meta, meta)
        _prune(where, step)
    return Built(path, False, seconds, step["key"], step["tensorflow"])


def _prune(where: Path, step: dict) -> None:
    """Drop the libraries of this kind and TensorFlow version built from other sources or flags
    (a process that loaded one keeps its mapping)."""
    stem = step["name"].rsplit("-", 1)[0] + "-"
    for old in where.glob(stem + "*"):
        key = old.name[len(stem):].split(".")[0]
        if key != step["key"][:16] and old.suffix in (".so", ".json"):
            old.unlink(missing_ok=True)
            (where / f".lock-{key}").unlink(missing_ok=True)


_built: dict = {}
_once = threading.Lock()


def library(kind: str = "ops") -> Built | None:
    """The library of `kind` for this process (built once), or None with one line on
    stderr saying why and what to install: the Python twin runs then."""
    with _once:
        if kind not in _built:
            try:
                _built[kind] = build(kind)
            except (BuildError, OSError, ImportError) as exc:
                print(f"rdmatensor: the native {WHAT[kind]} is not built ({exc}); the Python twin runs",
                      file=sys.stderr, flush=True)
                _built[kind] = None
        return _built[kind]
