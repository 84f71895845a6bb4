"""mpitrain.torch.DistributedOptimizer and the broadcasts on a small CNN: N ranks with batch b
each end where one process with batch N*b does (SGD with momentum, Adam; with and without
overlap, two backward passes per step, fp16 compression, a process set, the clip idiom); the
replicas stay bitwise equal; errors are raised on every rank. Runs as 1 process and under
mpiexec -n 2, 3, 4."""
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402

B = 4               # per-rank batch
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()
    torch.manual_seed(0)


def cnn(seed=0, extra=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 5))
    if extra:
        model.add_module("extra", nn.Linear(5, 5))       # used by some ranks only
    return model


def batch(step, ranks):
    """The global batch of ``step`` (ranks * B samples); rank r's shard is rows r::ranks."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ranks * B, 1, 8, 8, generator=g), torch.randint(0, 5, (ranks * B,),
                                                                       generator=g)


def shard(x, y, index, ranks):
    return x[index::ranks], y[index::ranks]


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train_reference(kind, ranks, steps=STEPS, clip=None):
    """One process, the whole global batch: what N ranks must reproduce."""
    model = cnn()
    opt = make_optimizer(kind, model.parameters())
    for step in range(steps):
        x, y = batch(step, ranks)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_replicas_bitwise_equal(model, process_set=hvd.global_process_set):
    rows = hvd.allgather(flat(model)[None], process_set=process_set)
    assert all(torch.equal(rows[0].view(torch.int32), r.view(torch.int32)) for r in rows)


def assert_close_to(model, reference, tol=1e-5):
    torch.testing.assert_close(flat(model), flat(reference), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("overlap", [True, False])
def test_n_ranks_equal_one_rank_with_the_global_batch(kind, overlap):
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer(kind, model.parameters()),
                                   named_parameters=model.named_parameters(), overlap=overlap)
    assert isinstance(opt, type(make_optimizer(kind, cnn().parameters())))
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        # the hooks ran the buckets' allreduces during backward; its end averaged (DDP's moment)
        assert opt.mt_optimizer.synchronized and not opt.mt_optimizer.strategy.pending()
        opt.step()
    assert_close_to(model, train_reference(kind, n))
    assert_replicas_bitwise_equal(model)


def test_two_backward_passes_per_step():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   backward_passes_per_step=2)
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        for half in (slice(0, B // 2), slice(B // 2, B)):     # two micro-batches, loss / 2
            (nn.functional.cross_entropy(model(x[half]), y[half]) / 2).backward()
        opt.step()
    assert_close_to(model, train_reference("sgd", n))
    assert_replicas_bitwise_equal(model)


def test_fp16_compression_within_tolerance():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   compression=hvd.Compression.fp16)
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert_close_to(model, train_reference("sgd", n), tol=5e-3)
    assert_replicas_bitwise_equal(model)


def test_a_user_compressor_on_tensors():
    class Halves:
        """Horovod's protocol: sends float32 as float16, counts its calls."""
        calls = 0

        @staticmethod
        def compress(tensor):
            Halves.calls += 1
            return tensor.half(), tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.to(ctx)

    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   compression=Halves)
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert Halves.calls == (STEPS * len(list(model.parameters())) if n > 1 else 0)
    assert_close_to(model, train_reference("sgd", n), tol=5e-3)


def test_the_clip_idiom_synchronize_then_skip_synchronize():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
    assert_close_to(model, train_reference("sgd", n, clip=0.5))
    assert_replicas_bitwise_equal(model)


def test_the_grad_scaler_idiom():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    assert_close_to(model, train_reference("sgd", n, clip=0.5))
    assert_replicas_bitwise_equal(model)


def test_wrapping_the_parameters_again_replaces_the_old_hooks():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    for step in range(STEPS):              # a new optimizer per step: only the newest reports
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = shard(*batch(step, n), r, n)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    reference = cnn()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step, n)
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    assert_close_to(model, reference)


def test_a_process_set_trains_its_members_only():
    members = list(range(0, hvd.size(), 2))
    ps = hvd.add_process_set(members)
    try:
        if hvd.rank() in members:
            m, index = len(members), members.index(hvd.rank())
            model = cnn()
            opt = hvd.DistributedOptimizer(make_optimizer("adam", model.parameters()),
                                           process_set=ps)
            for step in range(STEPS):
                x, y = shard(*batch(step, m), index, m)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            assert_close_to(model, train_reference("adam", m))
            assert_replicas_bitwise_equal(model, ps)
    finally:
        hvd.remove_process_set(ps)


def test_unused_parameters_do_not_hang_and_replicas_stay_equal():
    n, r = hvd.size(), hvd.rank()
    model = cnn(extra=True)
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters())
    layers = list(model.children())
    for step in range(STEPS):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        out = nn.Sequential(*layers[:-1])(x)
        if (r + step) % 2 == 0:                # the extra layer: some ranks, some steps
            out = layers[-1](out)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    assert_replicas_bitwise_equal(model)


def test_frozen_parameters_are_left_alone():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = shard(*batch(0, n), r, n)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None
    assert_replicas_bitwise_equal(model)


def test_a_wrong_pass_count_is_an_error_at_step_on_every_rank():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   backward_passes_per_step=2)
    x, y = shard(*batch(0, n), r, n)
    nn.functional.cross_entropy(model(x), y).backward()        # one pass of two
    with pytest.raises(ValueError, match="backward_passes_per_step=2"):
        opt.step()
    for _ in range(2):                                          # the optimizer goes on
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert_replicas_bitwise_equal(model)


def test_wrapper_is_the_optimizers_class_and_takes_a_scheduler():
    model = cnn()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base)
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups is base.param_groups and opt.state is base.state
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = shard(*batch(0, hvd.size()), hvd.rank(), hvd.size())
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05
    state = opt.state_dict()
    assert set(state) == {"state", "param_groups"}
    with pytest.raises(TypeError):
        hvd.DistributedOptimizer(model)
    with pytest.raises(ValueError, match="already"):
        hvd.DistributedOptimizer(opt)


def test_broadcast_parameters_makes_differing_models_one():
    r = hvd.rank()
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Linear(6, 3))
    torch.manual_seed(r)
    for p in model.parameters():
        nn.init.normal_(p)
    model[1].running_mean.fill_(r)
    model[1].num_batches_tracked.fill_(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert_replicas_bitwise_equal(model)
    assert model[1].running_mean.tolist() == [0.0, 0.0]
    assert model[1].num_batches_tracked.item() == 0
    root = hvd.size() - 1
    torch.manual_seed(r + 10)
    for p in model.parameters():
        nn.init.normal_(p)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=root)
    assert_replicas_bitwise_equal(model)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state_makes_differing_states_one(kind):
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = make_optimizer(kind, model.parameters())
    opt.param_groups[0]["lr"] = 0.01 * (r + 1)
    for step in range(r % 2 + 1 if r > 0 else 2):   # rank 0 stepped; others 0 .. 2 steps
        if r > 0 and r % 2 == 0 and step == 0:
            continue
        x, y = batch(step + r, 1)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    tensors = [v for s in opt.state_dict()["state"].values() for v in s.values()]
    assert tensors, "the root's state reached every rank"
    mine = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    rows = hvd.allgather(mine[None])
    assert all(torch.equal(rows[0], row) for row in rows)
    # and training goes on identically
    x, y = shard(*batch(5, n), r, n)
    wrapped = hvd.DistributedOptimizer(opt)
    nn.functional.cross_entropy(model(x), y).backward()
    wrapped.step()
    assert_replicas_bitwise_equal(model)


def test_sum_op_and_predivide():
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 / n),
                                   op=hvd.Sum, gradient_predivide_factor=2.0)
    x, y = shard(*batch(0, n), r, n)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    reference = cnn()
    x, y = batch(0, n)
    nn.functional.cross_entropy(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close_to(model, reference)


def test_join_with_uneven_batches():
    """Rank r has r + 1 batches; a rank out of data joins and its share is zeros (the average
    still divides by N); the last to join broadcasts the model, as in Horovod's recipe."""
    n, r = hvd.size(), hvd.rank()
    lr = 0.1
    model = cnn()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    for step in range(r + 1):
        x, y = shard(*batch(step, n), r, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    last = hvd.join()
    assert last == n - 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    assert_replicas_bitwise_equal(model)
    reference = cnn()
    for step in range(n):
        grads = [torch.zeros_like(p) for p in reference.parameters()]
        for rank in range(step, n):                   # the ranks still holding data
            reference.zero_grad()
            x, y = shard(*batch(step, n), rank, n)
            nn.functional.cross_entropy(reference(x), y).backward()
            grads = [g + p.grad / n for g, p in zip(grads, reference.parameters())]
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p -= lr * g
    assert_close_to(model, reference)


def test_step_after_the_callers_synchronize_outside_skip_synchronize_warns():
    import warnings
    n, r = hvd.size(), hvd.rank()
    model = cnn()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters())

    def backward():
        x, y = shard(*batch(0, n), r, n)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()

    backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="without optimizer.skip_synchronize"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # neither the idiom nor a plain step warns
        backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        backward()
        opt.step()
    assert_replicas_bitwise_equal(model)


@pytest.mark.skipif(hvd.size() < 2, reason="a rank outside the set needs two ranks")
def test_a_rank_outside_the_optimizers_process_set_steps_alone():
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    try:
        model = cnn()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        before = flat(model).clone()
        opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       process_set=evens)
        for step in range(STEPS):
            x, y = shard(*batch(step, n), r, n)       # every rank its own shard
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        assert not torch.equal(flat(model), before)
        rows = hvd.allgather(flat(model)[None])
        inside = [rows[k] for k in range(0, n, 2)]
        assert all(torch.equal(inside[0], row) for row in inside)     # one model in the set
        assert not torch.equal(rows[0], rows[1])                      # rank 1 stepped alone
    finally:
        hvd.remove_process_set(evens)
