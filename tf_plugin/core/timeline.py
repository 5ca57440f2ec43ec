"""A time line of the all-reduce, as Chrome trace JSON (open it in Perfetto or
chrome://tracing): per step, when each bucket's gradients were ready, when its
ring started and finished, and how long TensorFlow waited for its result.

    RDMATENSOR_TIMELINE=/tmp/timeline.json            # rank 0 writes it (HOROVOD_TIMELINE too)
    RDMATENSOR_TIMELINE=/tmp/timeline-{rank}.json     # every rank writes its own

Events go to the file as they happen, one per line, in the JSON array format
of the trace event specification; close() (at shutdown, or at exit) ends the
array. A process that dies leaves the closing bracket out, which the viewers
accept. Times are microseconds since the time line was opened. Tracks
(thread ids): TensorFlow (buckets handed over, waits for results) and
communication (rings). Every event's args name its round (one all-reduce of
one tensor set: a step, for the gradients) and bucket.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time

from rdmatensor.errors import UsageError

from . import settings

TENSORFLOW, COMMUNICATION = 1, 2


class Timeline:
    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        try:                    # its folder is made, as a user of --timeline out/run.json expects
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "w")
        except OSError as exc:
            raise UsageError(f"rank {rank} cannot write its time line (RDMATENSOR_TIMELINE) to {path!r}: "
                             f"{exc.strerror or exc}") from exc
        self._file.write("[\n")
        self._write({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, name in ((TENSORFLOW, "TensorFlow"), (COMMUNICATION, "communication")):
            self._write({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        atexit.register(self.close)

    @classmethod
    def from_env(cls, rank: int) -> Timeline | None:
        """The time line RDMATENSOR_TIMELINE (or Horovod's HOROVOD_TIMELINE) asks this rank for, or None."""
        path = settings.text(settings.TIMELINE)
        if not path or ("{rank}" not in path and rank != 0):
            return None
        return cls(path.replace("{rank}", str(rank)), rank)

    def micros(self, t: float) -> float:
        """A time.perf_counter() reading on the time line."""
        return round((t - self._origin) * 1e6, 3)

    def instant(self, name: str, tid: int, t: float, **args) -> None:
        self._write({"name": name, "ph": "i", "s": "t", "pid": self.rank, "tid": tid, "ts": self.micros(t),
                     "args": args})

    def span(self, name: str, tid: int, t0: float, t1: float, **args) -> None:
        self._write({"name": name, "ph": "X", "pid": self.rank, "tid": tid, "ts": self.micros(t0),
                     "dur": round((t1 - t0) * 1e6, 3), "args": args})

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def _write(self, event: dict) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(event) + ",\n")

    def close(self) -> None:
        """End the JSON array (idempotent)."""
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.write(json.dumps({"name": "trace_end", "ph": "M", "pid": self.rank, "args": {}}) + "\n]\n")
            f.close()
            atexit.unregister(self.close)
