"""mpitrain.keras on a small model under model.fit: DistributedOptimizer (N ranks x batch b =
1 rank x batch N*b, with backward_passes_per_step=2 and fp16 compression), the broadcast of
differing initial weights (bitwise equal replicas after the first batch), MetricAverageCallback
against a hand mean, the warm-up against Horovod's formula, load_model and the error paths on
every rank. Runs as 1 process and under mpiexec -n 2, 3, 4."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import mpitrain.keras as hvd                     # noqa: E402
import mpitrain.tensorflow.keras as hvd_alias    # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def N():
    return hvd.size()


def model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(1)])


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, np.sin(x.sum(1, keepdims=True)).astype(np.float32)


def shard(x, b):
    """This rank's rows of each global batch of N*b rows, in order."""
    r, n = hvd.rank(), N()
    idx = [i for start in range(0, len(x), n * b) for i in range(start + r * b,
                                                                 start + (r + 1) * b)]
    return x[idx]


def flat(m):
    return np.concatenate([w.reshape(-1) for w in m.get_weights()])


def same_on_every_rank(values):
    rows = hvd.allgather_object(np.asarray(values).tobytes())
    return all(row == rows[0] for row in rows)


def test_the_alias_and_the_names():
    assert hvd_alias is hvd
    assert hvd.size() >= 1 and callable(hvd.DistributedOptimizer)


@pytest.mark.parametrize("passes, compression", [(1, "none"), (2, "none"), (1, "fp16")])
def test_fit_on_n_ranks_equals_one_rank_on_the_global_batch(passes, compression):
    b, steps = 4, 4
    x, y = data(N() * b * passes * steps)
    ref = model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    ref.fit(x, y, batch_size=N() * b * passes, shuffle=False, epochs=1, verbose=0)

    dist = model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                   backward_passes_per_step=passes,
                                   average_aggregated_gradients=True,
                                   compression=getattr(hvd.Compression, compression))
    assert isinstance(opt, keras.optimizers.SGD)
    dist.compile(optimizer=opt, loss="mse")
    dist.fit(shard(x, b), shard(y, b), batch_size=b, shuffle=False, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == steps
    tol = 1e-5 if compression == "none" else 3e-3
    np.testing.assert_allclose(flat(dist), flat(ref), rtol=tol, atol=tol)
    assert same_on_every_rank(flat(dist))


def test_broadcast_callback_makes_differing_weights_equal_after_the_first_batch():
    x, y = data(8 * 3, seed=hvd.rank())
    m = model(seed=100 + hvd.rank())                          # each rank its own weights
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(same_on_every_rank(np.concatenate(
                [flat(m)] + [np.asarray(v).reshape(-1) for v in m.optimizer.variables])))
    m.fit(x, y, batch_size=8, shuffle=False, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Record()])
    assert seen == [True] * 3


def test_metric_average_against_a_hand_mean():
    x, y = data(16 * N(), seed=10 + hvd.rank())
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse",
              metrics=["mae"])
    local = {}

    class Before(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            local.update(logs)
    history = m.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y),
                    callbacks=[Before(), hvd.callbacks.MetricAverageCallback()])
    assert {"loss", "mae", "val_loss", "val_mae"} <= set(local)
    every = hvd.allgather_object(local)
    for key in local:
        expect = np.mean([float(d[key]) for d in every])
        assert history.history[key][0] == pytest.approx(expect, rel=1e-12)


def test_warmup_follows_horovods_formula():
    steps, epochs, lr0 = 3, 3, 0.2
    x, y = data(4 * steps)
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr0, momentum=0.9)),
              loss="mse")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(keras.ops.convert_to_numpy(m.optimizer.learning_rate)))
    m.fit(x, y, batch_size=4, shuffle=False, epochs=epochs, verbose=0,
          callbacks=[hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=2,
                                                               verbose=0), Record()])
    n = N()
    expect = []
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch < 2:
                e = epoch + batch / steps + 1.0 / steps
                expect.append(lr0 / n * (e * (n - 1) / 2 + 1))
            else:
                expect.append(expect[-1])
    np.testing.assert_allclose(seen, expect, rtol=1e-6)
    assert m.optimizer.momentum == pytest.approx(0.9)          # restored after each batch


def test_load_model_wraps_the_saved_optimizer(tmp_path):
    path = str(tmp_path / f"m{hvd.rank()}.keras")
    x, y = data(8 * N())
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    m.fit(shard(x, 8), shard(y, 8), batch_size=8, verbose=0)
    m.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert int(loaded.optimizer.iterations.numpy()) == 1       # its state as saved
    calls = []
    from mpitrain import comm
    real = comm.grouped_allreduce

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    comm.grouped_allreduce = spy
    try:
        loaded.fit(shard(x, 8), shard(y, 8), batch_size=8, verbose=0)
    finally:
        comm.grouped_allreduce = real
    assert calls == [1]                                        # the loaded one averages
    assert same_on_every_rank(flat(loaded))


def test_bad_arguments_raise_on_every_rank():
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="op must be Average or Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Max)
    with pytest.raises(TypeError, match="expected a Keras optimizer"):
        hvd.DistributedOptimizer(object())
    if N() > 1:
        with pytest.raises(hvd.CollectiveError):               # only rank 0 refuses
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                     backward_passes_per_step=0 if hvd.rank() == 0 else 1)
            hvd.allreduce(tf.zeros(1))
