"""mpitrain.tensorflow's collectives on tf.Tensors against a reference computed from every
rank's data (each rank regenerates the others' inputs from their seeds): every collective x
dtype x op, eagerly and inside a tf.function; DistributedGradientTape (one fused exchange,
None gradients, N ranks x batch b = 1 rank x batch N*b, fp16); process sets; the thread
budget; the error paths, raised on every rank. Runs as 1 process and under mpiexec -n 2, 3, 4."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import mpitrain as mt                            # noqa: E402
import mpitrain.tensorflow as hvd                # noqa: E402
from mpitrain import comm                        # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
MODES = ["eager", "function"]
SHAPE = (3, 4)


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def N():
    return hvd.size()


def data(r, dtype, shape=SHAPE, seed=0):
    """Rank r's input: small values, so integer sums and products never overflow."""
    rng = np.random.default_rng(1000 * seed + r)
    if dtype.is_floating:
        values = rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)
    else:
        values = rng.integers(-3, 4, shape)
    return tf.cast(tf.constant(values), dtype)


def as64(t):
    return tf.cast(t, tf.float64).numpy()


def reference(dtype, op, ranks=None, shape=SHAPE, seed=0):
    ranks = range(N()) if ranks is None else ranks
    rows = np.stack([as64(data(r, dtype, shape, seed)) for r in ranks])
    out = {hvd.Sum: rows.sum(0), hvd.Average: rows.sum(0) / len(rows), hvd.Min: rows.min(0),
           hvd.Max: rows.max(0), hvd.Product: rows.prod(0)}[op]
    return out if dtype.is_floating else np.trunc(out)


def tolerance(dtype):
    return {tf.float16: 2e-2, tf.bfloat16: 4e-2, tf.float32: 1e-5}.get(dtype, 1e-12)


def run(mode, fn, *args):
    if mode == "eager":
        return fn(*args)
    return tf.function(fn)(*args)


def check(out, dtype, expect):
    assert out.dtype == dtype
    got = as64(out)
    assert got.shape == expect.shape
    if dtype.is_floating:
        np.testing.assert_allclose(got, expect, rtol=tolerance(dtype), atol=tolerance(dtype))
    else:
        np.testing.assert_array_equal(got, expect)


CASES = [(d, op, m) for d in DTYPES for op in OPS for m in MODES]


@pytest.mark.parametrize("dtype, op, mode", CASES,
                         ids=[f"{d.name}-{o.value}-{m}" for d, o, m in CASES])
def test_allreduce_against_the_reference(dtype, op, mode):
    x = data(hvd.rank(), dtype)
    out = run(mode, lambda t: hvd.allreduce(t, op=op, name=f"tf.{dtype.name}.{op.value}"), x)
    check(out, dtype, reference(dtype, op))


@pytest.mark.parametrize("dtype, mode", [(d, m) for d in DTYPES for m in MODES])
def test_grouped_allreduce_and_scale_factors(dtype, mode):
    xs = [data(hvd.rank(), dtype, seed=s) for s in range(3)]
    outs = run(mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Sum), *xs)
    for s, out in enumerate(outs):
        check(out, dtype, reference(dtype, hvd.Sum, seed=s))
    if dtype.is_floating:
        out = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5,
                                                postscale_factor=4.0), xs[0])
        check(out, dtype, reference(dtype, hvd.Sum) * 2.0)
        out = run(mode, lambda t: hvd.allreduce(t, average=False,
                                                compression=hvd.Compression.fp16), xs[0])
        assert out.dtype == dtype
        np.testing.assert_allclose(as64(out), reference(dtype, hvd.Sum), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype, mode", [(d, m) for d in DTYPES for m in MODES])
def test_allgather_with_first_dims_that_differ(dtype, mode):
    rows = lambda r: r + 1                                      # noqa: E731
    x = data(hvd.rank(), dtype, shape=(rows(hvd.rank()), 2))
    out = run(mode, hvd.allgather, x)
    expect = np.concatenate([as64(data(r, dtype, shape=(rows(r), 2))) for r in range(N())])
    assert out.dtype == dtype
    np.testing.assert_array_equal(as64(out), expect)           # bits moved exactly


@pytest.mark.parametrize("dtype, mode", [(d, m) for d in DTYPES for m in MODES])
def test_broadcast_from_every_root(dtype, mode):
    for root in range(N()):
        out = run(mode, lambda t: hvd.broadcast(t, root), data(hvd.rank(), dtype))
        assert out.dtype == dtype
        np.testing.assert_array_equal(as64(out), as64(data(root, dtype)))


@pytest.mark.parametrize("dtype, op, mode", [(d, op, m) for d in DTYPES
                                             for op in (hvd.Sum, hvd.Average) for m in MODES])
def test_reducescatter_gives_each_rank_its_block(dtype, op, mode):
    shape = (N() + 1, 3)
    out = run(mode, lambda t: hvd.reducescatter(t, op=op), data(hvd.rank(), dtype, shape))
    full = reference(dtype, op, shape=shape)
    bounds = np.cumsum([0] + [shape[0] // N() + (1 if r < shape[0] % N() else 0)
                              for r in range(N())])
    r = hvd.rank()
    check(out, dtype, full[bounds[r]:bounds[r + 1]])


@pytest.mark.parametrize("dtype, mode", [(d, m) for d in DTYPES for m in MODES])
def test_alltoall_with_and_without_splits(dtype, mode):
    r, n = hvd.rank(), N()
    x = data(r, dtype, shape=(2 * n, 2))
    out, received = run(mode, hvd.alltoall, x)
    expect = np.concatenate([as64(data(j, dtype, shape=(2 * n, 2)))[2 * r:2 * r + 2]
                             for j in range(n)])
    np.testing.assert_array_equal(as64(out), expect)
    assert received.numpy().tolist() == [2] * n
    splits = [1 + (j % 2) for j in range(n)]                   # rank j gets 1 or 2 rows
    y = data(r, dtype, shape=(sum(splits), 2))
    out, received = run(mode, lambda t, s: hvd.alltoall(t, s), y, tf.constant(splits))
    start = sum(splits[:r])
    expect = np.concatenate([as64(data(j, dtype, shape=(sum(splits), 2)))
                             [start:start + splits[r]] for j in range(n)])
    assert out.dtype == dtype and received.dtype == tf.int32
    np.testing.assert_array_equal(as64(out), expect)
    assert received.numpy().tolist() == [splits[r]] * n


def test_objects_barrier_join_and_variables():
    assert hvd.broadcast_object({"r": hvd.rank()}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(hvd.rank()) == list(range(N()))
    hvd.barrier()
    assert 0 <= hvd.join() < N()
    v = [tf.Variable(data(hvd.rank(), tf.float32)), tf.Variable(hvd.rank(), dtype=tf.int64)]
    hvd.broadcast_variables(v, root_rank=0)
    np.testing.assert_array_equal(v[0].numpy(), data(0, tf.float32).numpy())
    assert int(v[1].numpy()) == 0
    w = tf.Variable(data(hvd.rank(), tf.float64))

    @tf.function
    def assign():
        hvd.broadcast_variables([w], root_rank=N() - 1)
    assign()
    np.testing.assert_array_equal(w.numpy(), data(N() - 1, tf.float64).numpy())


def test_names_and_queries():
    assert hvd.rank() == mt.rank() and hvd.size() == mt.size()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert hvd.cross_size() >= 1 and 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.mpi_built()
    assert hvd.is_homogeneous() in (True, False)
    assert hvd.CollectiveError is comm.CollectiveError


def test_tensorflow_gets_the_thread_budget():
    """The test environment exports OMP_NUM_THREADS=1: TensorFlow's pools follow it."""
    from mpitrain.runtime import threads
    threading = tf.config.threading
    n = threads.resolve(threads.from_env())
    assert threading.get_intra_op_parallelism_threads() == n
    assert threading.get_inter_op_parallelism_threads() == n


def test_process_set_of_the_even_ranks():
    evens = hvd.add_process_set(list(range(0, N(), 2)))
    try:
        if hvd.rank() % 2 == 0:
            for mode in MODES:
                out = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=evens),
                          data(hvd.rank(), tf.float64))
                check(out, tf.float64, reference(tf.float64, hvd.Sum,
                                                 ranks=range(0, N(), 2)))
        else:
            with pytest.raises(ValueError):
                hvd.allreduce(data(hvd.rank(), tf.float64), process_set=evens)
    finally:
        hvd.remove_process_set(evens)


# --- DistributedGradientTape ------------------------------------------------------------------

def _weights():
    rng = np.random.default_rng(7)
    return [tf.Variable(rng.normal(size=(5, 3)), dtype=tf.float32),
            tf.Variable(rng.normal(size=(3,)), dtype=tf.float32)]


def _batch(n, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    return x, (x[:, :3] * 2.0 - 1.0).astype(np.float32)


def _loss(ws, x, y):
    return tf.reduce_mean((tf.tanh(x @ ws[0] + ws[1]) - y) ** 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_tape_on_n_ranks_equals_one_rank_on_the_global_batch(mode, compression):
    b, steps, lr = 4, 3, 0.1
    x, y = _batch(N() * b * steps)
    local, ref = _weights(), _weights()
    unused = tf.Variable(1.0)
    comp = getattr(hvd.Compression, compression)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = _loss(local, xb, yb)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, local + [unused])
        assert grads[-1] is None                             # stays None, sent by no rank
        for w, g in zip(local, grads):
            w.assign_sub(lr * g)
    step = step if mode == "eager" else tf.function(step)
    r = hvd.rank()
    for s in range(steps):
        g0 = s * N() * b
        step(tf.constant(x[g0 + r * b:g0 + (r + 1) * b]), tf.constant(y[g0 + r * b:g0 + (r + 1) * b]))
        with tf.GradientTape() as tape:                      # 1 rank x batch N*b
            loss = _loss(ref, x[g0:g0 + N() * b], y[g0:g0 + N() * b])
        for w, g in zip(ref, tape.gradient(loss, ref)):
            w.assign_sub(lr * g)
    tol = 1e-5 if compression == "none" else 3e-3
    for a, e in zip(local, ref):
        np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=tol, atol=tol)
    gathered = hvd.allgather(tf.reshape(local[0], (1, -1))).numpy()
    assert (gathered == gathered[0]).all()                    # the replicas bitwise equal


@pytest.mark.parametrize("mode", MODES)
def test_tape_is_one_fused_exchange_and_predivides(mode, monkeypatch):
    calls = []
    grouped, single = comm.grouped_allreduce, comm.allreduce
    monkeypatch.setattr(comm, "grouped_allreduce",
                        lambda *a, **k: calls.append("grouped") or grouped(*a, **k))
    monkeypatch.setattr(comm, "allreduce", lambda *a, **k: calls.append("one") or single(*a, **k))
    ws = [tf.Variable(tf.fill((4,), float(hvd.rank() + 1))) for _ in range(6)]

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(w * w) for w in ws])
        return hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0).gradient(loss, ws)
    out = grads() if mode == "eager" else tf.function(grads)()
    assert calls == ["grouped"]                                # one host round trip
    mean = np.mean([2.0 * (r + 1) for r in range(N())])
    for g in out:
        np.testing.assert_allclose(g.numpy(), np.full(4, mean), rtol=1e-6)


def test_indexed_slices_are_made_dense():
    table = tf.Variable(tf.ones((6, 2)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [hvd.rank() % 6]))
    [g] = hvd.DistributedGradientTape(tape).gradient(loss, [table])
    assert isinstance(g, tf.Tensor)
    expect = np.zeros((6, 2))
    for r in range(N()):
        expect[r % 6] += 1.0 / N()
    np.testing.assert_allclose(g.numpy(), expect, rtol=1e-6)


# --- errors, on every rank --------------------------------------------------------------------

def test_a_shape_mismatch_is_a_collective_error_on_every_rank():
    if N() == 1:
        pytest.skip("needs two ranks")
    x = tf.zeros((2 + (hvd.rank() == 0),))
    with pytest.raises(hvd.CollectiveError):
        hvd.allreduce(x)
    with pytest.raises(tf.errors.UnknownError, match="CollectiveError"):
        tf.function(lambda t: hvd.allreduce(t))(x)
    hvd.barrier()                                              # the communicator still works


def test_a_dtype_mismatch_and_none_on_some_ranks_raise_everywhere():
    if N() == 1:
        pytest.skip("needs two ranks")
    x = tf.zeros((3,), tf.float32 if hvd.rank() else tf.float64)
    with pytest.raises(hvd.CollectiveError):
        hvd.allreduce(x)
    v = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = v * 2.0 if hvd.rank() else tf.constant(0.0)
    with pytest.raises(hvd.CollectiveError):
        hvd.DistributedGradientTape(tape).gradient(loss, [v])


def test_unsupported_inputs_raise_the_same_error_everywhere():
    with pytest.raises(TypeError, match="dtype complex64 is not supported"):
        hvd.allreduce(tf.zeros((2,), tf.complex64))
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(tf.zeros((2,)), average=True, op=hvd.Sum)
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.allreduce(tf.zeros((2,)), op=hvd.Adasum)
    if N() > 1:
        bad = tf.zeros((2,), tf.complex64 if hvd.rank() == 0 else tf.float32)
        with pytest.raises(hvd.CollectiveError):
            hvd.allreduce(bad)


def test_jit_compile_is_one_clear_error():
    f = tf.function(lambda t: hvd.allreduce(t), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="mpitrain_allreduce_needs_jit_compile_False"):
        f(tf.zeros((2,)))
