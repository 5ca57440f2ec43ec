"""The ring all-reduce as it was before two of its savings, kept only so that
bench.ring_cpu measures them against today's ring in one run; training never
runs these (the executor's ring has neither switch).

- copy_fused=True: a fused bucket's gradients are copied together into one
  buffer first, as before gather writes (the `copy` way);
- register_outputs=False: the output buffers are not registered, so on verbs
  the all-gather's writes are copied into staging first, as before (the
  `staged` way).
"""
from __future__ import annotations

import numpy as np

from tf_plugin.core.buffers import aligned_empty
from tf_plugin.executor.ring import BucketView, RingAllReduce


class VariantRing(RingAllReduce):
    def __init__(self, session, analysis, copy_fused: bool = False, register_outputs: bool = True, **kw):
        self._register = register_outputs
        # copy_fused: a fused bucket's input buffer, reused every step; its padding stays zero
        self._fused = {}
        if copy_fused:
            for b in analysis.buckets:
                if len(b.members) > 1:
                    self._fused[b.key] = aligned_empty((b.size,), b.dtype)
                    self._fused[b.key][...] = 0
        super().__init__(session, analysis, **kw)

    def _writes_leave_from(self, output: np.ndarray) -> None:
        if self._register:
            super()._writes_leave_from(output)

    def _flat(self, bucket, arrays: list, average: bool) -> tuple[BucketView, bool]:
        buf = self._fused.get(bucket.key)
        if buf is None:
            return super()._flat(bucket, arrays, average)
        for (_, offset, n), a in zip(bucket.members, arrays, strict=True):
            np.copyto(buf[offset:offset + n], a.reshape(-1))
        self.meter.tally["fused"] += len(bucket.members)
        return BucketView.of(buf), average
