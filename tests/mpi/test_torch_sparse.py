"""Sparse gradients in mpitrain.torch.DistributedOptimizer (mpitrain/torch/sparse.py):
``nn.Embedding(sparse=True)`` with ``sparse_as_dense=False`` (Horovod's default) is averaged by
allgather of its rows. The gradients here are sums of small integers, so every path's sum is
exact: the gathered average must be the dense average's bits (hvd.allreduce of the same
gradients, and ``sparse_as_dense=True``), at every N; with one or two passes per step; with a
rank that did not use the table; for a model mixing sparse and dense parameters, which must
also end where one process with the global batch does. Errors are raised on every rank.
Runs as 1 process and under mpiexec -n 2, 3, 4."""
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from mpi4py import MPI                         # noqa: E402
from torch import nn                           # noqa: E402

V, D, L = 12, 4, 6          # table rows, width, indices per rank and pass
N = MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


def table(seed=0):
    """A sparse-gradient table of small integers (so that SGD's updates are exact too)."""
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(V, D, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.randint(-8, 9, (V, D), generator=g).float())
    return emb


def linear():
    torch.manual_seed(1)
    return nn.Linear(D, 1)


def pass_input(rank, step, used=True):
    """Rank ``rank``'s indices (with repeats) and integer weights for one pass; no indices
    where ``used`` is False."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = L if used else 0
    return (torch.randint(0, V, (n,), generator=g),
            torch.randint(-4, 5, (n, D), generator=g).float())


def loss_of(emb, idx, w):
    return (emb(idx) * w).sum()


def dense_grad(idx, w):
    """The table's gradient of ``loss_of``, dense: the weights summed into their rows."""
    return torch.zeros(V, D).index_add_(0, idx, w)


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (a, b)


def assert_replicas_equal(tensor):
    rows = hvd.allgather(tensor.detach().reshape(1, -1))
    assert all(torch.equal(rows[0].view(torch.int32), r.view(torch.int32)) for r in rows)


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
@pytest.mark.parametrize("passes", [1, 2])
def test_the_gathered_gradient_is_the_dense_average_bit_for_bit(op, passes):
    r = hvd.rank()
    emb = table()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), op=op,
                                   named_parameters=emb.named_parameters(),
                                   backward_passes_per_step=passes)
    for step in range(3):
        opt.zero_grad()
        local = torch.zeros(V, D)
        for k in range(passes):
            idx, w = pass_input(r, passes * step + k)
            loss_of(emb, idx, w).backward()
            local += dense_grad(idx, w)
        grad = emb.weight.grad
        assert grad.layout is torch.sparse_coo
        want = hvd.allreduce(local, op=op, name="sparse.reference")
        if N == 1:
            want = local                           # one rank: the gradient as torch made it
        else:
            assert grad.is_coalesced()             # each row once
        assert_bitwise(grad.to_dense(), want)
        before = emb.weight.detach().clone()
        opt.step()
        untouched = want.abs().sum(1) == 0         # rows no rank's batch touched
        assert torch.equal(emb.weight[untouched], before[untouched])
    assert_replicas_equal(emb.weight)


def train(sparse_as_dense, optimizer, steps=3, unused_at=None, passes=1):
    """``steps`` steps of the table alone; at step ``unused_at`` rank 0 does not use it (no
    gradient there). Returns the table and the dense gradient of each step."""
    r = hvd.rank()
    emb = table()
    opt = hvd.DistributedOptimizer(optimizer(emb.parameters()), sparse_as_dense=sparse_as_dense,
                                   backward_passes_per_step=passes)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            idx, w = pass_input(r, passes * step + k, used=not (step == unused_at and r == 0))
            loss_of(emb, idx, w).backward()        # no indices: a sparse gradient, no rows
        grad = emb.weight.grad
        grads.append(None if grad is None else grad.to_dense().clone())
        if grad is not None:
            assert grad.layout is torch.sparse_coo     # SparseAdam takes sparse ones only
        opt.step()
    return emb, grads


@pytest.mark.parametrize("optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.25),
    lambda p: torch.optim.SparseAdam(list(p), lr=0.1)], ids=["sgd", "sparse_adam"])
@pytest.mark.parametrize("passes", [1, 2])
def test_gathered_and_sparse_as_dense_train_the_same_bits(optimizer, passes):
    gathered, g1 = train(False, optimizer, passes=passes)
    dense, g2 = train(True, optimizer, passes=passes)
    for a, b in zip(g1, g2):
        assert_bitwise(a, b)
    assert_bitwise(gathered.weight.detach(), dense.weight.detach())
    assert_replicas_equal(gathered.weight)


def test_a_rank_without_rows_still_averages_and_sends_none():
    """Rank 0 touches no row in step 1: its gradient is sparse and empty (the table is in its
    graph); the average is the others' sum over N, as the dense one."""
    gathered, g1 = train(False, lambda p: torch.optim.SGD(p, lr=0.25), unused_at=1)
    dense, g2 = train(True, lambda p: torch.optim.SGD(p, lr=0.25), unused_at=1)
    for a, b in zip(g1, g2):
        assert_bitwise(a, b)
    assert_bitwise(gathered.weight.detach(), dense.weight.detach())


def test_a_table_one_rank_leaves_out_of_its_graph():
    """The first pass decides from every rank: rank 0 does not use the table at all in the
    first step (no gradient, no hook), the others do; in the third no rank does, and the
    table gets no gradient, on every rank (as at N = 1)."""
    r = hvd.rank()
    emb, other = table(), linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*emb.parameters(), *other.parameters()],
                                                   lr=0.25))
    for step, users in enumerate([lambda q: q != 0, lambda q: True, lambda q: False]):
        opt.zero_grad()
        idx, w = pass_input(r, step)
        loss = other(torch.ones(1, D)).sum()
        if users(r):
            loss = loss + loss_of(emb, idx, w)
        loss.backward()
        want = hvd.allreduce(dense_grad(idx, w) if users(r) else torch.zeros(V, D),
                             name="sparse.unused")
        opt.step()
        if not any(users(q) for q in range(hvd.size())):
            assert emb.weight.grad is None
        elif hvd.size() > 1 or users(r):
            assert emb.weight.grad.layout is torch.sparse_coo
            assert_bitwise(emb.weight.grad.to_dense(), want)
    assert_replicas_equal(emb.weight)


def test_a_table_no_rank_used_in_the_first_pass_is_averaged_dense():
    """No rank's first pass touched the table, so it was not agreed gathered: from then on
    its sparse gradient is averaged dense in the buckets and made sparse again -- the same
    bits, still a sparse ``p.grad``."""
    r = hvd.rank()
    emb, other = table(), linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*emb.parameters(), *other.parameters()],
                                                   lr=0.25))
    for step in range(3):
        opt.zero_grad()
        idx, w = pass_input(r, step)
        loss = other(torch.ones(1, D)).sum()
        if step:
            loss = loss + loss_of(emb, idx, w)
        loss.backward()
        if step:
            want = hvd.allreduce(dense_grad(idx, w), name="sparse.late")
            assert emb.weight.grad.layout is torch.sparse_coo
            assert_bitwise(emb.weight.grad.to_dense(), want)
        opt.step()
    assert_replicas_equal(emb.weight)


class Mixed(nn.Module):
    """A sparse table, a dense table and a linear layer: both kinds in one optimizer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.sparse = nn.Embedding(V, D, sparse=True)
        self.dense = nn.Embedding(V, D)
        self.head = nn.Linear(2 * D, 3)

    def forward(self, idx):
        return self.head(torch.cat([self.sparse(idx).mean(1), self.dense(idx).mean(1)], 1))


def global_batch(step, ranks, per_rank=4):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randint(0, V, (ranks * per_rank, 3), generator=g),
            torch.randint(0, 3, (ranks * per_rank,), generator=g))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_model_of_sparse_and_dense_parameters_trains_as_one_process(overlap):
    n, r = hvd.size(), hvd.rank()
    model = Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), overlap=overlap,
                                   fusion_threshold_bytes=64)      # several buckets
    reference = Mixed()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(4):
        x, y = global_batch(step, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[r::n]), y[r::n]).backward()
        assert model.sparse.weight.grad.layout is torch.sparse_coo
        assert model.dense.weight.grad.layout is torch.strided
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    assert_replicas_equal(flat(model))
    if n == 1:
        assert_bitwise(flat(model), flat(reference))
    else:
        torch.testing.assert_close(flat(model), flat(reference), rtol=1e-5, atol=1e-6)


def test_synchronize_then_skip_synchronize_and_manual_gradients():
    """Horovod's idiom: synchronize(), edit, step() inside skip_synchronize(); and gradients
    set by hand (no hook ran), averaged at step()."""
    r = hvd.rank()
    emb = table()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0))
    idx, w = pass_input(r, 0)
    emb.weight.grad = torch.sparse_coo_tensor(idx[None], w, (V, D),       # by hand: no hook
                                              check_invariants=True)
    want = hvd.allreduce(dense_grad(idx, w), name="sparse.manual")
    before = emb.weight.detach().clone()
    opt.step()
    assert_bitwise(emb.weight.detach(), before - want)
    opt.zero_grad()
    idx, w = pass_input(r, 1)
    loss_of(emb, idx, w).backward()
    opt.synchronize()
    want = hvd.allreduce(dense_grad(idx, w), name="sparse.manual")
    assert_bitwise(emb.weight.grad.to_dense(), want)
    emb.weight.grad = emb.weight.grad * 2.0
    before = emb.weight.detach().clone()
    with opt.skip_synchronize():
        opt.step()
    assert_bitwise(emb.weight.detach(), before - want * 2.0)


def test_a_wrong_count_of_passes_is_a_value_error_on_every_rank():
    r = hvd.rank()
    emb = table()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.25),
                                   backward_passes_per_step=2)
    idx, w = pass_input(r, 0)
    loss_of(emb, idx, w).backward()
    with pytest.raises(ValueError, match=r"step\(\) after 1 backward passes"):
        opt.step()
    for k in range(2):                                   # the next step counts afresh
        loss_of(emb, *pass_input(r, k)).backward()
    opt.step()
    assert_replicas_equal(emb.weight)


@pytest.mark.skipif(N < 2, reason="needs replicas to differ (N >= 2)")
def test_replicas_that_start_apart_raise_on_every_rank():
    emb = table(seed=hvd.rank())                        # broadcast_parameters forgotten
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.25))
    with pytest.raises(hvd.CollectiveError, match=r"replicas start from different parameters"):
        loss_of(emb, *pass_input(hvd.rank(), 0)).backward()
    opt.zero_grad()


def test_sharding_gradients_refuses_a_sparse_gradient_on_every_rank():
    emb, other = table(), linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*emb.parameters(), *other.parameters()],
                                                   lr=0.25), sharding="gradients")
    with pytest.raises(ValueError, match=r"sharding='gradients' cannot reduce-scatter"):
        (loss_of(emb, *pass_input(hvd.rank(), 0)) + other(torch.ones(1, D)).sum()).backward()
    opt.zero_grad()


def test_sharding_optimizer_gives_the_unsharded_bits():
    def run(sharding):
        r = hvd.rank()
        model = Mixed()
        opt = hvd.DistributedOptimizer(
            torch.optim.Adam([{"params": model.dense.parameters()},
                              {"params": model.head.parameters(), "lr": 0.05}], lr=0.1),
            sharding=sharding)
        sparse_opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(model.sparse.parameters()), lr=0.1), sharding=sharding)
        for step in range(3):
            x, y = global_batch(step, hvd.size())
            opt.zero_grad()
            sparse_opt.zero_grad()
            nn.functional.cross_entropy(model(x[r::hvd.size()]), y[r::hvd.size()]).backward()
            opt.step()
            sparse_opt.step()
        return flat(model)
    assert_bitwise(run("optimizer"), run("none"))


def test_on_a_process_set_only_its_ranks_average():
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(range(0, n, 2))
    try:
        emb = table()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.25),
                                       process_set=evens)
        idx, w = pass_input(r, 0)
        loss_of(emb, idx, w).backward()
        if evens.included():
            want = hvd.allreduce(dense_grad(idx, w), name="sparse.set", process_set=evens)
            if evens.size() == 1:
                want = dense_grad(idx, w)
            assert_bitwise(emb.weight.grad.to_dense(), want)
        else:                                            # outside its set: its own gradient
            assert_bitwise(emb.weight.grad.to_dense(), dense_grad(idx, w))
        opt.step()
    finally:
        assert hvd.remove_process_set(evens)


def test_an_empty_process_set_is_one_no_rank_is_in():
    empty = hvd.add_process_set([])
    try:
        assert empty.included() is False and empty.size() == 0
        with pytest.raises(ValueError, match=r"is not in ProcessSet\(.*ranks=\[\]\)"):
            hvd.allreduce(torch.ones(2), process_set=empty)
        with pytest.raises(ValueError, match=r"is not in ProcessSet\(.*ranks=\[\]\)"):
            hvd.allgather(torch.ones(2), process_set=empty)
        emb = table()                                    # outside its set: steps alone
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       process_set=empty)
        idx, w = pass_input(hvd.rank(), 0)
        loss_of(emb, idx, w).backward()
        before = emb.weight.detach().clone()
        opt.step()
        assert torch.equal(emb.weight.detach(), before - dense_grad(idx, w))
    finally:
        assert hvd.remove_process_set(empty)
