"""mpitrain.torch's collectives on torch.Tensors against a reference computed from every rank's
data (each rank regenerates the others' inputs from their seeds): every dtype x op x form
(out of place, in place, async, async in place), the data movers, process sets, autograd, join
and the error paths, raised on every rank. Runs as 1 process and under mpiexec -n 2, 3, 4."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpitrain as mt                          # noqa: E402
import mpitrain.torch as hvd                   # noqa: E402
from mpitrain.runtime import threads as thread_budget   # noqa: E402

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int32, torch.int64, torch.uint8]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
SHAPE = (3, 5)


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def N():
    return hvd.size()


def data(r, dtype, shape=SHAPE, seed=0):
    """Rank r's input: small values, so integer sums and products never overflow."""
    rng = np.random.default_rng(1000 * seed + r)
    if dtype is torch.bool:
        return torch.from_numpy(rng.integers(0, 2, shape).astype(bool))
    if dtype.is_floating_point:
        values = rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)
        return torch.from_numpy(values).to(dtype)
    return torch.from_numpy(rng.integers(0, 4, shape)).to(dtype)


def reference(dtype, op, ranks=None, shape=SHAPE, seed=0, pre=1.0, post=1.0):
    ranks = range(N()) if ranks is None else ranks
    rows = np.stack([data(r, dtype, shape, seed).to(torch.float64).numpy() * pre
                     for r in ranks])
    reduced = {hvd.Sum: rows.sum(0), hvd.Average: rows.sum(0) / len(rows), hvd.Min: rows.min(0),
               hvd.Max: rows.max(0), hvd.Product: rows.prod(0)}[op] * post
    if not dtype.is_floating_point:
        reduced = np.trunc(reduced)        # integer Average: the sum times 1/N, truncated
    return torch.from_numpy(reduced)


def tolerance(dtype):
    return {torch.float16: 2e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5}.get(dtype, 1e-12)


def assert_reduced(out, dtype, op, **kw):
    assert out.dtype is dtype and out.device.type == "cpu"
    expect = reference(dtype, op, **kw)
    if dtype.is_floating_point:
        torch.testing.assert_close(out.to(torch.float64), expect.to(dtype).to(torch.float64),
                                   rtol=tolerance(dtype), atol=tolerance(dtype))
    else:
        assert torch.equal(out, expect.to(dtype)), (out, expect)


CASES = ([(d, op) for d in FLOATS + INTS for op in OPS]
         + [(torch.bool, op) for op in (hvd.Min, hvd.Max, hvd.Product)])


@pytest.mark.parametrize("dtype, op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_allreduce_every_form_against_the_reference(dtype, op):
    r = hvd.rank()
    x = data(r, dtype)
    before = x.clone()
    out = hvd.allreduce(x, op=op, name=f"t.{dtype}.{op.value}")
    assert_reduced(out, dtype, op)
    assert torch.equal(x, before)                                   # input untouched

    y = data(r, dtype)
    assert hvd.allreduce_(y, op=op) is y                            # the same object
    assert_reduced(y, dtype, op)

    h = hvd.allreduce_async(data(r, dtype), op=op)
    assert_reduced(hvd.synchronize(h), dtype, op)
    assert hvd.poll(h)

    z = data(r, dtype)
    h = hvd.allreduce_async_(z, op=op)
    assert hvd.synchronize(h) is z
    assert_reduced(z, dtype, op)


def test_all_ranks_hold_identical_bits():
    out = hvd.allreduce(data(hvd.rank(), torch.float32, (1000,)), op=hvd.Sum)
    gathered = hvd.allgather(out.view(1, -1))
    assert all(torch.equal(gathered[0].view(torch.int32), g.view(torch.int32))
               for g in gathered)


def test_scale_factors_and_average_flag():
    x = data(hvd.rank(), torch.float64)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert_reduced(out, torch.float64, hvd.Sum, pre=0.5, post=3.0)
    assert_reduced(hvd.allreduce(x, average=False), torch.float64, hvd.Sum)
    assert_reduced(hvd.allreduce(x, average=True), torch.float64, hvd.Average)
    assert_reduced(hvd.allreduce(x), torch.float64, hvd.Average)     # the default


def test_fp16_compression_returns_the_input_dtype():
    x = data(hvd.rank(), torch.float32)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, reference(torch.float32, hvd.Sum).float(), rtol=2e-3,
                               atol=2e-3)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_grouped_allreduce_mixed_dtypes(in_place, asynchronous):
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float32]
    xs = [data(hvd.rank(), d, (i + 2, 3), seed=i) for i, d in enumerate(dtypes)]
    call = {(False, False): hvd.grouped_allreduce, (True, False): hvd.grouped_allreduce_,
            (False, True): hvd.grouped_allreduce_async,
            (True, True): hvd.grouped_allreduce_async_}[in_place, asynchronous]
    out = call(xs, op=hvd.Sum)
    if asynchronous:
        out = hvd.synchronize(out)
    for i, (d, t) in enumerate(zip(dtypes, out)):
        assert (t is xs[i]) == in_place
        assert_reduced(t, d, hvd.Sum, shape=(i + 2, 3), seed=i)


def test_grouped_allreduce_of_integers_averages_like_allreduce():
    xs = [data(hvd.rank(), torch.int64, (4,), seed=i) for i in range(3)]
    for i, t in enumerate(hvd.grouped_allreduce(xs)):
        assert_reduced(t, torch.int64, hvd.Average, shape=(4,), seed=i)


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool, torch.int16])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_allgather_concatenates_uneven_first_dims_bitwise(dtype, asynchronous):
    mine = data(hvd.rank(), dtype, (hvd.rank() + 1, 2))
    out = (hvd.synchronize(hvd.allgather_async(mine)) if asynchronous
           else hvd.allgather(mine))
    expect = torch.cat([data(r, dtype, (r + 1, 2)) for r in range(N())])
    assert out.dtype is dtype and torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_broadcast_from_every_root(dtype):
    for root in range(N()):
        x = data(hvd.rank(), dtype)
        before = x.clone()
        out = hvd.broadcast(x, root_rank=root)
        assert torch.equal(out, data(root, dtype)) and torch.equal(x, before)
        assert hvd.broadcast_(x, root) is x and torch.equal(x, data(root, dtype))
        y = data(hvd.rank(), dtype)
        assert hvd.synchronize(hvd.broadcast_async_(y, root)) is y
        assert torch.equal(y, data(root, dtype))
        assert torch.equal(hvd.synchronize(hvd.broadcast_async(x, root)), data(root, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_reducescatter_gives_each_rank_its_block(dtype, op):
    rows = 2 * N() + 1
    out = hvd.reducescatter(data(hvd.rank(), dtype, (rows, 3)), op=op)
    full = reference(dtype, op, shape=(rows, 3)).to(dtype)
    sizes = [rows // N() + (1 if r < rows % N() else 0) for r in range(N())]
    start = sum(sizes[:hvd.rank()])
    expect = full[start:start + sizes[hvd.rank()]]
    assert out.dtype is dtype
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    h = hvd.reducescatter_async(data(hvd.rank(), dtype, (rows, 3)), op=op)
    torch.testing.assert_close(hvd.synchronize(h), expect, rtol=1e-5, atol=1e-5)


def test_alltoall_with_and_without_splits():
    r, n = hvd.rank(), N()
    # rank r sends j + 1 rows to rank j, each row filled with 10 * r + j
    splits = [j + 1 for j in range(n)]
    x = torch.cat([torch.full((j + 1, 2), 10.0 * r + j) for j in range(n)])
    out, received = hvd.alltoall(x, splits=torch.tensor(splits))
    assert received.dtype is torch.int32 and received.tolist() == [r + 1] * n
    expect = torch.cat([torch.full((r + 1, 2), 10.0 * s + r) for s in range(n)])
    assert torch.equal(out, expect)
    even = torch.arange(2 * n, dtype=torch.int64) + 100 * r
    got = hvd.synchronize(hvd.alltoall_async(even))
    assert torch.equal(got, torch.tensor([100 * s + 2 * r + k for s in range(n)
                                          for k in range(2)]))
    b = torch.tensor([True, False] * n)
    assert torch.equal(hvd.alltoall(b), torch.tensor([True, False] * n))


def test_process_set_reduces_over_its_ranks_only():
    members = list(range(0, N(), 2))
    ps = hvd.add_process_set(members)
    try:
        x = data(hvd.rank(), torch.float64)
        if hvd.rank() in members:
            assert_reduced(hvd.allreduce(x, op=hvd.Sum, process_set=ps), torch.float64,
                           hvd.Sum, ranks=members)
            out = hvd.allgather(torch.tensor([hvd.rank()]), process_set=ps)
            assert out.tolist() == members
            assert torch.equal(hvd.broadcast(x, members[-1], process_set=ps),
                               data(members[-1], torch.float64))
        else:
            with pytest.raises(ValueError):
                hvd.allreduce(x, process_set=ps)
    finally:
        hvd.remove_process_set(ps)


def test_allreduce_is_differentiable():
    x = data(hvd.rank(), torch.float64).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * 2).sum().backward()
    assert torch.equal(x.grad, torch.full(SHAPE, 2.0 * N(), dtype=torch.float64))
    x.grad = None
    hvd.allreduce(x).sum().backward()                   # Average's gradient: the average
    torch.testing.assert_close(x.grad, torch.ones(SHAPE, dtype=torch.float64))


def test_allgather_and_broadcast_are_differentiable():
    r = hvd.rank()
    x = torch.ones(r + 1, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.arange(sum(range(1, N() + 1)) * 2, dtype=torch.float64).view(-1, 2)
    (hvd.allgather(x) * weights).sum().backward()
    start = sum(range(1, r + 1))
    # every rank's loss has the same weights: their average over ranks is the weights
    # (Horovod's allgather gradient averages; a sum would give N times them)
    assert torch.equal(x.grad, weights[start:start + r + 1])
    z = torch.ones(3, dtype=torch.float64, requires_grad=True)
    hvd.broadcast(z, root_rank=0).sum().backward()
    assert torch.equal(z.grad, torch.ones(3, dtype=torch.float64) * (r == 0))


def test_join_serves_the_active_ranks_with_zeros():
    r, n = hvd.rank(), N()
    for k in range(r + 1):                   # rank r runs out of data after r + 1 batches
        out = hvd.allreduce(torch.tensor([1.0, float(k)]), op=hvd.Sum, name="batch")
        active = n - min(k, n)               # ranks still in batch k: r >= k
        assert out.tolist() == [float(active), float(k * active)]
    assert hvd.join() == n - 1               # the last rank joined last


def test_objects_and_barrier():
    assert hvd.broadcast_object({"rank": hvd.rank()}, root_rank=N() - 1) == {"rank": N() - 1}
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", r) for r in range(N())]
    hvd.barrier()


def test_mismatched_shapes_are_a_collective_error_on_every_rank():
    x = torch.zeros(hvd.rank() + 2)
    if N() == 1:
        pytest.skip("a mismatch needs two ranks")
    with pytest.raises(hvd.CollectiveError, match="shape"):
        hvd.allreduce(x)
    with pytest.raises(hvd.CollectiveError):
        hvd.synchronize(hvd.allreduce_async(x))
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [N(), N()]   # still usable


def test_a_bad_tensor_on_one_rank_raises_on_every_rank():
    x = torch.zeros(4, 3)
    bad = x.t() if hvd.rank() == 0 else x.t().contiguous()
    expected = ValueError if N() == 1 else hvd.CollectiveError
    with pytest.raises(expected, match="contiguous"):
        hvd.allreduce(bad)
    with pytest.raises(expected, match="contiguous"):
        hvd.broadcast_(bad, 0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N()


def test_the_same_bad_argument_everywhere_is_the_same_error_everywhere():
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce(np.zeros(3))
    with pytest.raises(TypeError, match="dtype"):
        hvd.allgather(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="not contiguous"):
        hvd.allreduce_(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool), op=hvd.Sum)
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(TypeError, match="list of tensors"):
        hvd.grouped_allreduce_(torch.ones(2))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N()


def test_init_gives_torch_the_thread_budget():
    budget = thread_budget.resolve(thread_budget.from_env(), mt.local_size())
    assert torch.get_num_threads() == budget
    hvd.init(threads=1)
    assert torch.get_num_threads() == 1
    hvd.init()
    assert torch.get_num_threads() == budget


def test_job_questions():
    assert (hvd.rank(), hvd.size()) == (mt.rank(), mt.size())
    assert hvd.is_initialized() and hvd.mpi_built() and hvd.mpi_enabled()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert isinstance(hvd.is_homogeneous(), bool)
    assert not hvd.gloo_built()
