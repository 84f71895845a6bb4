"""mpitrain.torch behaves as horovod.torch where Horovod's own test suite checks it: float16
scaling, the gradients of every collective, names in flight, Adasum and bad alltoall splits
refused with Horovod's exceptions, a fresh optimizer's state created by the broadcast, and the
grouped and sparse collectives. Each test fails on the behaviour it replaced. Runs as 1 process
and under mpiexec -n 2, 3, 4."""
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from mpitrain.comm import handles              # noqa: E402

F = 0.19152     # 65 x F: 12.4453125 rounded once from float32; 12.453125 with F as float16


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def N():
    return hvd.size()


def rounded_once(value, factor):
    """Horovod's float16 scaling: value x factor in float32, rounded to float16 once."""
    return (torch.tensor(value, dtype=torch.float16).float()
            * torch.tensor(factor, dtype=torch.float32)).half()


def only_rank0(value, shape=(3,)):
    """``value`` on rank 0, zeros elsewhere: every sum is exact, so only the scaling rounds."""
    return torch.full(shape, value if hvd.rank() == 0 else 0.0, dtype=torch.float16)


# --- float16 scale factors: float32 arithmetic, one rounding --------------------------------

def test_float16_factors_multiply_in_float32_and_round_once():
    pre = rounded_once(65.0, F)
    assert pre.item() == 12.4453125          # the float16-rounded factor gives 12.453125
    out = hvd.allreduce(only_rank0(65.0), op=hvd.Sum, prescale_factor=F)
    assert torch.equal(out, pre.expand(3))
    out = hvd.allreduce(only_rank0(65.0), op=hvd.Sum, postscale_factor=F)
    assert torch.equal(out, pre.expand(3))
    # the in-place and async forms, and Average's 1/N, scale the same way
    x = only_rank0(65.0)
    assert hvd.allreduce_(x, op=hvd.Sum, prescale_factor=F) is x
    assert torch.equal(x, pre.expand(3))
    h = hvd.allreduce_async(only_rank0(65.0), postscale_factor=F)
    assert torch.equal(hvd.synchronize(h), rounded_once(65.0, F / N()).expand(3))
    assert torch.equal(hvd.allreduce(only_rank0(65.0)), rounded_once(65.0, 1.0 / N()).expand(3))


def test_float16_factors_in_reducescatter_and_groups():
    out = hvd.reducescatter(only_rank0(65.0, (2 * N(), 2)), op=hvd.Sum, prescale_factor=F)
    assert torch.equal(out, rounded_once(65.0, F).expand(2, 2))
    out = hvd.reducescatter(only_rank0(65.0, (2 * N(),)), postscale_factor=F)      # Average
    assert torch.equal(out, rounded_once(65.0, F / N()).expand(2))
    # a group mixing float16 with float32: each scaled as its dtype is
    x32 = torch.full((2,), 65.0 if hvd.rank() == 0 else 0.0)
    half, single = hvd.grouped_allreduce([only_rank0(65.0), x32], op=hvd.Sum,
                                         postscale_factor=F)
    assert torch.equal(half, rounded_once(65.0, F).expand(3))
    assert torch.equal(single, torch.full((2,), np.float32(65.0) * np.float32(F)))


# --- gradients ------------------------------------------------------------------------------

def test_grouped_allreduce_is_differentiable():
    xs = [torch.ones(3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    for s in hvd.grouped_allreduce(xs, op=hvd.Sum):
        s.backward(torch.ones(3, dtype=torch.float64))
    assert all(torch.equal(x.grad, torch.full((3,), float(N()), dtype=torch.float64))
               for x in xs)
    ys = [torch.ones(3, requires_grad=True)]
    hvd.grouped_allreduce(ys)[0].sum().backward()                  # Average
    assert torch.equal(ys[0].grad, torch.ones(3))


@pytest.mark.parametrize("op, factor", [(hvd.Sum, "N"), (hvd.Average, 1)])
def test_reducescatter_is_differentiable(op, factor):
    """Horovod's gradient: the allgather of the blocks' gradients, times N for a Sum."""
    want = N() if factor == "N" else factor
    x = torch.ones(2 * N(), 3, dtype=torch.float64, requires_grad=True)
    hvd.reducescatter(x, op=op).backward(torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(x.grad, torch.full((2 * N(), 3), float(want), dtype=torch.float64))
    xs = [torch.ones(N(), requires_grad=True), torch.ones(2 * N(), requires_grad=True)]
    for out in hvd.grouped_reducescatter(xs, op=op, postscale_factor=0.5):
        out.backward(torch.ones_like(out))
    assert all(torch.equal(x.grad, torch.full_like(x, want * 0.5)) for x in xs)


def test_alltoall_is_differentiable():
    r = hvd.rank()
    x = torch.arange(N() * (r + 1), dtype=torch.float64).requires_grad_()
    out, received = hvd.alltoall(x, splits=torch.tensor([r + 1] * N(), dtype=torch.int32))
    assert not received.requires_grad
    weights = torch.arange(out.numel(), dtype=torch.float64)
    (out * weights).sum().backward()
    # each element's gradient is the weight its row met on the rank it went to
    sent = hvd.alltoall(weights, splits=received)[0]
    assert torch.equal(x.grad, sent)
    # equal splits of a different number of rows on every rank: the gradient goes back in
    # the rows each rank sent
    y = torch.arange(N() * (r + 1), dtype=torch.float64).requires_grad_()
    out = hvd.alltoall(y)
    (out * torch.arange(out.numel(), dtype=torch.float64)).sum().backward()
    assert torch.equal(y.grad, hvd.alltoall(torch.arange(out.numel(), dtype=torch.float64),
                                            splits=received)[0])


def test_grouped_allgather_gradient_averages():
    r = hvd.rank()
    xs = [torch.ones(r + 1, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    outs = hvd.grouped_allgather(xs)
    (outs[0] * (r + 1)).sum().backward(retain_graph=True)
    outs[1].sum().backward()
    mean = sum(range(1, N() + 1)) / N()            # the average of every rank's weight
    assert torch.allclose(xs[0].grad, torch.full((r + 1,), mean))
    assert torch.equal(xs[1].grad, torch.ones(2, 2))


# --- names in flight ------------------------------------------------------------------------

@pytest.mark.skipif(not handles.comm_thread_available(), reason="no comm thread")
def test_a_name_still_in_flight_is_a_value_error_at_the_call():
    gate = threading.Event()
    blocker = handles.submit(gate.wait, 60)    # holds the comm thread: what follows is pending
    try:
        first = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="twice")
        with pytest.raises(ValueError, match="'twice' is still in flight"):
            hvd.allreduce_async(torch.ones(2), name="twice")
        with pytest.raises(ValueError, match="in flight"):
            hvd.allgather_async(torch.ones(2), name="twice")
        with pytest.raises(ValueError, match="in flight"):
            hvd.broadcast_async(torch.ones(2), 0, name="twice")
        with pytest.raises(ValueError, match="in flight"):
            hvd.reducescatter_async(torch.ones(N()), name="twice")
    finally:
        gate.set()
    handles.synchronize(blocker)
    assert torch.equal(hvd.synchronize(first), torch.full((2,), float(N())))
    # finished, the name is free again
    again = hvd.synchronize(hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="twice"))
    assert torch.equal(again, torch.full((2,), float(N())))


# --- Horovod's exceptions -------------------------------------------------------------------

def test_adasum_reducescatter_is_a_runtime_error_on_every_rank():
    with pytest.raises(RuntimeError, match="Adasum is not supported"):
        hvd.reducescatter(torch.ones(N()), op=hvd.Adasum)
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.grouped_reducescatter([torch.ones(N())], op=hvd.Adasum)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N()      # still in step


def test_alltoall_refuses_floating_point_splits():
    # different values on every rank, as uninitialised memory has: the same ValueError
    with pytest.raises(ValueError, match="splits must be integers, got a float32 tensor"):
        hvd.alltoall(torch.ones(N()), torch.full((N(),), 0.5 + hvd.rank()))
    with pytest.raises(ValueError, match="splits must be integers, got float values"):
        hvd.alltoall(torch.ones(N()), [1.5 + hvd.rank()] + [1] * (N() - 1))
    out, received = hvd.alltoall(torch.ones(N()), torch.ones(N(), dtype=torch.int32))
    assert received.tolist() == [1] * N()


def test_horovod_internal_error_catches_a_collective_error():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    if N() == 1:
        pytest.skip("a mismatch needs two ranks")
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allreduce(torch.zeros(hvd.rank() + 1))


# --- broadcast_optimizer_state of a fresh optimizer -----------------------------------------

@pytest.mark.parametrize("distributed", [False, True])
def test_broadcast_state_creates_a_fresh_optimizers_state(distributed):
    torch.manual_seed(hvd.rank())
    frozen = torch.nn.Parameter(torch.tensor([1.0, 3.0]), requires_grad=False)
    weight = torch.nn.Parameter(torch.rand(4))
    hvd.broadcast_parameters([("weight", weight)], root_rank=0)
    before = weight.detach().clone()
    opt = torch.optim.SGD([frozen, weight], lr=0.1, momentum=0.9, weight_decay=0.01,
                          nesterov=True)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[("frozen", frozen),
                                                              ("weight", weight)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None                   # no gradient for what does not train
    assert torch.equal(weight.grad, torch.zeros(4))
    assert torch.equal(weight.detach(), before)  # the step that made the state moved nothing
    buf = opt.state[weight]["momentum_buffer"]
    assert torch.equal(hvd.broadcast(buf, root_rank=0), buf)


# --- the grouped and sparse collectives -----------------------------------------------------

def test_grouped_reducescatter_and_allgather_match_the_single_calls():
    r = hvd.rank()
    xs = [torch.arange(2 * N(), dtype=torch.float64) * (r + 1),
          torch.full((N() + 1, 2), float(r))]
    singles = [hvd.reducescatter(x, op=hvd.Sum) for x in xs]
    grouped = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="g")
    pending = hvd.synchronize(hvd.grouped_reducescatter_async(xs, op=hvd.Sum))
    assert all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(singles, grouped, pending))
    ys = [torch.full((r + 1, 2), float(r)), torch.arange(3) + r]
    singles = [hvd.allgather(y) for y in ys]
    handle = hvd.grouped_allgather_async(ys, name="g")
    assert all(torch.equal(a, b) for a, b in zip(singles, hvd.grouped_allgather(ys)))
    assert all(torch.equal(a, b) for a, b in zip(singles, hvd.synchronize(handle)))


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_sparse_allreduce_async_equals_the_dense_allreduce(op):
    torch.manual_seed(100 + hvd.rank())
    dense = torch.rand(12, 3)
    dense[dense < 0.7] = 0
    want = hvd.allreduce(dense, op=op)
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=op)
    got = handle()                                     # Horovod's spelling
    assert got.layout is torch.sparse_coo and got.shape == dense.shape
    torch.testing.assert_close(got.to_dense(), want, rtol=1e-6, atol=1e-6)
    assert hvd.synchronize(handle) is got
