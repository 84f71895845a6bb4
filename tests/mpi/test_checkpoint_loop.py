"""mt.checkpoint.save / load_latest under 1..4 ranks: rank 0 alone touches the folder, every
rank ends with rank 0's model, the optimizer state the strategy's checkpoint holds (in weights
mode the mean of the ranks' moments) and the same meta, and every failure is the same
CheckpointError on every rank (never one rank raising while the others wait)."""
import os
import shutil
import tempfile

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.train.checkpoint import CheckpointError

N, R = mt.size(), mt.rank()


@pytest.fixture
def folder():
    """One fresh folder, the same path on every rank (rank 0 creates and removes it)."""
    path = mt.broadcast_object(tempfile.mkdtemp(prefix="mt-ckpt-") if R == 0 else None)
    yield path
    mt.barrier()
    if R == 0:
        shutil.rmtree(path, ignore_errors=True)


def _replica(seed):
    """A model and a wrapped SGD with momentum, after one update on this seed's data."""
    model = mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=seed)
    opt = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  average="weights", average_every=2)   # each rank its own
    data = mt.data.synthetic(8, shape=(12,), classes=3, seed=seed)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    opt.zero_grad()
    loss_fn(model(data.images), data.labels)
    model.backward(loss_fn.backward())
    opt.step()
    return model, opt


def _bytes(model, opt):
    state = {n: a.tobytes() for n, a in model.state_dict(copy=True).items()}
    state.update({k: np.asarray(v).tobytes() for k, v in opt.state_dict().items()})
    return state


def test_every_rank_resumes_from_rank_0s_model_and_the_mean_of_the_moments(folder):
    model, opt = _replica(seed=R)                       # every rank differs
    saved = {n: a.tobytes() for n, a in model.state_dict(copy=True).items()}
    for key, value in opt.state_dict().items():         # weights mode: the moments' mean
        value = np.asarray(value)
        if value.dtype.kind == "f" and value.ndim:
            value = np.asarray(mt.allreduce(value, op=mt.Average), value.dtype)
        saved[key] = value.tobytes()
    path = mt.checkpoint.save(folder, model, opt, step=5, extra={"epoch": 2})
    assert mt.allgather_object(path) == [os.path.join(folder, "ckpt-00000005.npz")] * N
    fresh, fresh_opt = _replica(seed=100 + R)
    meta = mt.checkpoint.load_latest(folder, fresh, fresh_opt)
    assert meta == {"step": 5, "epoch": 2}
    assert all(m == meta for m in mt.allgather_object(meta))
    assert mt.allgather_object(_bytes(fresh, fresh_opt)) == [mt.broadcast_object(saved)] * N


def test_rank_0_alone_writes(folder):
    """The other ranks' folder argument is never touched: a path they could not create."""
    where = folder if R == 0 else os.path.join(os.devnull, "nowhere")
    model, opt = _replica(seed=0)
    mt.checkpoint.save(where, model, opt, step=1)
    assert os.listdir(folder) == ["ckpt-00000001.npz"]
    assert mt.checkpoint.load_latest(where, *_replica(seed=1)) == {"step": 1}


def test_no_checkpoint_is_none_everywhere_and_a_damaged_one_warns_on_rank_0(folder, capsys):
    assert mt.allgather_object(mt.checkpoint.load_latest(folder, *_replica(0))) == [None] * N
    model, opt = _replica(seed=0)
    mt.checkpoint.save(folder, model, opt, step=3)
    if R == 0:
        with open(os.path.join(folder, "ckpt-00000004.npz"), "wb") as f:
            f.write(b"half a file")
    mt.barrier()
    capsys.readouterr()
    assert mt.checkpoint.load_latest(folder, *_replica(seed=1)) == {"step": 3}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (1 if R == 0 else 0), err
    if R == 0:
        assert err[0].startswith("mpitrain: warning: skipping ") and "ckpt-00000004.npz" in err[0]


def test_a_checkpoint_that_does_not_fit_one_ranks_model_raises_on_every_rank(folder):
    model, opt = _replica(seed=0)
    mt.checkpoint.save(folder, model, opt, step=1)
    odd = R == N - 1                                    # the last rank built another model
    other = mt.models.mlp(in_features=12, hidden=(5 if odd else 8,), classes=3, seed=0)
    other_opt = mt.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="ckpt-00000001.npz does not fit this model"):
        mt.checkpoint.load_latest(folder, other, other_opt)


def test_a_failed_write_on_rank_0_raises_on_every_rank(folder):
    blocker = os.path.join(folder, "a-file")
    if R == 0:
        with open(blocker, "w") as f:
            f.write("not a folder")
    mt.barrier()
    with pytest.raises(CheckpointError, match="cannot write a checkpoint in .*a-file"):
        mt.checkpoint.save(blocker, *_replica(seed=0), step=1)
    with pytest.raises(CheckpointError, match="cannot read checkpoints in .*a-file"):
        mt.checkpoint.load_latest(blocker, *_replica(seed=0))


def test_an_argument_bad_on_one_rank_raises_on_every_rank_before_writing(folder):
    odd = R == N - 1
    with pytest.raises(ValueError, match="extra object is not JSON-able"):
        mt.checkpoint.save(folder, *_replica(seed=0), step=1, extra={"x": object() if odd else 1})
    assert os.listdir(folder) == []
