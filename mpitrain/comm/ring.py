"""Pipelined ring-allreduce: reduce-scatter, then allgather, between ring neighbours only.

The N ranks form a ring; rank r sends only to its right neighbour r+1 and receives only from its
left neighbour r-1 (mod N). The buffer is cut into N chunks (the first len % N chunks are one
element longer), chunk c = buf[start[c]:start[c+1]]::

        +--> 0 --> 1 --+
        |              |        N = 4: every arrow carries one chunk per step
        +--- 3 <-- 2 <-+

Reduce-scatter, step s = 0 .. N-2: rank r sends chunk (r - s) % N and receives chunk
(r - s - 1) % N, which it reduces into its own copy. After N-1 steps rank r holds the fully
reduced chunk (r + 1) % N. Allgather, step s = 0 .. N-2: rank r sends chunk (r + 1 - s) % N
(already final) and receives chunk (r - s) % N, overwriting its copy. For N = 4 (send / receive):

    phase            step   rank 0   rank 1   rank 2   rank 3
    reduce-scatter   0      0 / 3    1 / 0    2 / 1    3 / 2
                     1      3 / 2    0 / 3    1 / 0    2 / 1
                     2      2 / 1    3 / 2    0 / 3    1 / 0    -> rank r owns chunk r+1
    allgather        0      1 / 0    2 / 1    3 / 2    0 / 3
                     1      0 / 3    1 / 0    2 / 1    3 / 2
                     2      3 / 2    0 / 3    1 / 0    2 / 1    -> every rank has all chunks

That is 2(N-1) steps of one chunk each, 2N(N-1) chunk transfers in all (tests/unit/
test_ring_schedule.py checks exactly this table). Each rank sends and receives 2(N-1)/N of the
buffer, whatever N: the time is bounded by the link bandwidth, not by the number of ranks, which is
why the ring is the bandwidth-optimal allreduce (a tree or a reduce+broadcast sends the whole
buffer at least twice through its busiest rank).

Pipelining: a chunk is sent as sub-chunks of ``sub`` elements. While sub-chunk k is reduced from
the scratch buffer into ``buf``, sub-chunk k+1 is already arriving in the other half of scratch
(double buffering), so the reduction runs on cache-warm data and overlaps the next transfer. In
the allgather phase sub-chunks are received directly into ``buf``. Extra memory: ``scratch`` of
2*sub elements, owned by the caller and reused by every call; nothing is allocated per call.

The algorithm never touches elements itself: it slices ``buf``/``scratch`` (numpy, cupy or numba
device arrays all slice the same way), sends them as raw bytes with the communicator, and calls
``reduce(dst, src)`` -- so device buffers only need a device reduce function and a communicator
that can move device memory.
"""
import functools

from mpi4py import MPI


def chunk_bounds(n, size):
    """Start offsets of the ``size`` chunks of an n-element buffer (size+1 entries)."""
    base, extra = divmod(n, size)
    return [c * base + min(c, extra) for c in range(size + 1)]


def ring_allreduce(comm, buf, reduce, scratch, sub, finish=None):
    """Allreduce the 1-D contiguous ``buf`` in place over ``comm``.

    reduce(dst, src): dst = op(dst, src) on equal-length 1-D slices.
    scratch: 1-D, same dtype as buf, at least 2*sub elements (the double buffer).
    sub: sub-chunk length in elements (> 0); the pipelining grain.
    finish(piece): optional, applied in place to each sub-chunk of the one chunk this rank
    completes, right after its last reduction (still in cache) and before the allgather sends
    it: Average's 1/N costs each rank 1/N of a pass over the buffer instead of a whole pass.
    """
    ring_reduce_scatter(comm, buf, reduce, scratch, sub, finish)
    ring_allgather(comm, buf, sub)
    return buf


def owned_chunk(rank, size):
    """The chunk that rank holds fully reduced after ``ring_reduce_scatter``."""
    return (rank + 1) % size


def ring_reduce_scatter(comm, buf, reduce, scratch, sub, finish=None, bounds=None):
    """The first phase alone: afterwards chunk ``owned_chunk(rank, size)`` of ``buf`` (bounds
    ``chunk_bounds``, or ``bounds``: size+1 offsets of chunks of any sizes) is reduced over
    every rank; the other chunks hold partial results. Arguments as for ``ring_allreduce``;
    hierarchical.py runs it inside a node."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.shape[0] == 0:
        return buf
    if sub < 1 or scratch.shape[0] < 2 * sub:
        raise ValueError(f"ring scratch of {scratch.shape[0]} elements < 2 * sub ({sub})")
    right, left = (rank + 1) % size, (rank - 1) % size
    bounds = None if bounds is None else tuple(int(b) for b in bounds)
    for step, (sends, recvs) in enumerate(_schedule(buf.shape[0], size, rank, sub,
                                                    bounds)[0]):
        _reduce_step(comm, buf, sends, recvs, left, right, reduce, scratch, sub, step,
                     finish if step == size - 2 else None)
    return buf


def ring_allgather(comm, buf, sub):
    """The second phase alone: every rank's ``owned_chunk`` of ``buf`` to every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.shape[0] == 0:
        return buf
    right, left = (rank + 1) % size, (rank - 1) % size
    for step, (sends, recvs) in enumerate(_schedule(buf.shape[0], size, rank, sub)[1]):
        _copy_step(comm, buf, sends, recvs, left, right, size + step)
    return buf


@functools.lru_cache(maxsize=256)
def _schedule(n, size, rank, sub, bounds=None):
    """(reduce-scatter steps, allgather steps) of one rank, each step (the sub-chunks it sends,
    the sub-chunks it receives) as (lo, hi) bounds: the table above, worked out once per shape
    (a training step repeats the same few); ``bounds``: the chunks' offsets, default
    ``chunk_bounds(n, size)``."""
    if bounds is None:
        bounds = chunk_bounds(n, size)
    elif len(bounds) != size + 1 or bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"ring chunk bounds {bounds} do not cut {n} elements in {size}")

    def step(send_c, recv_c):
        return _pieces(bounds, send_c, sub), _pieces(bounds, recv_c, sub)
    return (tuple(step((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)),
            tuple(step((rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1)))


def _pieces(bounds, c, sub):
    """(lo, hi) of the sub-chunks of chunk c; the same on sender and receiver."""
    return tuple((lo, min(lo + sub, bounds[c + 1])) for lo in range(bounds[c], bounds[c + 1], sub))


def _send_all(comm, buf, pieces, right, tag):
    return [comm.Isend([buf[lo:hi], MPI.BYTE], right, tag) for lo, hi in pieces]


def _reduce_step(comm, buf, send_pieces, pieces, left, right, reduce, scratch, sub, tag,
                 finish=None):
    if pieces:                           # posted before the sends: no unexpected message
        lo, hi = pieces[0]
        pending = comm.Irecv([scratch[:hi - lo], MPI.BYTE], left, tag)
    sends = _send_all(comm, buf, send_pieces, right, tag)
    for k, (lo, hi) in enumerate(pieces):
        pending.Wait()
        if k + 1 < len(pieces):          # the next piece arrives while this one is reduced
            nlo, nhi = pieces[k + 1]
            other = sub * ((k + 1) % 2)
            pending = comm.Irecv([scratch[other:other + nhi - nlo], MPI.BYTE], left, tag)
        slot = sub * (k % 2)
        reduce(buf[lo:hi], scratch[slot:slot + hi - lo])
        if finish is not None:
            finish(buf[lo:hi])
    for req in sends:
        req.Wait()


def _copy_step(comm, buf, send_pieces, recv_pieces, left, right, tag):
    recvs = [comm.Irecv([buf[lo:hi], MPI.BYTE], left, tag) for lo, hi in recv_pieces]
    sends = _send_all(comm, buf, send_pieces, right, tag)
    for req in recvs + sends:
        req.Wait()
