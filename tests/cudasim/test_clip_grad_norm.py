"""mt.nn.clip_grad_norm_ on both GPU backends against the same call on the CPU kernels."""
import math

import numpy as np
import pytest

import mpitrain.nn as nn


@pytest.fixture(params=["numba", "cupy"])
def k(request):
    """The backend under test: Numba CUDA (simulated) or CuPy (emulated)."""
    return request.getfixturevalue({"numba": "dev", "cupy": "emulated"}[request.param])


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])             # clipped / left alone
def test_matches_cpu(cpu, k, norm_type, max_norm):
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(shape).astype(np.float32) for shape in [(6, 4), (4,), (2, 3)]]
    results = []
    for kernels in (cpu, k):
        params = []
        for g in grads:
            p = nn.Parameter(np.zeros(g.shape, np.float32), kernels)
            kernels.copy(p.grad, kernels.to_device(g))
            params.append(p)
        total = nn.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        results.append((total, [np.array(kernels.to_host(p.grad)) for p in params]))
    (want_total, want), (total, got) = results
    assert total == pytest.approx(want_total, rel=1e-6)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    if max_norm > 100:
        for w, g in zip(grads, got):
            np.testing.assert_array_equal(g, w)
