"""How an emulated provider's waiter looks for writes before it sleeps: it
spins for a short while, yielding the core between looks (a peer sharing the
core runs now, not at the next scheduler tick), then gives up to sleep on the
provider's doorbell (stream_channel.StreamChannel._consume)."""
from __future__ import annotations

import os
import time


class Patience:
    """`seconds` of looking, counted from the first look that found nothing."""

    def __init__(self, seconds: float):
        self.seconds, self.until = seconds, 0.0

    def exhausted(self) -> bool:
        """After a look that found nothing: True when the time is up, else yield the core and go on."""
        now = time.monotonic()
        if not self.until:
            self.until = now + self.seconds
        elif now >= self.until:
            return True
        os.sched_yield()
        return False
