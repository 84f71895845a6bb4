"""Run under ``mpiexec -n N`` with NUMBA_ENABLE_CUDASIM=1: device collectives vs the host oracle.

Every rank checks mt.* collectives on (simulated) Numba device arrays against the same calls on
NumPy arrays, which take the host path; prints "device comm OK" on rank 0 when all pass.
"""
import numpy as np

import mpitrain as mt
from mpitrain.comm import device
from mpitrain.kernels import cuda_numba as k


def close(dev_array, host_array, what):
    got = k.to_host(dev_array)
    assert got.dtype == host_array.dtype and got.shape == host_array.shape, what
    np.testing.assert_allclose(got, host_array, rtol=1e-6, atol=1e-6, err_msg=what)


def main():
    mt.init()
    rank, size = mt.rank(), mt.size()
    assert device.select_device() == 0
    rng = np.random.default_rng(100 + rank)
    for n in sorted({0, 1, max(size - 1, 1), size, 7, 1000}):
        x = rng.standard_normal(n).astype(np.float32)
        close(mt.allreduce(k.to_device(x)), mt.allreduce(x), f"average n={n}")
    for op in (mt.Sum, mt.Min, mt.Max, mt.Product):
        for dtype in (np.float64, np.int32, np.float16):
            x = (rng.standard_normal((3, 5)) * 4).astype(dtype)                  # (3, 5)
            d = k.to_device(x)
            assert mt.allreduce_(d, op=op, name="x") is d
            close(d, mt.allreduce(x, op=op, name="x"), f"{op} {np.dtype(dtype)}")
    x = rng.standard_normal(33).astype(np.float32)
    close(mt.allreduce(k.to_device(x), op=mt.Average, prescale_factor=2.0,
                       postscale_factor=0.5),
          mt.allreduce(x, op=mt.Average, prescale_factor=2.0, postscale_factor=0.5), "scaled")
    # the Average of integers is a float64 mean, as on the host, grouped or not; in place it is
    # refused
    ints = np.full(4, rank + 1, np.int32)
    close(mt.allreduce(k.to_device(ints)), mt.allreduce(ints), "integer average")
    mixed = [np.arange(3, dtype=np.int64) * (rank + 1), np.full(2, rank + 0.5, np.float32), ints]
    for got, want in zip(mt.grouped_allreduce([k.to_device(a) for a in mixed]),
                         mt.grouped_allreduce(mixed)):
        close(got, want, "grouped integer average")
    for call in (lambda: mt.allreduce_(k.to_device(ints)),
                 lambda: mt.grouped_allreduce_([k.to_device(ints)])):
        try:
            call()
        except ValueError as exc:
            assert "not an integer" in str(exc), exc
        else:
            raise AssertionError("an integer Average on the device did not raise")
    # grouped, in place: the launcher sets a tiny fusion threshold -> several device buckets
    shapes = [(4, 3), (5,), (1,), (2, 2, 2), (40,)]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes] + [np.arange(3.0)]
    ds = [k.to_device(a) for a in xs]
    assert mt.grouped_allreduce_(ds) == ds
    for d, want in zip(ds, mt.grouped_allreduce(xs)):
        close(d, want, "grouped")
    outs = mt.grouped_allreduce([k.to_device(a) for a in xs], op=mt.Sum)
    for d, want in zip(outs, mt.grouped_allreduce(xs, op=mt.Sum)):
        close(d, want, "grouped sum")
    # the one-off collectives
    x = rng.standard_normal((2, 3)).astype(np.float32)
    d = k.to_device(x)
    mt.broadcast_(d, root_rank=size - 1)
    close(d, mt.broadcast(x, root_rank=size - 1), "broadcast_")
    close(mt.broadcast(k.to_device(x), 0), mt.broadcast(x, 0), "broadcast")
    rows = rng.standard_normal((rank + 1, 2)).astype(np.float32)
    close(mt.allgather(k.to_device(rows)), mt.allgather(rows), "allgather")
    x = rng.standard_normal((2 * size + 1, 3))
    close(mt.reducescatter(k.to_device(x)), mt.reducescatter(x), "reducescatter")
    x = rng.standard_normal((2 * size, 2))
    close(mt.alltoall(k.to_device(x)), mt.alltoall(x), "alltoall")
    # a shape mismatch is a CollectiveError on every rank, not a hang
    try:
        mt.allreduce(k.zeros((rank + 1,)), name="bad")
    except mt.CollectiveError as exc:
        assert "shape" in str(exc), exc
    else:
        raise AssertionError("mismatched shapes did not raise")
    assert device.transport() == "host"
    mt.barrier()
    if rank == 0:
        print("device comm OK", flush=True)


if __name__ == "__main__":
    main()
