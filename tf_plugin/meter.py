"""What a rank measures about itself: time spent communicating, and the copies
the plugin makes (the session counts its own: staging copies, dynamic fallbacks)."""
from __future__ import annotations

import contextlib
import time


class Meter:
    def __init__(self):
        self.comm_seconds = 0.0
        # tensors into TF with no copy / copied; ring chunks forwarded; gradients copied into a fusion buffer
        self.tally = {"zero_copy": 0, "copied": 0, "forwarded": 0, "fused": 0}

    @contextlib.contextmanager
    def comm(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm_seconds += time.perf_counter() - t0

    @property
    def copies(self) -> int:
        """Payload copies made by the plugin (not by TensorFlow's own kernels)."""
        return self.tally["copied"] + self.tally["forwarded"] + self.tally["fused"]
