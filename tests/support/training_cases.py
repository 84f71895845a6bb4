"""Two-step training cases shared by the simulator suites (tests/cudasim): the same model and
optimizer trained on the CPU kernels and on a device backend must end in the same state.

A tiny CNN built from every layer type (Conv2D, MaxPool2D, Flatten, Linear+ReLU, Dropout, ReLU), a
tiny ResNet (BatchNorm, residual block, global average pooling), the zoo MLP and a tiny GPT (with
AdamW), trained through mpitrain.nn + mpitrain.optim with unchanged layer code: only the kernels
module differs. Shapes are tiny because the simulator runs each GPU thread in Python.
"""
import numpy as np

import mpitrain.nn as nn
from mpitrain.optim import SGD, Adam, AdamW


def tiny_cnn(kernels):
    rng = np.random.default_rng(7)
    kw = dict(seed=rng, kernels=kernels)
    return nn.Sequential(
        nn.Conv2D(2, 3, 3, padding=1, relu=True, **kw),        # (B, 3, 6, 6)
        nn.MaxPool2D(2, kernels=kernels),                      # (B, 3, 3, 3)
        nn.Flatten(kernels=kernels),                           # (B, 27)
        nn.Linear(27, 8, **kw),
        nn.ReLU(kernels=kernels),
        nn.Dropout(0.25, seed=3, kernels=kernels),
        nn.Linear(8, 4, **kw),
        input_shape=(2, 6, 6))


def tiny_mlp(kernels):
    return nn.models.mlp(in_features=12, hidden=(16, 8), classes=4, seed=5, kernels=kernels)


def tiny_resnet(kernels):
    """Every layer ResNet-20 needs: conv-BN-ReLU, a downsampling BasicBlock (option-A shortcut,
    residual add) on an odd 5x5 map, global average pooling, Linear-BatchNorm1d-ReLU."""
    rng = np.random.default_rng(11)
    kw = dict(seed=rng, kernels=kernels)
    return nn.Sequential(
        nn.Conv2D(2, 3, 3, padding=1, bias=False, **kw),        # (B, 3, 5, 5)
        nn.BatchNorm2d(3, kernels=kernels),                     # 125 values per channel
        nn.ReLU(kernels=kernels),
        nn.BasicBlock(3, 4, stride=2, **kw),                    # (B, 4, 3, 3)
        nn.GlobalAvgPool2d(kernels=kernels),                    # (B, 4)
        nn.Linear(4, 6, **kw),
        nn.BatchNorm1d(6, kernels=kernels),
        nn.ReLU(kernels=kernels),
        nn.Linear(6, 4, **kw),
        input_shape=(2, 5, 5))


def tiny_gpt(kernels):
    """Every transformer layer: embeddings (tied head), LayerNorm, causal attention with dropout,
    GELU MLP; vocabulary 7, context 5."""
    return nn.models.gpt(vocab_size=7, block_size=5, n_layer=1, n_head=2, n_embd=8, dropout=0.1,
                         seed=3, kernels=kernels)


def train(kernels, build, make_opt, x, y, steps=2):
    """Run ``steps`` SGD/Adam steps; return host parameters, losses and correct counts."""
    model = build(kernels)
    loss_fn = nn.SoftmaxCrossEntropy(kernels=kernels)
    opt = make_opt(model.parameters())
    xd, yd = kernels.to_device(x), kernels.to_device(y)
    losses, correct = [], []
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        losses.append(loss_fn.forward(model.forward(xd), yd))
        correct.append(loss_fn.correct)
        model.backward(loss_fn.backward())
        opt.step()
    return model.state_dict(copy=True), losses, correct, opt.state_dict()


CASES = {
    "cnn-sgd": (tiny_cnn, (5, 2, 6, 6),
                lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3)),
    "mlp-adam": (tiny_mlp, (6, 12), lambda p: Adam(p, lr=1e-2)),
    "resnet-sgd": (tiny_resnet, (5, 2, 5, 5),
                   lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3)),
    # tokens (B, T) with their next tokens as labels (B, T), vocabulary 7. The key bias's exact
    # gradient is 0 (a row's softmax ignores a shift of all its scores): its rounding noise,
    # which differs by backend, moves it by up to ~1e-5 under Adam's normalisation.
    "gpt-adamw": (tiny_gpt, ("tokens", 3, 5, 7),
                  lambda p: AdamW(p, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), 3e-5),
}



def check_two_steps(cpu, dev, build, shape, make_opt, atol=1e-6):
    rng = np.random.default_rng(0)
    if shape[0] == "tokens":
        _, b, t, vocab = shape
        x, y = (rng.integers(0, vocab, size=(b, t)).astype(np.int64) for _ in range(2))
    else:
        x = rng.standard_normal(shape).astype(np.float32)
        y = rng.integers(0, 4, size=shape[0]).astype(np.int64)
    want, want_losses, want_correct, want_opt = train(cpu, build, make_opt, x, y)
    got, got_losses, got_correct, got_opt = train(dev, build, make_opt, x, y)
    assert list(got) == list(want)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert got_correct == want_correct
    start = build(cpu).state_dict()
    for name in want:
        assert not np.array_equal(want[name], start[name]), f"{name} did not train"
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=atol, err_msg=name)
    for key in want_opt:
        np.testing.assert_allclose(np.asarray(got_opt[key], dtype=np.float64),
                                   np.asarray(want_opt[key], dtype=np.float64),
                                   rtol=1e-4, atol=atol, err_msg=key)
