"""broadcast_parameters / broadcast_optimizer_state with every spelling Horovod users write.

Every rank first makes its replica different (a rank-dependent perturbation), broadcasts from the
last rank, and then all ranks must hold bitwise-equal parameters (checksums compared through
allgather_object). The first test is the idiom of every Horovod script,
``broadcast_parameters(model.state_dict(), root_rank=0)``, which silently did nothing while
state_dict() returned copies.
"""
import hashlib

import numpy as np
import pytest

import mpitrain as mt

N, R = mt.size(), mt.rank()
ROOT = N - 1                        # not always 0: the root really is the source


def _model():
    return mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=0)


def _perturb(arrays):
    rng = np.random.default_rng(100 + R)
    for a in arrays:
        a += rng.standard_normal(a.shape).astype(a.dtype)


def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _equal_everywhere(arrays):
    digests = mt.allgather_object(_digest(arrays))
    return len(set(digests)) == 1


SPELLINGS = {
    "state_dict": lambda m: m.state_dict(),
    "named_parameters": lambda m: m.named_parameters(),
    "parameters": lambda m: m.parameters(),
    "dict_of_arrays": lambda m: {name: p.data for name, p in m.named_parameters()},
    "list_of_name_parameter": lambda m: list(m.named_parameters()),
    "generator_of_pairs": lambda m: ((name, p) for name, p in m.named_parameters()),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_spelling_makes_the_replicas_bitwise_equal(spelling):
    model = _model()
    _perturb([p.data for p in model.parameters()])
    root_values = mt.broadcast_object(model.state_dict(copy=True), root_rank=ROOT)
    assert N == 1 or not _equal_everywhere([p.data for p in model.parameters()])
    mt.broadcast_parameters(SPELLINGS[spelling](model), root_rank=ROOT)
    assert _equal_everywhere([p.data for p in model.parameters()])
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, root_values[name])


def test_a_dict_of_the_users_own_arrays_is_written_in_place():
    arrays = {"w": np.full((2, 3), float(R)), "b": np.arange(4, dtype=np.float32) * (R + 1)}
    mt.broadcast_parameters(arrays, root_rank=ROOT)
    np.testing.assert_array_equal(arrays["w"], np.full((2, 3), float(ROOT)))
    np.testing.assert_array_equal(arrays["b"], np.arange(4, dtype=np.float32) * (ROOT + 1))


@pytest.mark.parametrize("bad, match", [
    ({"w": [1.0, 2.0]}, "list, which cannot be written back"),
    ({"w": 3.0}, "float, which cannot be written back"),
    (42, "got int"),
    ([("w", np.zeros(2), "extra")], r"\(name, parameter\) pairs"),
])
def test_input_that_cannot_be_written_back_raises_on_every_rank(bad, match):
    with pytest.raises(ValueError, match=match):
        mt.broadcast_parameters(bad, root_rank=0)


def test_a_bad_input_on_one_rank_raises_on_every_rank_instead_of_hanging():
    w = np.zeros(3)
    if R == N - 1:
        w.flags.writeable = False
    with pytest.raises(ValueError, match=rf"rank {N - 1}: 'w' is a read-only array"):
        mt.broadcast_parameters({"w": w}, root_rank=0)


def test_different_names_across_ranks_are_a_collective_error():
    arrays = {"w" if R == 0 else "v": np.zeros(2)}
    if N == 1:
        mt.broadcast_parameters(arrays, root_rank=0)
        return
    with pytest.raises(mt.CollectiveError, match="names of ranks"):
        mt.broadcast_parameters(arrays, root_rank=0)


def _stepped_optimizer(kind, model):
    params = model.parameters()
    make = {"sgd": lambda: mt.optim.SGD(params, lr=0.1, momentum=0.9),
            "adam": lambda: mt.optim.Adam(params, lr=1e-3),
            "rmsprop": lambda: mt.optim.RMSprop(params, lr=1e-3, momentum=0.9, centered=True)}
    opt = make[kind]()
    rng = np.random.default_rng(7 + R)                  # per-rank gradients -> per-rank state
    for _ in range(2 + R):                              # ... and a per-rank step count
        for p in params:
            p.grad[...] = rng.standard_normal(p.shape)
        opt.step()
    return opt


@pytest.mark.parametrize("kind", ["sgd", "adam", "rmsprop"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_broadcast_optimizer_state_makes_momentum_and_adam_state_equal(kind, wrapped):
    model = _model()
    opt = _stepped_optimizer(kind, model)
    if wrapped:
        opt = mt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt.lr = 0.1 * (R + 1)
    root_state = mt.broadcast_object(opt.state_dict(), root_rank=ROOT)
    mt.broadcast_optimizer_state(opt, root_rank=ROOT)
    state = opt.state_dict()
    assert sorted(state) == sorted(root_state)
    for key, value in root_state.items():
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(value), err_msg=key)
    arrays = [state[k] for k in sorted(state) if isinstance(state[k], np.ndarray)]
    assert arrays and _equal_everywhere(arrays)
    assert len(set(mt.allgather_object((opt.lr, state["step"])))) == 1
