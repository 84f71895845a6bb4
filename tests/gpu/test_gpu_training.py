"""Short training on the GPU (both flavours) matches the CPU, on 1 rank or on N ranks.

On N ranks (``mpiexec -n 2 pytest -m gpu tests/gpu``: both share the GPU) every rank trains on its
shard of each global batch with DistributedOptimizer (device gradient allreduce), and the result
must equal one CPU process training on the whole global batch (N x b == 1 x N*b).
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.optim import SGD, Adam, AdamW

pytestmark = pytest.mark.gpu

GLOBAL_BATCH = 8
STEPS = 3


def train(kernels, build, make_opt, xs, ys, distributed):
    model = build(kernels)
    loss_fn = mt.nn.SoftmaxCrossEntropy(kernels=kernels)
    opt = make_opt(model.parameters())
    rank, size = (mt.rank(), mt.size()) if distributed else (0, 1)
    if distributed:
        opt = mt.DistributedOptimizer(opt, model.named_parameters())
    for x, y in zip(xs, ys):
        xb = np.ascontiguousarray(x[rank::size])                   # this rank's shard (b, ...)
        yb = np.ascontiguousarray(y[rank::size])
        xd = xb if kernels.name == "cpu" else kernels.to_device(xb)
        yd = yb if kernels.name == "cpu" else kernels.to_device(yb)
        opt.zero_grad()
        loss_fn.forward(model.forward(xd), yd)
        model.backward(loss_fn.backward())
        opt.step()
    return model.state_dict(copy=True)


MODELS = {
    "mlp-sgd": (lambda k: mt.models.mlp(in_features=20, hidden=(64, 32), classes=5, seed=1,
                                        kernels=k), (20,), 5,
                lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    # Adam's step is about lr * sign(g) for any |g| >> eps: a gradient that is rounding noise
    # on both backends (a weight whose true gradient is ~0) takes a full step of opposite sign
    # on each. eps=1e-8 left 10-13 of LeNet's 3.2M weights 0.15 lr apart on an H100; eps=1e-6
    # damps noise-level gradients, the kernel under test is the same.
    "lenet-adam": (lambda k: mt.models.lenet(classes=10, seed=2, kernels=k), (1, 28, 28), 10,
                   lambda p: Adam(p, lr=1e-3, eps=1e-6)),
    # tokens (B, 32) of a vocabulary of 65 with next tokens as labels; eps as for LeNet (the
    # key bias's exact gradient is 0: a row's softmax ignores a shift of all its scores)
    "gpt-adamw": (lambda k: mt.models.gpt(vocab_size=65, block_size=32, n_layer=2, n_head=4,
                                          n_embd=64, seed=3, kernels=k), "tokens", 65,
                  lambda p: AdamW(p, lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_training_matches_cpu(cpu, gpu, model):
    build, shape, classes, make_opt = MODELS[model]
    if GLOBAL_BATCH % mt.size():
        pytest.skip(f"global batch {GLOBAL_BATCH} does not split over {mt.size()} ranks")
    rng = np.random.default_rng(0)                                 # same data on every rank
    if shape == "tokens":
        xs, ys = ([rng.integers(0, classes, (GLOBAL_BATCH, 32)) for _ in range(STEPS)]
                  for _ in range(2))
    else:
        xs = [rng.standard_normal((GLOBAL_BATCH,) + shape).astype(np.float32)
              for _ in range(STEPS)]
        ys = [rng.integers(0, classes, GLOBAL_BATCH).astype(np.int64) for _ in range(STEPS)]
    want = train(cpu, build, make_opt, xs, ys, distributed=False)
    got = train(gpu, build, make_opt, xs, ys, distributed=True)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-3, atol=1e-5, err_msg=name)
