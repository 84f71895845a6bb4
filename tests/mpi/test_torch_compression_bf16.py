"""mpitrain.torch's Compression.bf16: DistributedOptimizer's gradients travel as bfloat16 bits
(mt.Compression.bf16 in the buckets); a direct allreduce rounds the values to bfloat16.

Oracles: one process training on the global batch without compression (N ranks with batch b
each and an average are that process, up to bfloat16's precision); for a direct allreduce, the
float32 mean of every rank's tensor (gathered) to bfloat16's precision. Runs as 1 process and
under mpiexec -n 2, 3, 4.
"""
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402

B, STEPS = 4, 4


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def batch(step, ranks):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ranks * B, 12, generator=g), torch.randint(0, 5, (ranks * B,), generator=g)


def train(n, r, compression=None, overlap=True, ranks=None):
    """Rank r of n's shard of each global batch (of ``ranks`` ranks' samples, default n)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if compression is not None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression, overlap=overlap,
                                       fusion_threshold_bytes=1024)
    for step in range(STEPS):
        x, y = batch(step, n if ranks is None else ranks)
        x, y = x[r::n], y[r::n]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("overlap", [True, False])
def test_bf16_training_matches_one_process_uncompressed(overlap):
    n, r = hvd.size(), hvd.rank()
    got = train(n, r, hvd.Compression.bf16, overlap)
    reference = train(1, 0, ranks=n)
    torch.testing.assert_close(got, reference, rtol=2e-2, atol=2e-3)
    rows = hvd.allgather(got[None])
    assert all(torch.equal(rows[0], row) for row in rows)          # replicas agree bitwise


def test_allreduce_with_bf16_compression_rounds_to_bfloat16():
    n = hvd.size()
    t = torch.randn(1000, generator=torch.Generator().manual_seed(hvd.rank())) * 3
    out = hvd.allreduce(t, compression=hvd.Compression.bf16)
    assert out.dtype is torch.float32
    every = hvd.allgather(t[None]).to(torch.bfloat16).float()
    ref = every.mean(0)
    bound = (n + 1) * 2.0 ** -8 * every.abs().sum(0) / n + 1e-30
    assert bool(((out - ref).abs() <= bound).all())


def test_bf16_is_a_horovod_protocol_compressor():
    t = torch.tensor([1.0, float("nan"), 3.0e38, -0.0])
    wire, ctx = hvd.Compression.bf16.compress(t)
    assert wire.dtype is torch.bfloat16
    back = hvd.Compression.bf16.decompress(wire, ctx)
    assert back.dtype is torch.float32 and torch.isnan(back[1]) and back[0] == 1.0
    ints = torch.arange(3)
    assert hvd.Compression.bf16.compress(ints)[0] is ints
