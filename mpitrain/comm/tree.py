"""One fixed binary reduction tree: the same additions in the same order for any number of ranks.

The ring (ring.py) reduces chunk c starting at rank c+1, so which partial sums meet depends on N,
and float addition is not associative: 1 rank x batch 8b and 2 ranks x batch 4b agree only up to
rounding. Bitwise equality across N (deterministic mode) needs one tree that every N evaluates
the same way.

The tree has M leaves (M a power of two: the micro-shards of one global batch, in order), and each
inner node adds its left and right subtree. With N ranks (a power of two dividing M), rank r owns
the leaves [r*M/N, (r+1)*M/N): a complete subtree. So the tree splits into two halves that never
depend on N:

- below the ranks: each rank adds its own leaves pairwise (``PairwiseSum``: a binary counter of
  partial sums, log2(M/N) + 1 buffers, each leaf added as soon as it exists);
- above the ranks: ``tree_allreduce`` combines the ranks' subtree sums level by level, partners at
  distance 1, then 2, 4, ...: at level l, rank r meets r XOR 2**l, and both hold the sums of two
  sibling subtrees. IEEE addition is commutative (a + b and b + a are the same bits), so both
  partners get the same node whatever order they add in. For M = 8 leaves g0..g7::

        N = 1:  ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))      all local
        N = 2:  rank 0 (g0+g1)+(g2+g3), rank 1 (g4+g5)+(g6+g7), then level 0 across ranks
        N = 4:  rank r  g2r + g2r+1, then levels 0 and 1 across ranks

  Every N performs exactly the additions of the N = 1 line, each on the same operands.

Traffic: recursive halving (a reduce-scatter: at each level a rank keeps one half of its current
segment, sends the other half, adds the partner's copy of its half), then recursive doubling (an
allgather, the levels in reverse). Each rank sends 2(N-1)/N of the buffer, as in the ring, in
2 log2(N) steps instead of 2(N-1). The segment split at a level is the same on both partners,
because they agree on every lower bit of their rank. N must be a power of two.
"""
from mpi4py import MPI


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


class PairwiseSum:
    """Sum leaves in the fixed pairwise tree, one leaf at a time: ``add(leaf)`` ... ``result()``.

    ``new_buffer()`` makes an array like a leaf (the caller's backend), ``reduce(dst, src)`` does
    dst += src. ``add`` copies a leaf in (the caller may reuse its array at once); without the
    copy, fill ``spare()`` and ``push`` it. The number of leaves must be a power of two (else the
    tree would depend on when the count stops).
    """

    def __init__(self, new_buffer, copy, reduce):
        self.new_buffer, self.copy, self.reduce = new_buffer, copy, reduce
        self._stack = []             # [(level, array)], levels strictly decreasing
        self._free = []
        self.count = 0

    def add(self, leaf):
        buf = self.spare()
        self.copy(buf, leaf)
        self.push(buf)

    def spare(self):
        """A buffer like a leaf, from the free list or new: fill it, then ``push`` it."""
        return self._free.pop() if self._free else self.new_buffer()

    def push(self, buf):
        """Add the leaf already in ``buf`` (from ``spare()``), without a copy; the tree owns it."""
        level = 0
        # binary counter: two partial sums of the same level are siblings in the tree
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            self.reduce(left, buf)                                      # left = left + right
            self._free.append(buf)
            buf, level = left, level + 1
        self._stack.append((level, buf))
        self.count += 1

    def result(self):
        """The root: the sum of every leaf so far, which must be a power of two of them."""
        if not is_power_of_two(self.count):
            raise ValueError(f"a pairwise tree needs a power-of-two number of leaves, got "
                             f"{self.count}")
        (_, root), = self._stack
        return root

    def take(self):
        """``result()``, handed over: the tree no longer owns the root (``release`` it later)."""
        root = self.result()
        self._stack = []
        self.count = 0
        return root

    def release(self, buf):
        """Give a buffer (a taken root, an unused spare) back to the free list."""
        self._free.append(buf)

    def reset(self):
        self._free += [buf for _, buf in self._stack]
        self._stack = []
        self.count = 0


def tree_allreduce(comm, buf, reduce, scratch):
    """Sum the 1-D contiguous ``buf`` over ``comm`` in place, in the fixed tree above.

    reduce(dst, src): dst = dst + src on equal-length 1-D slices. scratch: 1-D, same dtype, at
    least half of buf (the halves received during the reduce-scatter).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if not is_power_of_two(size):
        raise ValueError(f"the deterministic tree allreduce needs a power-of-two number of "
                         f"ranks, got {size}")
    n = buf.shape[0]
    if size == 1 or n == 0:
        return buf
    if scratch.shape[0] < (n + 1) // 2:
        raise ValueError(f"tree scratch of {scratch.shape[0]} elements < half the buffer ({n})")
    lo, hi, path = 0, n, []
    for level in range(size.bit_length() - 1):                      # reduce-scatter, halving
        partner = rank ^ (1 << level)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank < partner else ((mid, hi), (lo, mid))
        got = scratch[:keep[1] - keep[0]]
        comm.Sendrecv([buf[give[0]:give[1]], MPI.BYTE], partner, level,
                      [got, MPI.BYTE], partner, level)
        reduce(buf[keep[0]:keep[1]], got)                               # same node on both
        path.append((partner, keep, give))
        lo, hi = keep
    for level in range(len(path) - 1, -1, -1):                        # allgather, doubling
        partner, keep, give = path[level]
        comm.Sendrecv([buf[keep[0]:keep[1]], MPI.BYTE], partner, 64 + level,
                      [buf[give[0]:give[1]], MPI.BYTE], partner, 64 + level)
    return buf
