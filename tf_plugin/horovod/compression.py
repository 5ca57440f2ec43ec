"""horovod.tensorflow.compression: how a tensor travels (`hvd.Compression.none`, `.fp16`).

A compressor's compress() returns what is sent and a context; decompress()
turns what arrives back into the tensor's dtype with that context.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["Compression", "FP16Compressor", "NoneCompressor"]


class NoneCompressor:
    """Tensors travel as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 (half the bytes) and come back in their dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
