"""hvd.Adasum in mpitrain.torch: ``hvd.allreduce(t, op=hvd.Adasum)`` and
``hvd.DistributedOptimizer(opt, op=hvd.Adasum)`` (comm/adasum.py underneath).

Oracles, as Horovod's test/parallel/test_adasum_pytorch.py: orthogonal columns (one per rank)
combine to their sum, parallel ones to their mean; the optimizer's step with plain SGD moves each
parameter by lr times the Adasum of every rank's gradient, computed here in float64 from the
gathered gradients. At N = 3 (not a power of two) every call is one ValueError on every rank.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402

from tests.support.oracles import adasum_oracle  # noqa: E402

POW2 = None


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    global POW2
    hvd.init()
    POW2 = hvd.size() & (hvd.size() - 1) == 0


def test_orthogonal_and_parallel_tensors():
    if not POW2:
        pytest.skip("power-of-two ranks")
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng(2)
    for dtype in (np.float32, np.float64):
        q, _ = np.linalg.qr(rng.normal(0, 1, (n * 20 - 17, n)))
        got = hvd.allreduce(torch.from_numpy(q[:, r].astype(dtype)), op=hvd.Adasum)
        assert got.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
        diff = np.linalg.norm(q.sum(1) - got.double().numpy()) / np.linalg.norm(q.sum(1))
        assert diff / 100 < np.finfo(dtype).eps
        par = rng.normal(0, 1, (50, 1)) @ rng.normal(0, 1, (n, 1)).T
        t = torch.from_numpy(par[:, r].astype(dtype))
        handle = hvd.allreduce_async(t, op=hvd.Adasum)
        out = hvd.synchronize(handle).double().numpy()
        assert np.linalg.norm(out - par.mean(1)) / np.linalg.norm(par.mean(1)) / 100 \
            < np.finfo(dtype).eps
    ts = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)), torch.randn(5)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Adasum)
    for t, out in zip(ts, outs):
        rows = hvd.allgather(t.reshape(1, -1)).double().numpy()
        np.testing.assert_allclose(out.reshape(-1).numpy(), adasum_oracle(rows), rtol=1e-5,
                                   atol=1e-6)


def test_distributed_optimizer_with_adasum():
    r = hvd.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if not POW2:
        with pytest.raises(ValueError, match="power-of-two"):
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           op=hvd.Adasum)
            x = torch.randn(4, 6)
            model(x).sum().backward()
            opt.step()
        return
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   op=hvd.Adasum)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + r)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]   # already combined
        opt.step()
        for p, old, combined in zip(model.parameters(), before, grads):
            torch.testing.assert_close((old - p.detach()) / 0.5, combined, rtol=1e-4,
                                       atol=1e-6)
    # the combination itself: each gradient's Adasum over the ranks
    opt.zero_grad()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(99 + r))
    model(x).pow(2).sum().backward()
    combined = [p.grad.detach().clone() for p in model.parameters()]   # after backward
    model2 = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model2.load_state_dict(model.state_dict())
    model2(x).pow(2).sum().backward()
    for p2, c in zip(model2.parameters(), combined):
        rows = hvd.allgather(p2.grad.reshape(1, -1)).double().numpy()
        np.testing.assert_allclose(c.reshape(-1).double().numpy(), adasum_oracle(rows),
                                   rtol=1e-4, atol=1e-6)
    opt.step()


def test_reducescatter_still_refuses_adasum():
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.reducescatter(torch.ones(hvd.size() * 2), op=hvd.Adasum)
