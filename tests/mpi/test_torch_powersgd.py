"""hvd.Compression.powersgd in mpitrain.torch's DistributedOptimizer (parallel/powersgd.py).

Oracles: the first start_iter steps equal uncompressed training bitwise (a plain average);
afterwards each compressed weight's gradient is the projection P Q^T of the ranks' mean
(checked against the gathered gradients: its residual is what error feedback keeps), and a small
classifier trained with it still reaches a loss near uncompressed training's.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 16, generator=g)
    return x, x[:, :4].argmax(1)


def train(compression, steps=30):
    n, r = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    x, y = data()
    losses, snapshots = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[r::n]), y[r::n])
        loss.backward()
        losses.append(float(hvd.allreduce(loss.detach())))
        opt.step()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return losses, snapshots


def test_plain_average_before_start_iter_then_converges():
    plain, plain_snaps = train(hvd.Compression.none)
    comp = hvd.Compression.powersgd(rank=2, start_iter=5)
    low, snaps = train(comp)
    for a, b in zip(snaps[:5], plain_snaps[:5]):
        assert torch.equal(a, b)
    assert low[-1] < 0.6 * low[0]
    assert abs(low[-1] - plain[-1]) < 0.5 * plain[0]
    if hvd.size() > 1:
        assert comp.iter == 30 and comp.errors and comp.qs


def test_the_compressed_gradient_is_the_projection_of_the_mean():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("one rank averages nothing")
    lin = nn.Linear(40, 30, bias=False)
    comp = hvd.Compression.powersgd(rank=3, start_iter=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.0),
                                   named_parameters=lin.named_parameters(), compression=comp)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(r))
    opt.zero_grad()
    q0 = comp.initial_q(0, 40, 3, np.float32)
    lin(x).pow(2).sum().backward()
    local = (2 * (x @ lin.weight.detach().T).T @ x).numpy()       # d/dW of |W x|^2
    got = lin.weight.grad.numpy()
    every = hvd.allgather(torch.from_numpy(local)[None]).double().numpy()
    p = sum(m @ q0 for m in every)
    p, _ = np.linalg.qr(p)
    qn = sum(m.T @ p for m in every) / n
    np.testing.assert_allclose(got, p @ qn.T, rtol=0, atol=1e-3 * np.abs(every).max())
    opt.step()
