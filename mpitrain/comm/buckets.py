"""Bucket planning: which arrays are reduced together, as a pure function of sizes and dtypes.

One planner for the fusion buffer (fusion.py, and device.py through it), the overlapped bucket
allreduce (overlap.py) and the performance model (benchmarks/perfmodel_lib). A bucket is a run
of arrays of one dtype packed into one flat buffer and reduced by one allreduce; it holds at
least one array and at most ``threshold_bytes`` (an array larger than that is alone). An array
of at least ``solo_bytes`` that may go solo gets a bucket of its own, reduced in place.
Two grouping rules:

- by dtype (``consecutive=False``, the fusion buffer): arrays are grouped by dtype in order of
  first appearance and packed in input order within a dtype; a solo array does not interrupt
  the bucket being filled (it is emitted first, the bucket continues after it);
- in arrival order (``consecutive=True``, the overlap path, where buckets go out as backward
  produces them): consecutive arrays of one dtype; a dtype change or a solo array ends the
  bucket being filled, and the array after a solo one starts a new bucket.

Worked example, float32 arrays a (8 elements, 32 B), b (30, 120 B), c (4, 16 B), d (8, 32 B),
threshold 64 B, solo 100 B (tests/unit/test_buckets.py checks it):

    by dtype:        [b] [a c] [d]     b goes alone, a's bucket continues: a + c = 48 B,
                                       + d = 80 B > 64, so d starts the next one
    arrival order:   [a] [b] [c d]     b ends a's bucket; c starts fresh, c + d = 48 B

The plan depends on nothing but its arguments, so every rank that passes the same sizes and
dtypes builds the same plan, and every element is summed in the same order on every run.
"""
import numpy as np

__all__ = ["Bucket", "SOLO_BYTES", "plan_buckets"]

# Arrays of at least this size travel alone, reduced in place: packing and unpacking would copy
# them twice (2 x 1 MiB at ~10 GB/s is ~0.2 ms), more than one more allreduce call costs (tens
# of us). E.g. the MLP's two weight gradients (3.2 and 4.2 MB) are no longer copied every step.
SOLO_BYTES = 1 << 20


class Bucket:
    """Arrays reduced together: entries are (input index, offset, length) in the flat buffer,
    in elements of ``dtype``; ``total`` is the buffer's length."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.entries = []
        self.total = 0

    def add(self, index, n):
        self.entries.append((index, self.total, n))
        self.total += n

    def __repr__(self):
        return f"Bucket({self.dtype}, {[e[0] for e in self.entries]}, {self.total})"


def plan_buckets(sizes, dtypes, threshold_bytes, solo_bytes=SOLO_BYTES, consecutive=False,
                 may_go_solo=None):
    """The list of Buckets for arrays of ``sizes`` elements of ``dtypes`` (see the module
    docstring for the two rules). may_go_solo: per array, whether it may have a bucket of its
    own (overlap.py: only when it needs no cast); None = every array may."""
    dtypes = [np.dtype(d) for d in dtypes]
    if len(dtypes) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(dtypes)} dtypes")
    order = range(len(sizes))
    if not consecutive:
        groups = {}
        for i, dtype in enumerate(dtypes):
            groups.setdefault(dtype, []).append(i)
        order = [i for group in groups.values() for i in group]
    buckets, current = [], None
    for i in order:
        n, dtype = int(sizes[i]), dtypes[i]
        alone = (may_go_solo is None or bool(may_go_solo[i])) and n * dtype.itemsize >= solo_bytes
        if current is not None and (
                dtype != current.dtype or (alone and consecutive)
                or (not alone and (current.total + n) * dtype.itemsize > threshold_bytes)):
            buckets.append(current)
            current = None
        if alone:
            solo = Bucket(dtype)
            solo.add(i, n)
            buckets.append(solo)
            continue
        if current is None:
            current = Bucket(dtype)
        current.add(i, n)
    if current is not None:
        buckets.append(current)
    return buckets
