"""mt.Compression.bf16 (parallel/gradients.py, kernels/cpu/bfloat16.py): float32 gradients
travel as bfloat16 bits, summed on the ring in float32 and rounded once per hop.

Oracles: torch's own float32 -> bfloat16 conversion (round to nearest even, NaN kept) for the
encoding; for the average, the float32 mean of every rank's bfloat16-rounded gradients (gathered
here), which the ring's sum must match within bfloat16's precision (each of the N - 1 additions
and the 1/N scale round once: relative error <= (N + 1) * 2**-8 of the summed magnitudes);
for training, the same steps with mt.Compression.none, to bfloat16's precision.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()
BF16_EPS = 2.0 ** -8                # half a bfloat16 ulp, relative


def test_round_trip_is_within_bfloat16_precision_and_keeps_specials():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
    x[:5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    wire, ctx = mt.Compression.bf16.compress(x)
    assert wire.nbytes == x.nbytes // 2
    back = mt.Compression.bf16.decompress(wire, ctx)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.isnan(back[0]) and back[1] == np.inf and back[2] == -np.inf
    assert np.signbit(back[4]) and back[3] == 0.0
    finite = np.isfinite(x)
    assert np.all(np.abs(back[finite] - x[finite]) <= BF16_EPS * np.abs(x[finite]))


def test_encoding_is_round_to_nearest_even_as_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x = rng.standard_normal(10000).astype(np.float32)
    bits = x.view(np.uint32)
    bits[:100] = (bits[:100] & 0xFFFF0000) | 0x8000       # exact ties: to even
    bits[100] = 0x7F800001                                 # a signalling NaN
    wire, _ = mt.Compression.bf16.compress(x)
    ours = wire.view(np.uint16)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(np.delete(ours, 100), np.delete(theirs, 100))
    assert np.isnan(mt.Compression.bf16.decompress(wire, np.float32)[100])


def _grads(t):
    rng = np.random.default_rng(1000 * t + R)
    return rng.standard_normal(3000).astype(np.float32) * (R + 1)


@pytest.mark.parametrize("overlap", [True, False])
def test_average_matches_the_mean_of_the_rounded_gradients(overlap):
    p = mt.nn.Parameter(np.zeros(3000, np.float32))
    q = mt.nn.Parameter(np.zeros((40, 30), np.float32))
    opt = DistributedOptimizer(mt.optim.SGD([p, q], lr=0.0), [("p", p), ("q", q)],
                               compression=mt.Compression.bf16, overlap=overlap,
                               fusion_threshold_bytes=2048)
    for t in range(3):
        g, h = _grads(t), _grads(t + 10)[:1200].reshape(40, 30)
        p.grad[...] = g
        q.grad[...] = h
        if overlap:
            opt.backward_hook([q, p])
        opt.synchronize()
        for mine, got in ((g, p.grad), (h, q.grad)):
            rounded = mt.Compression.bf16.decompress(*mt.Compression.bf16.compress(mine))
            every = np.array(mt.allgather_object(rounded))               # (N, ...)
            ref = every.mean(axis=0)
            bound = (N + 1) * BF16_EPS * np.abs(every).sum(axis=0) / N + 1e-30
            assert got.dtype == np.float32
            assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)
            # every rank holds the same bits
            assert all(np.array_equal(got, o) for o in mt.allgather_object(got.copy()))
        opt.step()


def _train(compression, hook, steps=6, sharding="none"):
    model = mt.models.mlp(in_features=12, hidden=(32, 16), seed=0, dtype=np.float32)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               model.named_parameters(), compression=compression,
                               fusion_threshold_bytes=1024, sharding=sharding)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    losses = []
    for t in range(steps):
        rng = np.random.default_rng(100 * t + R)
        x = rng.standard_normal((8, 12)).astype(np.float32)
        y = rng.integers(0, 10, 8).astype(np.int64)
        opt.zero_grad()
        losses.append(float(loss_fn.forward(model.forward(x), y)))
        model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook if hook else None)
        opt.step()
    return model.state_dict(copy=True), losses


@pytest.mark.parametrize("hook", [True, False])
def test_training_with_bf16_matches_uncompressed(hook):
    reference, ref_losses = _train(mt.Compression.none, hook)
    got, losses = _train(mt.Compression.bf16, hook)
    for k in reference:
        assert np.allclose(got[k], reference[k], rtol=2e-2, atol=2e-3), k
    assert np.allclose(losses, ref_losses, rtol=2e-2)


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
def test_bf16_with_reduce_scattered_shards_is_refused(sharding):
    p = mt.nn.Parameter(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="bf16"):
        DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)],
                             compression=mt.Compression.bf16, sharding=sharding)


def test_bf16_with_sharded_optimizer_state_matches_uncompressed():
    got = _train(mt.Compression.bf16, True, sharding="optimizer")[0]
    reference = _train(mt.Compression.none, True, sharding="optimizer")[0]
    for k in reference:
        assert np.allclose(got[k], reference[k], rtol=2e-2, atol=2e-3), k
