"""Gradient accumulation: DistributedOptimizer(backward_passes_per_step=k) and opt.no_sync().

Oracle: N ranks x k passes x batch b, the loss scaled by 1/k, make the update of 1 rank on the
whole global batch of N*k*b samples -- which every rank also computes locally with the bare
inner optimizer. The global batches come from DistributedSampler over a small dataset, so the
steps cross several epoch boundaries (Horovod's 2466/2497 trap is at such a boundary). Error
paths: a step at the wrong count raises on every rank and leaves the world usable.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data.sampler import DistributedSampler
from mpitrain.parallel.optimizer import DistributedOptimizer
from tests.support.batches import global_batches

mt.init()
N, R = mt.size(), mt.rank()
B = 3                       # samples per pass per rank
DATA = 50                   # samples: epochs of a few steps, so steps cross epoch boundaries
SHAPE = (12,)


def _data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((DATA,) + SHAPE)                 # (DATA, 12)
    y = rng.integers(0, 10, DATA).astype(np.int64)           # (DATA,)
    return x, y


def _model():
    return mt.models.mlp(in_features=SHAPE[0], hidden=(10, 8), seed=0, dtype=np.float64)


def _inner(kind, model):
    if kind == "sgd":
        return mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return mt.optim.Adam(model.parameters(), lr=0.01)


def _pass(model, loss_fn, x, y, idx, scale, hook=None):
    """Forward and backward of samples ``idx``, the gradient of the loss times ``scale``."""
    loss_fn.forward(model.forward(np.ascontiguousarray(x[idx])), np.ascontiguousarray(y[idx]))
    g = loss_fn.backward()                                    # (len(idx), 10)
    g *= scale
    model.backward(g, on_layer_done=hook)


def _global_batches(k, steps):
    """The global batches (steps, N*k*B) as the sampler gives them, epoch after epoch."""
    return global_batches(DATA, N * k * B, steps, seed=3)


def _reference(kind, k, steps):
    """One process, the whole global batch per step."""
    x, y = _data()
    model = _model()
    opt = _inner(kind, model)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for idx in _global_batches(k, steps):
        opt.zero_grad()
        _pass(model, loss_fn, x, y, idx, 1.0)
        opt.step()
    return model.state_dict(copy=True)


def _accumulated(kind, k, steps, quiet=0, **opt_kw):
    """N ranks, k counted passes per step (plus ``quiet`` of the k as no_sync passes)."""
    x, y = _data()
    model = _model()
    opt = DistributedOptimizer(_inner(kind, model), model.named_parameters(),
                               backward_passes_per_step=k - quiet, **opt_kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    sampler = DistributedSampler(DATA, N, R, seed=3, batch_size=k * B)
    taken, epoch = 0, 0
    while taken < steps:
        sampler.set_epoch(epoch)
        for share in sampler.indices():                       # (k*B,): this rank's share
            opt.zero_grad()
            micro = share.reshape(k, B)                       # consecutive slices
            for j in range(k):
                if j < quiet:
                    with opt.no_sync():
                        _pass(model, loss_fn, x, y, micro[j], 1.0 / k, opt.backward_hook)
                else:
                    _pass(model, loss_fn, x, y, micro[j], 1.0 / k, opt.backward_hook)
            opt.step()
            taken += 1
            if taken == steps:
                break
        epoch += 1
    return model.state_dict(copy=True)


def _close(a, b, rtol=1e-9):
    return all(np.allclose(a[key], b[key], rtol=rtol, atol=1e-12) for key in b)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_n_ranks_k_passes_equal_one_rank_whole_global_batch(kind, k, overlap):
    steps = 7                                 # 7 steps cross epoch ends at every N
    got = _accumulated(kind, k, steps, overlap=overlap, fusion_threshold_bytes=256)
    assert _close(got, _reference(kind, k, steps))


def test_fp16_compression_and_fused_buckets_accumulate_too():
    got = _accumulated("sgd", 2, 4, compression=mt.Compression.fp16)
    assert _close(got, _reference("sgd", 2, 4))  # float64 gradients travel as they are


def test_no_sync_passes_add_up_and_the_next_pass_averages_them():
    """PyTorch's idiom: k-1 passes inside no_sync, the k-th outside (which communicates)."""
    for counted in (1, 2):                    # backward_passes_per_step = 1, then 2
        got = _accumulated("sgd", 3, 5, quiet=3 - counted)
        assert _close(got, _reference("sgd", 3, 5))


def _one_step_setup(k, **opt_kw):
    x, y = _data()
    model = _model()
    opt = DistributedOptimizer(_inner("sgd", model), model.named_parameters(),
                               backward_passes_per_step=k, **opt_kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    idx = np.arange(R * B, R * B + B)

    def run_pass(hook=True):
        _pass(model, loss_fn, x, y, idx, 1.0, opt.backward_hook if hook else None)
    return model, opt, run_pass


@pytest.mark.parametrize("average", ["gradients", "weights"])
@pytest.mark.parametrize("passes", [1, 2, 4])
def test_step_at_the_wrong_count_raises_on_every_rank_and_drops_the_gradients(average, passes):
    model, opt, run_pass = _one_step_setup(3, average=average, fusion_threshold_bytes=256)
    before = model.state_dict(copy=True)
    for _ in range(passes):
        run_pass()
    with pytest.raises(ValueError, match=f"step\\(\\) after {passes} backward passes; "
                                         f"backward_passes_per_step=3"):
        opt.step()
    assert _close(model.state_dict(copy=True), before, rtol=0)   # no update
    assert all(not p.grad.any() for p in model.parameters())    # dropped
    # counting starts again: a right step now works and the replicas stay one model
    for _ in range(3):
        run_pass()
    opt.step()
    states = mt.allgather_object(model.state_dict(copy=True))
    assert all(_close(s, states[0], rtol=0) for s in states)


@pytest.mark.skipif(N == 1, reason="needs ranks at different counts")
@pytest.mark.parametrize("overlap", [True, False])
def test_ranks_at_different_counts_get_a_collective_error_not_a_hang(overlap):
    model, opt, run_pass = _one_step_setup(2, overlap=overlap)
    for _ in range(1 if R == 0 else 2):       # rank 0 one pass short: its buckets never start
        run_pass()
    with pytest.raises(mt.CollectiveError, match="rank 0: step\\(\\) after 1 backward passes"):
        opt.step()
    assert mt.allreduce(np.ones(2), op=mt.Sum)[0] == N


@pytest.mark.skipif(N == 1, reason="needs ranks at different counts")
def test_two_hooked_passes_at_k_1_on_one_rank_raise_on_every_rank():
    model, opt, run_pass = _one_step_setup(1)
    before = model.state_dict(copy=True)
    for _ in range(2 if R == 0 else 1):       # rank 0 runs a second pass before its step
        run_pass()
    with pytest.raises(mt.CollectiveError, match="rank 0: step\\(\\) after 2 backward passes"):
        opt.step()
    assert _close(model.state_dict(copy=True), before, rtol=0)    # no rank stepped
    run_pass()
    opt.step()
    states = mt.allgather_object(model.state_dict(copy=True))
    assert all(_close(s, states[0], rtol=0) for s in states)


def test_the_count_needs_the_hook_and_a_pass_outside_no_sync():
    model, opt, run_pass = _one_step_setup(2)
    run_pass(hook=False)
    run_pass(hook=False)
    with pytest.raises(ValueError, match="hook, which was not called"):
        opt.step()
    model, opt, run_pass = _one_step_setup(1)
    with opt.no_sync():
        run_pass()
    with pytest.raises(ValueError, match="all inside no_sync"):
        opt.step()
    run_pass()                                # counted pass 1 of 1: its average starts
    with opt.no_sync():
        run_pass()                            # changes gradients already being averaged
    with pytest.raises(ValueError, match="inside no_sync\\(\\) came after counted pass 1"):
        opt.step()
    with opt.no_sync():
        with pytest.raises(RuntimeError, match="does not nest"):
            with opt.no_sync():
                pass
    # k = 1 without the hook stays what it always was: synchronize() averages everything
    model, opt, run_pass = _one_step_setup(1)
    run_pass(hook=False)
    opt.step()


def test_zero_grad_drops_a_partial_accumulation():
    model, opt, run_pass = _one_step_setup(2, fusion_threshold_bytes=256)
    ref_model, ref_opt, ref_pass = _one_step_setup(2, fusion_threshold_bytes=256)
    run_pass()
    run_pass()                                # the averages start on the 2nd pass ...
    opt.zero_grad()                           # ... and are waited for, then dropped
    run_pass()
    opt.zero_grad()                           # a partial accumulation, dropped
    for _ in range(2):
        run_pass()
        ref_pass()
    opt.step()
    ref_opt.step()
    assert _close(model.state_dict(copy=True), ref_model.state_dict(copy=True), rtol=0)


def test_weights_mode_accumulates_k_passes_into_one_local_step():
    """Plain SGD, average_every=1: the mean of the local steps is the global batch's step."""
    x, y = _data()
    model = _model()
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1), average="weights",
                               backward_passes_per_step=2)
    ref = _model()
    ref_opt = mt.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for idx in _global_batches(2, 4):                    # (N*2*B,)
        opt.zero_grad()
        for micro in idx[R::N].reshape(2, B):
            _pass(model, loss_fn, x, y, micro, 0.5, opt.backward_hook)
        opt.step()
        ref_opt.zero_grad()
        _pass(ref, loss_fn, x, y, idx, 1.0)
        ref_opt.step()
    assert _close(model.state_dict(copy=True), ref.state_dict(copy=True))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_bad_backward_passes_per_step(bad):
    model = _model()
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                             backward_passes_per_step=bad)
