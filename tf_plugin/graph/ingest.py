"""A received slot as a TensorFlow tensor, and when the slot goes back to the sender.

What was measured (TensorFlow 2.21, numpy 2.4, CPU):

- `tf.convert_to_tensor(ndarray)` and `tf.constant(ndarray)` copy.
- `tf.experimental.dlpack.from_dlpack(ndarray.__dlpack__())` aliases the
  array's memory: no copy, and the tensor holds a reference to the ndarray
  until TensorFlow frees the buffer (DLPack's deleter drops it).
- A read-only ndarray (what `Session.recv` hands out) cannot be exported:
  numpy raises BufferError, since the DLPack version TensorFlow consumes
  (unversioned "dltensor" capsules) cannot say "read-only"; the versioned
  capsule, which can, is refused by TensorFlow. So a fresh writeable ndarray
  is made over the same arena bytes: TensorFlow never writes into its inputs
  except by buffer forwarding, and the slot is ours until released.
- TensorFlow's kernels CHECK-fail (abort the process) on buffers not aligned
  to 64 bytes. Plan slots are 64-byte aligned in page-aligned arenas, so this
  holds; anything else is copied.

The rule implemented: zero-copy when possible, and the slot is released when
TensorFlow frees the last tensor aliasing it (a weakref finalizer on the
exported ndarray, which only the DLPack capsule references). Otherwise
(unaligned, empty, or `copy=True`) the bytes are copied on ingest and the
slot is released at once. Keep no received tensor beyond the step: the
sender cannot write the next value until the slot is released.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import tensorflow as tf

from ..core.buffers import TF_ALIGN

_counts = {"zero_copy": 0, "copied": 0}
_lock = threading.Lock()


def _count(key: str, tally: dict | None = None) -> None:
    with _lock:
        _counts[key] += 1
        if tally is not None:
            tally[key] = tally.get(key, 0) + 1


def counts() -> dict:
    """How many received tensors reached TensorFlow with no copy, and with one."""
    with _lock:
        return dict(_counts)


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def writeable_alias(view: np.ndarray) -> np.ndarray | None:
    """A new writeable ndarray over the same bytes as `view`, or None."""
    root = _root(view)
    if not root.flags.writeable:
        return None
    offset = view.ctypes.data - root.ctypes.data
    return np.ndarray(view.shape, view.dtype, buffer=root, offset=offset)


def to_tensor(received, copy: bool = False, tally: dict | None = None) -> tf.Tensor:
    """Hand `received` (a rdmatensor Received) to TensorFlow, releasing it per the rule above.
    Counted in `tally` (zero_copy / copied) as well as in counts()."""
    view = received.array
    alias = None
    if not copy and view.size and view.ctypes.data % TF_ALIGN == 0:
        alias = writeable_alias(view)
    if alias is not None:
        try:
            tensor = tf.experimental.dlpack.from_dlpack(alias.__dlpack__())
        except Exception:  # noqa: BLE001 - e.g. a dtype DLPack cannot carry into TensorFlow
            alias = None    # copy instead
        else:
            weakref.finalize(alias, received.release)
            del alias
            _count("zero_copy", tally)
            return tensor
    tensor = tf.constant(view)
    received.release()
    _count("copied", tally)
    return tensor


def borrow(array: np.ndarray, tally: dict | None = None) -> tf.Tensor:
    """An ndarray as a tensor with no copy (it must be 64-byte aligned and stay untouched
    while the tensor lives); otherwise copied. Counted like to_tensor."""
    if array.size and array.ctypes.data % TF_ALIGN == 0 and array.flags.c_contiguous:
        alias = array if array.flags.writeable else writeable_alias(array)
        if alias is not None:
            _count("zero_copy", tally)
            return tf.experimental.dlpack.from_dlpack(alias.__dlpack__())
    _count("copied", tally)
    return tf.constant(array)
