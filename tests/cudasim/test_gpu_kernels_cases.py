"""benchmarks/gpu_kernels.py's kernel cases run on both GPU backends (simulated / emulated).

The benchmark itself refuses the simulator (its timings mean nothing there), so nothing else
would notice a case that calls a kernel with the wrong arguments before a run on a real GPU
does: every case is called once here, on the smallest batch, and must return without error.
"""
import numpy as np
import pytest

import gpu_kernels


@pytest.fixture(params=["numba", "cupy"])
def k(request):
    return request.getfixturevalue({"numba": "dev", "cupy": "emulated"}[request.param])


def test_every_benchmark_case_runs(k):
    n = 16 * 28 * 28                                    # one (1, 16, 28, 28) image
    cases, (a, b, c) = gpu_kernels.elementwise_cases(k, 64)
    cases += gpu_kernels.norm_cases(k, n)
    names = [name for name, _, _ in cases]
    assert len(set(names)) == len(names) and "bn_backward_input" in names
    for name, fn, nbytes in cases:
        fn()
        assert nbytes > 0, name
    k.synchronize()
    assert np.isfinite(k.to_host(c)).all()
