"""Sharded optimizer state in mpitrain.torch: hvd.ZeroRedundancyOptimizer and
hvd.DistributedOptimizer(..., sharding="optimizer" or "gradients") give bitwise the parameters
of the unsharded hvd.DistributedOptimizer (SGD with nesterov momentum and weight decay, Adam,
AdamW; uneven partitions, ranks without parameters), hold ~1/N of its optimizer state (and
with "gradients" of its gradients), consolidate to its state_dict, load a state saved at
another N, add parameter groups, and raise one-line errors on every rank. Runs as 1 process
and under mpiexec -n 2, 3, 4; sharded gradients under the ring allreduce (the unsharded run's
sums at N >= 3 are the ring's only with it)."""
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402

B = 3               # per-rank batch
STEPS = 4
KINDS = ["sgd", "adam", "adamw"]
SHARDED = ["zero", "sharding", "gradients"]


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    hvd.init()


@pytest.fixture(autouse=True)
def ring_for_sharded_gradients(request, use_settings):
    """Tests of sharding="gradients" run with the ring allreduce: its reduce-scatter sums each
    element as the unsharded ring allreduce does (MPI's own may sum in another order at
    N >= 3)."""
    callspec = getattr(request.node, "callspec", None)
    if ((callspec is not None and callspec.params.get("how") == "gradients")
            or "gradients" in request.node.name):
        use_settings(algorithm="ring")


def mlp(seed=0):
    """Ten parameters of uneven sizes (512, 32, 1024, 32, 96, 3, 15, 5, 9, 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3), nn.Tanh(), nn.Linear(3, 5), nn.Tanh(),
                         nn.Linear(5, 3, bias=False), nn.Linear(3, 1, bias=False))


def tiny(seed=0):
    """Two parameters: at N = 3, 4 some ranks own none."""
    torch.manual_seed(seed)
    return nn.Linear(16, 1)


def balanced(seed=0):
    """Twelve equal layers: the greedy partition splits them evenly at N = 1, 2, 3, 4."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
}


def make(how, kind, params, **kwargs):
    """The optimizer under test: "unsharded" (the reference), "sharding" (the optimizer
    state), "gradients" (and the gradients) or "zero"."""
    cls, defaults = OPTIMIZERS[kind]
    if how == "zero":
        return hvd.ZeroRedundancyOptimizer(params, cls, **defaults)
    sharding = {"sharding": "optimizer", "gradients": "gradients"}.get(how, "none")
    return hvd.DistributedOptimizer(cls(params, **defaults), sharding=sharding, **kwargs)


def batch(step, features=16):
    """This rank's shard of the global batch of ``step``."""
    n, r = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n * B, features, generator=g)
    return x[r::n]


def train(model, opt, steps=STEPS, first=0, scheduler=None):
    for step in range(first, first + steps):
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def bitwise_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_replicas_bitwise_equal(model):
    rows = hvd.allgather(flat(model)[None])
    assert all(bitwise_equal(rows[0], row) for row in rows)


def run(how, kind, build=mlp, steps=STEPS, schedule=False):
    model = build()
    opt = make(how, kind, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if schedule else None
    train(model, opt, steps, scheduler=scheduler)
    return model, opt


def assert_same_state(a, b):
    """Two state_dicts in PyTorch's format with the same values (tensors bitwise)."""
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for index in a["state"]:
        sa, sb = a["state"][index], b["state"][index]
        assert sorted(sa) == sorted(sb), index
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert bitwise_equal(sa[key].float(), sb[key].float()), (index, key)
            else:
                assert sa[key] == sb[key], (index, key)


# -- bitwise the unsharded run ------------------------------------------------------------------

@pytest.mark.parametrize("how", SHARDED)
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_parameters_are_bitwise_the_unsharded_ones(how, kind):
    reference, _ = run("unsharded", kind, schedule=True)
    model, opt = run(how, kind, schedule=True)
    assert bitwise_equal(flat(model), flat(reference))
    assert_replicas_bitwise_equal(model)
    assert opt.param_groups[0]["lr"] == OPTIMIZERS[kind][1]["lr"] * 0.25   # the scheduler's


@pytest.mark.parametrize("how", SHARDED)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_ranks_without_parameters_take_part(how, kind):
    reference, _ = run("unsharded", kind, build=tiny)
    model, opt = run(how, kind, build=tiny)
    assert bitwise_equal(flat(model), flat(reference))
    if how == "zero":
        owned = sum(len(g["params"]) for g in opt.optim.param_groups)
        counts = hvd.allgather(torch.tensor([owned]))
        assert counts.sum().item() == 2 and (hvd.size() < 3 or counts.min().item() == 0)


class TwoDtypes(nn.Module):
    """A float32 and a float64 branch: the wrapper's sharding sends each dtype apart."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 4).double()

    def forward(self, x):
        return self.a(x).sum(1) + self.b(x.double()).sum(1).float()


def test_the_wrappers_sharding_takes_parameters_of_two_dtypes(use_settings):
    use_settings(algorithm="ring")         # for sharding="gradients"
    results = {}
    for how in ["unsharded", "sharding", "gradients"]:
        model = TwoDtypes()
        opt = make(how, "adam", model.parameters())
        train(model, opt)
        results[how] = [p.detach().clone() for p in model.parameters()]
    for how in ["sharding", "gradients"]:
        for a, b in zip(results[how], results["unsharded"]):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_partition_is_pytorchs_sorted_greedy():
    model = mlp()
    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    n, sizes, expected = hvd.size(), [0] * hvd.size(), [[] for _ in range(hvd.size())]
    for p in sorted(model.parameters(), key=lambda t: t.numel(), reverse=True):
        rank = sizes.index(min(sizes))
        expected[rank].append(p)
        sizes[rank] += p.numel()
    mine = opt.optim.param_groups[0]["params"]
    assert [id(p) for p in mine] == [id(p) for p in expected[hvd.rank()]]
    assert opt.world_size == n and opt.rank == hvd.rank()
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))


# -- memory ---------------------------------------------------------------------------------

@pytest.mark.parametrize("how", SHARDED)
def test_memory_bytes_shows_the_saving(how):
    n = hvd.size()
    _, full = run("unsharded", "adam", build=balanced, steps=1)
    _, opt = run(how, "adam", build=balanced, steps=1)
    mine, whole = opt.memory_bytes(), full.memory_bytes()
    assert set(mine) == {"parameters", "gradients", "optimizer_state"}
    assert mine["parameters"] == whole["parameters"] == sum(
        p.numel() * 4 for g in full.param_groups for p in g["params"])
    grads = hvd.allgather(torch.tensor([mine["gradients"]]))
    if how == "gradients":            # each gradient on its owner only, between steps
        assert grads.sum().item() == whole["gradients"] == whole["parameters"]
        assert grads.max().item() <= whole["gradients"] / n * 1.02
    else:
        assert mine["gradients"] == whole["gradients"]
    # Adam: two moments of every parameter plus a 4-byte step each
    assert whole["optimizer_state"] == 2 * whole["parameters"] + 4 * 24
    states = hvd.allgather(torch.tensor([mine["optimizer_state"]]))
    assert states.sum().item() == whole["optimizer_state"]        # each entry on one rank
    assert states.max().item() <= whole["optimizer_state"] / n * 1.02
    if hvd.rank() == 0:
        print(f"\nN={n} {how}: optimizer_state {states.tolist()} of "
              f"{whole['optimizer_state']} bytes unsharded, gradients {grads.tolist()} of "
              f"{whole['gradients']}")


# -- the state_dict -----------------------------------------------------------------------------

@pytest.mark.parametrize("how", SHARDED)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_consolidated_state_dict_is_the_unsharded_one(how, kind):
    _, full = run("unsharded", kind)
    _, opt = run(how, kind)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()                          # on every rank: not consolidated yet
    opt.consolidate_state_dict(to=0)
    if hvd.rank() == 0:
        assert_same_state(opt.state_dict(), full.state_dict())
    else:
        with pytest.raises(RuntimeError, match="not been consolidated on this rank"):
            opt.state_dict()
    last = hvd.size() - 1
    opt.consolidate_state_dict(to=last)           # to another rank: only that one holds it
    if hvd.rank() == last:
        assert_same_state(opt.state_dict(), full.state_dict())
    else:
        with pytest.raises(RuntimeError):
            opt.state_dict()


def save_on_rank0(obj):
    """torch.save ``obj`` of rank 0 to a temporary file; every rank gets its path."""
    path = None
    if hvd.rank() == 0:
        handle, path = tempfile.mkstemp(suffix=".pt")
        os.close(handle)
        torch.save(obj, path)
    return hvd.broadcast_object(path, root_rank=0)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_state_saved_at_another_n_loads_and_continues_as_unsharded(kind, use_settings):
    """A ZeroRedundancyOptimizer over the first max(1, N - 1) ranks trains and saves; all N
    load the file into each optimizer, continue, and end bitwise where the unsharded one
    does."""
    use_settings(algorithm="ring")         # sharding="gradients" is among the loaders
    n, r = hvd.size(), hvd.rank()
    savers = list(range(max(1, n - 1)))
    ps = hvd.add_process_set(savers) if n > 1 else hvd.global_process_set
    try:
        saved = None
        if r in savers:
            model = mlp(seed=3)
            cls, defaults = OPTIMIZERS[kind]
            opt = hvd.ZeroRedundancyOptimizer(model.parameters(), cls, process_set=ps,
                                              **defaults)
            for step in range(3):
                opt.zero_grad()
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 7 + r))
                model(x).pow(2).mean().backward()
                opt.step()
            opt.consolidate_state_dict(to=0)
            if r == 0:
                saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                assert len(saved["optimizer"]["state"]) == len(list(model.parameters()))
        hvd.barrier()
    finally:
        if n > 1:
            hvd.remove_process_set(ps)
    path = save_on_rank0(saved)
    try:
        results = {}
        for how in ["unsharded", "sharding", "gradients", "zero"]:
            checkpoint = torch.load(path, weights_only=True)
            model = mlp()
            model.load_state_dict(checkpoint["model"])
            opt = make(how, kind, model.parameters())
            opt.load_state_dict(checkpoint["optimizer"])
            if how != "unsharded":                # each rank keeps its partition's entries
                held = opt.optim.state if how == "zero" else opt.state
                counts = hvd.allgather(torch.tensor([len(held)]))
                assert counts.sum().item() == len(list(model.parameters()))
            train(model, opt, steps=3, first=10)
            results[how] = (flat(model), opt)
        for how in ["sharding", "gradients", "zero"]:
            assert bitwise_equal(results[how][0], results["unsharded"][0]), how
        # and the continued states are the same again
        full = results["unsharded"][1].state_dict()
        for how in ["sharding", "gradients", "zero"]:
            opt = results[how][1]
            opt.consolidate_state_dict(to=0)
            if r == 0:
                assert_same_state(opt.state_dict(), full)
    finally:
        hvd.barrier()
        if r == 0:
            os.unlink(path)


@pytest.mark.parametrize("how", SHARDED)
def test_broadcast_optimizer_state_on_a_sharded_optimizer(how):
    """The Horovod start: a fresh optimizer's state made and broadcast from rank 0; every
    rank keeps its partition's, and training matches the unsharded optimizer's."""
    results = {}
    for name in ["unsharded", how]:
        model = mlp()
        opt = make(name, "adam", model.parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        train(model, opt)
        results[name] = flat(model)
    assert bitwise_equal(results[how], results["unsharded"])


# -- add_param_group --------------------------------------------------------------------------

def two_parts(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8), nn.Tanh(),
                         nn.Linear(8, 4))


@pytest.mark.parametrize("how", SHARDED)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_add_param_group_partitions_and_averages_the_new_group(how, kind):
    cls, defaults = OPTIMIZERS[kind]
    # reference: the unsharded optimizer, the group added to it and the optimizer wrapped again
    reference = two_parts()
    first, later = list(reference[:2].parameters()), list(reference[2:].parameters())
    base = cls(first, **defaults)
    opt = hvd.DistributedOptimizer(base)
    train(reference, opt, steps=2)
    base.add_param_group({"params": later, "lr": defaults["lr"] / 2})
    opt = hvd.DistributedOptimizer(base)
    train(reference, opt, steps=3, first=2)

    model = two_parts()
    first, later = list(model[:2].parameters()), list(model[2:].parameters())
    opt = make(how, kind, first)
    train(model, opt, steps=2)
    opt.add_param_group({"params": later, "lr": defaults["lr"] / 2})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == defaults["lr"] / 2
    if how == "zero":
        assert len(opt.optim.param_groups) == 2
        assert opt.optim.param_groups[1]["lr"] == defaults["lr"] / 2
    train(model, opt, steps=3, first=2)
    assert bitwise_equal(flat(model), flat(reference))
    assert_replicas_bitwise_equal(model)
    held = opt.optim.state if how == "zero" else opt.state
    counts = hvd.allgather(torch.tensor([len(held)]))
    assert counts.sum().item() == 6


# -- errors: one line, on every rank ------------------------------------------------------------

def one_line(excinfo):
    assert "\n" not in str(excinfo.value)


def test_sharding_argument_errors():
    model = mlp()
    with pytest.raises(ValueError, match="'none', 'optimizer', 'gradients', 'parameters'") as e:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sharding="zero")
    one_line(e)
    with pytest.raises(ValueError, match="not available in mpitrain.torch yet") as e:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 sharding="parameters")
    one_line(e)
    hvd.barrier()


def test_zero_argument_errors():
    model = mlp()
    cases = [
        (dict(overlap_with_ddp=True), ValueError, "overlap_with_ddp"),
        (dict(parameters_as_bucket_view=True), ValueError, "parameters_as_bucket_view"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match) as e:
            hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, **kwargs)
        one_line(e)
    with pytest.raises(ValueError, match="empty parameter list") as e:
        hvd.ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1)
    one_line(e)
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dense type") as e:
        hvd.ZeroRedundancyOptimizer(mixed, torch.optim.SGD, lr=0.1)
    one_line(e)
    with pytest.raises(TypeError, match="optimizer_class"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), "SGD", lr=0.1)
    hvd.barrier()


@pytest.mark.parametrize("how", SHARDED)
def test_state_errors_raise_on_every_rank(how):
    model, opt = run(how, "adam", steps=1)
    with pytest.raises(ValueError, match="not a rank of the process set") as e:
        opt.consolidate_state_dict(to=hvd.size())
    one_line(e)
    with pytest.raises(RuntimeError, match="consolidate_state_dict") as e:
        opt.state_dict()
    one_line(e)
    other = torch.optim.Adam(list(mlp().parameters())[:3])
    other_state = other.state_dict()
    other_state["param_groups"].append(dict(other_state["param_groups"][0]))
    with pytest.raises(ValueError, match="parameter groups") as e:
        opt.load_state_dict(other_state)
    one_line(e)
    with pytest.raises(ValueError, match="parameter group 0") as e:
        opt.load_state_dict(other.state_dict())
    one_line(e)
    train(model, opt, steps=1, first=5)          # the optimizer goes on after the errors
    assert_replicas_bitwise_equal(model)


# -- sharding="gradients": reduce-scattered, each gradient on its owner only -------------------

def owned_by_me(opt):
    return {id(p) for params in opt.mt_partition.mine for p in params}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setup", ["overlapped", "fp16", "accumulated"])
def test_sharded_gradients_are_bitwise_the_unsharded_ones_in_buckets(kind, setup):
    """Several overlapped buckets (fusion_threshold_bytes=512), fp16 on the wire, two
    backward passes per step: the unsharded parameters' bits, with reduce-scatters."""
    kwargs = dict(fusion_threshold_bytes=512)
    if setup == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
    passes = 2 if setup == "accumulated" else 1
    if passes > 1:
        kwargs["backward_passes_per_step"] = passes
    results = {}
    for how in ["unsharded", "gradients"]:
        model = mlp()
        opt = make(how, kind, model.parameters(), named_parameters=model.named_parameters(),
                   **kwargs)
        for step in range(STEPS):
            opt.zero_grad()
            for k in range(passes):
                model(batch(step * passes + k)).pow(2).mean().backward()
            opt.step()
        results[how] = flat(model)
        if how == "gradients" and hvd.size() > 1:
            assert opt.mt_optimizer.strategy.reduce_scatters
    assert bitwise_equal(results["gradients"], results["unsharded"])


@pytest.mark.parametrize("threshold", [None, 512])
def test_sharded_gradients_are_held_by_their_owner_only(threshold):
    """After backward each rank holds the averaged gradients of its partition, bitwise the
    unsharded averages, and None for the others; the same after the step."""
    reference = mlp()
    full = make("unsharded", "sgd", reference.parameters(), fusion_threshold_bytes=threshold)
    model = mlp()
    opt = make("gradients", "sgd", model.parameters(), fusion_threshold_bytes=threshold)
    mine = owned_by_me(opt)
    for step in range(2):
        for m, o in [(reference, full), (model, opt)]:
            o.zero_grad()
            m(batch(step)).pow(2).mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            if id(p) in mine:
                assert p.grad is not None and bitwise_equal(p.grad, q.grad)
            else:
                assert p.grad is None
        full.step()
        opt.step()
        assert [p.grad is not None for p in model.parameters()] == [
            id(p) in mine for p in model.parameters()]
    held = hvd.allgather(torch.tensor([[id(p) in mine for p in model.parameters()]]))
    assert held.sum(0).tolist() == [1] * len(list(model.parameters()))   # one owner each
    assert bitwise_equal(flat(model), flat(reference))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_sharded_gradients_clip_with_the_optimizers_method(kind):
    """opt.clip_grad_norm_ gathers the norms of the gradients a rank does not hold: the total
    norm and the parameters are torch.nn.utils.clip_grad_norm_'s on the unsharded run."""
    results = {}
    for how in ["unsharded", "gradients"]:
        model = mlp()
        opt = make(how, kind, model.parameters())
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            model(batch(step)).pow(2).mean().backward()
            if how == "unsharded":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
            else:
                norms.append(opt.clip_grad_norm_(0.01))
            opt.step()
        results[how] = (flat(model), torch.stack(norms))
    assert bitwise_equal(results["gradients"][1], results["unsharded"][1])
    assert (results["unsharded"][1] > 0.01).any()          # the clip did clip
    assert bitwise_equal(results["gradients"][0], results["unsharded"][0])
