"""Tensor fusion: many small allreduces become a few large ones through persistent flat buffers.

A model's gradients are dozens of arrays, many tiny (biases); one ring allreduce each would pay
the per-call latency dozens of times. ``FusionBuffer`` packs them into flat buffers ("buckets"),
runs one allreduce per bucket, and unpacks.

The plan (comm/buckets.py) is a pure function of the inputs' (shape, dtype) sequence and the
threshold: arrays are grouped by dtype in order of first appearance, and within a dtype packed in
input order into buckets of at most ``threshold_bytes``; an array larger than the threshold, of
at least ``SOLO_BYTES``, or alone in its bucket, is reduced directly in its output without
packing (the small ones around it share buckets as before). Every rank therefore builds the same
plan (the caller has checked that the shapes agree), every element is summed in the same order on
every run, and reruns are bitwise identical -- unlike dynamic fusion that packs whatever is ready.
Plans are cached by signature, and one flat buffer per dtype (sized to that dtype's largest
bucket, so never above the threshold) is reused by every bucket and every call.

The loop serves every array family (``NumpyArrays`` here, CuPy's and Numba's in device.py): how
to allocate (``empty``), copy between an array and a slice of the flat buffer (``copy``), and see
an array as contiguous 1-D (``flat``, ``contiguous``).
"""
import numpy as np

from mpitrain.comm.buckets import SOLO_BYTES, plan_buckets
from mpitrain.timeline import current as current_timeline

DEFAULT_THRESHOLD_BYTES = 64 * 1024 * 1024


def check_threshold(value):
    """An explicit bucket size limit, validated: an int >= 0 (bytes). The default, when none is
    given, is the World's setting (MPITRAIN_FUSION_THRESHOLD) or the caller's own."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"fusion_threshold_bytes {value!r}: expected an integer >= 0 (bytes)")
    return int(value)


class NumpyArrays:
    """The array family of NumPy arrays (what FusionBuffer needs; see the module docstring)."""

    empty = staticmethod(np.empty)
    flat = staticmethod(lambda a: np.ascontiguousarray(a).reshape(-1))   # a copy if strided
    contiguous = staticmethod(lambda a: a.flags.c_contiguous)

    @staticmethod
    def copy(dst, src):
        """dst[...] = src for arrays of one size (either may be the other one flattened)."""
        if dst.flags.c_contiguous:
            dst.reshape(src.shape)[...] = src
        else:
            dst[...] = src.reshape(dst.shape)


class FusionBuffer:
    """The plan, and its flat buffers allocated by ``family`` (NumPy's, or a device family's:
    same plan, buffers on the GPU)."""

    def __init__(self, threshold_bytes=DEFAULT_THRESHOLD_BYTES, family=NumpyArrays):
        self.threshold_bytes = check_threshold(threshold_bytes)
        self.family = family
        self._plans = {}
        self._buffers = {}

    def buffer_sizes(self):
        """dtype -> elements of its persistent flat buffer (never more than a threshold's)."""
        return {dtype: buf.size for dtype, buf in self._buffers.items()}

    def plan(self, arrays):
        """The list of Buckets for these arrays (cached; identical for identical signatures)."""
        key = tuple((tuple(a.shape), np.dtype(a.dtype).str) for a in arrays)
        buckets = self._plans.get(key)
        if buckets is None:
            buckets = self._plans[key] = plan_buckets(
                [a.size for a in arrays], [a.dtype for a in arrays], self.threshold_bytes,
                SOLO_BYTES)
            for b in buckets:                    # a packed bucket fits its dtype's buffer
                if len(b.entries) > 1:
                    cap = self._buffers.get(b.dtype)
                    if cap is None or cap.size < b.total:
                        self._buffers[b.dtype] = self.family.empty((b.total,), b.dtype)
        return buckets

    def allreduce(self, arrays, outs, reduce_flat):
        """Reduce ``arrays`` into ``outs`` (may be the same arrays) bucket by bucket.

        reduce_flat(flat): allreduce a contiguous 1-D array in place (scaling included).
        """
        tl, fam = current_timeline(), self.family
        for index, bucket in enumerate(self.plan(arrays)):
            nbytes = bucket.total * bucket.dtype.itemsize
            if len(bucket.entries) == 1:                 # alone: reduced in its output
                i = bucket.entries[0][0]
                with tl.span("allreduce", cat="comm", bucket=index, bytes=nbytes):
                    if outs[i] is not arrays[i]:
                        fam.copy(outs[i], arrays[i])
                    flat = fam.flat(outs[i])
                    reduce_flat(flat)
                    if not fam.contiguous(outs[i]):
                        fam.copy(outs[i], flat)
                continue
            flat = self._buffers[bucket.dtype][:bucket.total]  # (total,)
            with tl.span("pack", cat="comm", bucket=index):
                for i, off, n in bucket.entries:
                    fam.copy(flat[off:off + n], arrays[i])
            with tl.span("allreduce", cat="comm", bucket=index, bytes=nbytes):
                reduce_flat(flat)
            with tl.span("unpack", cat="comm", bucket=index):
                for i, off, n in bucket.entries:
                    fam.copy(outs[i], flat[off:off + n])
        return outs
