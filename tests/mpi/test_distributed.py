"""DistributedOptimizer, weight averaging and optimizer-state broadcast, under 1..4 ranks.

The oracle needs no MPI: every rank can build the whole global batch of step t (it is generated
from t), so every rank also trains the 1-rank reference -- one model on the full global batch of
N*b samples -- locally, and compares it with the distributed run on its b-sample shard.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()
STEPS = 20


def _batch(step, n, shape, dtype):
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((n,) + shape).astype(dtype)  # (n, ...)
    y = rng.integers(0, 10, n).astype(np.int64)           # (n,)
    return x, y


def _model(name, dtype, seed=0):
    if name == "mlp":
        return mt.models.mlp(in_features=20, hidden=(16, 12), seed=seed, dtype=dtype)
    return mt.models.lenet(seed=seed, dtype=dtype)


def _optimizer(model, kind, lr=0.05):
    if kind == "sgd":
        return mt.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    if kind == "plain":
        return mt.optim.SGD(model.parameters(), lr=lr)
    return mt.optim.Adam(model.parameters(), lr=1e-3)


def _train(name, dtype, per_rank, world, rank, steps=STEPS, kind="sgd", wrap=None):
    """Train on rank ``rank``'s shard (r::world) of each global batch of world*per_rank."""
    model = _model(name, dtype)
    opt = _optimizer(model, kind)
    if wrap is not None:
        opt = wrap(opt, model)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    shape = model.input_shape
    for t in range(steps):
        x, y = _batch(t, world * per_rank, shape, dtype)
        opt.zero_grad()
        logits = model.forward(np.ascontiguousarray(x[rank::world]))
        loss_fn.forward(logits, np.ascontiguousarray(y[rank::world]))
        model.backward(loss_fn.backward())
        opt.step()
    return model.state_dict(), opt


def _rel_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) / max(float(np.max(np.abs(b[k]))), 1e-30)
               for k in b)


def _gradients(opt, model):
    return DistributedOptimizer(opt, named_parameters=model.named_parameters())


@pytest.mark.parametrize("name, per_rank", [("mlp", 4), ("lenet", 2)])
def test_n_ranks_times_b_equals_one_rank_times_nb_float64(name, per_rank):
    dist, _ = _train(name, np.float64, per_rank, N, R, wrap=_gradients)
    ref, _ = _train(name, np.float64, per_rank * N, 1, 0)
    assert _rel_diff(dist, ref) <= 1e-5


def test_n_ranks_times_b_equals_one_rank_times_nb_float32():
    dist, _ = _train("mlp", np.float32, 4, N, R, wrap=_gradients)
    ref, _ = _train("mlp", np.float32, 4 * N, 1, 0)
    assert _rel_diff(dist, ref) <= 1e-3


def test_adam_gradient_averaging_matches_big_batch():
    dist, _ = _train("mlp", np.float64, 3, N, R, kind="adam", wrap=_gradients)
    ref, _ = _train("mlp", np.float64, 3 * N, 1, 0, kind="adam")
    assert _rel_diff(dist, ref) <= 1e-5


def _identical_on_every_rank(state):
    gathered = mt.allgather_object(state)
    return all(all(np.array_equal(g[k], state[k]) for k in state) for g in gathered)


def test_replicas_stay_bitwise_identical():
    state, _ = _train("mlp", np.float32, 4, N, R, wrap=_gradients)
    assert _identical_on_every_rank(state)


def test_weight_averaging_every_step_equals_gradient_averaging_with_sgd():
    def weights(opt, model):
        return DistributedOptimizer(opt, model.named_parameters(), average="weights",
                                    average_every=1)
    w, _ = _train("mlp", np.float64, 4, N, R, kind="plain", wrap=weights)
    g, _ = _train("mlp", np.float64, 4, N, R, kind="plain", wrap=_gradients)
    assert _rel_diff(w, g) <= 1e-9
    assert _identical_on_every_rank(w)


def test_weight_averaging_every_k_steps():
    def weights(opt, model):
        return DistributedOptimizer(opt, model.named_parameters(), average="weights",
                                    average_every=3)
    at_average, _ = _train("mlp", np.float64, 4, N, R, steps=6, kind="plain", wrap=weights)
    between, _ = _train("mlp", np.float64, 4, N, R, steps=7, kind="plain", wrap=weights)
    assert _identical_on_every_rank(at_average)
    # One local step after an average, each replica has moved on its own shard.
    assert _identical_on_every_rank(between) == (N == 1)
    # And k=3 is not the same trajectory as averaging every step (when there is anything to mix).
    def every(opt, model):
        return DistributedOptimizer(opt, model.named_parameters(), average="weights")
    each, _ = _train("mlp", np.float64, 4, N, R, steps=6, kind="plain", wrap=every)
    assert (_rel_diff(at_average, each) > 1e-9) == (N > 1)


def test_weight_averaging_schedule_follows_the_restored_step_count():
    """A job resumed at step 7 (optimizer state restored) averages at 9, as an uninterrupted
    one would -- not 3 steps after the resume."""
    def weights(opt, model):
        opt.load_state_dict(dict(opt.state_dict(), step=7))   # as a resume at step 7 leaves it
        return DistributedOptimizer(opt, model.named_parameters(), average="weights",
                                    average_every=3)
    at_9, _ = _train("mlp", np.float64, 4, N, R, steps=2, kind="plain", wrap=weights)
    assert _identical_on_every_rank(at_9)


def test_fp16_compression_is_close_and_sends_half_precision():
    assert mt.Compression.fp16.wire_dtype(np.float32) == np.float16
    assert mt.Compression.fp16.wire_dtype(np.float64) == np.float64
    assert mt.Compression.none.wire_dtype(np.float32) == np.float32

    def fp16(opt, model):
        return DistributedOptimizer(opt, model.named_parameters(),
                                    compression=mt.Compression.fp16)
    comp, _ = _train("mlp", np.float32, 4, N, R, steps=5, wrap=fp16)
    full, _ = _train("mlp", np.float32, 4, N, R, steps=5, wrap=_gradients)
    assert _rel_diff(comp, full) <= 1e-2
    assert _identical_on_every_rank(comp)


def test_synchronize_then_clip_then_step():
    model = _model("mlp", np.float64)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters())
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    x, y = _batch(0, 4 * N, (20,), np.float64)
    logits = model.forward(np.ascontiguousarray(x[R::N]))
    loss_fn.forward(logits, np.ascontiguousarray(y[R::N]))
    model.backward(loss_fn.backward())
    before = model.state_dict(copy=True)
    opt.synchronize()
    averaged = [p.grad.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad *= 0.5  # "clipping"
    with opt.skip_synchronize():
        opt.step()
    after = model.state_dict()
    for (name, _), g in zip(model.named_parameters(), averaged):
        np.testing.assert_allclose(after[name], before[name] - 0.1 * 0.5 * g, rtol=1e-12)
    assert _identical_on_every_rank(after)


def test_sum_op_and_predivide_factor():
    def summed(opt, model):
        return DistributedOptimizer(opt, model.named_parameters(), op=mt.Sum,
                                    gradient_predivide_factor=2.0)
    s, _ = _train("mlp", np.float64, 4, N, R, steps=1, kind="plain", wrap=summed)
    base = _model("mlp", np.float64).state_dict()
    a, _ = _train("mlp", np.float64, 4, N, R, steps=1, kind="plain", wrap=_gradients)
    for k in base:  # a summed step is N averaged steps long
        np.testing.assert_allclose(s[k] - base[k], N * (a[k] - base[k]), rtol=1e-9, atol=1e-15)


def test_bad_arguments_raise_value_error():
    model = _model("mlp", np.float32)
    opt = mt.optim.SGD(model.parameters(), lr=0.1)
    named = model.named_parameters()
    with pytest.raises(ValueError, match="duplicate parameter name '0.weight'"):
        DistributedOptimizer(opt, [named[0], ("0.weight", named[1][1])] + named[2:])
    with pytest.raises(ValueError, match="no name"):
        DistributedOptimizer(opt, named[1:])
    stranger = mt.nn.Parameter(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="'extra'"):
        DistributedOptimizer(opt, named + [("extra", stranger)])
    with pytest.raises(ValueError, match="average 'both'"):
        DistributedOptimizer(opt, named, average="both")
    with pytest.raises(ValueError, match="average_every 0"):
        DistributedOptimizer(opt, named, average="weights", average_every=0)
    with pytest.raises(ValueError, match="op"):
        DistributedOptimizer(opt, named, op=mt.Max)
    with pytest.raises(ValueError, match="fp16"):
        DistributedOptimizer(opt, named, average="weights", compression=mt.Compression.fp16)


def test_wrapper_delegates_lr_and_state():
    model = _model("mlp", np.float32)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    opt.lr = 0.3
    assert opt.optimizer.lr == 0.3 and opt.state_dict()["lr"] == 0.3
    assert opt.params == model.parameters()
    assert opt.names[0] == "param.0"


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state_gives_everyone_roots_state(kind):
    model = _model("mlp", np.float32, seed=R)  # replicas differ on purpose
    opt = _optimizer(model, kind)
    if R != 0:  # non-root ranks: some local history, a different lr
        loss_fn = mt.nn.SoftmaxCrossEntropy()
        x, y = _batch(R, 4, (20,), np.float32)
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        opt.lr = 0.5 + R
    wrapped = DistributedOptimizer(opt, model.named_parameters())
    mt.broadcast_parameters(model.named_parameters(), root_rank=0)
    mt.broadcast_optimizer_state(wrapped, root_rank=0)
    state = opt.state_dict()
    root = mt.broadcast_object(state, root_rank=0)
    assert state.keys() == root.keys()
    for k in state:
        np.testing.assert_array_equal(np.asarray(state[k]), np.asarray(root[k]))
    assert _identical_on_every_rank(model.state_dict())
