"""The ring's schedule, checked with a fake communicator that records every transfer.

N threads each run ring_allreduce for one rank over an in-memory "network" (queues keyed by
source, destination and tag). Every Isend is recorded with the chunk it carries (found from the
byte offset of the sent slice in that rank's buffer), so the tests can check what ring.py's
docstring claims: 2N(N-1) chunk transfers, all to the right neighbour, following the N=4 table
printed there -- and that the result is the true reduction on every rank.
"""
import queue
import re
import threading

import numpy as np
import pytest

from mpitrain.comm import ring
from mpitrain.kernels.cpu import reduce_into


class _Done:
    def Wait(self):
        pass


class _Recv:
    def __init__(self, q, dst):
        self.q, self.dst = q, dst

    def Wait(self):
        data = self.q.get(timeout=10)
        assert data.size == self.dst.size, "message length differs from the posted receive"
        self.dst[...] = data


class FakeNet:
    def __init__(self, size):
        self.size = size
        self.queues = {}
        self.sends = []                      # (src, dst, tag, byte offset, nbytes)
        self.lock = threading.Lock()

    def queue(self, src, dst, tag):
        with self.lock:
            return self.queues.setdefault((src, dst, tag), queue.Queue())


class FakeComm:
    def __init__(self, net, rank, buf):
        self.net, self.rank, self.buf = net, rank, buf

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.net.size

    def Isend(self, msg, dest, tag):
        view = msg[0].view(np.uint8)
        offset = view.__array_interface__["data"][0] - self.buf.__array_interface__["data"][0]
        assert 0 <= offset < self.buf.nbytes, "ring sent something that is not in its buffer"
        with self.net.lock:
            self.net.sends.append((self.rank, dest, tag, offset, view.size))
        self.net.queue(self.rank, dest, tag).put(view.copy())
        return _Done()

    def Irecv(self, msg, source, tag):
        return _Recv(self.net.queue(source, self.rank, tag), msg[0].view(np.uint8))


def run_ring(inputs, op="sum", sub=3):
    size = len(inputs)
    net = FakeNet(size)
    bufs = [x.copy() for x in inputs]
    errors = []

    def worker(r):
        try:
            scratch = np.empty(2 * sub, bufs[r].dtype)
            ring.ring_allreduce(FakeComm(net, r, bufs[r]), bufs[r],
                                lambda d, s: reduce_into(d, s, op), scratch, sub)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return bufs, net


def chunk_transfers(net, n, itemsize):
    """{(src, tag): chunk index} for every chunk transfer (sub-chunk messages merged)."""
    bounds = [b * itemsize for b in ring.chunk_bounds(n, net.size)]
    chunks = {}
    for src, dst, tag, off, nbytes in net.sends:
        assert dst == (src + 1) % net.size, f"rank {src} sent to {dst}, not its right neighbour"
        c = max(i for i in range(net.size) if bounds[i] <= off)
        assert off + nbytes <= bounds[c + 1], "a message crosses a chunk boundary"
        assert chunks.setdefault((src, tag), c) == c, "two chunks sent in one step"
    return chunks


def docstring_table():
    """Rows of the N=4 table in ring.py's docstring: [(sends, recvs) per rank] per step."""
    cells = [re.findall(r"(\d) / (\d)", line) for line in ring.__doc__.splitlines()]
    return [[(int(a), int(b)) for a, b in row] for row in cells if row]


@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize("n", [None, 1000])
def test_exactly_2n_n_minus_1_chunk_transfers_to_the_right(size, n):
    n = n or size * 3 + 1                          # uneven chunks
    inputs = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(size)]
    bufs, net = run_ring(inputs, sub=7)
    chunks = chunk_transfers(net, n, 8)
    assert len(chunks) == 2 * size * (size - 1)
    for r in range(size):
        for step in range(size - 1):
            assert chunks[(r, step)] == (r - step) % size                   # reduce-scatter
            assert chunks[(r, size + step)] == (r + 1 - step) % size        # allgather
    want = np.arange(n) * size * (size + 1) / 2
    for b in bufs:
        np.testing.assert_array_equal(b, want)


def test_docstring_table_is_what_the_code_does():
    table = docstring_table()
    assert len(table) == 6 and all(len(row) == 4 for row in table)
    size, n = 4, 40
    _, net = run_ring([np.ones(n, np.float32)] * size, sub=4)
    chunks = chunk_transfers(net, n, 4)
    for row_index, row in enumerate(table):
        tag = row_index if row_index < 3 else size + row_index - 3
        for r, (send_c, recv_c) in enumerate(row):
            assert chunks[(r, tag)] == send_c
            assert chunks[((r - 1) % size, tag)] == recv_c                 # left neighbour's send


@pytest.mark.parametrize("op,npop", [("sum", np.add), ("prod", np.multiply),
                                     ("min", np.minimum), ("max", np.maximum)])
@pytest.mark.parametrize("dtype", ["int8", "int64", "float16", "float32"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 17])
def test_result_every_op_dtype_and_short_lengths(op, npop, dtype, n):
    size = 3
    rng = np.random.default_rng(n)
    inputs = [rng.integers(-3, 4, n).astype(dtype) for _ in range(size)]
    bufs, net = run_ring(inputs, op=op, sub=2)
    want = inputs[0].copy()
    for x in inputs[1:]:
        npop(want, x, out=want)
    for b in bufs:
        np.testing.assert_array_equal(b, want)
    if n == 0:
        assert net.sends == []


def test_single_rank_is_a_no_op_and_scratch_is_validated():
    x = np.arange(5.0)
    bufs, net = run_ring([x], sub=2)
    np.testing.assert_array_equal(bufs[0], x) and not net.sends
    with pytest.raises(ValueError, match="scratch"):
        ring.ring_allreduce(FakeComm(FakeNet(2), 0, x), x, None, np.empty(3), 2)


def test_chunk_bounds_first_len_mod_n_get_one_more():
    assert ring.chunk_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert ring.chunk_bounds(2, 4) == [0, 1, 2, 2, 2]
