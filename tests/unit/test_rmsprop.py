"""RMSprop against a NumPy transcription of PyTorch's algorithm (torch.optim.RMSprop's
single-tensor loop), its state dict and a checkpoint round trip."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain import checkpoint
from mpitrain.optim import RMSprop


def torch_rmsprop(params, grads_per_step, lr, alpha, eps, weight_decay, momentum, centered):
    """PyTorch's update, op for op (float64): returns the params and the state after all steps."""
    params = [p.copy() for p in params]
    square_avg = [np.zeros_like(p) for p in params]
    grad_avg = [np.zeros_like(p) for p in params]
    buf = [np.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, (p, grad) in enumerate(zip(params, grads)):
            if weight_decay != 0:
                grad = grad + weight_decay * p                     # grad.add(param, alpha=wd)
            square_avg[i] = square_avg[i] * alpha + (1 - alpha) * grad * grad   # addcmul_
            if centered:
                grad_avg[i] = grad_avg[i] + (1 - alpha) * (grad - grad_avg[i])  # lerp_
                avg = np.sqrt(square_avg[i] - grad_avg[i] * grad_avg[i]) + eps
            else:
                avg = np.sqrt(square_avg[i]) + eps
            if momentum > 0:
                buf[i] = buf[i] * momentum + grad / avg                         # addcdiv_
                p -= lr * buf[i]
            else:
                p -= lr * grad / avg                                            # addcdiv_
    return params, square_avg, grad_avg, buf


def _params(rng):
    return [mt.nn.Parameter(rng.standard_normal(s)) for s in ((3, 4), (4,))]


def _run(opt, params, grads_per_step):
    for grads in grads_per_step:
        opt.zero_grad()
        for p, g in zip(params, grads):
            p.grad[...] = g
        opt.step()


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_matches_pytorchs_algorithm(centered, momentum, weight_decay):
    rng = np.random.default_rng(0)
    params = _params(rng)
    start = [np.array(p.data) for p in params]
    grads = [[rng.standard_normal(p.shape) for p in params] for _ in range(4)]
    hyper = dict(lr=0.01, alpha=0.9, eps=1e-8, weight_decay=weight_decay, momentum=momentum,
                 centered=centered)
    opt = RMSprop(params, **hyper)
    _run(opt, params, grads)
    want, square_avg, grad_avg, buf = torch_rmsprop(start, grads, **hyper)
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.data, want[i], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(opt.state["square_avg"][i], square_avg[i], rtol=1e-12)
        if centered:
            np.testing.assert_allclose(opt.state["grad_avg"][i], grad_avg[i], rtol=1e-12)
        if momentum:
            np.testing.assert_allclose(opt.state["momentum_buffer"][i], buf[i], rtol=1e-12)
    keys = {k.split(".")[0] for k in opt.state_dict() if "." in k}
    assert keys == {"square_avg"} | ({"grad_avg"} if centered else set()) \
        | ({"momentum_buffer"} if momentum else set())


def test_defaults_are_pytorchs():
    opt = RMSprop(_params(np.random.default_rng(1)))
    assert (opt.lr, opt.alpha, opt.eps, opt.weight_decay, opt.momentum, opt.centered) == \
        (0.01, 0.99, 1e-8, 0.0, 0.0, False)


def test_no_decay_exempts_biases():
    rng = np.random.default_rng(2)
    params = _params(rng)
    start = [np.array(p.data) for p in params]
    grads = [[rng.standard_normal(p.shape) for p in params] for _ in range(2)]
    opt = RMSprop(params, lr=0.1, weight_decay=0.5, no_decay=mt.optim.is_bias_or_norm)
    _run(opt, params, grads)
    decayed = torch_rmsprop(start[:1], [g[:1] for g in grads], 0.1, 0.99, 1e-8, 0.5, 0, False)
    plain = torch_rmsprop(start[1:], [g[1:] for g in grads], 0.1, 0.99, 1e-8, 0.0, 0, False)
    np.testing.assert_allclose(params[0].data, decayed[0][0], rtol=1e-12)
    np.testing.assert_allclose(params[1].data, plain[0][0], rtol=1e-12)


@pytest.mark.parametrize("kwargs,match", [(dict(alpha=1.0), "alpha"), (dict(eps=0), "eps"),
                                          (dict(momentum=-1), "momentum"),
                                          (dict(weight_decay=-1), "weight_decay")])
def test_bad_hyper_parameters_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RMSprop(_params(np.random.default_rng(3)), **kwargs)


def test_a_checkpoint_resumes_bit_for_bit(tmp_path):
    """state_dict -> checkpoint.write (which flattens the state into arrays and a JSON layout)
    -> read_latest -> load_state_dict, then the same steps as the uninterrupted optimizer:
    identical parameters and state."""
    rng = np.random.default_rng(4)
    grads = [[rng.standard_normal(s) for s in ((3, 4), (4,))] for _ in range(5)]
    hyper = dict(lr=0.02, alpha=0.95, momentum=0.9, centered=True, weight_decay=1e-3)
    params = _params(np.random.default_rng(5))
    opt = RMSprop(params, **hyper)
    _run(opt, params, grads[:3])
    checkpoint.write(str(tmp_path), 3, {f"p{i}": np.array(p.data) for i, p in
                                        enumerate(params)}, opt.state_dict(), {"epoch": 0})
    _run(opt, params, grads[3:])

    ckpt, skipped = checkpoint.read_latest(str(tmp_path))
    assert skipped == []
    resumed = [mt.nn.Parameter(np.array(ckpt.params[f"p{i}"])) for i in range(2)]
    opt2 = RMSprop(resumed, **hyper)
    opt2.load_state_dict(ckpt.optimizer_state)
    assert opt2.steps == 3 and opt2.centered is True and opt2.momentum == 0.9
    _run(opt2, resumed, grads[3:])
    for a, b in zip(params, resumed):
        np.testing.assert_array_equal(a.data, b.data)
    want, got = opt.state_dict(), opt2.state_dict()
    assert sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def test_a_state_dict_of_another_variant_is_refused():
    params = _params(np.random.default_rng(6))
    centered = RMSprop(params, centered=True).state_dict()
    with pytest.raises(ValueError, match=r"unexpected keys \['grad_avg.0', 'grad_avg.1'\]"):
        RMSprop(params).load_state_dict(centered)
