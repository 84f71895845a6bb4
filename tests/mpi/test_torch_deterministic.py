"""mpitrain.torch's deterministic mode: the same bits for N = 1, 2, 4 ranks.

A small CNN with BatchNorm and dropout (SGD with momentum) and a small nanoGPT-shaped GPT
(AdamW, dropout, tied embeddings, clipping after the average by the synchronize / clip /
skip_synchronize idiom) train 20 steps with M = 4 micro-shards per global batch. Oracle: in the
same job every rank also trains alone, in a process set of its own (N = 1: k = 4 passes per
step); the model's ``state_dict()`` bytes (parameters and BatchNorm buffers) and the optimizer's
state must be those of the N-rank run, and a checkpoint of the N-rank run after 10 steps,
resumed on half the ranks (N = 4 -> 2, 2 -> 1), must end on the same bytes. The data spans six
orders of magnitude, so any other order of additions shows in the last bits. The refusals are
the same ValueError on every rank. Runs as 1 process and under mpiexec -n 2, 4.
"""
import hashlib
import io
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpitrain.torch as hvd                   # noqa: E402
from torch import nn                           # noqa: E402
from torch.nn import functional as F           # noqa: E402
from mpitrain.torch.deterministic import micro_shard_seed      # noqa: E402

M = 4               # micro-shards per global batch
G = 16              # samples per global batch
STEPS = 20
N, R = None, None


@pytest.fixture(scope="module", autouse=True)
def horovod_init():
    global N, R
    hvd.init()
    N, R = hvd.size(), hvd.rank()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


power_of_two = pytest.mark.skipif("hvd.size() & (hvd.size() - 1)",
                                  reason="N not a power of two: refused (tested below)")


# -- the two models --------------------------------------------------------------------------
def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Dropout(0.25), nn.Linear(4 * 3 * 3, 8),
                         nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5))


def cnn_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    scale = 10.0 ** torch.randint(-3, 3, (G, 1, 1, 1), generator=g).float()
    return torch.randn(G, 1, 8, 8, generator=g) * scale, torch.randint(0, 5, (G,), generator=g)


class Block(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t).tril() == 0, float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """nanoGPT's shape: token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, vocab=17, block=8, d=16, heads=2, layers=2, p=0.1):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def gpt():
    torch.manual_seed(0)
    return GPT()


def gpt_batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, 17, (G, 9), generator=g)
    return data[:, :-1], data[:, 1:]


def cnn_case():
    model = cnn()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def gpt_case():
    model = gpt()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


CASES = {"cnn": (cnn_case, cnn_batch, lambda model, x, y: F.cross_entropy(model(x), y), None),
         "gpt": (gpt_case, gpt_batch, lambda model, x, y: model(x, y), 0.5)}


# -- training and the bytes compared ---------------------------------------------------------
def train(case, process_set, start=0, stop=STEPS, state=None):
    """Steps [start, stop) on ``process_set``; ``state``: a checkpoint to resume from."""
    make, batch, loss_fn, clip = CASES[case]
    model, inner = make()
    if state is not None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
    k = M // process_set.size()
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=k, process_set=process_set,
                                   deterministic=True)
    model.train()
    for step in range(start, stop):
        opt.zero_grad()
        for x, y in hvd.micro_shards(*batch(step), micro_shards=M, seed=7, step=step,
                                     process_set=process_set):
            loss_fn(model, x, y).backward()
        if clip is None:
            opt.step()
        else:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
    return model, opt


def checkpoint(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


def state_bytes(model, opt):
    """Every byte of the model's state_dict and the optimizer's state, with their names."""
    out = []
    for name, value in model.state_dict().items():
        out.append((name, value.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    for index, entries in sorted(opt.state_dict()["state"].items()):
        for name, value in sorted(entries.items()):
            if torch.is_tensor(value):
                value = value.detach().contiguous().view(-1).view(torch.uint8).tolist()
            out.append((f"state.{index}.{name}", value))
    return out


@pytest.fixture(scope="module")
def own_sets():
    """Process sets of one rank each (the oracle's N = 1) and, for N >= 2, halves."""
    alone = [hvd.add_process_set([r]) for r in range(N)]
    halves = ([hvd.add_process_set(list(range(h * N // 2, (h + 1) * N // 2))) for h in (0, 1)]
              if N >= 4 else [])
    yield alone[R], (halves[R * 2 // N] if halves else alone[R])
    for s in alone + halves:
        hvd.remove_process_set(s)


@power_of_two
@pytest.mark.parametrize("case", ["cnn", "gpt"])
def test_n_ranks_end_on_the_bits_of_one_and_a_resume_on_half_the_ranks(case, own_sets):
    alone, half = own_sets
    model, opt = train(case, hvd.global_process_set)
    got = state_bytes(model, opt)
    # every rank holds the same bytes
    digests = hvd.allgather_object(hashlib.sha256(repr(got).encode()).hexdigest())
    assert len(set(digests)) == 1
    # one rank alone (M passes per step) makes the same bytes
    ref_model, ref_opt = train(case, alone)
    want = state_bytes(ref_model, ref_opt)
    assert [n for n, _ in got] == [n for n, _ in want]
    assert got == want
    # saved after half the steps on N ranks, resumed on N / 2 (N = 1: on 1)
    first, first_opt = train(case, hvd.global_process_set, stop=STEPS // 2)
    resumed = train(case, half, start=STEPS // 2, state=checkpoint(first, first_opt))
    assert state_bytes(*resumed) == want


@power_of_two
@pytest.mark.parametrize("momentum", [0.1, None])
def test_the_batchnorm_buffers_follow_the_micro_shards_in_order(momentum):
    """The running statistics are PyTorch's for the M micro-batches in sequence: the mean bit
    for bit, the variance (rounded by PyTorch from a float64 it does not keep) to float32's
    last bits; num_batches_tracked counts the micro-batches."""
    model, _ = train("cnn", hvd.global_process_set, stop=3)
    torch.manual_seed(3)
    xs = [torch.randn(4, 3) * 10.0 ** e for e in (-2, 0, 1, 2)]
    bn = nn.BatchNorm1d(3, momentum=momentum)
    ref = nn.BatchNorm1d(3, momentum=momentum)
    for x in xs:
        ref(x)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(bn.parameters(), lr=0.0),
                                   named_parameters=bn.named_parameters(),
                                   backward_passes_per_step=M // N, deterministic=True)
    opt.zero_grad()
    for (x,) in hvd.micro_shards(torch.cat(xs), micro_shards=np.int64(M), step=np.int64(2)):
        bn(x).sum().backward()
    assert torch.equal(bn.running_mean, torch.zeros(3))     # untouched between the passes
    opt.step()
    assert torch.equal(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-6, atol=0)
    assert int(bn.num_batches_tracked) == M
    assert int(model[1].num_batches_tracked) == 3 * M


@power_of_two
def test_the_average_is_the_mean_over_the_global_batch():
    """Close to plain PyTorch accumulating the M micro-shards' losses / M in one process (the
    same math, another order of additions): parameters and running means."""
    model, _ = train("cnn", hvd.global_process_set, stop=3)
    plain, inner = cnn_case()
    for step in range(3):
        inner.zero_grad()
        x, y = cnn_batch(step)
        for j in range(M):
            torch.manual_seed(micro_shard_seed(7, step, j))
            b = G // M
            (F.cross_entropy(plain(x[j * b:(j + 1) * b]), y[j * b:(j + 1) * b]) / M).backward()
        inner.step()
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        if "var" not in name:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def _optimizer(**kwargs):
    model = nn.Linear(2, 2)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    deterministic=True, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(compression=hvd.Compression.fp16), "compression"),
    (dict(gradient_predivide_factor=2.0), "gradient_predivide_factor"),
    (dict(op=hvd.Sum), "op="),
    (dict(op=hvd.Adasum), "op="),
    (dict(sharding="optimizer"), "sharding"),
    (dict(sharding="gradients"), "sharding"),
    (dict(backward_passes_per_step=3), "power of two"),
])
def test_refusals_are_the_same_value_error_on_every_rank(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _optimizer(**kwargs)
    assert len(set(hvd.allgather_object(str(info.value)))) == 1


def test_a_number_of_ranks_not_a_power_of_two_is_refused_on_every_rank():
    """N = 3 itself, or a process set of 3 of 4 ranks."""
    if N < 3:
        pytest.skip("needs 3 ranks or more")
    three = hvd.global_process_set if N & (N - 1) else hvd.add_process_set([0, 1, 2])
    try:
        with pytest.raises(ValueError, match="power-of-two number of ranks") as info:
            _optimizer(process_set=three)
        assert len(set(hvd.allgather_object(str(info.value)))) == 1
        if three.included():
            with pytest.raises(ValueError, match="must be a power of two"):
                list(hvd.micro_shards(torch.zeros(8, 2), micro_shards=4, process_set=three))
    finally:
        if three is not hvd.global_process_set:
            hvd.remove_process_set(three)


@power_of_two
@pytest.mark.parametrize("m, g, match", [(3, 12, "power of two"), (4, 10, "equal size"),
                                         (0, 4, "power of two")])
def test_micro_shards_refusals(m, g, match):
    with pytest.raises(ValueError, match=match):
        list(hvd.micro_shards(torch.zeros(g, 2), micro_shards=m))


@power_of_two
def test_micro_shards_fewer_than_ranks_is_refused():
    if N == 1:
        pytest.skip("needs 2 ranks or more")
    with pytest.raises(ValueError, match="at most the number of micro-shards"):
        list(hvd.micro_shards(torch.zeros(8, 2), micro_shards=N // 2))


@power_of_two
def test_micro_shards_are_this_ranks_slices_and_seed_by_micro_shard():
    x, y = torch.arange(16.0), torch.arange(16) * 10
    got = list(hvd.micro_shards(x, y, micro_shards=8, seed=1, step=5))
    k = 8 // N
    assert len(got) == k
    for i, (xb, yb) in enumerate(got):
        j = R * k + i
        assert torch.equal(xb, x[2 * j:2 * j + 2]) and torch.equal(yb, y[2 * j:2 * j + 2])
    draws = []
    for _ in hvd.micro_shards(x, micro_shards=8, seed=1, step=5):
        draws.append(torch.rand(1).item())
    every = sum(hvd.allgather_object(draws), [])
    torch.manual_seed(micro_shard_seed(1, 5, 7))
    assert every[7] == torch.rand(1).item()
    assert len(set(every)) == 8


@power_of_two
def test_a_wrong_pass_count_raises_on_every_rank_and_the_next_step_works():
    model = nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=M // N, deterministic=True)
    x = torch.ones(G, 2)
    opt.zero_grad()
    model(x[:2]).sum().backward()
    if M // N > 1:
        with pytest.raises(ValueError, match="backward passes"):
            opt.step()
    opt.zero_grad()
    for (xb,) in hvd.micro_shards(x, micro_shards=M):
        model(xb).sum().backward()
    opt.step()
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), 4.0))
