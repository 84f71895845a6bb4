"""Model zoo, Sequential state dicts and modes, Parameter semantics."""
import numpy as np
import pytest

import mpitrain as mt


@pytest.mark.parametrize("name,shapes", [
    ("mlp", [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]),
    ("lenet", [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (1024, 3136), (1024,), (10, 1024),
               (10,)]),
    ("cifar_cnn", [(32, 3, 3, 3), (32,), (32, 32, 3, 3), (32,), (64, 32, 3, 3), (64,),
                   (64, 64, 3, 3), (64,), (512, 4096), (512,), (10, 512), (10,)]),
])
def test_zoo_shapes_forward_and_seed(name, shapes):
    model = mt.models.get(name, seed=3)
    assert [tuple(p.data.shape) for p in model.parameters()] == shapes
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["0.weight", "0.bias"] and len(set(names)) == len(names)
    assert all(p.data.dtype == np.float32 for p in model.parameters())
    x = np.random.default_rng(0).standard_normal((2,) + model.input_shape).astype(np.float32)
    logits = model.forward(x)
    assert logits.shape == (2, 10) and np.isfinite(logits).all()
    same, other = mt.models.get(name, seed=3), mt.models.get(name, seed=4)
    for (n, a), b, c in zip(model.state_dict().items(), same.parameters(), other.parameters()):
        np.testing.assert_array_equal(a, b.data)
        if n.endswith("weight"):
            assert not np.array_equal(a, c.data)


def test_mlp_options_and_float64():
    model = mt.models.mlp(in_features=20, hidden=(8,), classes=3, dtype=np.float64)
    assert model.input_shape == (20,) and len(model.parameters()) == 4
    assert model.parameters()[0].data.dtype == np.float64
    ref32 = mt.models.mlp(in_features=20, hidden=(8,), classes=3)
    np.testing.assert_allclose(ref32.parameters()[0].data, model.parameters()[0].data,
                               rtol=1e-6)                  # float32 = rounded float64 init
    with pytest.raises(ValueError, match="resnet"):
        mt.models.get("resnet")


def test_init_scale_he_and_glorot():
    model = mt.models.mlp(in_features=400, hidden=(300,), classes=200, init=None)
    w0, w1 = model.parameters()[0].data, model.parameters()[2].data
    assert abs(w0.std() - np.sqrt(2 / 400)) < 0.05 * np.sqrt(2 / 400)        # He normal
    limit = np.sqrt(6 / (300 + 200))
    assert np.abs(w1).max() <= limit and np.abs(w1).max() > 0.95 * limit    # Glorot uniform
    assert not model.parameters()[1].data.any()
    w0 = mt.models.mlp(in_features=400, hidden=(300,), classes=200).parameters()[0].data
    limit = np.sqrt(6 / (400 + 300))                                         # zoo default
    assert np.abs(w0).max() <= limit and np.abs(w0).max() > 0.95 * limit
    conv = mt.models.lenet().parameters()[0].data                            # fan 25 / 800
    assert np.abs(conv).max() <= np.sqrt(6 / (25 + 800))


def test_state_dict_round_trip_and_errors():
    a, b = mt.models.lenet(seed=1), mt.models.lenet(seed=2)
    state = a.state_dict(copy=True)
    assert list(state) == [n for n, _ in a.named_parameters()]
    state["0.bias"][0] = 99.0                       # a host copy: the model is unaffected
    assert a.parameters()[1].data[0] == 0.0
    live = a.state_dict()                           # PyTorch's: the model's own arrays
    assert all(live[n] is p.data for n, p in a.named_parameters())
    live["0.bias"][0] = 7.0
    assert a.parameters()[1].data[0] == 7.0
    live["0.bias"][0] = 0.0
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    bad = a.state_dict(copy=True)
    bad["0.weight"] = np.zeros((1, 2))
    with pytest.raises(ValueError, match="0.weight"):
        b.load_state_dict(bad)
    bad = a.state_dict(copy=True)
    del bad["2.bias"]
    bad["9.extra"] = np.zeros(1)
    with pytest.raises(ValueError, match=r"2\.bias.*9\.extra"):
        b.load_state_dict(bad)


def test_forward_returns_fresh_array_and_handles_smaller_batch():
    model = mt.models.mlp(in_features=6, hidden=(5,), classes=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    first = model.forward(x)
    model.forward(-x)
    small = model.forward(x[:2])                    # last, smaller batch of an epoch
    np.testing.assert_allclose(small, first[:2], rtol=1e-6)
    np.testing.assert_allclose(model.forward(x), first, rtol=1e-6)


def test_conv_model_smaller_batch_uses_leading_workspace_rows():
    model = mt.nn.Sequential(mt.nn.Conv2D(1, 2, 3, padding=1, relu=True), mt.nn.MaxPool2D(2),
                             mt.nn.Flatten(), mt.nn.Linear(2 * 3 * 3, 4))
    x = np.random.default_rng(1).standard_normal((5, 1, 6, 6)).astype(np.float32)
    full = model.forward(x)
    np.testing.assert_allclose(model.forward(x[:2]), full[:2], rtol=1e-6)
    loss = mt.nn.SoftmaxCrossEntropy()
    labels = np.array([0, 1, 2, 3, 0])
    model.zero_grad()
    loss.forward(model.forward(x[:2]), labels[:2])
    model.backward(loss.backward())
    small = [np.array(p.grad) for p in model.parameters()]
    model.forward(x)                                  # grow back: same gradients as fresh
    model.zero_grad()
    loss.forward(model.forward(x[:2]), labels[:2])
    model.backward(loss.backward())
    for a, p in zip(small, model.parameters()):
        np.testing.assert_allclose(p.grad, a, rtol=1e-6)


def test_dropout_train_eval_modes():
    model = mt.nn.Sequential(mt.nn.Linear(4, 50), mt.nn.Dropout(0.5, seed=1))
    x = np.ones((8, 4), np.float32)
    train_a, train_b = model.forward(x), model.forward(x)
    assert (train_a == 0).any() and not np.array_equal(train_a, train_b)
    model.eval()
    assert not model.layers[1].training
    np.testing.assert_array_equal(model.forward(x), model.forward(x))
    assert not (model.forward(x) == 0).all()
    model.train()
    assert model.layers[1].training


def test_parameter_basics():
    p = mt.nn.Parameter(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert p.grad.shape == (2, 3) and not p.grad.any() and p.kernels is mt.kernels.get("cpu")
    with pytest.raises(ValueError, match="int64"):
        mt.nn.Parameter(np.arange(3))
    with pytest.raises(ValueError, match="grad shape"):
        p.grad = np.zeros(3, np.float32)


def test_layer_input_errors():
    lin = mt.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="3 input features"):
        lin.forward(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="float64"):
        lin.forward(np.ones((2, 3), np.float64))
    conv = mt.nn.Conv2D(2, 3, 3)
    with pytest.raises(ValueError, match="2 input channels"):
        conv.forward(np.ones((1, 1, 5, 5), np.float32))
    with pytest.raises(ValueError, match="padding"):
        mt.nn.Conv2D(2, 3, 3, padding=-1)
    with pytest.raises(ValueError, match="does not fit"):
        mt.nn.MaxPool2D(4).forward(np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match="labels"):
        mt.nn.SoftmaxCrossEntropy().forward(np.ones((2, 3), np.float32), np.zeros(3, np.int64))


def test_training_reduces_loss_on_separable_data():
    """A few SGD steps on a tiny separable problem: the whole model path learns."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 10)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = mt.models.mlp(in_features=10, hidden=(16,), classes=2, seed=0)
    loss = mt.nn.SoftmaxCrossEntropy()
    opt = mt.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    first = loss(model.forward(x), y)
    for _ in range(30):
        opt.zero_grad()
        loss(model.forward(x), y)
        model.backward(loss.backward())
        opt.step()
    assert loss(model.forward(x), y) < 0.3 * first and loss.correct >= 60
