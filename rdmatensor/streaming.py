"""Copies and sums of payloads bigger than the caches, streamed to memory (`_streaming.c`).

    streaming.copy(dst, src)                 # shm: a payload into the peer's slot
    streaming.add(out, a, b, scale)          # the ring: (a + b) * scale, float32/float64

What streams is a payload of STREAM_BYTES or more (`stream=`: the caller's
call, for a piece of a larger payload). Otherwise, or where the extension is
not built (`make setup` builds it; `BUILD_ERROR` says why not), or with
`enabled` False (what bench.ring_cpu measures against), they are plain
memory copies and numpy ops, with the same results bit for bit.
"""
from __future__ import annotations

import numpy as np

from . import native

_streaming, BUILD_ERROR = native.load("rdmatensor._streaming")

# Below this, the destination is read again soon from the cache it is in (and a
# call into C costs more than it saves).
STREAM_BYTES = 256 << 10

enabled = _streaming is not None


def copy(dst, src, stream: bool | None = None) -> None:
    """dst[:] = src, for two contiguous buffers of one length (dst a memoryview or array)."""
    if enabled and (src.nbytes >= STREAM_BYTES if stream is None else stream) and src.nbytes:
        _streaming.copy(dst, src)
    else:
        dst[:] = src


def add(out: np.ndarray, a: np.ndarray, b: np.ndarray, scale=None, stream: bool | None = None) -> None:
    """out = a + b, then times `scale` if given (a number of out's dtype, as numpy
    multiplies); float32 and float64 stream, any other dtype goes to numpy."""
    if (enabled and (out.nbytes >= STREAM_BYTES if stream is None else stream) and out.size
            and out.dtype in FLOATS and a.dtype == b.dtype == out.dtype and (scale is None or scale != 0)):
        _streaming.add(out, a, b, out.dtype.itemsize, 0.0 if scale is None else float(scale))
        return
    np.add(a, b, out=out)
    if scale is not None:
        np.multiply(out, scale, out=out)


FLOATS = (np.dtype(np.float32), np.dtype(np.float64))     # the dtypes add() streams
