"""What must match across ranks beyond the comm layer's own checks, for mpitrain.torch: the
torch dtypes that travel as another dtype (bfloat16, bool) and the optimizer class of
``broadcast_optimizer_state``. A difference is a CollectiveError on every rank, before anything
is reduced or loaded. Runs as 1 process and under mpiexec -n 2, 3, 4."""
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def N():
    return hvd.size()


def rank0_differs(dtype, others):
    return torch.ones(N(), dtype=dtype if hvd.rank() == 0 else others)


@pytest.mark.parametrize("dtype, others", [(torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.int16),
                                           (torch.bool, torch.uint8)])
def test_a_disguised_dtype_against_its_carrier_is_a_collective_error(dtype, others):
    if N() == 1:
        pytest.skip("a mismatch needs two ranks")
    if dtype is not torch.bool:
        with pytest.raises(hvd.CollectiveError, match="dtype"):
            hvd.allreduce(rank0_differs(dtype, others))
        with pytest.raises(hvd.CollectiveError, match="dtype"):
            hvd.grouped_allreduce([torch.ones(2), rank0_differs(dtype, others)])
        with pytest.raises(hvd.CollectiveError, match="dtype"):
            hvd.synchronize(hvd.reducescatter_async(rank0_differs(dtype, others)))
    with pytest.raises(hvd.CollectiveError, match="dtype"):
        hvd.allgather(rank0_differs(dtype, others))
    with pytest.raises(hvd.CollectiveError, match="dtype"):
        hvd.broadcast_(rank0_differs(dtype, others), 0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N()      # still in step


def test_the_same_disguised_dtype_everywhere_still_works():
    out = hvd.allreduce(torch.ones(3, dtype=torch.bfloat16), op=hvd.Sum)
    assert out.dtype is torch.bfloat16 and out.tolist() == [N()] * 3
    flags = hvd.allgather(torch.tensor([hvd.rank() % 2 == 0]))
    assert flags.tolist() == [r % 2 == 0 for r in range(N())]


def test_broadcast_optimizer_state_into_another_class_is_a_collective_error():
    w = torch.nn.Parameter(torch.ones(3))
    if hvd.rank() == 0:
        opt = torch.optim.Adam([w], lr=0.1)
    else:
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    if N() == 1:
        hvd.broadcast_optimizer_state(opt, root_rank=0)     # one rank: nothing to differ
        assert opt.state[w]["step"].item() == 1
        return
    with pytest.raises(hvd.CollectiveError, match="torch.optim.adam.Adam"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    if hvd.rank() != 0:
        assert opt.param_groups[0]["momentum"] == 0.9       # nothing was loaded
    # the same class wrapped or not agrees
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    if hvd.rank() == 1:
        sgd = hvd.DistributedOptimizer(sgd, named_parameters=[("w", w)])
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    assert "momentum_buffer" in sgd.state[w]


def test_a_joined_rank_passes_the_dtype_check_and_serves_the_reduction():
    last = N() - 1
    if hvd.rank() == last:
        hvd.join()                           # joins first: it serves the others' reduction
        return
    out = hvd.allreduce(torch.ones(2, dtype=torch.bfloat16), op=hvd.Sum)
    assert out.dtype is torch.bfloat16 and out.tolist() == [N() - 1] * 2    # its zeros
    hvd.join()
