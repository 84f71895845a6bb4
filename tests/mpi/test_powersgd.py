"""mt.Compression.powersgd (parallel/powersgd.py): PowerSGD as PyTorch's powerSGD_hook.

Oracle: the hook's algorithm evaluated here in numpy from every rank's gradients (gathered):
for each matrix that compression pays for, M_i = G_i + e_i, P = sum_i M_i Q (Q: the state's
warm-started one), orthonormalised, Q' = sum_i M_i^T P / N, result P Q'^T, residual
e_i = M_i - P Q'^T; every other gradient is the plain mean. Before start_iter every gradient is
the plain mean; at N = 1 nothing is averaged, so nothing is compressed. Training a small model
with it still lowers the loss like uncompressed SGD.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()
SHAPES = [(40, 30), (30,), (3, 3), (16, 8, 3), (50, 20)]


def gram_schmidt(p):
    a = p.astype(np.float64)
    for j in range(a.shape[1]):
        before = np.linalg.norm(a[:, j])
        for k in range(j):
            a[:, j] -= (a[:, k] @ a[:, j]) * a[:, k]
        norm = np.linalg.norm(a[:, j])
        a[:, j] = 0.0 if norm == 0.0 or norm <= 1e-5 * before else a[:, j] / norm
    return a


def make(rank=4, start_iter=2, **kw):
    params = [mt.nn.Parameter(np.zeros(s, np.float32)) for s in SHAPES]
    comp = mt.Compression.powersgd(rank=rank, start_iter=start_iter)
    opt = DistributedOptimizer(mt.optim.SGD(params, lr=0.0),
                               [(f"p{i}", p) for i, p in enumerate(params)], compression=comp,
                               **kw)
    return params, comp, opt


def gradients(t, low_rank=False):
    rng = np.random.default_rng(100 * t + R)
    out = []
    for s in SHAPES:
        g = rng.standard_normal(s).astype(np.float32)
        if low_rank and len(s) == 2:            # rank 1 on every rank: rank-deficient factors
            g = np.outer(np.arange(1, s[0] + 1), rng.standard_normal(s[1])).astype(np.float32)
        out.append(g)
    return out


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_matches_the_numpy_reference_with_error_feedback(low_rank, overlap):
    params, comp, opt = make(overlap=overlap)
    errors = {}
    for t in range(5):
        grads = gradients(t, low_rank)
        qs = {i: q.copy() for i, q in comp.qs.items()}
        for p, g in zip(params, grads):
            p.grad[...] = g
        opt.synchronize()
        if N == 1:              # one rank: nothing to average, the gradients stay as they are
            assert all(np.array_equal(p.grad, g) for p, g in zip(params, grads))
            continue
        every = [np.array(mt.allgather_object(g)) for g in grads]        # (N, ...)
        for i, (p, g, allg) in enumerate(zip(params, grads, every)):
            r = comp.compressed_rank(g.shape)
            if t < 2 or r is None:
                np.testing.assert_allclose(p.grad, allg.mean(0), rtol=1e-5, atol=1e-6)
                continue
            n = g.shape[0]
            all_e = np.array(mt.allgather_object(errors.get(i, np.zeros((n, g.size // n)))))
            ms = allg.reshape(N, n, -1).astype(np.float64) + all_e
            q = qs.get(i)
            if q is None:
                q = comp.initial_q(i, ms.shape[2], r, np.float32)
            pm = gram_schmidt(sum(m @ q for m in ms))
            qn = sum(m.T @ pm for m in ms) / N
            approx = pm @ qn.T
            scale = np.abs(ms).max()
            np.testing.assert_allclose(p.grad.reshape(n, -1), approx, rtol=0,
                                       atol=2e-4 * scale)
            errors[i] = ms[R] - approx
            np.testing.assert_allclose(comp.errors[i], errors[i], rtol=0, atol=2e-4 * scale)
            np.testing.assert_allclose(comp.qs[i], qn, rtol=0, atol=2e-4 * scale * n)
            if low_rank and g.ndim == 2:    # a rank-1 mean comes back exactly; residuals sum to 0
                np.testing.assert_allclose(p.grad, allg.mean(0), rtol=0, atol=1e-4 * scale)
                total = np.sum(mt.allgather_object(comp.errors[i]), axis=0)
                assert np.abs(total).max() <= 1e-4 * scale * N
        assert all(np.array_equal(a, b) for a, b in
                   zip(mt.allgather_object([p.grad.copy() for p in params])[0],
                       [p.grad for p in params]))
        opt.step()
    assert comp.iter == (0 if N == 1 else 5)


def test_which_gradients_are_compressed():
    comp = mt.Compression.powersgd(rank=4)
    assert comp.compressed_rank((40, 30)) == 4
    assert comp.compressed_rank((30,)) is None
    assert comp.compressed_rank((3, 3)) is None                 # (3 + 3) 3 * 2 >= 9
    assert comp.compressed_rank((16, 8, 3)) == 4                # 16 x 24
    assert mt.Compression.powersgd(rank=100).compressed_rank((40, 30)) is None


def test_refusals():
    p = mt.nn.Parameter(np.zeros((8, 8), np.float32))
    comp = mt.Compression.powersgd()
    with pytest.raises(ValueError, match="deterministic|powersgd"):
        DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)], compression=comp,
                             deterministic=True)
    with pytest.raises(ValueError, match="sharding"):
        DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)],
                             compression=mt.Compression.powersgd(), sharding="optimizer")
    DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)], compression=comp)
    with pytest.raises(ValueError, match="new one"):
        DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)], compression=comp)
    with pytest.raises(ValueError, match="rank"):
        mt.Compression.powersgd(rank=0)
    with pytest.raises(TypeError, match="inside DistributedOptimizer"):
        comp.compress(np.ones(3))


def _train(compression, steps=30):
    model = mt.models.mlp(in_features=16, hidden=(64, 32), seed=0, dtype=np.float32)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               model.named_parameters(), compression=compression)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    data = np.random.default_rng(5)
    x_all = data.standard_normal((64, 16)).astype(np.float32)
    y_all = (x_all[:, :4].argmax(1)).astype(np.int64)
    losses = []
    for t in range(steps):
        x, y = x_all[R::N], y_all[R::N]
        opt.zero_grad()
        losses.append(float(loss_fn.forward(model.forward(x), y)))
        model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
        opt.step()
    return losses


def test_training_still_converges():
    plain = _train(mt.Compression.none)
    low = _train(mt.Compression.powersgd(rank=2, start_iter=5))
    assert low[-1] < 0.6 * low[0]
    assert low[-1] < plain[0] and abs(low[-1] - plain[-1]) < 0.5 * plain[0]
