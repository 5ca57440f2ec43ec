"""Pre- and postscale factors as Horovod applies them on CPU.

Horovod's ops take their factors as float32 attributes, so a factor is
rounded to float32 first and then used as a double. An Average is a Sum
whose postscale is divided by the number of ranks (in double), so an
integer average truncates once, after the sum. Each scaling multiplies an
element by the factor:

- float64 in double; float32 by the factor rounded to float32, in float32;
  float16 in float32 (rounded back to half);
- integers in double, truncated toward zero back to their type.

The prescale is applied to each rank's input, the postscale to the sum.
This module does not import TensorFlow.
"""
from __future__ import annotations

import numpy as np


def factor(value: float) -> float:
    """A scale factor as Horovod's op attribute holds it: rounded to float32."""
    return float(np.float32(value))


def in_dtype(scale: float, dtype) -> np.generic:
    """The factor as a float array of `dtype` is multiplied by (its precision there)."""
    dtype = np.dtype(dtype)
    return np.float64(scale) if dtype == np.float64 else np.float32(scale)


def scaled(array: np.ndarray, scale: float) -> np.ndarray:
    """A new array: `array` times `scale`, as Horovod's ScaleBuffer computes it."""
    out = np.empty_like(array)
    scale_into(out, array, scale)
    return out


def scale_into(out: np.ndarray, array: np.ndarray, scale: float) -> None:
    """out = array * scale (out may be array), as Horovod's ScaleBuffer computes it."""
    kind = array.dtype.kind
    if kind == "f" and array.dtype != np.float16:
        np.multiply(array, in_dtype(scale, array.dtype), out=out)
    elif kind == "f":
        np.copyto(out, array.astype(np.float32) * np.float32(scale), casting="same_kind")
    elif kind in "iu":
        np.copyto(out, np.trunc(array * np.float64(scale)), casting="unsafe")
    else:
        raise TypeError(f"cannot scale a {array.dtype} tensor")
