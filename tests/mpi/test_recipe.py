"""The recipe under mpiexec: augmented global batches independent of N, the no-decay mask broadcast.

Run with -n 1, 2, 3, 4: each rank augments only its own shard (as the trainer does), the shards
are gathered, and the global batch must equal the one a single process builds for batch N*b.
"""
import numpy as np

import mpitrain as mt

N, R = mt.size(), mt.rank()


def test_augmented_global_batch_is_the_same_for_any_n():
    data = mt.data.synthetic(200, shape=(2, 9, 7), seed=1)
    aug = mt.data.Augment(3, flip=True, seed=4, fill=np.array([0.5, -1.0]))
    b = 5
    sampler = mt.data.DistributedSampler(data, batch_size=b, seed=4)
    alone = mt.data.DistributedSampler(len(data), 1, 0, batch_size=b * N, seed=4)
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        alone.set_epoch(epoch)
        for idx, whole in zip(sampler.indices(), alone.indices()):
            mine = aug(data.images[idx], idx, epoch)                       # (b, 2, 9, 7)
            got = mt.allgather(mine)                                       # (N*b, 2, 9, 7)
            got_idx = mt.allgather(idx)                                    # (N*b,)
            want = aug(data.images[whole], whole, epoch)                   # (N*b, 2, 9, 7)
            order, want_order = np.argsort(got_idx), np.argsort(whole)
            np.testing.assert_array_equal(got_idx[order], whole[want_order])
            np.testing.assert_array_equal(got[order], want[want_order])


def test_broadcast_optimizer_state_carries_the_no_decay_mask():
    model = mt.models.mlp(in_features=6, hidden=(4,), classes=3, seed=0)
    root = N - 1
    # Only the root excludes biases; the others decay everything until the broadcast.
    no_decay = mt.optim.is_bias_or_norm if R == root else None
    opt = mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5,
                       no_decay=no_decay)
    opt = mt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    mt.broadcast_optimizer_state(opt, root_rank=root)
    want = [int(p.data.ndim <= 1) for p in model.parameters()]
    assert opt.state_dict()["no_decay"].tolist() == want and 1 in want and 0 in want
    rng = np.random.default_rng(7)                     # same data everywhere: same update
    x = rng.standard_normal((4, 6)).astype(np.float32)
    y = np.arange(4) % 3
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    opt.zero_grad()
    loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    digests = mt.allgather_object([p.data.tobytes() for p in model.parameters()])
    assert all(d == digests[0] for d in digests)
