"""mpitrain.torch on CUDA tensors: the collectives and DistributedOptimizer through the device
path (torch's stream synchronised, then NCCL / CUDA-aware MPI / staging), against the same calls
on CPU tensors as oracle. The "cpu" cases run anywhere (they check the test itself); the "cuda"
ones skip without torch's CUDA. The GPU check runs this folder on 1 and 2 ranks."""
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd  # noqa: E402

pytestmark = pytest.mark.gpu
hvd.init()


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return request.param


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed + 17 * hvd.rank())
    return (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
def test_allreduce_on_the_device_matches_the_host(device, dtype, op):
    if dtype is torch.int32 and op is hvd.Average:
        pytest.skip("an integer Average truncates; covered by tests/mpi")
    x = _tensor((1000, 3), dtype, seed=1)
    want = hvd.allreduce(x, op=op)                                   # the CPU oracle
    on = x.to(device)
    got = hvd.allreduce(on, op=op)
    assert got.device.type == device and got.dtype == dtype
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    same = hvd.allreduce_(on, op=op)
    assert same is on
    torch.testing.assert_close(on.cpu().float(), want.float(), rtol=tol, atol=tol)


def test_broadcast_and_allgather_on_the_device(device):
    x = _tensor((5, 4), torch.float32, seed=2).to(device)
    root = hvd.broadcast(x, root_rank=0)
    torch.testing.assert_close(root.cpu(), hvd.broadcast(x.cpu(), root_rank=0))
    gathered = hvd.allgather(x)
    assert gathered.shape == (5 * hvd.size(), 4) and gathered.device.type == device
    torch.testing.assert_close(gathered.cpu(), hvd.allgather(x.cpu()))


def _train(device, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        x = torch.randn(8, 1, 8, 8, generator=g).to(device)
        y = torch.randint(0, 10, (8,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_distributed_optimizer_on_the_device_trains_as_on_the_host(device):
    got, want = _train(device), _train("cpu")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a in got:                                  # the replicas are one model
        every = hvd.allgather(a.reshape(1, -1))
        assert all(torch.equal(every[0], every[r]) for r in range(hvd.size()))
