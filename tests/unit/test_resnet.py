"""The module system and the ResNet zoo: gradients of the residual pieces (float64 finite
differences), dotted names, buffers in state_dict, mode switching, the backward-hook order."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.nn import (Add, BasicBlock, Conv2D, GlobalAvgPool2d, Linear, Module, ReLU,
                         Sequential, ShortcutA)
from tests.support.gradcheck import check_layer, check_module


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def test_global_avgpool_gradient(rng):
    check_layer(GlobalAvgPool2d(dtype=np.float64), rng.standard_normal((2, 3, 4, 5)), rng)


@pytest.mark.parametrize("cin,cout,stride,hw", [(2, 4, 2, (5, 5)), (3, 3, 1, (4, 4)),
                                                (2, 6, 2, (4, 6))])
def test_shortcut_gradient(rng, cin, cout, stride, hw):
    check_layer(ShortcutA(cin, cout, stride, dtype=np.float64),
                rng.standard_normal((2, cin) + hw), rng)


def test_conv_without_bias(rng):
    conv = Conv2D(2, 3, 3, padding=1, bias=False, seed=1, dtype=np.float64, init="he")
    assert [n for n, _ in conv.named_parameters()] == ["weight"]
    check_layer(conv, rng.standard_normal((2, 2, 4, 4)), rng)
    fused = Conv2D(2, 3, 3, padding=1, bias=False, relu=True, seed=1, dtype=np.float64,
                   init="he")
    x = rng.standard_normal((2, 2, 4, 4))
    np.testing.assert_array_equal(fused.forward(x), np.maximum(conv.forward(x), 0))
    check_layer(fused, x, rng)


@pytest.mark.parametrize("cin,cout,stride", [(3, 3, 1), (2, 4, 2)])
def test_basic_block_gradient(rng, cin, cout, stride):
    block = BasicBlock(cin, cout, stride, seed=3, dtype=np.float64)
    for bn in (block.bn1, block.bn2):           # non-trivial affine parameters
        bn.weight.data[...] = rng.uniform(0.5, 1.5, cout)
        bn.bias.data[...] = rng.standard_normal(cout) * 0.3
    check_module(block, rng.standard_normal((3, cin, 4, 4)), rng)


def test_sequential_of_blocks_gradient(rng):
    """Two blocks in a Sequential child: gradients flow through nested composites."""
    seq = Sequential(BasicBlock(2, 2, 1, seed=1, dtype=np.float64),
                     BasicBlock(2, 4, 2, seed=2, dtype=np.float64))
    check_module(seq, rng.standard_normal((2, 2, 4, 4)), rng)


def test_add_layer():
    add = Add(dtype=np.float64)
    a, b = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    np.testing.assert_array_equal(add.forward(a, b), a + 1)
    np.testing.assert_array_equal(add.sum_grads(a, b), a + 1)


@pytest.mark.parametrize("name,depth", [("resnet20", 20), ("resnet32", 32), ("resnet56", 56)])
def test_zoo_resnets(name, depth):
    model = mt.models.get(name)
    n = (depth - 2) // 6
    # conv1 + 3 stages x n blocks x 2 convs, each conv with its BatchNorm, plus the head
    assert len(model.parameters()) == 1 + 2 + 3 * n * 2 * 3 + 2
    assert len(model.buffers()) == 2 * (1 + 3 * n * 2)
    if name == "resnet20":
        assert model.num_parameters() == 269_722                       # "0.27M"
        assert mt.models.resnet20(input_shape=(1, 28, 28)).num_parameters() == 269_434


def test_resnet_names_and_forward_shapes(rng):
    model = mt.models.resnet20(input_shape=(1, 28, 28), seed=5)
    names = [n for n, _ in model.named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "stage1.0.conv1.weight" in names and "stage3.2.bn2.bias" in names
    assert names[-2:] == ["fc.weight", "fc.bias"]
    assert "stage2.0.bn1.running_var" in dict(model.named_buffers())
    y = model.forward(rng.standard_normal((3, 1, 28, 28)).astype(np.float32))
    assert y.shape == (3, 10) and y.dtype == np.float32
    same = mt.models.resnet20(input_shape=(1, 28, 28), seed=5)
    for a, b in zip(model.parameters(), same.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
    with pytest.raises(ValueError, match="6n\\+2"):
        mt.models.resnet(21)


def test_resnet_he_init():
    model = mt.models.resnet56(seed=0)
    w = model.stage3[1].conv2.weight.data                               # (64, 64, 3, 3)
    assert abs(w.std() / np.sqrt(2.0 / (64 * 9)) - 1) < 0.05


def test_backward_hook_runs_in_reverse_parameter_order(rng):
    model = mt.models.resnet(8, input_shape=(1, 8, 8), dropout=0.2)
    layers = []
    y = model.forward(rng.standard_normal((2, 1, 8, 8)).astype(np.float32))
    model.backward(np.ones_like(y), on_layer_done=layers.append)
    # layer by layer, last first: what DistributedOptimizer's bucket plan assumes
    assert [id(p) for ps in reversed(layers) for p in ps] == [id(p) for p in model.parameters()]
    assert len(layers) == 2 + 3 * 4 + 1          # conv1, bn1, 3 blocks of conv-bn-conv-bn, fc


def test_train_eval_recurse_and_dropout_in_zoo(rng):
    model = mt.models.resnet(8, input_shape=(1, 8, 8), dropout=0.5)
    assert model.dropout.p == 0.5
    model.eval()
    assert not any(m.training for m in model.modules())
    x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(model.forward(x), model.forward(x))   # deterministic in eval
    model.train()
    assert all(m.training for m in model.modules())
    for name in ("mlp", "lenet", "cifar_cnn"):
        plain, dropped = mt.models.get(name), mt.models.get(name, dropout=0.3)
        kinds = [type(layer).__name__ for layer in dropped.layers]
        assert kinds[-2:] == ["Dropout", "Linear"] and len(dropped) == len(plain) + 1


def test_state_dict_without_buffers_is_refused_naming_them():
    model = mt.models.resnet(8, input_shape=(1, 8, 8))
    params_only = {n: p.data for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"missing keys \['bn1.running_mean', "):
        model.load_state_dict(params_only)
    lenet = mt.models.lenet()
    state = lenet.state_dict(copy=True)
    state["1.running_mean"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"unexpected keys \['1.running_mean'\]"):
        lenet.load_state_dict(state)


def test_module_tree_api():
    class Two(Module):
        def __init__(self):
            super().__init__()
            self.add_child("a", Linear(3, 2, dtype=np.float64))
            self.add_child("r", ReLU(dtype=np.float64))

    m = Two()
    assert [n for n, _ in m.named_modules()] == ["", "a", "r"]
    assert m.a is m.children()[0]
    with pytest.raises(ValueError, match="contain no"):
        m.add_child("x.y", ReLU())
    with pytest.raises(TypeError, match="not a Module"):
        m.add_child("z", object())
    with pytest.raises(NotImplementedError):
        m.forward(np.zeros((1, 3)))


def test_small_resnet_learns_and_eval_agrees():
    """SGD on synthetic classes: training loss falls, and eval mode (running statistics) scores
    the training data about as well as train mode -- the running statistics are usable."""
    data = mt.data.synthetic(64, shape=(1, 8, 8), classes=4, seed=1)
    model = mt.models.resnet(8, input_shape=(1, 8, 8), classes=4, seed=0)
    loss = mt.nn.SoftmaxCrossEntropy()
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = loss(model.forward(data.images), data.labels)
    for _ in range(25):
        opt.zero_grad()
        loss(model.forward(data.images), data.labels)
        model.backward(loss.backward())
        opt.step()
    trained = loss(model.forward(data.images), data.labels)
    assert trained < 0.3 * first and loss.correct >= 60
    model.eval()
    loss(model.forward(data.images), data.labels)
    assert loss.correct >= 56
