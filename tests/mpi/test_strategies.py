"""One suite that every averaging strategy of DistributedOptimizer passes, under 1..4 ranks.

Strategies: gradients (overlapped buckets), gradients fused (``overlap=False``), weights
(PNNL, every step), deterministic (power-of-two N) and sharded (the optimizer state; the
gradients too, fused or in overlapped buckets; the parameters too). Each must give, through
the same own
loop: the one-process result on the global batch (k = 1 and 2 passes a step); the OR of the
ranks' step flags; a wrong pass count raising on every rank, after which the next step works;
a checkpoint that resumes to the run it interrupted; its refusals as one ValueError on every
rank at construction. A new strategy joins by adding its line to STRATEGIES.

Oracle: every rank builds the whole global batch of step t (generated from t) and trains the
one-process reference locally: SGD with momentum in float64 is linear in the gradients, so
averaging weights every step gives the average of gradients too (up to rounding).
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm.tree import is_power_of_two
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()
B = 3                  # samples per pass and rank
STEPS = 6
STRATEGIES = {
    "gradients": dict(),
    "gradients-fused": dict(overlap=False),
    "weights": dict(average="weights"),
    "deterministic": dict(deterministic=True),
    "sharded-optimizer": dict(sharding="optimizer"),
    "sharded-gradients": dict(sharding="gradients"),
    "sharded-gradients-buckets": dict(sharding="gradients", fusion_threshold_bytes=512),
    "sharded-deterministic": dict(sharding="gradients", deterministic=True),
    "sharded-parameters": dict(sharding="parameters"),
    "sharded-parameters-buckets": dict(sharding="parameters", fusion_threshold_bytes=512),
    "sharded-parameters-deterministic": dict(sharding="parameters", deterministic=True),
}
# what the step's agreement carries, per strategy: flags travel where the step exchanges a
# message (none in weights mode, which agrees nothing per step)
EXCHANGES = {"gradients": True, "gradients-fused": True, "weights": False,
             "deterministic": True, "sharded-optimizer": True, "sharded-gradients": True,
             "sharded-gradients-buckets": True, "sharded-deterministic": True,
             "sharded-parameters": True, "sharded-parameters-buckets": True,
             "sharded-parameters-deterministic": True}


def usable(name):
    return not (STRATEGIES[name].get("deterministic") and not is_power_of_two(N))


def each_strategy(test):
    return pytest.mark.parametrize("name", [
        pytest.param(name, marks=pytest.mark.skipif(not usable(name),
                                                    reason="a power-of-two N only"))
        for name in STRATEGIES])(test)


def model():
    return mt.models.mlp(in_features=10, hidden=(12, 8), seed=0, dtype=np.float64)


def inner(m):
    return mt.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def batch(step, n):
    rng = np.random.default_rng(500 + step)
    return rng.standard_normal((n, 10)), rng.integers(0, 10, n).astype(np.int64)


def one_pass(m, loss_fn, x, y, scale, hook=None):
    loss_fn.forward(m.forward(np.ascontiguousarray(x)), np.ascontiguousarray(y))
    g = loss_fn.backward() * scale
    m.backward(g, on_layer_done=hook)


def train(name, steps, k=1, start=0, m=None, opt=None):
    """``steps`` steps of k passes of B samples per rank, from step ``start``; rank r's passes
    are the slices [r*k + j] of each global batch of N*k*B samples (each pass's loss gradient
    scaled to the mean of the rank's k*B samples, the ranks averaged)."""
    m = model() if m is None else m
    opt = DistributedOptimizer(inner(m), m.named_parameters(), backward_passes_per_step=k,
                               **STRATEGIES[name]) if opt is None else opt
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(start, start + steps):
        x, y = batch(t, N * k * B)
        opt.zero_grad()
        for j in range(k):
            part = slice((R * k + j) * B, (R * k + j + 1) * B)
            one_pass(m, loss_fn, x[part], y[part], 1.0 / k, opt.backward_hook)
        opt.step()
    return m, opt


def reference(steps, k=1):
    m = model()
    opt = inner(m)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(steps):
        x, y = batch(t, N * k * B)
        m.zero_grad()
        one_pass(m, loss_fn, x, y, 1.0)
        opt.step()
    return m.state_dict(copy=True)


def state(m, opt):
    """The model's state, whole (collective: sharded parameters are gathered for it)."""
    with opt.full_parameters():
        return m.state_dict(copy=True)


def assert_one_model(m, opt):
    flat = b"".join(v.tobytes() for _, v in sorted(state(m, opt).items()))
    assert len(set(mt.allgather_object(flat))) == 1, "the replicas differ"


@each_strategy
@pytest.mark.parametrize("k", [1, 2])
def test_n_ranks_equal_one_process_on_the_global_batch(name, k):
    m, opt = train(name, STEPS, k)
    opt.settle()
    want = reference(STEPS, k)
    for key, value in state(m, opt).items():
        np.testing.assert_allclose(value, want[key], rtol=1e-9, atol=1e-12, err_msg=key)
    assert_one_model(m, opt)


@each_strategy
def test_step_flags_are_ored_over_the_ranks(name):
    m = model()
    opt = DistributedOptimizer(inner(m), m.named_parameters(), **STRATEGIES[name])
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    x, y = batch(0, N * B)
    opt.zero_grad()
    one_pass(m, loss_fn, x[R * B:(R + 1) * B], y[R * B:(R + 1) * B], 1.0, opt.backward_hook)
    agreed = opt.step(flags=1 << R)
    if N > 1 and EXCHANGES[name]:
        assert agreed == (1 << N) - 1
    else:
        assert agreed is None          # nothing exchanged: the caller exchanges them itself


@each_strategy
def test_a_wrong_pass_count_raises_on_every_rank_and_the_next_step_works(name):
    m = model()
    opt = DistributedOptimizer(inner(m), m.named_parameters(), backward_passes_per_step=2,
                               **STRATEGIES[name])
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    x, y = batch(0, N * B)
    mine = slice(R * B, (R + 1) * B)
    # weights mode checks each rank alone: every rank is short there; else rank 0 alone
    short = STRATEGIES[name].get("average") == "weights" or R == 0
    opt.zero_grad()
    for _ in range(1 if short else 2):
        one_pass(m, loss_fn, x[mine], y[mine], 0.5, opt.backward_hook)
    with pytest.raises((ValueError, mt.CollectiveError), match="backward pass"):
        opt.step()
    opt.zero_grad()
    for _ in range(2):
        one_pass(m, loss_fn, x[mine], y[mine], 0.5, opt.backward_hook)
    opt.step()
    opt.settle()
    assert_one_model(m, opt)


@each_strategy
def test_a_checkpoint_resumes_the_run_it_interrupted(name, tmp_path_factory):
    folder = mt.broadcast_object(str(tmp_path_factory.mktemp("ckpt")) if R == 0 else None,
                                 root_rank=0)
    m, opt = train(name, 3)
    mt.checkpoint.save(folder, m, opt, step=3)
    whole, whole_opt = train(name, 3, start=3, m=m, opt=opt)
    whole_opt.settle()
    m2 = model()
    opt2 = DistributedOptimizer(inner(m2), m2.named_parameters(), **STRATEGIES[name])
    assert mt.checkpoint.load_latest(folder, m2, opt2)["step"] == 3
    resumed, resumed_opt = train(name, 3, start=3, m=m2, opt=opt2)
    resumed_opt.settle()
    if STRATEGIES[name].get("average") == "weights" and N > 1:
        # the moments stay per rank; a checkpoint holds their mean (every rank resumes from it)
        got, want = state(resumed, resumed_opt), state(whole, whole_opt)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12)
    else:
        got, want = state(resumed, resumed_opt), state(whole, whole_opt)
        for key in want:
            assert got[key].tobytes() == want[key].tobytes(), key
    assert_one_model(resumed, resumed_opt)


def test_each_refusal_is_one_value_error_on_every_rank_at_construction():
    m = model()
    refusals = [
        (dict(average="weights", clip_grad_norm=1.0), "average='weights' averages parameters"),
        (dict(average="weights", compression=mt.Compression.fp16), "full-precision weights"),
        (dict(deterministic=True, average="weights"), "average='weights' is not supported"),
        (dict(deterministic=True, backward_passes_per_step=3), "a power of two, got 3"),
        (dict(sharding="gradients", average="weights"), "has no gradients to shard"),
        (dict(sharding="parameters", average="weights"), "has no gradients to shard"),
    ]
    if not is_power_of_two(N):
        refusals.append((dict(deterministic=True), "power-of-two number of ranks"))
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            DistributedOptimizer(inner(m), m.named_parameters(), **kwargs)
    mt.barrier()
