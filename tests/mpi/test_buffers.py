"""Buffers (BatchNorm running statistics) travel with the parameters, under 1..4 ranks:
``mt.broadcast_parameters(model.state_dict())`` gives every rank root's running statistics too,
and the optimizer never sees them."""
import numpy as np

import mpitrain as mt

mt.init()
N, R = mt.size(), mt.rank()


def test_broadcast_of_state_dict_updates_buffers():
    model = mt.models.resnet(8, input_shape=(1, 6, 6), seed=R)          # differs per rank
    x = np.random.default_rng(R).standard_normal((4, 1, 6, 6)).astype(np.float32)
    model.forward(x * (R + 1))                                           # rank-specific stats
    before = mt.allgather(model.bn1.running_mean.reshape(1, -1))       # (N, 16)
    assert N == 1 or not np.array_equal(before[0], before[-1])           # really rank-specific
    root = N - 1
    mt.broadcast_parameters(model.state_dict(), root_rank=root)
    state = model.state_dict(copy=True)
    want = mt.broadcast_object(state, root_rank=root)
    assert [n for n in state if "running" in n][:2] == ["bn1.running_mean", "bn1.running_var"]
    for name in want:
        np.testing.assert_array_equal(state[name], want[name], err_msg=name)
    opt = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters())
    assert not any("running" in n for n in opt.names)
    assert len(opt.params) == len(model.parameters()) < len(state)
