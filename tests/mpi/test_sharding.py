"""Sharded data parallel under 1..4 ranks, the optimizer state (``sharding="optimizer"``, ZeRO
stage 1), the gradients too (``"gradients"``, stage 2) and the parameters too (``"parameters"``,
stage 3: gathered layer by layer): the parameters are the unsharded
run's bit for bit (SGD with momentum, Nesterov and weight decay, Adam, AdamW; clipping;
accumulation; fp16 wire; overlapped buckets and the fused path), each rank holds 1/N of the
optimizer state (and of the gradients), a checkpoint holds the unsharded state and loads into a
run at any N, sharded or not, and what cannot be sharded is refused at construction on every
rank.

Both runs of a comparison use the same gradients path and one summation algorithm for every
size (the ring), so the average is the same bits and only the sharding differs.
"""
import contextlib
import os

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer
from mpitrain.train import checkpoint as ckpt
from mpitrain.train.checkpoint_shards import ShardedState

mt.init()
N, R = mt.size(), mt.rank()
B = 4
STEPS = 5


@pytest.fixture(autouse=True)
def one_algorithm(use_settings):
    use_settings(algorithm="ring")


def model(dtype=np.float32):
    return mt.models.mlp(in_features=9, hidden=(13, 7), seed=1, dtype=dtype)


INNER = {
    "sgd": lambda m: mt.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                  weight_decay=1e-2, no_decay=mt.optim.is_bias_or_norm),
    "adam": lambda m: mt.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3),
    "adamw": lambda m: mt.optim.AdamW(m.parameters(), lr=1e-2,
                                      no_decay=mt.optim.is_bias_or_norm),
}


def train(kind, sharding, steps=STEPS, start=0, m=None, opt=None, k=1, **kw):
    m = model() if m is None else m
    if opt is None:
        opt = DistributedOptimizer(INNER[kind](m), m.named_parameters(), sharding=sharding,
                                   backward_passes_per_step=k, **kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(start, start + steps):
        rng = np.random.default_rng(77 + t)
        x = rng.standard_normal((N * k * B, 9)).astype(np.float32)
        y = rng.integers(0, 10, N * k * B)
        opt.zero_grad()
        for j in range(k):
            part = slice((R * k + j) * B, (R * k + j + 1) * B)
            loss_fn.forward(m.forward(np.ascontiguousarray(x[part])), y[part])
            m.backward(loss_fn.backward() / k, on_layer_done=opt.backward_hook)
        opt.step()
    return m, opt


def state(m, opt=None):
    """The model's state, whole (collective: sharded parameters are gathered for it)."""
    with opt.full_parameters() if opt is not None else contextlib.nullcontext():
        return m.state_dict(copy=True)


def assert_bitwise(a, b):
    """``a``, ``b``: (model, its optimizer) pairs."""
    sa, sb = state(*a), state(*b)
    for key in sb:
        assert sa[key].tobytes() == sb[key].tobytes(), \
            f"{key}: max diff {np.max(np.abs(sa[key] - sb[key]))}"


def assert_one_model(m, opt):
    flat = b"".join(v.tobytes() for _, v in sorted(state(m, opt).items()))
    assert len(set(mt.allgather_object(flat))) == 1, "the replicas differ"


EXTRA = {
    "plain": dict(),
    "clip": dict(clip_grad_norm=0.5),
    "clip-buckets": dict(clip_grad_norm=0.5, fusion_threshold_bytes=256),
    "accumulate": dict(k=2, overlap=False),
    "accumulate-overlap": dict(k=2, fusion_threshold_bytes=256),
    "fp16": dict(compression=mt.Compression.fp16),
    "buckets": dict(fusion_threshold_bytes=256),                 # several overlapped buckets
    "buckets-fp16": dict(fusion_threshold_bytes=256, compression=mt.Compression.fp16),
    "per-tensor": dict(fusion_threshold_bytes=0, overlap=False),
}


SHARDED = ["optimizer", "gradients", "parameters"]


@pytest.mark.parametrize("sharding", SHARDED)
@pytest.mark.parametrize("kind", sorted(INNER))
@pytest.mark.parametrize("extra", sorted(EXTRA))
def test_sharded_parameters_are_the_unsharded_bits(sharding, kind, extra):
    extra = EXTRA[extra]
    sharded, opt = train(kind, sharding, **extra)
    whole, unsharded = train(kind, "none", **extra)
    assert_bitwise((sharded, opt), (whole, unsharded))
    if "clip_grad_norm" in extra:       # it clipped, by the unsharded norm's bits
        assert opt.grad_norm == unsharded.grad_norm > extra["clip_grad_norm"]
    assert_one_model(sharded, opt)
    assert f"sharding={sharding!r}" in repr(opt)


@pytest.mark.parametrize("sharding", SHARDED)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_each_rank_holds_its_share_of_the_optimizer_state(sharding, kind):
    _, sharded = train(kind, sharding, steps=2)
    _, whole = train(kind, "none", steps=1)
    mine, all_of_it = sharded.memory_bytes(), whole.memory_bytes()
    params = mt.allgather_object(mine["parameters"])
    if sharding != "parameters" or N == 1:
        assert params == [all_of_it["parameters"]] * N and params[0] > 0
    else:       # between steps a rank holds its share of the parameters, no more
        assert sum(params) == all_of_it["parameters"], params
    # the shares cover the flat parameters once: their sum over the ranks is the whole
    shares = mt.allgather_object(mine["optimizer_state"])
    assert sum(shares) == all_of_it["optimizer_state"] > 0
    itemsize = 4 * (2 if kind == "adam" else 1)           # float32, buffers per element
    # one element per bucket more on some ranks (the chunks of each bucket differ by one)
    assert max(shares) - min(shares) <= itemsize * (1 if sharding == "optimizer" else 8)
    grads = mt.allgather_object(mine["gradients"])
    if sharding == "optimizer" or N == 1:
        assert grads == [all_of_it["gradients"]] * N
    else:       # between steps a rank holds its chunks of the averaged gradient, no more
        assert sum(grads) == all_of_it["gradients"], grads


@pytest.mark.skipif(N == 1, reason="one rank holds its parameters whole")
def test_sharded_parameters_are_gathered_layer_by_layer_with_the_next_prefetched():
    """Each step after the first: every layer's parameters gathered before its forward and
    again before its backward, each gather but the first of a pass started one layer early;
    between steps no parameter is held, and reading one is an error that says what to do."""
    m, opt = train("adam", "parameters", steps=1)
    gate = opt.strategy.gate
    assert (gate.gathers, gate.prefetched) == (0, 0)      # the first step runs whole
    layers = sum(1 for mod in m.modules() if mod._params)
    train("adam", "parameters", steps=2, start=1, m=m, opt=opt)
    assert gate.gathers == 2 * 2 * layers
    assert gate.prefetched == 2 * 2 * (layers - 1)
    assert not any(p.holds_data for p in m.parameters())
    with pytest.raises(RuntimeError, match="opt.full_parameters"):
        m.state_dict()
    with opt.full_parameters():     # what is written there is kept
        m.parameters()[0].data[0, 0] = 42.0
    with opt.full_parameters():
        assert m.parameters()[0].data[0, 0] == 42.0
        assert all(p.holds_data for p in m.parameters())
    assert not any(p.holds_data for p in m.parameters())


@pytest.mark.parametrize("written", SHARDED)
def test_a_checkpoint_holds_the_unsharded_state_and_resumes_at_any_n(tmp_path_factory,
                                                                     written):
    folder = mt.broadcast_object(str(tmp_path_factory.mktemp("sharded")) if R == 0 else None,
                                 root_rank=0)
    m, opt = train("adam", written, steps=3)
    mt.checkpoint.save(folder, m, opt, step=3)
    uninterrupted = train("adam", written, steps=2, start=3, m=m, opt=opt)
    # resumed sharded each way, and resumed unsharded: all continue the same run
    for sharding in SHARDED + ["none"]:
        m2 = model()
        opt2 = DistributedOptimizer(INNER["adam"](m2), m2.named_parameters(), sharding=sharding)
        assert mt.checkpoint.load_latest(folder, m2, opt2)["step"] == 3
        resumed = train("adam", sharding, steps=2, start=3, m=m2, opt=opt2)
        assert_bitwise(resumed, uninterrupted)
    # loaded into a sharded run after its first step (its parameters already sharded)
    m4, opt4 = train("adam", "parameters", steps=1)
    assert mt.checkpoint.load_latest(folder, m4, opt4)["step"] == 3
    assert_bitwise(train("adam", "parameters", steps=2, start=3, m=m4, opt=opt4),
                   uninterrupted)
    # what the file holds is an unsharded Adam's state: a plain optimizer at N = 1 loads it
    m3 = model()
    plain = INNER["adam"](m3)
    written = mt.checkpoint.load_latest(folder, m3, plain)
    assert written["step"] == 3 and plain.steps == 3
    whole = DistributedOptimizer(INNER["adam"](model()), sharding="none").memory_bytes()
    assert sum(int(a.nbytes) for arrays in plain.state.values() for a in arrays) == \
        whole["optimizer_state"]


def test_what_cannot_be_sharded_is_one_value_error_on_every_rank():
    m = model()
    for kwargs, message in [
            (dict(sharding="bogus"), "expected one of none, optimizer, gradients, parameters"),
            (dict(sharding="gradients", clip_grad_norm=1.0), None),
            (dict(sharding="gradients", compression=mt.Compression.none), None),
            (dict(sharding="parameters", clip_grad_norm=1.0), None),
            (dict(sharding="optimizer", average="weights"), "has no gradients to shard"),
            (dict(sharding="gradients", compression=mt.Compression.fp16, deterministic=True),
             "compression")]:
        if message is None:
            DistributedOptimizer(INNER["sgd"](m), **kwargs)
            continue
        with pytest.raises(ValueError, match=message):
            DistributedOptimizer(INNER["sgd"](m), **kwargs)
    mixed = model()
    params = mixed.parameters()
    params[-1].data = params[-1].data.astype(np.float64)
    wide = mt.models.mlp(in_features=9, hidden=(13, 7), seed=1, dtype=np.float64)
    with pytest.raises(ValueError, match="needs float32 parameters"):
        DistributedOptimizer(mt.optim.SGD(wide.parameters(), lr=0.1), sharding="gradients",
                             clip_grad_norm=1.0)
    with pytest.raises(ValueError, match="one dtype"):
        DistributedOptimizer(mt.optim.SGD(params, lr=0.1), sharding="optimizer")
    mt.barrier()


ZOO = {
    "gpt": (lambda: mt.models.get("gpt", vocab_size=17, block_size=8, n_layer=2, n_head=2,
                                  n_embd=16),
            lambda rng: (rng.integers(0, 17, (2, 8)), rng.integers(0, 17, (2, 8)))),
    "resnet20": (lambda: mt.models.get("resnet20"),
                 lambda rng: (rng.standard_normal((2, 3, 32, 32)).astype(np.float32),
                              rng.integers(0, 10, 2))),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_zoo_models_shard_to_the_unsharded_bits(name):
    """Several overlapped buckets (a small threshold), BatchNorm buffers, embeddings."""
    build, data = ZOO[name]

    def run(sharding):
        m = build()
        opt = DistributedOptimizer(
            mt.optim.AdamW(m.parameters(), lr=1e-3, no_decay=mt.optim.is_bias_or_norm),
            m.named_parameters(), sharding=sharding, fusion_threshold_bytes=20000)
        loss_fn = mt.nn.SoftmaxCrossEntropy()
        for t in range(2):
            x, y = data(np.random.default_rng(10 * t + R))
            opt.zero_grad()
            loss_fn(m.forward_through(x), y)
            m.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
            opt.step()
        return m, opt

    whole = run("none")
    for sharding in ("gradients", "parameters"):
        sharded, opt = run(sharding)
        assert_bitwise((sharded, opt), whole)
        # one model (BatchNorm's running statistics are each rank's own, sharded or not)
        with opt.full_parameters():
            flat = b"".join(p.data.tobytes() for p in sharded.parameters())
        assert len(set(mt.allgather_object(flat))) == 1, "the replicas differ"


@pytest.mark.parametrize("sharding", SHARDED)
def test_every_rank_writes_its_piece_and_rank_0_a_manifest(tmp_path_factory, sharding):
    folder = mt.broadcast_object(str(tmp_path_factory.mktemp("pieces")) if R == 0 else None,
                                 root_rank=0)
    m, opt = train("adam", sharding, steps=2)

    def gathered():
        raise AssertionError("a sharded save gathered the whole optimizer state")
    opt.strategy.checkpoint_state = gathered
    mt.checkpoint.save(folder, m, opt, step=2)
    names = sorted(os.listdir(folder))
    assert names == ["ckpt-00000002.npz"] + [
        f"ckpt-00000002.shard-{r:05d}-of-{N:05d}.npz" for r in range(N)]
    manifest = ckpt.load(os.path.join(folder, "ckpt-00000002.npz"))
    state = manifest.optimizer_state
    assert isinstance(state, ShardedState) and sorted(state.buffers) == ["exp_avg", "exp_avg_sq"]
    mt.barrier()


def test_a_checkpoint_with_a_missing_or_corrupt_piece_falls_back_to_the_previous(
        tmp_path_factory, capfd):
    folder = mt.broadcast_object(str(tmp_path_factory.mktemp("broken")) if R == 0 else None,
                                 root_rank=0)
    m, opt = train("adam", "gradients", steps=2)
    mt.checkpoint.save(folder, m, opt, step=2)
    m, opt = train("adam", "gradients", steps=1, start=2, m=m, opt=opt)
    mt.checkpoint.save(folder, m, opt, step=3)
    m, opt = train("adam", "gradients", steps=1, start=3, m=m, opt=opt)
    mt.checkpoint.save(folder, m, opt, step=4)
    mt.barrier()
    if R == 0:
        os.unlink(os.path.join(folder, f"ckpt-00000004.shard-{N - 1:05d}-of-{N:05d}.npz"))
        piece = os.path.join(folder, f"ckpt-00000003.shard-00000-of-{N:05d}.npz")
        data = bytearray(open(piece, "rb").read())
        data[-5] ^= 0xFF
        open(piece, "wb").write(bytes(data))
    mt.barrier()
    m2 = model()
    opt2 = DistributedOptimizer(INNER["adam"](m2), m2.named_parameters(), sharding="gradients")
    assert mt.checkpoint.load_latest(folder, m2, opt2)["step"] == 2
    err = capfd.readouterr().err
    if R == 0:
        assert "is missing" in err and "checksum mismatch" in err, err
    resumed = train("adam", "gradients", steps=1, start=2, m=m2, opt=opt2)
    assert_bitwise(resumed, train("adam", "gradients", steps=3))


@pytest.mark.skipif(N & (N - 1) != 0, reason="deterministic mode: a power-of-two N")
@pytest.mark.parametrize("sharding", SHARDED)
@pytest.mark.parametrize("kind", sorted(INNER))
def test_deterministic_sharded_is_the_unsharded_deterministic_bits(sharding, kind):
    sharded, opt = train(kind, sharding, deterministic=True, k=2)
    assert_bitwise((sharded, opt), train(kind, "none", deterministic=True, k=2))
    assert_one_model(sharded, opt)
    shares = mt.allgather_object(opt.memory_bytes()["optimizer_state"])
    assert sum(shares) == whole_state_bytes(kind)


def whole_state_bytes(kind):
    _, opt = train(kind, "none", steps=1)
    return opt.memory_bytes()["optimizer_state"]


JOIN_EXTRA = ["plain", "clip", "clip-buckets", "fp16", "buckets-fp16", "per-tensor",
              "accumulate-overlap"]


def uneven(sharding, extra, joins=True):
    """Rank N-1 has 2 steps of data, the others 4 (the learning rate changes every step);
    then every rank joins, the sharded ones with their optimizer."""
    kw = dict(EXTRA[extra])
    k = kw.pop("k", 1)
    m = model()
    opt = DistributedOptimizer(INNER["adam"](m), m.named_parameters(), sharding=sharding,
                               backward_passes_per_step=k, **kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(2 if R == N - 1 else 4):
        rng = np.random.default_rng(77 + t)
        x = rng.standard_normal((N * k * B, 9)).astype(np.float32)
        y = rng.integers(0, 10, N * k * B)
        opt.zero_grad()
        for j in range(k):
            part = slice((R * k + j) * B, (R * k + j + 1) * B)
            loss_fn.forward(m.forward(np.ascontiguousarray(x[part])), y[part])
            m.backward(loss_fn.backward() / k, on_layer_done=opt.backward_hook)
        opt.lr = 1e-2 / (t + 1)
        opt.step()
    return m, opt, mt.join(optimizers=[opt] if joins else ())


@pytest.mark.skipif(N == 1, reason="a rank to join while the others step")
@pytest.mark.parametrize("sharding", SHARDED)
@pytest.mark.parametrize("extra", JOIN_EXTRA)
def test_a_joined_rank_steps_its_share_and_the_others_take_the_unsharded_steps(sharding,
                                                                                extra):
    """The active ranks end on the bits of the unsharded run with the same join (the joined
    rank's gradients zeros); the joined rank stepped its share with them, so every rank,
    the joined one too, holds that one model."""
    sharded_model, opt, last = uneven(sharding, extra)
    whole, whole_opt, whole_last = uneven("none", extra)
    assert last == whole_last == N - 2
    mine, want = state(sharded_model, opt), state(whole, whole_opt)
    if R != N - 1:
        for key in want:
            assert mine[key].tobytes() == want[key].tobytes(), key
    assert_one_model(sharded_model, opt)


@pytest.mark.skipif(N == 1, reason="a rank to join while the others step")
@pytest.mark.parametrize("sharding", SHARDED)
def test_a_rank_joined_without_its_sharded_optimizer_is_one_error_on_every_rank(sharding):
    m = model()
    opt = DistributedOptimizer(INNER["adam"](m), m.named_parameters(), sharding=sharding)
    if R == N - 1:
        with pytest.raises((ValueError, mt.CollectiveError), match=r"mt.join\(optimizers="):
            mt.join()
    else:
        loss_fn = mt.nn.SoftmaxCrossEntropy()
        rng = np.random.default_rng(R)
        opt.zero_grad()
        loss_fn.forward(m.forward(rng.standard_normal((B, 9)).astype(np.float32)),
                        rng.integers(0, 10, B))
        m.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
        with pytest.raises((ValueError, mt.CollectiveError), match=r"mt.join\(optimizers="):
            opt.step()
    mt.join()                       # every rank, the one whose join raised too
