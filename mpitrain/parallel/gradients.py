"""Gradient averaging (Horovod's mode): every ``.grad`` averaged across ranks before each update.

``GradientAveraging`` is the strategy DistributedOptimizer picks for ``average="gradients"``.
Its paths, chosen per step in one place (``average``):
- overlapped: with ``overlap=True``, host arrays, several ranks and more than one bucket's worth
  of gradients, ``backward_hook`` fills fixed buckets (reverse layer order,
  ``fusion_threshold_bytes`` each) whose allreduces run on the comm thread during backward;
  ``synchronize()`` waits for them (comm/overlap.py);
- fused: otherwise every gradient at ``synchronize()``, through the fusion buffer
  (``grouped_allreduce_``); a built-in compression (``Compression.fp16``) casts into persistent
  wire buffers around it;
- compressed: a user's compressor (Horovod's protocol) compresses each gradient, the wire arrays
  are averaged (fused), then decompressed into ``.grad``;
- one rank: nothing to average.
After the average every rank agrees on its count of backward passes (one small exchange), which
also carries the step's report (report.py): on the first step a digest of the parameters, and
which parameters had a gradient (those no rank used get none back, as at N = 1).
"""
import time

import numpy as np

from mpitrain.parallel import autotune, report
from mpitrain.parallel.powersgd import PowerSGD
from mpitrain import comm
from mpitrain.kernels.cpu import bfloat16
from mpitrain.kernels.cpu.bfloat16 import BFLOAT16
from mpitrain.timeline import current as current_timeline
from mpitrain.parallel.strategy import Strategy

# Gradient bucket size when overlapping: small enough that the last layers' allreduce starts
# early in backward, large enough that per-call latency stays small (PyTorch DDP: 25 MB).
OVERLAP_BUCKET_BYTES = 4 * 1024 * 1024


# the name of the gradients' average (a joined rank serving a sharded step looks for it)
GRADIENTS = "DistributedOptimizer.gradients"


class Compressor:
    """A built-in compression: ``wire_dtype(dtype)`` is the dtype sent for arrays of ``dtype``.

    It also speaks Horovod's protocol (``compress(array) -> (array, ctx)``,
    ``decompress(array, ctx) -> array``), but DistributedOptimizer does not call it: it casts
    into persistent wire buffers (or inside the overlap buckets) instead of allocating per step.
    """

    def __init__(self, name, wire):
        self.name = name
        self._wire = wire  # {float dtype: dtype on the wire}

    def wire_dtype(self, dtype):
        return np.dtype(self._wire.get(np.dtype(dtype), dtype))

    def compress(self, array):
        wire = self.wire_dtype(array.dtype)
        if wire == BFLOAT16:
            return bfloat16.encode(array), array.dtype
        return (array if wire == array.dtype else array.astype(wire)), array.dtype

    def decompress(self, array, ctx):
        if array.dtype == BFLOAT16:
            return bfloat16.decode(array).astype(ctx, copy=False)
        return array if array.dtype == ctx else array.astype(ctx)

    def __repr__(self):
        return f"mt.Compression.{self.name}"


class Compression:
    """``none``: gradients travel as they are; ``fp16``: float32 travels as float16 (half the bytes,
    ~3 significant digits; restored to float32 after the average); ``bf16``: float32 travels as
    bfloat16 (half the bytes, float32's range, ~2-3 significant digits; host arrays);
    ``powersgd(rank, start_iter, min_compression_rate)``: a new PowerSGD compressor with state
    (parallel/powersgd.py: low-rank factors, two allreduces a step, error feedback).

    bf16's wire: NumPy has no bfloat16, so the arrays on the wire hold the bits, the upper half of
    each float32 rounded to nearest even (kernels/cpu/bfloat16.py's BFLOAT16, a 2-byte dtype that
    no check takes for uint16). The ring adds them as it adds float16: each hop widens both
    operands to float32 (exact), adds, and rounds once back to bfloat16; Average's 1/N likewise.
    So the sum is the one a bfloat16 ufunc would give, and only 2-byte words cross the links.

    Any other object with Horovod's protocol is accepted too (a class with static methods, as in
    Horovod, or an instance): ``compress(array) -> (wire_array, ctx)`` on each gradient,
    the wire arrays averaged across ranks (fused, like the gradients themselves), then
    ``decompress(wire_array, ctx) -> array`` of the gradient's shape, written back into ``.grad``.
    Wire arrays must have the same shape and dtype on every rank (else comm.CollectiveError on every
    rank); such a compressor runs after backward (no overlap with it).
    """

    none = Compressor("none", {})
    fp16 = Compressor("fp16", {np.dtype(np.float32): np.dtype(np.float16)})
    bf16 = Compressor("bf16", {np.dtype(np.float32): BFLOAT16})

    @staticmethod
    def powersgd(rank=4, start_iter=10, min_compression_rate=2.0):
        """PowerSGD (parallel/powersgd.py): a new compressor with state, for one optimizer."""
        return PowerSGD(rank, start_iter, min_compression_rate)


def is_compressor(obj):
    """True for mt.Compression.none/.fp16/.bf16 and any object with compress() and
    decompress()."""
    return (isinstance(obj, Compressor) or (callable(getattr(obj, "compress", None))
                                            and callable(getattr(obj, "decompress", None))))


class GradientAveraging(Strategy):
    """``average="gradients"``: ``synchronize()`` averages every ``.grad``; ``step()`` updates."""

    def __init__(self, opt):
        super().__init__(opt)
        self.wire = None  # fp16 buffers, allocated at the first synchronize
        self.replicas_checked = False   # the first step compares the parameters' digests
        self.one_bucket = False         # every gradient fits one bucket: no overlap to gain
        # MPITRAIN_AUTOTUNE=1: the first steps try thresholds and paths (autotune.py)
        self.autotuner = None
        ps = opt.process_set
        if ps.included():
            self.autotuner = autotune.for_optimizer(
                comm.world_of(ps, "DistributedOptimizer"),
                lambda obj: comm.allgather_object(obj, process_set=ps),
                opt.fusion_threshold_bytes, sum(p.data.nbytes for p in opt.params),
                self.set_fusion_threshold)

    def bucket_allreduce(self):
        if self.buckets is not None or self.one_bucket:
            return self.buckets
        opt = self.opt
        if (not opt.overlap or opt.process_set.size() == 1 or opt.op is comm.Adasum
                or not opt.params or comm.on_device(opt.params[0].data)
                or not isinstance(opt.compression, Compressor)):
            return None
        # shapes from .data: reading a stale .grad would zero-fill it (see Parameter)
        grads = [p.data for p in reversed(opt.params)]
        wire = [opt.compression.wire_dtype(g.dtype) for g in grads]
        if (len(set(wire)) == 1 and 0 < opt.fusion_threshold_bytes
                and sum(g.size for g in grads) * wire[0].itemsize <= opt.fusion_threshold_bytes):
            # one bucket, complete with backward's last gradient: nothing to overlap, and the
            # fused path at synchronize() skips the comm thread's hand-offs
            self.one_bucket = True
            return None
        f = opt.gradient_predivide_factor
        self.buckets = comm.bucket_allreduce(
            opt.process_set, [(tuple(g.shape), g.dtype) for g in grads],
            opt.fusion_threshold_bytes, opt.op, 1.0 / f, f, GRADIENTS,
            wire_dtypes=wire)
        return self.buckets

    def synchronize(self, flags=None):
        """Average every ``.grad`` in place; then agree on the count of backward passes (and
        carry ``flags``: returns their OR over the ranks, or None)."""
        opt = self.opt
        error = self.passes.error()
        used = report.used(opt.params)         # before the average zero-fills the missing ones
        several = opt.process_set.size() > 1   # the average of one: nothing to do
        digest = agreed = None
        if several and not self.replicas_checked:
            digest = report.digest(opt.params)
            self.replicas_checked = True
        if several:
            start = time.perf_counter()
            current_timeline().cycle()           # mt.start_timeline(path, mark_cycles=True)
            with current_timeline().span("synchronize", cat="comm"):
                self.average()
            opt.comm_time_s += time.perf_counter() - start
        # checked after the average, so that ranks at different counts made the same calls
        self.passes.reset()
        if several:
            # behind whatever is in flight (another optimizer's buckets)
            agreed, any_used = self.agree(
                "DistributedOptimizer.step", self.step_fields(), error,
                ordered=True, flags=flags, digest=digest, used=used)
            if any_used is not None:        # no rank used these: no gradient, as at N = 1
                for p, u in zip(opt.params, any_used):
                    if not u:
                        p.drop_grad()
        elif error is not None:
            opt.zero_grad()               # a wrong count summed the wrong gradients
            raise ValueError(error)
        self.synchronized = True
        return agreed

    def set_fusion_threshold(self, threshold_bytes):
        super().set_fusion_threshold(threshold_bytes)
        self.one_bucket = False

    def step(self, skip, flags=None, update=None):
        agreed = super().step(skip, flags, update)
        if self.autotuner is not None:
            self.autotuner.step_done()
        return agreed

    def average(self):
        buckets = self.bucket_allreduce()
        if buckets is not None:
            buckets.finish([p.grad for p in reversed(self.opt.params)])
            return
        compression = self.opt.compression
        grads = [p.grad for p in self.opt.params]
        kernels = self.opt.params[0].kernels
        if isinstance(compression, PowerSGD):
            if comm.on_device(grads[0]):
                raise ValueError(f"{compression!r} compresses host arrays")
            compression.average(grads, self.opt.process_set, self.opt.op, GRADIENTS)
            return
        if not isinstance(compression, Compressor):
            self.average_with_compressor(compression, grads, kernels)
            return
        if self.wire is None:
            if compression is Compression.bf16 and comm.on_device(grads[0]):
                raise ValueError("mt.Compression.bf16 compresses host arrays; on the GPU use "
                                 "mt.Compression.fp16")
            self.wire = [None if compression.wire_dtype(g.dtype) == g.dtype
                         else kernels.empty(tuple(g.shape), compression.wire_dtype(g.dtype))
                         for g in grads]
        for g, w in zip(grads, self.wire):
            if w is not None:
                kernels.cast(w, g)
        wire = [g if w is None else w for g, w in zip(grads, self.wire)]
        self.grouped_allreduce(wire)
        for g, w in zip(grads, self.wire):
            if w is not None:
                kernels.cast(g, w)

    def average_with_compressor(self, compression, grads, kernels):
        """A user's compressor (Horovod's protocol): compress each gradient of ``grads``,
        average the wire arrays (fused), decompress into them."""
        wire, contexts = [], []
        for g in grads:
            w, ctx = compression.compress(g)
            if isinstance(w, np.ndarray) and not (w.flags.writeable and w.flags.c_contiguous):
                w = np.array(w, order="C")   # averaged in place: needs its own writable copy
            wire.append(w)
            contexts.append(ctx)
        self.grouped_allreduce(wire)
        for name, g, w, ctx in zip(self.opt.names, grads, wire, contexts):
            out = compression.decompress(w, ctx)
            if tuple(out.shape) != tuple(g.shape):
                raise ValueError(f"compression {compression!r}: decompress gave shape "
                                 f"{tuple(out.shape)} for {name!r}, whose gradient has "
                                 f"{tuple(g.shape)}")
            if out is g:
                continue
            if isinstance(g, np.ndarray):
                np.copyto(g, out, casting="unsafe")
            else:
                kernels.copy(g, out if out.dtype == g.dtype else out.astype(g.dtype))

    def grouped_allreduce(self, arrays):
        opt = self.opt
        f = opt.gradient_predivide_factor
        comm.grouped_allreduce_(arrays, op=opt.op, name=GRADIENTS,
                                       prescale_factor=1.0 / f, postscale_factor=f,
                                       fusion_threshold_bytes=opt.fusion_threshold_bytes,
                                       process_set=opt.process_set)
