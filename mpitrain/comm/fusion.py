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


class FusionBuffer:
    """``empty(shape, dtype)`` allocates the flat buffers: NumPy here, a device backend's
    ``kernels.empty`` for comm/device.py's subclass (same plan, buffers on the GPU)."""

    def __init__(self, threshold_bytes=DEFAULT_THRESHOLD_BYTES, empty=np.empty):
        self.threshold_bytes = check_threshold(threshold_bytes)
        self._empty = empty
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
            buckets = self._plans[key] = self._make_plan(arrays)
        return buckets

    def _make_plan(self, arrays):
        buckets = plan_buckets([a.size for a in arrays], [a.dtype for a in arrays],
                               self.threshold_bytes, SOLO_BYTES)
        for b in buckets:
            if len(b.entries) > 1:
                cap = self._buffers.get(b.dtype)
                if cap is None or cap.size < b.total:
                    self._buffers[b.dtype] = self._empty((b.total,), b.dtype)
        return buckets

    def allreduce(self, arrays, outs, reduce_flat):
        """Reduce ``arrays`` into ``outs`` (may be the same arrays) bucket by bucket.

        reduce_flat(flat): allreduce a contiguous 1-D array in place (scaling included).
        """
        tl = current_timeline()
        for index, bucket in enumerate(self.plan(arrays)):
            nbytes = bucket.total * bucket.dtype.itemsize
            if len(bucket.entries) == 1:
                i = bucket.entries[0][0]
                with tl.span("allreduce", cat="comm", bucket=index, bytes=nbytes):
                    _reduce_direct(arrays[i], outs[i], reduce_flat)
                continue
            flat = self._buffers[bucket.dtype][:bucket.total]  # (total,)
            with tl.span("pack", cat="comm", bucket=index):
                for i, off, n in bucket.entries:
                    flat[off:off + n].reshape(arrays[i].shape)[...] = arrays[i]
            with tl.span("allreduce", cat="comm", bucket=index, bytes=nbytes):
                reduce_flat(flat)
            with tl.span("unpack", cat="comm", bucket=index):
                for i, off, n in bucket.entries:
                    outs[i][...] = flat[off:off + n].reshape(outs[i].shape)
        return outs


def _reduce_direct(x, out, reduce_flat):
    if out is not x:
        out[...] = x
    if out.flags.c_contiguous:
        reduce_flat(out.reshape(-1))
    else:
        tmp = np.ascontiguousarray(out)
        reduce_flat(tmp.reshape(-1))
        out[...] = tmp
