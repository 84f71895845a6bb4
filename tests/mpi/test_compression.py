"""mt.Compression accepts any object with Horovod's compress/decompress protocol
(parallel/gradients.py).

Oracle: the same steps with mt.Compression.none. A user compressor that sends float64 gradients
as scaled float32 must give that result to float32 precision, call compress once per gradient
per step, and get its own ctx back in decompress.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()


class HorovodStyle:
    """Horovod's form: a class with static methods, passed as the class itself."""

    @staticmethod
    def compress(tensor):
        return (tensor * 4.0).astype(np.float32), ("scaled", tensor.dtype)

    @staticmethod
    def decompress(tensor, ctx):
        tag, dtype = ctx
        assert tag == "scaled"
        return (tensor / 4.0).astype(dtype)


class Counting:
    """An instance that counts its calls; sends a read-only float32 view (copied before use)."""

    def __init__(self):
        self.compressed = self.decompressed = 0

    def compress(self, array):
        self.compressed += 1
        wire = array.astype(np.float32)
        wire.flags.writeable = False
        return wire, array.shape

    def decompress(self, array, ctx):
        self.decompressed += 1
        assert array.shape == ctx and array.dtype == np.float32
        return array


class Identity:
    def compress(self, array):
        return array, None

    def decompress(self, array, ctx):
        return array


def _train(compression, steps=4, hook=True):
    model = mt.models.mlp(in_features=12, hidden=(10, 8), seed=0, dtype=np.float64)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model.named_parameters(), compression=compression)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(steps):
        rng = np.random.default_rng(100 * t + R)      # every rank its own batch
        x = rng.standard_normal((5, 12))                                   # (5, 12)
        y = rng.integers(0, 10, 5).astype(np.int64)                        # (5,)
        opt.zero_grad()
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook if hook else None)
        opt.step()
    return model.state_dict(copy=True), len(model.parameters())


def _close(a, b, rtol):
    return all(np.allclose(a[k], b[k], rtol=rtol, atol=rtol * 1e-3) for k in b)


@pytest.mark.parametrize("hook", [True, False])
def test_a_user_compressor_averages_like_none_to_its_precision(hook):
    reference, _ = _train(mt.Compression.none, hook=hook)
    got, _ = _train(HorovodStyle, hook=hook)
    assert _close(got, reference, rtol=1e-5)
    if N > 1:            # float32 on the wire really happened: not bitwise the float64 result
        assert any(not np.array_equal(got[k], reference[k]) for k in reference)
    exact, _ = _train(Identity(), hook=hook)
    assert all(np.array_equal(exact[k], reference[k]) for k in reference)


def test_compress_and_decompress_run_once_per_gradient_and_step():
    counting = Counting()
    got, n_params = _train(counting, steps=3)
    reference, _ = _train(mt.Compression.none, steps=3)
    assert _close(got, reference, rtol=1e-5)
    expected = 3 * n_params if N > 1 else 0          # one rank averages nothing
    assert counting.compressed == counting.decompressed == expected


def test_builtin_compressions_speak_the_protocol_too():
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    wire, ctx = mt.Compression.fp16.compress(x)
    assert wire.dtype == np.float16
    back = mt.Compression.fp16.decompress(wire, ctx)
    assert back.dtype == np.float32 and np.allclose(back, x, atol=1e-3)
    wire, ctx = mt.Compression.none.compress(x)
    assert wire is x and mt.Compression.none.decompress(wire, ctx) is x


class CompressOnly:
    def compress(self, array):
        return array, None


@pytest.mark.parametrize("bad", [CompressOnly(), "fp16", None, 3])
def test_an_object_without_the_protocol_is_a_clear_error(bad):
    model = mt.models.mlp(in_features=12, hidden=(10,), seed=0)
    with pytest.raises(ValueError, match="an object with compress\\(array\\) -> \\(array, ctx\\) "
                                         "and decompress\\(array, ctx\\)"):
        DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1), compression=bad)


def test_weights_mode_refuses_a_compressor():
    model = mt.models.mlp(in_features=12, hidden=(10,), seed=0)
    with pytest.raises(ValueError, match="average='weights' sends full-precision weights"):
        DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1), average="weights",
                             compression=HorovodStyle)


class WrongShape:
    def compress(self, array):
        return array, None

    def decompress(self, array, ctx):
        return array.reshape(-1)


class RankDependent:
    """Wire arrays whose length differs by rank: the ranks must learn it, not hang."""

    def compress(self, array):
        return np.array(array.reshape(-1)[:max(1, array.size - mt.rank())]), array.shape

    def decompress(self, array, ctx):
        return np.resize(array, ctx)


@pytest.mark.skipif(N == 1, reason="one rank sends nothing: nothing to decompress")
def test_decompress_of_the_wrong_shape_and_mismatched_wire_arrays_raise_on_every_rank():
    with pytest.raises(ValueError, match="decompress gave shape"):
        _train(WrongShape(), steps=1)
    with pytest.raises(mt.CollectiveError):
        _train(RankDependent(), steps=1)
    assert mt.allreduce(np.ones(2), op=mt.Sum)[0] == N      # the world is still usable
