"""The CuPy flavour's one-launch SGD over every parameter against sgd_update per parameter, its
CUDA C run on the CPU (tests/support/fake_cupy.py)."""
import numpy as np
import pytest

import mpitrain as mt

SIZES = (3, 8192 * 2 + 5, 1, 700)        # one parameter spans three chunks


def _tensors(seed, dtype=np.float32):
    g = np.random.default_rng(seed)
    return [[g.standard_normal(n).astype(dtype) for n in SIZES] for _ in range(3)]


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_group_matches_one_update_per_parameter(emulated, momentum, nesterov):
    decays = [0.0, 1e-2, 0.0, 5e-4]
    want, got = _tensors(0), _tensors(0)
    for _ in range(2):                   # the second call reuses the cached tables
        for p, g, b, wd in zip(*want, decays):
            emulated.sgd_update(p, g, b, 0.05, momentum, nesterov, wd)
        emulated.sgd_update_group(got[0], got[1], got[2] if momentum else got[0], 0.05,
                                  momentum, nesterov, decays)
    checked = (0, 2) if momentum else (0,)
    for i in checked:
        for a, b in zip(got[i], want[i]):
            np.testing.assert_array_equal(a, b)         # the same arithmetic, in order


def test_mixed_dtypes_fall_back_to_one_update_each(cpu, emulated):
    p32, p64 = np.ones(4, np.float32), np.ones(4, np.float64)
    emulated.sgd_update_group([p32, p64], [p32 * 2, p64 * 2], [p32, p64], 0.5, 0.0, False,
                              [0.0, 0.0])
    assert p32.tolist() == [0.0] * 4 and p64.tolist() == [0.0] * 4
    emulated.sgd_update_group([], [], [], 0.5, 0.0, False, [])            # nothing to do


def test_sgd_uses_the_group_kernel(emulated, monkeypatch):
    calls = []
    monkeypatch.setattr(emulated, "sgd_update", lambda *a: calls.append(a))
    model = mt.nn.Sequential(mt.nn.Linear(4, 3, kernels=emulated))
    opt = mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [np.array(p.data) for p in model.parameters()]
    for p in model.parameters():
        p.grad = np.ones(p.shape, p.dtype)
    opt.step()
    assert calls == []                   # no per-parameter launch
    for p, old in zip(model.parameters(), before):
        np.testing.assert_allclose(p.data, old - 0.1, rtol=1e-6)
