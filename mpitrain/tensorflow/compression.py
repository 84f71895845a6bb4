"""Gradient and allreduce compression on tf.Tensors (horovod.tensorflow's ``Compression``).

``Compression.none`` leaves tensors as they are; ``Compression.fp16`` sends floating-point
tensors as float16 (half the bytes, about three significant digits) and casts the result back;
``Compression.bf16`` sends float32 as bfloat16.
Any object with Horovod's two static methods works wherever a compression is taken:
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``.
"""
import tensorflow as tf


class NoneCompressor:
    """Tensors travel as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class BF16Compressor:
    """float32 tensors travel as bfloat16 (TensorFlow's cast: round to nearest even) and come
    back as float32."""

    @staticmethod
    def compress(tensor):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype == tf.float32:
            return tf.cast(tensor, tf.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """``Compression.none``, ``Compression.fp16`` (Horovod's names) and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
