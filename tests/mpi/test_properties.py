"""Property tests (hypothesis): random shapes, dtypes, ops and paths against the NumPy oracle.

derandomize=True and no example database: every rank draws the same examples in the same order,
so they make the same collective calls (the rank only changes the data, through the seed).
"""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import mpitrain as mt
from tests.support.comm import comm_settings
from tests.support.oracles import DTYPES, OPS, assert_matches, numpy_oracle, rank_input

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()
SETTINGS = settings(max_examples=25, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
       dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       path=st.sampled_from(["auto", "ring", "mpi"]), seed=st.integers(0, 1000))
def test_allreduce_matches_oracle(shape, dtype, op, path, seed):
    with comm_settings(algorithm=path):
        n = int(np.prod(shape))
        inputs = [rank_input(r, n, dtype, op, seed).reshape(shape) for r in range(N)]
        got = mt.allreduce(inputs[R], op=op)
        assert_matches(got, numpy_oracle(inputs, op))


@SETTINGS
@given(sizes=st.lists(st.integers(0, 40), min_size=0, max_size=6),
       threshold=st.sampled_from([0, 16, 100, 1 << 20]))
def test_grouped_allreduce_matches_separate_allreduces(sizes, threshold):
    with comm_settings(fusion_threshold_bytes=threshold):
        xs = [np.arange(n, dtype=np.float32 if i % 2 else np.float64) * (R + 1) + i
              for i, n in enumerate(sizes)]
        outs = mt.grouped_allreduce(xs, op=mt.Sum)
        for x, o in zip(xs, outs):
            np.testing.assert_array_equal(o, mt.allreduce(x, op=mt.Sum))
