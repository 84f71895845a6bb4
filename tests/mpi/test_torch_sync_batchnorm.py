"""mpitrain.torch.SyncBatchNorm on each rank's shard against torch's BatchNorm on the global
batch: forward, input and parameter gradients, running statistics, uneven shards, eval mode and
convert_sync_batchnorm. Runs as 1 process and under mpiexec -n 2, 3, 4."""
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def rows_of(rank, uneven):
    """Rank r's number of samples."""
    return rank + 2 if uneven else 3


def global_batch(shape_tail, uneven, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    total = sum(rows_of(r, uneven) for r in range(hvd.size()))
    x = torch.randn(total, *shape_tail, generator=g, dtype=dtype) * 3 + 1
    upstream = torch.randn(total, *shape_tail, generator=g, dtype=dtype)   # dLoss/dout
    return x, upstream


def my_rows(uneven):
    start = sum(rows_of(r, uneven) for r in range(hvd.rank()))
    return slice(start, start + rows_of(hvd.rank(), uneven))


def affine(bn):
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, bn.num_features, dtype=bn.weight.dtype))
        bn.bias.copy_(torch.linspace(-1, 1, bn.num_features, dtype=bn.bias.dtype))
    return bn


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("tail, reference_class", [((3, 4, 5), nn.BatchNorm2d),
                                                   ((3,), nn.BatchNorm1d),
                                                   ((3, 6), nn.BatchNorm1d)])
def test_matches_batchnorm_on_the_global_batch(uneven, tail, reference_class):
    x, upstream = global_batch(tail, uneven)
    reference = affine(reference_class(3).double())
    xg = x.clone().requires_grad_()
    (reference(xg) * upstream).sum().backward()

    sync = affine(hvd.SyncBatchNorm(3).double())
    mine = my_rows(uneven)
    xs = x[mine].clone().requires_grad_()
    out = sync(xs)
    (out * upstream[mine]).sum().backward()

    with torch.no_grad():
        reference_out = affine(reference_class(3).double())(x)[mine]
    torch.testing.assert_close(out.detach(), reference_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xs.grad, xg.grad[mine], rtol=1e-9, atol=1e-10)
    # parameter gradients are local sums: their sum over ranks is the global gradient
    for mine_p, ref_p in ((sync.weight, reference.weight), (sync.bias, reference.bias)):
        total = hvd.allreduce(mine_p.grad, op=hvd.Sum)
        torch.testing.assert_close(total, ref_p.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(sync.running_mean, reference.running_mean, rtol=1e-10, atol=0)
    torch.testing.assert_close(sync.running_var, reference.running_var, rtol=1e-10, atol=0)
    assert sync.num_batches_tracked.item() == 1


def test_eval_mode_uses_the_running_statistics():
    x, _ = global_batch((3, 2, 2), False)
    sync, reference = affine(hvd.SyncBatchNorm(3).double()), affine(nn.BatchNorm2d(3).double())
    sync(x[my_rows(False)])
    reference(x)
    sync.eval()
    reference.eval()
    torch.testing.assert_close(sync(x), reference(x), rtol=1e-10, atol=1e-10)


def test_momentum_none_is_a_cumulative_average():
    x, _ = global_batch((2, 3), False)
    sync = hvd.SyncBatchNorm(2, momentum=None).double()
    reference = nn.BatchNorm1d(2, momentum=None).double()
    for k in range(3):
        sync(x[my_rows(False)] * (k + 1))
        reference(x * (k + 1))
    torch.testing.assert_close(sync.running_var, reference.running_var, rtol=1e-10, atol=0)


def test_convert_sync_batchnorm_keeps_parameters_and_statistics():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4),
                          nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(4)))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
        model[1].running_mean.fill_(0.5)
    weight = model[1].weight
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert isinstance(converted[2][1], hvd.SyncBatchNorm)
    assert isinstance(converted[1], nn.modules.batchnorm._BatchNorm)
    assert converted[1].weight is weight
    assert converted[1].running_mean.tolist() == [0.5] * 4
    assert hvd.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2)).num_features == 2


def test_trains_with_the_distributed_optimizer():
    """SyncBatchNorm's allreduces queue behind the gradient buckets in flight: no hang, one
    model on every rank."""
    torch.manual_seed(0)
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3),
        nn.BatchNorm1d(3)))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(3):
        x = torch.randn(4, 1, 8, 8, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    rows = hvd.allgather(torch.cat([t.reshape(-1) for t in model.state_dict().values()
                                    if t.dtype.is_floating_point])[None])
    assert all(torch.equal(rows[0], row) for row in rows)
