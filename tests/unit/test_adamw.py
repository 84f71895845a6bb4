"""AdamW against a NumPy transcription of PyTorch's update and against torch.optim.AdamW itself:
decoupled decay, bias correction, lr changed between steps, the no-decay mask, the state dict."""
import io

import numpy as np
import pytest

import mpitrain as mt

SHAPES = [(4, 3), (3,), (5, 4), (4,)]          # weights (decayed) and biases (not, with the mask)


def _params(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [mt.nn.Parameter(rng.standard_normal(s).astype(dtype)) for s in SHAPES]


def _grads(steps, dtype=np.float64, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(steps)]


LRS = [1e-2, 3e-2, 3e-2, 5e-3, 2e-2, 1e-2, 7e-3, 4e-2]     # a schedule's lr per step


def reference(init, grads, lrs, no_decay, betas=(0.9, 0.999), eps=1e-8, wd=0.1):
    """torch.optim.AdamW's single-tensor update, transcribed in float64."""
    b1, b2 = betas
    params = [np.array(a, np.float64) for a in init]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        for i, (p, g) in enumerate(zip(params, gs)):
            p *= 1 - lr * (0.0 if no_decay[i] else wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = np.sqrt(v[i]) / np.sqrt(1 - b2 ** t) + eps
            p -= lr / (1 - b1 ** t) * m[i] / denom
    return params, m, v


def _run(opt, grads, lrs):
    for gs, lr in zip(grads, lrs):
        opt.lr = lr
        for p, g in zip(opt.params, gs):
            p.grad[...] = g
        opt.step()


def test_decay_is_decoupled_from_the_gradient():
    """A zero gradient leaves m = v = 0, so the step is the decay alone: param *= 1 - lr*wd
    (Adam's L2 penalty would instead move it by about lr). Masked parameters stay put."""
    ps = _params()
    init = [p.data.copy() for p in ps]
    opt = mt.optim.AdamW(ps, lr=0.1, weight_decay=0.5, no_decay=mt.optim.is_bias_or_norm)
    for p in ps:
        p.grad[...] = 0.0
    opt.step()
    for p, a in zip(ps, init):
        want = a if p.data.ndim == 1 else a * (1 - 0.1 * 0.5)
        np.testing.assert_array_equal(p.data, want)


@pytest.mark.parametrize("betas,eps,wd", [((0.9, 0.999), 1e-8, 0.1), ((0.8, 0.95), 1e-6, 0.3)])
def test_matches_the_numpy_reference_with_lr_changes_and_the_mask(betas, eps, wd):
    ps = _params()
    init = [p.data.copy() for p in ps]
    grads = _grads(len(LRS))
    opt = mt.optim.AdamW(ps, lr=1.0, betas=betas, eps=eps, weight_decay=wd,
                         no_decay=mt.optim.is_bias_or_norm)
    _run(opt, grads, LRS)
    no_decay = [len(s) == 1 for s in SHAPES]
    want, m, v = reference(init, grads, LRS, no_decay, betas, eps, wd)
    assert opt.steps == len(LRS)
    for i, p in enumerate(ps):
        np.testing.assert_allclose(p.data, want[i], rtol=1e-12, atol=1e-14, err_msg=f"param {i}")
        np.testing.assert_allclose(opt.state["exp_avg"][i], m[i], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(opt.state["exp_avg_sq"][i], v[i], rtol=1e-12, atol=1e-15)
    # the mask mattered: the decayed reference without it differs in the biases
    unmasked, _, _ = reference(init, grads, LRS, [False] * len(SHAPES), betas, eps, wd)
    assert not np.allclose(unmasked[1], want[1], rtol=1e-9, atol=0)


def test_differs_from_adam_with_l2_decay():
    a, b = _params(), _params()
    grads = _grads(3)
    _run(mt.optim.AdamW(a, lr=0.01, weight_decay=0.1), grads, [0.01] * 3)
    _run(mt.optim.Adam(b, lr=0.01, weight_decay=0.1), grads, [0.01] * 3)
    assert not np.allclose(a[0].data, b[0].data, rtol=1e-6, atol=0)


def test_matches_torch_adamw_float32():
    torch = pytest.importorskip("torch")
    ps = _params(np.float32)
    grads = _grads(len(LRS), np.float32)
    tps = [torch.nn.Parameter(torch.tensor(p.data.copy())) for p in ps]
    decayed = [t for t, s in zip(tps, SHAPES) if len(s) > 1]
    free = [t for t, s in zip(tps, SHAPES) if len(s) == 1]
    topt = torch.optim.AdamW([{"params": decayed}, {"params": free, "weight_decay": 0.0}],
                             lr=1.0, weight_decay=0.1)
    opt = mt.optim.AdamW(ps, lr=1.0, weight_decay=0.1, no_decay=mt.optim.is_bias_or_norm)
    _run(opt, grads, LRS)
    for gs, lr in zip(grads, LRS):
        for group in topt.param_groups:
            group["lr"] = lr
        for t, g in zip(tps, gs):
            t.grad = torch.tensor(g)
        topt.step()
    for i, (p, t) in enumerate(zip(ps, tps)):
        assert p.data.dtype == np.float32
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=f"param {i}")
        state = topt.state[t]
        np.testing.assert_allclose(opt.state["exp_avg"][i], state["exp_avg"].numpy(),
                                   rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(opt.state["exp_avg_sq"][i], state["exp_avg_sq"].numpy(),
                                   rtol=1e-5, atol=1e-9)


def test_defaults_are_pytorchs():
    opt = mt.optim.AdamW(_params())
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    torch = pytest.importorskip("torch")
    t = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert (t["lr"], tuple(t["betas"]), t["eps"], t["weight_decay"]) == (
        opt.lr, opt.betas, opt.eps, opt.weight_decay)


def test_state_dict_round_trip_through_npz():
    init = [p.data.copy() for p in _params()]
    grads = _grads(5)
    lrs = LRS[:5]

    def make(ps):
        return mt.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.05,
                              no_decay=mt.optim.is_bias_or_norm)

    whole = [mt.nn.Parameter(a.copy()) for a in init]
    _run(make(whole), grads, lrs)
    first = [mt.nn.Parameter(a.copy()) for a in init]
    opt = make(first)
    _run(opt, grads[:2], lrs[:2])
    buf = io.BytesIO()
    np.savez(buf, **opt.state_dict())
    buf.seek(0)
    saved = dict(np.load(buf, allow_pickle=False))
    assert {"exp_avg.0", "exp_avg_sq.3", "beta1", "beta2", "eps", "weight_decay"} <= set(saved)
    resumed = [mt.nn.Parameter(p.data.copy()) for p in first]
    opt2 = mt.optim.AdamW(resumed)                     # other settings: restored from the dict
    opt2.load_state_dict(saved)
    assert opt2.steps == 2 and opt2.betas == (0.8, 0.9) and opt2.weight_decay == 0.05
    assert opt2.no_decay.tolist() == [0, 1, 0, 1]
    _run(opt2, grads[2:], lrs[2:])
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("kwargs,match", [
    (dict(betas=(1.0, 0.9)), "AdamW beta1 must be in"), (dict(betas=(0.9, -0.1)), "beta2"),
    (dict(eps=0.0), "eps must be > 0"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=-1.0), "learning rate")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.optim.AdamW(_params(), **kwargs)


def test_kernel_step_is_one_based():
    k = mt.kernels.get("cpu")
    with pytest.raises(ValueError, match="adamw_update: step is 1-based, got 0"):
        k.adamw_update(*[np.zeros(2, np.float32)] * 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0)
