"""What a training mode adds at the end of a run and to a checkpoint (the strategy's, not the
loop's): weights mode ends on one model (``settle``) and checkpoints the mean of the ranks'
momenta (``checkpoint_state``); gradients mode has nothing to do. Under 1..4 ranks."""
import numpy as np
import pytest

import mpitrain as mt

mt.init()
N, R = mt.size(), mt.rank()


def _trained(average, steps, average_every=2):
    """An MLP after ``steps`` local SGD-momentum steps on rank-dependent gradients."""
    model = mt.models.mlp(in_features=6, hidden=(5,), classes=3, seed=1)
    opt = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), average=average,
                                  average_every=average_every)
    for step in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad[...] = (R + 1) * (step + 1) * 0.01      # a different gradient per rank
        opt.backward_hook(model.parameters())
        opt.step()
    return model, opt


def _every(array):
    return mt.allgather(np.ascontiguousarray(array)[None])          # (N, ...)


@pytest.mark.parametrize("steps, averaged", [(3, False), (4, True)])
def test_weights_mode_settles_on_one_model(steps, averaged):
    model, opt = _trained("weights", steps)
    first = model.parameters()[0].data.copy()
    differ = N > 1 and not averaged          # the third step was local: replicas apart
    assert (len({_every(first)[r].tobytes() for r in range(N)}) > 1) == differ
    opt.settle()
    after = model.parameters()[0].data
    every = _every(after)
    assert all(np.array_equal(every[0], every[r]) for r in range(N))
    if averaged:                             # the last step averaged: settle changed nothing
        np.testing.assert_array_equal(after, first)


def test_weights_mode_checkpoints_the_mean_of_the_momenta():
    model, opt = _trained("weights", 4)
    mine = opt.optimizer.state_dict()
    state = opt.checkpoint_state()
    for key, value in mine.items():
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            np.testing.assert_allclose(state[key], _every(value).mean(axis=0), rtol=1e-6)
            every = _every(state[key])
            assert all(np.array_equal(every[0], every[r]) for r in range(N))


def test_gradients_mode_has_nothing_to_settle():
    model, opt = _trained("gradients", 3)
    before = [p.data.copy() for p in model.parameters()]
    opt.settle()
    assert all(np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))
    state = opt.checkpoint_state()
    mine = opt.optimizer.state_dict()
    assert state.keys() == mine.keys()
    assert all(np.array_equal(np.asarray(state[k]), np.asarray(mine[k])) for k in mine)
