"""Optimizers against hand-computed updates, and their state dicts."""
import io

import numpy as np
import pytest

import mpitrain as mt


def param(values, dtype=np.float64):
    return mt.nn.Parameter(np.array(values, dtype=dtype))


def set_grad(p, values):
    p.grad[...] = values


def test_sgd_plain_by_hand():
    p = param([1.0, -2.0])
    opt = mt.optim.SGD([p], lr=0.5)
    set_grad(p, [0.2, 0.4])
    opt.step()
    np.testing.assert_allclose(p.data, [0.9, -2.2])


def test_sgd_momentum_by_hand():
    p = param([1.0])
    opt = mt.optim.SGD([p], lr=0.1, momentum=0.9)
    set_grad(p, [1.0])
    opt.step()                 # buf = 1            p = 1 - 0.1 = 0.9
    np.testing.assert_allclose(p.data, [0.9])
    set_grad(p, [2.0])
    opt.step()                 # buf = 0.9 + 2 = 2.9, p = 0.9 - 0.29 = 0.61
    np.testing.assert_allclose(p.data, [0.61])


def test_sgd_nesterov_weight_decay_by_hand():
    p = param([2.0])
    opt = mt.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True, weight_decay=0.1)
    set_grad(p, [1.0])
    opt.step()                 # g = 1 + 0.2 = 1.2; buf = 1.2; g = 1.2 + 0.6 = 1.8; p = 1.82
    np.testing.assert_allclose(p.data, [1.82])
    set_grad(p, [0.0])
    opt.step()                 # g = 0.182; buf = 0.6 + 0.182 = 0.782; g = 0.182 + 0.391 = 0.573
    np.testing.assert_allclose(p.data, [1.82 - 0.0573])


def test_adam_by_hand():
    p = param([1.0])
    opt = mt.optim.Adam([p], lr=0.1)
    set_grad(p, [0.5])
    opt.step()                 # m_hat = 0.5, v_hat = 0.25: step = lr * 0.5 / (0.5 + eps)
    np.testing.assert_allclose(p.data, [1.0 - 0.1 * 0.5 / (0.5 + 1e-8)])
    set_grad(p, [-1.0])
    opt.step()
    m = 0.9 * 0.05 + 0.1 * -1.0
    v = 0.999 * 0.00025 + 0.001 * 1.0
    m_hat, v_hat = m / (1 - 0.9 ** 2), v / (1 - 0.999 ** 2)
    expected = 1.0 - 0.1 * 0.5 / (0.5 + 1e-8) - 0.1 * m_hat / (np.sqrt(v_hat) + 1e-8)
    np.testing.assert_allclose(p.data, [expected], rtol=1e-12)


def test_lr_is_settable_and_zero_grad():
    p = param([1.0])
    opt = mt.optim.SGD([p], lr=1.0)
    opt.lr = 0.25
    set_grad(p, [1.0])
    opt.step()
    np.testing.assert_allclose(p.data, [0.75])
    opt.zero_grad()
    np.testing.assert_array_equal(p.grad, [0.0])


@pytest.mark.parametrize("make", [
    lambda ps: mt.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda ps: mt.optim.SGD(ps, lr=0.1),
    lambda ps: mt.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.01),
])
def test_state_dict_round_trip_through_npz(make):
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal(a.shape) for a in init] for _ in range(4)]

    def run(opt, ps, steps):
        for gs in steps:
            for p, g in zip(ps, gs):
                set_grad(p, g)
            opt.step()

    ps_a = [param(a) for a in init]
    opt_a = make(ps_a)
    run(opt_a, ps_a, grads)

    ps_b = [param(a) for a in init]
    opt_b = make(ps_b)
    run(opt_b, ps_b, grads[:2])
    buf = io.BytesIO()
    np.savez(buf, **opt_b.state_dict())
    buf.seek(0)
    saved = dict(np.load(buf, allow_pickle=False))
    ps_c = [mt.nn.Parameter(np.array(p.data)) for p in ps_b]
    opt_c = make(ps_c)
    opt_c.lr = 123.0                                   # restored from the state dict
    opt_c.load_state_dict(saved)
    assert opt_c.lr == opt_b.lr and opt_c.steps == 2
    run(opt_c, ps_c, grads[2:])
    for a, c in zip(ps_a, ps_c):
        np.testing.assert_array_equal(a.data, c.data)


def test_state_dict_errors():
    p = param([1.0, 2.0])
    opt = mt.optim.SGD([p], lr=0.1, momentum=0.9)
    state = opt.state_dict()
    assert all(isinstance(v, (int, float, bool, np.ndarray)) for v in state.values())
    bad = dict(state, **{"momentum_buffer.0": np.zeros(3)})
    with pytest.raises(ValueError, match="momentum_buffer.0"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="missing keys"):
        opt.load_state_dict({"lr": 0.1})


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "learning rate"), (dict(lr=0.1, momentum=-0.5), "momentum"),
    (dict(lr=0.1, nesterov=True), "nesterov"), (dict(lr=0.1, weight_decay=-1), "weight_decay")])
def test_sgd_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.optim.SGD([param([1.0])], **kwargs)


def test_adam_bad_arguments():
    with pytest.raises(ValueError, match="beta1"):
        mt.optim.Adam([param([1.0])], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="empty"):
        mt.optim.Adam([])


def _conv_bn_params():
    """A conv weight (4-D), its bias (1-D), a BN weight/bias (1-D) and a linear weight (2-D)."""
    rng = np.random.default_rng(0)
    shapes = [(3, 2, 3, 3), (3,), (3,), (3,), (5, 3)]
    return [mt.nn.Parameter(rng.standard_normal(s)) for s in shapes]


@pytest.mark.parametrize("make", [
    lambda ps, nd: mt.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                no_decay=nd),
    lambda ps, nd: mt.optim.Adam(ps, lr=0.01, weight_decay=0.01, no_decay=nd)])
def test_no_decay_mask_equals_zero_decay_for_those_parameters(make):
    """Masked parameters move as with weight_decay=0; the others as with full decay."""
    masked, decayed, free = _conv_bn_params(), _conv_bn_params(), _conv_bn_params()
    opts = [make(masked, mt.optim.is_bias_or_norm), make(decayed, None)]
    plain = make(free, None)
    plain.weight_decay = 0.0
    rng = np.random.default_rng(1)
    for _ in range(3):
        grads = [rng.standard_normal(p.data.shape) for p in masked]
        for opt in opts + [plain]:
            for p, g in zip(opt.params, grads):
                p.grad[...] = g
            opt.step()
    np.testing.assert_array_equal(opts[0].no_decay, [0, 1, 1, 1, 0])
    for i, (m, d, f) in enumerate(zip(masked, decayed, free)):
        want = f if m.data.ndim <= 1 else d
        np.testing.assert_array_equal(m.data, want.data, err_msg=f"parameter {i}")
    assert not np.array_equal(masked[1].data, decayed[1].data)   # the mask did something


def test_no_decay_as_flags_and_errors():
    ps = _conv_bn_params()
    opt = mt.optim.SGD(ps, lr=0.1, weight_decay=0.1, no_decay=[True, False, False, True, False])
    np.testing.assert_array_equal(opt.no_decay, [1, 0, 0, 1, 0])
    with pytest.raises(ValueError, match="2 flags for 5 parameters"):
        mt.optim.SGD(ps, lr=0.1, no_decay=[True, False])
    assert mt.optim.SGD(ps, lr=0.1).no_decay.tolist() == [0] * 5    # default: decay everything


def test_no_decay_mask_travels_in_the_state_dict():
    src = mt.optim.SGD(_conv_bn_params(), lr=0.1, momentum=0.9, weight_decay=0.1,
                       no_decay=mt.optim.is_bias_or_norm)
    state = src.state_dict()
    assert state["no_decay"].dtype == np.uint8 and state["no_decay"].tolist() == [0, 1, 1, 1, 0]
    dst = mt.optim.SGD(_conv_bn_params(), lr=0.1, momentum=0.9, weight_decay=0.1)
    dst.load_state_dict(state)
    np.testing.assert_array_equal(dst.no_decay, src.no_decay)
    buf = io.BytesIO()                                  # survives np.savez without pickle
    np.savez(buf, **state)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        dst.load_state_dict(dict(z))
    np.testing.assert_array_equal(dst.no_decay, src.no_decay)
    old = {k: v for k, v in state.items() if k != "no_decay"}   # written before the mask
    dst.load_state_dict(old)
    assert dst.no_decay.tolist() == [0] * 5
    with pytest.raises(ValueError, match="one flag per parameter"):
        dst.load_state_dict(dict(state, no_decay=np.zeros(3, np.uint8)))
