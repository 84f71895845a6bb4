"""The synchronize -> clip_grad_norm_ -> step idiom under 1..4 ranks: every rank clips the same
averaged gradients, so the replicas stay one model, and the update is the NumPy reference's."""
import numpy as np
import pytest

import mpitrain as mt

N, R = mt.size(), mt.rank()


def _reference_clip(grads, max_norm):
    total = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    factor = min(max_norm / (total + 1e-6), 1.0)
    return total, [g * factor for g in grads]


@pytest.mark.parametrize("hook", [False, True])             # averaged in synchronize / overlapped
def test_synchronize_clip_step_keeps_the_replicas_identical(hook):
    model = mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=1)
    opt = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    mt.broadcast_parameters(model.named_parameters(), root_rank=0)
    data = mt.data.synthetic(8, shape=(12,), classes=3, seed=10 + R)    # each rank its own
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for step in range(3):
        before = [p.data.copy() for p in model.parameters()]
        opt.zero_grad()
        loss_fn(model(data.images * 50), data.labels)                    # large gradients
        model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook if hook else None)
        local = [p.grad.copy() for p in model.parameters()] if not hook else None
        opt.synchronize()
        total = mt.nn.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        assert total > 1.0                                               # it did clip
        assert len(set(mt.allgather_object(total))) == 1
        state = {n: a.tobytes() for n, a in model.state_dict(copy=True).items()}
        assert all(s == state for s in mt.allgather_object(state)), f"step {step}"
        if local is not None:     # the update is SGD on the clipped mean of the ranks' gradients
            every = mt.allgather_object(local)
            mean = [np.mean([g[i].astype(np.float64) for g in every], axis=0)
                    for i in range(len(local))]
            want_total, clipped = _reference_clip(mean, 1.0)
            assert total == pytest.approx(want_total, rel=1e-5)
            for p, b, c in zip(model.parameters(), before, clipped):
                np.testing.assert_allclose(p.data, b - 0.1 * c, rtol=1e-5, atol=1e-6)
