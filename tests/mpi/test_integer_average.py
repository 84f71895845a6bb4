"""The Average of integer host arrays, one rule everywhere (comm/host.py, device.py follows it):
a float64 mean out of place -- allreduce and grouped_allreduce give the same bits -- and a
ValueError on every rank in place, the arrays untouched. tests/cudasim checks device arrays."""
import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()


def _inputs(rank=R):
    return [np.arange(7, dtype=np.int32) * (rank + 1) - 3, np.full((2, 3), 2 * rank + 1, np.int64),
            np.linspace(-1, 1, 5).astype(np.float32), np.arange(4, dtype=np.uint8) + rank]


@pytest.mark.parametrize("threshold", [0, 64, None])
def test_grouped_integer_average_is_the_float64_mean_allreduce_gives(threshold):
    xs = _inputs()
    outs = mt.grouped_allreduce(xs, postscale_factor=3.0, fusion_threshold_bytes=threshold)
    assert [o.dtype for o in outs] == [np.float64, np.float64, np.float32, np.float64]
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert out.tobytes() == mt.allreduce(x, postscale_factor=3.0).tobytes()
        if x.dtype.kind != "f":
            want = sum(_inputs(r)[i].astype(np.float64) for r in range(N)) / N * 3
            np.testing.assert_allclose(out, want, rtol=1e-12)


def test_in_place_integer_average_is_refused_on_every_rank():
    xs = _inputs()
    before = [x.copy() for x in xs]
    for call in (lambda: mt.grouped_allreduce_(xs), lambda: mt.allreduce_(xs[0])):
        with pytest.raises(ValueError, match="Average of int32 arrays is not an integer"):
            call()
    for x, b in zip(xs, before):
        assert x.tobytes() == b.tobytes()
    assert mt.grouped_allreduce_(xs, op=mt.Sum)[1] is xs[1]              # Sum stays integer
    assert xs[1].dtype == np.int64 and (xs[1] == N * N).all()


def test_a_repeated_integer_average_reuses_its_plan(monkeypatch):
    from mpitrain.comm import host
    checked = []
    first = host.allreduce_checked
    monkeypatch.setattr(host, "allreduce_checked", lambda *a: checked.append(1) or first(*a))
    for x in (np.arange(5, dtype=np.int32) + R, np.arange(3000, dtype=np.int64) * (R + 1)):
        want = sum((x - R if x.size == 5 else x // (R + 1) * (r + 1)).astype(np.float64)
                   + (r if x.size == 5 else 0) for r in range(N)) / N
        results = [mt.allreduce(x, name="plan-reuse") for _ in range(3)]
        for got in results:                                 # (a new array each time)
            assert got.dtype == np.float64 and got.tobytes() == results[0].tobytes()
            np.testing.assert_allclose(got, want, rtol=1e-12)
        assert x.dtype.kind == "i"                          # the input itself stays integer
        with pytest.raises(ValueError, match="is not an integer"):       # in place: refused
            mt.allreduce_(x.copy(), name="plan-reuse")
    assert len(checked) == (4 if N > 1 else 8)   # each first call and each refusal (one rank:
                                                 # no plans, every call)
