"""kernels.cpu.reduce_into (the ring's reduction) against NumPy, every op and dtype."""
import numpy as np
import pytest

from mpitrain.kernels.cpu import reduce_into

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_into_matches_numpy(op, dtype):
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 1000):
        dst = rng.integers(-100, 100, n).astype(dtype)
        src = rng.integers(-100, 100, n).astype(dtype)
        want = OPS[op](dst, src)                       # wraps for integers, like MPI
        reduce_into(dst, src, op)
        np.testing.assert_array_equal(dst, want.astype(dtype))


def test_reduce_into_works_on_slices_in_place():
    buf = np.arange(10, dtype=np.float32)
    src = np.ones(4, np.float32)
    reduce_into(buf[3:7], src, "sum")
    np.testing.assert_array_equal(buf, [0, 1, 2, 4, 5, 6, 7, 7, 8, 9])
