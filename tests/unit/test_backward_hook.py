"""Sequential.backward(grad, on_layer_done=fn): fn sees each layer's parameters, last layer
first, right after that layer's backward, with gradients already final (what lets
DistributedOptimizer start their allreduce during the rest of backward)."""
import numpy as np

import mpitrain as mt


def test_hook_sees_final_gradients_last_layer_first():
    model = mt.models.lenet(seed=0, dtype=np.float64)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 28, 28))                              # (B, C, H, W)
    y = np.array([3, 7], np.int64)                                       # (B,)
    seen = []

    def on_layer_done(params):
        seen.append([(id(p), p.grad.copy()) for p in params])

    model.zero_grad()
    loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward(), on_layer_done=on_layer_done)
    by_layer = [[id(p) for _, p in layer.named_parameters()] for layer in model.layers]
    expected = [ids for ids in reversed(by_layer) if ids]
    assert [[i for i, _ in group] for group in seen] == expected
    final = {id(p): p.grad for p in model.parameters()}
    for group in seen:
        for i, g in group:
            np.testing.assert_array_equal(g, final[i])
    # and the hook changes nothing: the same gradients without it
    model.zero_grad()
    loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    for group in seen:
        for i, g in group:
            np.testing.assert_array_equal(g, final[i])
