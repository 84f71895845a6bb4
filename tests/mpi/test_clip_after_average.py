"""DistributedOptimizer(clip_grad_norm=C): the averaged gradients are clipped to global 2-norm C
before every update, on every path (plain, overlapped hook, accumulation, deterministic).

Oracle: N ranks with b samples each (k passes of b when accumulating, the loss scaled by 1/k)
make the update of 1 process on the whole global batch of N*k*b samples, clipped by
``mt.nn.clip_grad_norm_`` between backward and the step -- which every rank computes locally
with the bare inner optimizer. C is small enough that every step clips (checked). Horovod's
idiom (synchronize, clip by hand, step inside skip_synchronize) gives the same bits as
clip_grad_norm=C, and clip_grad_norm=C with the idiom clips once, not twice.
"""
import math

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm.tree import is_power_of_two
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()
B = 3                       # samples per pass per rank
STEPS = 4
CLIP = 0.05
SHAPE = (12,)


def _data(samples):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((samples,) + SHAPE) * 4.0                   # (samples, 12)
    y = rng.integers(0, 10, samples).astype(np.int64)                   # (samples,)
    return x, y


def _model():
    return mt.models.mlp(in_features=SHAPE[0], hidden=(10,), seed=0, dtype=np.float64)


def _inner(model):
    return mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _pass(model, loss_fn, x, y, scale, hook=None):
    loss_fn.forward(model.forward(np.ascontiguousarray(x)), np.ascontiguousarray(y))
    g = loss_fn.backward()                                               # (len(x), 10)
    g *= scale
    model.backward(g, on_layer_done=hook)


def _global_batches(k):
    """(STEPS, N*k*B) sample indices: step s takes the next N*k*B samples."""
    g = N * k * B
    return np.arange(STEPS * g).reshape(STEPS, g)


def _reference(k):
    """One process, the whole global batch per step, clipped by hand; and the norms."""
    x, y = _data(STEPS * N * k * B)
    model = _model()
    opt = _inner(model)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    norms = []
    for idx in _global_batches(k):
        opt.zero_grad()
        _pass(model, loss_fn, x[idx], y[idx], 1.0)
        norms.append(mt.nn.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
    assert min(norms) > 2 * CLIP, f"the clip must bite on every step: norms {norms}"
    return model.state_dict(copy=True), norms


def _distributed(k, hook, idiom=None, **opt_kw):
    """N ranks; ``idiom``: None (step() alone), "manual" (synchronize, clip_grad_norm_ by hand,
    step in skip_synchronize) or "skip" (synchronize, step in skip_synchronize)."""
    x, y = _data(STEPS * N * k * B)
    model = _model()
    opt = DistributedOptimizer(_inner(model), model.named_parameters(),
                               backward_passes_per_step=k, **opt_kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    norms = []
    for idx in _global_batches(k):
        opt.zero_grad()
        mine = idx[R * k * B:(R + 1) * k * B].reshape(k, B)             # (k, B) contiguous
        for micro in mine:
            _pass(model, loss_fn, x[micro], y[micro], 1.0 / k,
                  opt.backward_hook if hook else None)
        if idiom is None:
            opt.step()
            norms.append(opt.grad_norm)
            continue
        opt.synchronize()
        if idiom == "manual":
            norms.append(mt.nn.clip_grad_norm_(model.parameters(), CLIP))
        else:
            norms.append(opt.grad_norm)
        with opt.skip_synchronize():
            opt.step()
    return model.state_dict(copy=True), norms


def _assert_close(got, want, rtol=1e-10):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-12, err_msg=key)


def _assert_one_model(state):
    blob = b"".join(state[key].tobytes() for key in sorted(state))
    assert all(b == blob for b in mt.allgather_object(blob)), "the replicas differ"


PATHS = {
    "plain": (1, False, dict(overlap=False)),
    "overlap-hook": (1, True, dict(overlap=True)),
    "accumulate-overlap": (2, True, dict(overlap=True)),
    "accumulate-fused": (2, True, dict(overlap=False)),
    "deterministic": (2, True, dict(deterministic=True)),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_n_ranks_clipped_is_one_process_on_the_global_batch(path):
    k, hook, kw = PATHS[path]
    if kw.get("deterministic") and not is_power_of_two(N):
        pytest.skip("deterministic=True needs a power-of-two number of ranks")
    want, want_norms = _reference(k)
    got, norms = _distributed(k, hook, clip_grad_norm=CLIP, **kw)
    _assert_close(got, want)
    _assert_one_model(got)
    assert all(isinstance(n, float) for n in norms)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-10)           # the pre-clip norms
    assert all(n == norms for n in mt.allgather_object(norms))


def test_without_the_clip_the_result_differs():
    """The oracle sees the clip: unclipped training ends elsewhere."""
    want, _ = _reference(1)
    got, norms = _distributed(1, True)
    assert norms == [None] * STEPS                   # no clip_grad_norm: no norm computed
    assert any(not np.allclose(got[key], want[key], rtol=1e-6) for key in want)


@pytest.mark.parametrize("hook", [False, True])
def test_horovod_idiom_is_clip_grad_norm(hook):
    auto, auto_norms = _distributed(1, hook, clip_grad_norm=CLIP)
    manual, manual_norms = _distributed(1, hook, idiom="manual")
    once, once_norms = _distributed(1, hook, idiom="skip", clip_grad_norm=CLIP)
    for key in auto:
        np.testing.assert_array_equal(manual[key], auto[key], err_msg=key)
        np.testing.assert_array_equal(once[key], auto[key], err_msg=key)   # clipped once
    assert manual_norms == auto_norms == once_norms
    _assert_one_model(manual)


def test_synchronize_then_step_clips_once():
    """synchronize() clips; a step() after it (no skip_synchronize) neither averages nor clips
    again: the same bits as step() alone."""
    x, y = _data(N * B)
    results = []
    for explicit in (False, True):
        model = _model()
        opt = DistributedOptimizer(_inner(model), model.named_parameters(), clip_grad_norm=CLIP)
        loss_fn = mt.nn.SoftmaxCrossEntropy()
        opt.zero_grad()
        mine = np.arange(R * B, (R + 1) * B)
        _pass(model, loss_fn, x[mine], y[mine], 1.0, opt.backward_hook)
        if explicit:
            opt.synchronize()
            clipped = [p.grad.copy() for p in model.parameters()]
            total = math.sqrt(sum(float((g ** 2).sum()) for g in clipped))
            assert total == pytest.approx(CLIP, rel=1e-5) and opt.grad_norm > CLIP
        opt.step()
        results.append(model.state_dict(copy=True))
    for key in results[0]:
        np.testing.assert_array_equal(results[1][key], results[0][key], err_msg=key)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.inf, math.nan, True, "1.0", [1.0]])
def test_bad_clip_grad_norm(value):
    model = _model()
    with pytest.raises(ValueError, match=r"clip_grad_norm .*expected a finite number > 0"):
        DistributedOptimizer(_inner(model), clip_grad_norm=value)


def test_weights_mode_refuses_the_clip():
    model = _model()
    with pytest.raises(ValueError, match="average='weights' averages parameters instead"):
        DistributedOptimizer(_inner(model), average="weights", clip_grad_norm=1.0)
    opt = DistributedOptimizer(_inner(model), clip_grad_norm=np.float32(2))
    assert opt.clip_grad_norm == 2.0 and opt.grad_norm is None
    assert "clip_grad_norm=2.0" in repr(opt)
