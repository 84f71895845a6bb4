"""Overlapped bucket allreduce: reduce gradients while backward is still producing the rest.

Why: without overlap a step is backward, then all communication, then the update; the network
idles during backward and the cores idle during the allreduce. Backward produces gradients from
the last layer to the first, so the last layers' gradients are final long before the step ends.
``BucketAllreduce`` cuts the arrays, in the order the caller will report them (reverse layer
order for a Sequential), into buckets of at most ``threshold_bytes``; as soon as every array of
the next bucket has been reported ready, the bucket is packed and its allreduce is handed to one
background thread per process, and ``finish`` waits for them only before the update::

    main thread   backward L3 | pack b0 | backward L2 | backward L1 | pack b1 | wait | unpack
    comm thread                 allreduce b0 ..........               allreduce b1 ..

Rules that keep N processes consistent (and reruns bitwise identical):
- The plan is fixed at the first call from the (shape, dtype) sequence, agreed across ranks once
  (the World's agreement, check.py: a mismatch is a CollectiveError on every rank), and identical
  on every rank. Each step's first bucket is preceded by one prepared agreement of the same
  description ("allreduce buckets"): the exchange through which a rank that has run out of data
  (join.py) learns that a step is being reduced, and takes part in it with zeros. With
  ``agree_each`` every bucket is preceded by its own ("allreduce bucket", its index) instead:
  where other collectives run between a step's buckets (sharded parameters gather layers while
  backward goes on), a joined rank must learn each bucket where it comes.
- Buckets are submitted strictly in plan order, whatever order the arrays are reported in, and
  one thread runs them in submission order: every rank issues the same allreduces in the same
  order, so MPI's matching and the ring's tags stay consistent.
- Only the comm thread calls MPI while buckets are in flight; the caller must not call MPI
  between the first ``ready`` and ``finish`` (the training loop only computes there). Needs
  ``MPI.Query_thread() >= MPI_THREAD_SERIALIZED`` (mpi4py asks for MULTIPLE); below that the
  allreduces run inline on the caller's thread (same plan, same bits, no overlap).
- An exception in the comm thread skips the later buckets and is re-raised by ``finish`` after
  every bucket has finished, so no MPI call is left running behind the caller's back.

Numba kernels and BLAS release the GIL, and mpi4py releases it inside MPI calls, so the two
threads really run at once. Each bucket has its own flat buffer (all are in flight together);
an array alone in its bucket, contiguous and already of the wire dtype, is reduced in place.
"""
import contextlib

import numpy as np

from mpitrain.comm import check, handles, world
from mpitrain.comm.buckets import SOLO_BYTES, plan_buckets
from mpitrain.comm.handles import comm_thread_available
from mpitrain.timeline import current as current_timeline
from mpitrain.comm.kinds import Kind
from mpitrain.kernels import cpu


class BucketAllreduce:
    """Allreduce a fixed list of arrays in buckets, overlapping with the caller's compute.

    specs: [(shape, dtype)] in submission order (the order arrays become ready).
    wire_dtypes: the dtype each array travels as (float16 for fp16 compression), or None.
    reduce_flat(flat): allreduces a contiguous 1-D host array in place (scaling included); it
    runs on the comm thread.
    describe: fields agreed across ranks together with the plan (op, factors, name).
    state: the World (world.py) of the ranks that reduce: its agreement checks the plan, its
    watchdog Record marks each bucket (the global set's or a process set's; None: the global
    set's).
    agree_each: one agreement before every bucket rather than one per step (see above).
    """

    def __init__(self, specs, threshold_bytes, reduce_flat, describe, wire_dtypes=None,
                 overlap=True, state=None, arrival=True, agree_each=False):
        self.agree_each = agree_each
        self.state = state
        self.specs = [(tuple(s), np.dtype(d)) for s, d in specs]
        wire = wire_dtypes or [d for _, d in self.specs]
        self.wire = [np.dtype(w) for w in wire]
        self.threshold_bytes = int(threshold_bytes)
        self.reduce_flat = reduce_flat
        self.describe = dict(describe)
        self.overlap = overlap and comm_thread_available()
        self.arrival = arrival      # plan in arrival order (else the fusion buffer's: plan())
        self.buckets = None
        self._checks = []
        self._bucket_of = []
        self._reset_step()

    # -- plan ------------------------------------------------------------------------------------
    def _plan(self):
        """The plan's buckets (buckets.Bucket), each with its index in the plan and ``flat``, its
        persistent buffer (total,), or None when it is reduced in place."""
        no_cast = [w == d for (_, d), w in zip(self.specs, self.wire)]
        buckets = plan(self.specs, self.wire, self.threshold_bytes, self.arrival)
        for index, b in enumerate(buckets):
            inplace = len(b.entries) == 1 and no_cast[b.entries[0][0]]
            b.index, b.packed = index, not inplace
            b.flat = None if inplace else np.empty(b.total, b.dtype)
        return buckets

    def release(self):
        """Free the packed buckets' buffers until the next step needs them (sharded
        gradients keep only their chunk of each: the whole would be the memory saved)."""
        for b in self.buckets or ():
            if b.packed:
                b.flat = None

    def _build(self):
        fields = dict(self.describe, threshold_bytes=self.threshold_bytes,
                      arrays=tuple((s, d.str) for s, d in self.specs),
                      wire=tuple(w.str for w in self.wire), overlap=True)
        # Once per plan, before any bucket of it moves: ranks whose arrays differ learn it
        # here, all of them. Behind whatever is in flight (another optimizer's buckets).
        if self.state is None:
            self.state = world.current()
        agreement = self.state.agreement
        handles.ordered(agreement, Kind.GROUPED_ALLREDUCE, fields)
        # and once per step, before the first bucket: the collective a rank that has joined
        # (join.py) learns the step from -- one small exchange, prepared once
        self.buckets = self._plan()
        self._checks = [None] * len(self.buckets)
        if agreement.usable and self.agree_each:
            self._checks = [check.Prepared(agreement, Kind.ALLREDUCE_BUCKET,
                                           dict(fields, index=b.index, agree_each=True))
                            for b in self.buckets]
        elif agreement.usable:
            self._checks[0] = check.Prepared(agreement, Kind.ALLREDUCE_BUCKETS, fields)
        self._bucket_of = [0] * len(self.specs)
        for b in self.buckets:
            for i, _, _ in b.entries:
                self._bucket_of[i] = b.index

    def _reset_step(self):
        self._arrays = [None] * len(self.specs)
        self._missing = None if self.buckets is None else [len(b.entries) for b in self.buckets]
        self._next = 0           # next bucket to submit (plan order)
        self._futures = []
        self._failed = False

    # -- per step --------------------------------------------------------------------------------
    def pending(self):
        """True between the first ``ready`` of a step and its ``finish``."""
        return any(a is not None for a in self._arrays)

    def ready(self, i, array):
        """Array i holds its final value for this step; submit every bucket now complete."""
        if self.buckets is None:
            self._build()
            self._missing = [len(b.entries) for b in self.buckets]
        if self._arrays[i] is not None:
            self._wait_all()
            self._reset_step()
            raise ValueError(f"array {i} reported ready twice before finish() (its first "
                             f"allreduce may have read it half-written)")
        self._arrays[i] = array
        self._missing[self._bucket_of[i]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._submit(self.buckets[self._next])
            self._next += 1

    def finish(self, arrays):
        """Reduce whatever was not reported, wait for every bucket, write results into
        ``arrays`` (all of them, in spec order); re-raise a comm-thread error here."""
        try:
            self._complete(arrays)
            tl = current_timeline()
            for b in self.buckets:
                if b.flat is None:
                    continue
                with tl.span("unpack", cat="comm", bucket=b.index):
                    for i, off, n in b.entries:
                        _assign(arrays[i], b.flat[off:off + n].reshape(arrays[i].shape))
            return arrays
        finally:
            self._reset_step()

    def finish_flat(self, arrays):
        """As ``finish``, without the unpack: [(bucket, its reduced 1-D buffer)] in plan order
        (the buffer of an array reduced in place is that array, flattened), valid until the
        next step's buckets run. A reduce-scatter keeps only its own chunk of each."""
        try:
            self._complete(arrays)
            return [(b, self._arrays[b.entries[0][0]].reshape(-1) if b.flat is None else b.flat)
                    for b in self.buckets]
        finally:
            self._reset_step()

    def _complete(self, arrays):
        for i, a in enumerate(arrays):
            if self._arrays[i] is None:
                self.ready(i, a)
        error = self._wait_all()
        if error is not None:
            raise error

    def _wait_all(self):
        """Wait for every submitted bucket; the first error (or None)."""
        error = None
        for fut in self._futures:
            try:
                handles.synchronize(fut)
            except BaseException as exc:  # noqa: BLE001 - returned, re-raised by the caller
                error = error or exc
        return error

    def _submit(self, b):
        if b.packed and b.flat is None:          # released after the last step
            b.flat = np.empty(b.total, b.dtype)
        if b.flat is None:
            a = self._arrays[b.entries[0][0]]
            flat = a.reshape(-1) if a.flags.c_contiguous else None
            if flat is None:                      # reduce a contiguous copy, unpack later
                b.flat = np.empty(b.total, b.dtype)
        if b.flat is not None:
            with current_timeline().span("pack", cat="comm", bucket=b.index):
                for i, off, n in b.entries:
                    _assign(b.flat[off:off + n], self._arrays[i].reshape(-1))
            flat = b.flat
        nbytes = b.total * b.dtype.itemsize
        if not self.overlap:
            self._reduce(flat, b.index, nbytes, "main")
            return
        self._futures.append(handles.submit(self._run, flat, b.index, nbytes,
                                            kind=Kind.ALLREDUCE_BUCKET))

    def _run(self, flat, index, nbytes):
        # comm thread: buckets run one at a time, in submission order
        if self._failed:
            return
        try:
            self._reduce(flat, index, nbytes, "comm")
        except BaseException:
            self._failed = True
            raise

    def _reduce(self, flat, index, nbytes, tid):
        if self._checks[index] is not None:
            self._checks[index]()
        with watched(self.state, index), current_timeline().span(
                "allreduce", cat="comm", tid=tid, bucket=index, bytes=nbytes,
                process_set=self.state.set_id):
            self.reduce_flat(flat)


@contextlib.contextmanager
def watched(state, index):
    """Bucket ``index`` marked in flight on ``state``'s stall-watchdog Record, like an agreement
    (watchdog.py): a rank that never sends its gradients is named. The caller makes no MPI call
    while buckets are in flight, so this is the one collective running in this process (a
    joined rank replaying a step marks its buckets the same way, join.py)."""
    record = state.record
    record.enter(("allreduce bucket", {"name": f"bucket {index}"}, None))
    try:
        yield
    finally:
        record.leave()


def plan(specs, wire, threshold_bytes, arrival=True):
    """The buckets (buckets.Bucket) of arrays ``specs`` [(shape, dtype)] travelling as ``wire``
    dtypes: consecutive arrays of one wire dtype, up to threshold_bytes per bucket (>= 1 array);
    an array of at least buckets.SOLO_BYTES that needs no cast has a bucket of its own (it is
    reduced in place: no pack, no unpack copy). A joined rank (join.py) replays a step from it.
    ``arrival=False``: the fusion buffer's plan instead (fusion.py: grouped by dtype, any large
    array alone), so that a reduce-scatter keeps the elements the fused allreduce would sum in
    the same order."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape, _ in specs]
    if not arrival:
        return plan_buckets(sizes, [np.dtype(w) for w in wire], threshold_bytes, SOLO_BYTES)
    no_cast = [np.dtype(w) == np.dtype(d) for (_, d), w in zip(specs, wire)]
    return plan_buckets(sizes, [np.dtype(w) for w in wire], threshold_bytes, SOLO_BYTES,
                        consecutive=True, may_go_solo=no_cast)


def _assign(dst, src):
    """dst[...] = src; a float32 <-> float16 cast (fp16 compression) in the Numba kernel, which
    gives NumPy's bits about 10x faster than NumPy's own float16 conversion."""
    if dst.dtype != src.dtype and dst.flags.c_contiguous and src.flags.c_contiguous:
        cpu.cast(dst, src)
    else:
        dst[...] = src

