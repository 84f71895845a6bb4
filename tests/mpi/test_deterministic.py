"""DistributedOptimizer(deterministic=True) in an own loop: the parameters of N ranks are the bits
of one process, for N = 1, 2, 4 (and N = 3 is refused on every rank).

Oracle: every rank also trains the same model alone, with the bare inner optimizer, on the same
global batches: M = 4 micro-shards per step, one forward/backward each, the M gradients summed
in the binary tree ((g0 + g1) + (g2 + g3)) by plain NumPy -- no PairwiseSum, no tree_allreduce.
The distributed run gives rank r the micro-shards [r*M/N, (r+1)*M/N), k = M/N passes per step.
Steps cross epoch ends; the data has a wide dynamic range so that the order of additions shows
in the last bits (checked: a sequential sum of the same leaves differs).
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm.tree import is_power_of_two
from mpitrain.parallel.optimizer import DistributedOptimizer
from tests.support.batches import global_batches

mt.init()
N, R = mt.size(), mt.rank()
M = 4                       # micro-shards per global batch
B = 3                       # samples per micro-shard
DATA = 40
STEPS = 12
SHAPE = (12,)
power_of_two = pytest.mark.skipif(not is_power_of_two(N), reason="N=3: refused (tested below)")


def _data():
    rng = np.random.default_rng(11)
    scale = 10.0 ** rng.integers(-3, 3, size=(DATA, 1))
    x = (rng.standard_normal((DATA,) + SHAPE) * scale).astype(np.float32)   # (DATA, 12)
    y = rng.integers(0, 10, DATA).astype(np.int64)                          # (DATA,)
    return x, y


def _model():
    return mt.models.mlp(in_features=SHAPE[0], hidden=(16, 8), seed=0)      # float32


def _inner(kind, model):
    if kind == "sgd":
        return mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return mt.optim.Adam(model.parameters(), lr=0.01)


def _global_batches():
    """(STEPS, M*B) global batches, epoch after epoch (the sampler's seeded order)."""
    return global_batches(DATA, M * B, STEPS, seed=3)


def _pass(model, loss_fn, x, y, idx, scale, hook=None):
    loss_fn.forward(model.forward(np.ascontiguousarray(x[idx])), np.ascontiguousarray(y[idx]))
    g = loss_fn.backward()                                                  # (B, 10)
    g *= np.float32(scale)
    model.backward(g, on_layer_done=hook)


def _tree(leaves):
    if len(leaves) == 1:
        return leaves[0]
    half = len(leaves) // 2
    return _tree(leaves[:half]) + _tree(leaves[half:])


def _reference(kind, scale_by):
    """One process: M passes per step, the leaves summed in the tree by NumPy."""
    x, y = _data()
    model = _model()
    opt = _inner(kind, model)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    orders_differ = False
    for batch in _global_batches():
        leaves = []
        for micro in batch.reshape(M, B):
            model.zero_grad()
            _pass(model, loss_fn, x, y, micro, scale_by)
            leaves.append([p.grad.copy() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            column = [leaf[i] for leaf in leaves]
            p.grad = _tree(column)
            sequential = column[0].copy()
            for g in column[1:]:
                sequential += g
            orders_differ |= sequential.tobytes() != p.grad.tobytes()
        opt.step()
    assert orders_differ, "the data must make the order of additions visible"
    return model.state_dict(copy=True)


def _distributed(kind, op, scale_by, hook=True, **kw):
    x, y = _data()
    model = _model()
    k = M // N
    opt = DistributedOptimizer(_inner(kind, model), model.named_parameters(), op=op,
                               backward_passes_per_step=k, deterministic=True, **kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for batch in _global_batches():
        opt.zero_grad()
        mine = batch.reshape(M, B)[R * k:(R + 1) * k]                      # (k, B) contiguous
        for micro in mine:
            _pass(model, loss_fn, x, y, micro, scale_by(k), opt.backward_hook if hook else None)
        opt.step()
    return model.state_dict(copy=True)


def _assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), \
            f"{key}: max diff {np.max(np.abs(got[key] - want[key]))}"
    every = mt.allgather_object(b"".join(got[key].tobytes() for key in sorted(got)))
    assert all(e == every[0] for e in every)


@power_of_two
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_sum_of_micro_shards_scaled_by_one_over_m_is_one_process_bitwise(kind):
    """The CLI's recipe: loss gradient x 1/M (the same factor for every N), op=Sum."""
    got = _distributed(kind, mt.Sum, lambda k: 1.0 / M)
    _assert_bitwise(got, _reference(kind, 1.0 / M))


@power_of_two
def test_average_of_passes_scaled_by_one_over_k_is_one_process_bitwise():
    """Horovod's accumulation recipe (loss x 1/k, op=Average): exact power-of-two scalings."""
    got = _distributed("sgd", mt.Average, lambda k: 1.0 / k)
    _assert_bitwise(got, _reference("sgd", 1.0 / M))


@power_of_two
def test_one_pass_per_step_without_the_hook():
    """k = 1 (N = M): .grad at step() is the one leaf; here the world is the M micro-shards."""
    x, y = _data()
    model = _model()
    opt = DistributedOptimizer(_inner("sgd", model), op=mt.Sum, deterministic=True)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    want = model.state_dict(copy=True)
    opt.zero_grad()
    _pass(model, loss_fn, x, y, np.arange(R * B, (R + 1) * B), 1.0)
    grads = [mt.allgather(p.grad[None]) for p in model.parameters()]    # (N, ...) per param
    opt.step()
    inner = _inner("sgd", mt.models.mlp(in_features=SHAPE[0], hidden=(16, 8), seed=0))
    for p, g in zip(inner.params, grads):
        p.grad = _tree(list(g))
    inner.step()
    got = model.state_dict(copy=True)
    assert any(got[key].tobytes() != want[key].tobytes() for key in want)    # it stepped
    for (name, _), p in zip(model.named_parameters(), inner.params):
        assert got[name].tobytes() == p.data.tobytes(), name


def test_refusals_are_the_same_value_error_on_every_rank():
    model = _model()
    inner = _inner("sgd", model)
    if not is_power_of_two(N):
        with pytest.raises(ValueError, match=f"power-of-two number of ranks .*got {N}"):
            DistributedOptimizer(inner, deterministic=True)
    for kw, message in [
            (dict(average="weights"), "average='weights' is not supported"),
            (dict(compression=mt.Compression.fp16), "refuses compression=mt.Compression.fp16"),
            (dict(backward_passes_per_step=3), "backward_passes_per_step a power of two, got 3"),
            (dict(gradient_predivide_factor=2.0), "gradient_predivide_factor")]:
        with pytest.raises(ValueError, match=message):
            DistributedOptimizer(inner, deterministic=True, **kw)
    mt.barrier()


@power_of_two
def test_wrong_pass_count_raises_on_every_rank_and_the_next_step_works():
    x, y = _data()
    model = _model()
    opt = DistributedOptimizer(_inner("sgd", model), backward_passes_per_step=2,
                               deterministic=True)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    idx = np.arange(R * B, (R + 1) * B)
    opt.zero_grad()
    passes = 1 if R == 0 else 2                      # rank 0 is one pass short
    for _ in range(passes):
        _pass(model, loss_fn, x, y, idx, 0.5, opt.backward_hook)
    with pytest.raises((ValueError, mt.CollectiveError), match="backward pass"):
        opt.step()
    opt.zero_grad()
    for _ in range(2):
        _pass(model, loss_fn, x, y, idx, 0.5, opt.backward_hook)
    opt.step()
    with pytest.raises(RuntimeError, match="no_sync"):
        opt.no_sync()
