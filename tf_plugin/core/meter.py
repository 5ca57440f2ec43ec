"""What a rank measures about itself: time spent communicating, how much of the
rings' time overlapped backprop, and the copies the plugin makes (the session
counts its own: staging copies, dynamic fallbacks)."""
from __future__ import annotations

import contextlib
import threading
import time


class Meter:
    def __init__(self):
        self._lock = threading.Lock()        # the communication thread adds its time too
        self.comm_seconds = 0.0
        self.ring_seconds = 0.0              # the communication thread's work on buckets ...
        self.overlapped_seconds = 0.0        # ... of which while backprop still ran
        self.ring_cpu_seconds = 0.0          # ... and the CPU it used: taken from compute on a busy machine
        self.rounds = 0                      # all-reduces the communication thread finished
        # tensors into TF with no copy / copied; ring chunks copied to be forwarded (none since chunks
        # go on from the output buffer; kept for readers of the tally); gradients copied into a fusion
        # buffer; output buffers allocated (a reused one is not counted)
        self.tally = {"zero_copy": 0, "copied": 0, "forwarded": 0, "fused": 0, "allocated": 0}

    @contextlib.contextmanager
    def comm(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_comm(time.perf_counter() - t0)

    def add_comm(self, seconds: float) -> None:
        with self._lock:
            self.comm_seconds += seconds

    def add_round(self, busy: float, overlapped: float, cpu: float = 0.0) -> None:
        """One all-reduce done by the communication thread: `busy` seconds on its
        buckets, `overlapped` of them before its last bucket was handed over,
        `cpu` seconds of CPU time used meanwhile."""
        with self._lock:
            self.comm_seconds += busy
            self.ring_seconds += busy
            self.overlapped_seconds += overlapped
            self.ring_cpu_seconds += cpu
            self.rounds += 1

    def restart(self) -> None:
        """Forget the times so far (the traced first step is not timed)."""
        with self._lock:
            self.comm_seconds = self.ring_seconds = self.overlapped_seconds = self.ring_cpu_seconds = 0.0
            self.rounds = 0

    @property
    def overlap(self) -> float | None:
        """The share of the communication thread's time spent while backprop still
        ran (None before any round)."""
        return self.overlapped_seconds / self.ring_seconds if self.ring_seconds else None

    @property
    def copies(self) -> int:
        """Payload copies made by the plugin (not by TensorFlow's own kernels)."""
        return self.tally["copied"] + self.tally["forwarded"] + self.tally["fused"]
