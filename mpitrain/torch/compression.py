"""Gradient and allreduce compression on tensors (horovod.torch's ``Compression``).

``Compression.none`` leaves tensors as they are; ``Compression.fp16`` sends floating-point
tensors as float16 (half the bytes, about three significant digits) and casts the result back;
``Compression.bf16`` sends float32 as bfloat16 (float32's range, about two to three digits).
Any object with Horovod's two static methods works wherever a compression is taken:
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``.

DistributedOptimizer does not call the built-in two per gradient: it hands the matching
built-in of mpitrain's own (``mt.Compression``) to the gradient buckets, which cast into
persistent wire buffers instead of allocating a tensor per step (``builtin``).
"""
import torch

import mpitrain
from mpitrain.parallel.powersgd import PowerSGD


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
        if tensor.dtype.is_floating_point and tensor.dtype is not torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class BF16Compressor:
    """float32 tensors travel as bfloat16 (round to nearest even, NaN kept) and come back as
    float32. In DistributedOptimizer the gradients' wire is 2 bytes a value (mt.Compression.bf16:
    summed in float32, rounded once per hop); in a direct ``allreduce(t, compression=...)`` the
    bfloat16 tensor is reduced as tensors.py reduces bfloat16 (on a float32 copy): the values are
    rounded to bfloat16, the bytes sent are not halved."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype is torch.float32:
            return tensor.to(torch.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """``Compression.none``, ``Compression.fp16`` (Horovod's names) and ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def powersgd(rank=4, start_iter=10, min_compression_rate=2.0):
        """PowerSGD with state (mt.Compression.powersgd): for one DistributedOptimizer."""
        return mpitrain.Compression.powersgd(rank, start_iter, min_compression_rate)


def is_compression(obj):
    """True for an object with Horovod's compress() and decompress()."""
    return callable(getattr(obj, "compress", None)) and callable(getattr(obj, "decompress",
                                                                          None))


def builtin(compression):
    """mpitrain's own built-in equivalent of ``compression`` (which runs inside the gradient
    buckets, overlapped), or None for a user's compressor."""
    if compression is NoneCompressor:
        return mpitrain.Compression.none
    if compression is FP16Compressor:
        return mpitrain.Compression.fp16
    if compression is BF16Compressor:
        return mpitrain.Compression.bf16
    if isinstance(compression, PowerSGD):
        return compression
    return None
