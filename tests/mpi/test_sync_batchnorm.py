"""SyncBatchNorm under 1..4 ranks: N ranks x batch b == 1 rank x batch N*b (float64).

The oracle: every rank also runs plain BatchNorm on the whole global batch locally. Rank r takes
samples r, r+N, r+2N, ... of it. Checked: the forward output and the input gradient (rank r's
rows), the running statistics, and the parameter gradients summed over ranks (each rank holds
its local sums, as in PyTorch); then whole trainings of a small ResNet with
DistributedOptimizer, with gradient overlap on (bucket allreduces on the comm thread while
SyncBatchNorm reduces inside backward) and off.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer
from mpitrain.nn import BatchNorm1d, BatchNorm2d, SyncBatchNorm

mt.init()
N, R = mt.size(), mt.rank()


def _global_input(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N * shape[0],) + shape[1:]) * 2 + 0.5      # (N*b, ...)
    r = rng.standard_normal(x.shape)                                    # upstream gradient
    return x, r


@pytest.mark.parametrize("cls,shape", [(BatchNorm2d, (3, 4, 5, 5)), (BatchNorm1d, (5, 3))])
def test_layer_matches_the_double_batch(cls, shape):
    x, r = _global_input(shape, seed=len(shape))
    ref = cls(shape[1], dtype=np.float64)
    ref.weight.data[...] = np.linspace(0.5, 1.5, shape[1])
    ref.bias.data[...] = np.linspace(-1, 1, shape[1])
    sync = SyncBatchNorm.convert(cls(shape[1], dtype=np.float64))
    sync.weight.data[...] = ref.weight.data
    sync.bias.data[...] = ref.bias.data
    for step in range(2):                                   # twice: running stats compound
        y_ref = ref.forward(x + step)
        y = sync.forward(np.ascontiguousarray(x[R::N] + step))
        np.testing.assert_allclose(y, y_ref[R::N], rtol=1e-10, atol=1e-10)
        ref.zero_grad()
        sync.zero_grad()
        gx_ref = ref.backward(r)
        gx = sync.backward(np.ascontiguousarray(r[R::N]))
        np.testing.assert_allclose(gx, gx_ref[R::N], rtol=1e-9, atol=1e-10)
        for p, q in zip(sync.parameters(), ref.parameters()):
            total = mt.allreduce(np.array(p.grad), op=mt.Sum)
            np.testing.assert_allclose(total, q.grad, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(sync.running_mean, ref.running_mean, rtol=1e-12)
    np.testing.assert_allclose(sync.running_var, ref.running_var, rtol=1e-12)


def _train(per_rank, world, rank, sync, overlap, steps=3):
    model = mt.models.resnet(8, input_shape=(2, 6, 6), classes=4, seed=3, dtype=np.float64)
    if sync:
        SyncBatchNorm.convert(model)
    opt = mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if world > 1:
        # small buckets: several allreduces are in flight while backward still runs
        opt = DistributedOptimizer(opt, model.named_parameters(), overlap=overlap,
                                   fusion_threshold_bytes=4096)
    hook = opt.backward_hook if world > 1 else None
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(steps):
        rng = np.random.default_rng(100 + t)
        x = rng.standard_normal((world * per_rank, 2, 6, 6))               # (N*b, 2, 6, 6)
        y = rng.integers(0, 4, world * per_rank).astype(np.int64)
        opt.zero_grad()
        loss_fn.forward(model.forward(np.ascontiguousarray(x[rank::world])),
                        np.ascontiguousarray(y[rank::world]))
        model.backward(loss_fn.backward(), on_layer_done=hook)
        opt.step()
    return model.state_dict(copy=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_resnet_training_with_sync_bn_matches_one_rank(overlap):
    if N == 1:
        pytest.skip("compares N ranks with one: needs at least 2")
    got = _train(2, N, R, sync=True, overlap=overlap)
    want = _train(2 * N, 1, 0, sync=False, overlap=False)
    assert list(got) == list(want)
    for name in want:          # parameters and running statistics alike
        np.testing.assert_allclose(got[name], want[name], rtol=1e-8, atol=1e-10, err_msg=name)


def test_plain_batchnorm_is_per_rank():
    """Without sync every rank normalises by its own batch: different from the double batch
    (the difference SyncBatchNorm exists to remove), and running stats differ across ranks."""
    if N == 1:
        pytest.skip("per-rank vs global statistics differ only with several ranks")
    x, _ = _global_input((4, 3), seed=9)
    bn = BatchNorm1d(3, dtype=np.float64)
    bn.forward(np.ascontiguousarray(x[R::N] * (R + 1)))
    means = mt.allgather(bn.running_mean.reshape(1, -1))
    assert not np.allclose(means[0], means[1])


@pytest.mark.skipif(N < 3, reason="needs a process set beside a rank outside it")
def test_process_set_shares_statistics_among_its_ranks_only():
    """Ranks 0 and 2 share their statistics: each sees the BatchNorm of their two batches."""
    ps = mt.add_process_set([0, 2])
    x, r = _global_input((3, 4, 5, 5), seed=9)                  # (3N, ...): rank r's is x[r::N]
    if ps.included():
        pair = np.concatenate([x[0::N], x[2::N]])               # the set's batch, in rank order
        ref = BatchNorm2d(4, dtype=np.float64)
        y_ref = ref.forward(pair)
        sync = SyncBatchNorm.convert(BatchNorm2d(4, dtype=np.float64), process_set=ps)
        y = sync.forward(np.ascontiguousarray(x[R::N]))
        mine = slice(0, 3) if R == 0 else slice(3, 6)
        np.testing.assert_allclose(y, y_ref[mine], rtol=1e-10, atol=1e-10)
        gx = sync.backward(np.ascontiguousarray(r[R::N]))
        gx_ref = ref.backward(np.concatenate([r[0::N], r[2::N]]))
        np.testing.assert_allclose(gx, gx_ref[mine], rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(sync.running_var, ref.running_var, rtol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        SyncBatchNorm(4, reduce=lambda a: None, process_set=ps)
    mt.remove_process_set(ps)
