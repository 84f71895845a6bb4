"""mt.evaluate warns (rank 0, one stderr line) when plain BatchNorm running statistics differ
across ranks, and is silent when they agree or belong to SyncBatchNorm; under 1..4 ranks (one
rank: nothing can differ, never a warning)."""
import numpy as np
import pytest

import mpitrain as mt

N, R = mt.size(), mt.rank()
DATA = mt.data.synthetic(20, shape=(12,), classes=3, seed=4)


def _model(norm=mt.nn.BatchNorm1d):
    return mt.nn.Sequential(mt.nn.Linear(12, 8, seed=1), norm(8), mt.nn.ReLU(),
                            mt.nn.Linear(8, 3, seed=2))


def _evaluate(capsys, model):
    """mt.evaluate's result and the stderr lines of this rank."""
    capsys.readouterr()
    result = mt.evaluate(model, DATA, batch_size=7)
    return result, capsys.readouterr().err.splitlines()


def test_differing_running_means_warn_once_on_rank_0(capsys):
    model = _model()
    model[1].running_mean[...] = 0.5 * R + np.arange(8, dtype=np.float32)      # (8,)
    model[1].running_var[...] = 2.0
    result, err = _evaluate(capsys, model)
    assert result["total"] == 20
    if N == 1 or R != 0:
        assert err == []
        return
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("mpitrain: warning: evaluate: BatchNorm running statistics differ "
                           "across ranks ('1.running_mean' up to ")
    assert f" up to {0.5 * (N - 1):.3g} apart)" in line
    assert "mt.grouped_allreduce_(model.buffers(), op=mt.Average)" in line
    assert "mt.broadcast_parameters(model.state_dict(), root_rank=0)" in line


def test_the_first_differing_buffer_is_named(capsys):
    model = _model()
    model[1].running_var[3] = 1.0 + R                  # the means agree, one variance does not
    _, err = _evaluate(capsys, model)
    if N == 1 or R != 0:
        assert err == []
    else:
        assert len(err) == 1 and f"('1.running_var' up to {N - 1} apart)" in err[0], err


def test_training_on_each_ranks_shard_makes_them_differ_and_averaging_fixes_it(capsys):
    model = _model()
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = mt.data.synthetic(16, shape=(12,), classes=3, seed=30 + R)   # each rank its own
    model.train()
    model(mine.images)                                  # running statistics of this rank only
    _, err = _evaluate(capsys, model)
    assert len(err) == (1 if N > 1 and R == 0 else 0), err
    mt.grouped_allreduce_(model.buffers(), op=mt.Average)
    averaged, err = _evaluate(capsys, model)
    assert err == []
    model(mine.images)
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast, err = _evaluate(capsys, model)
    assert err == []
    assert len(set(map(str, mt.allgather_object((averaged, broadcast))))) == 1


@pytest.mark.parametrize("norm", [mt.nn.SyncBatchNorm, None])
def test_equal_by_construction_or_no_batchnorm_is_silent(capsys, norm):
    model = mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=1) if norm is None \
        else _model(norm)
    if norm is not None:
        model[1].running_mean[...] = R       # SyncBatchNorm's are left out of the comparison
    _, err = _evaluate(capsys, model)
    assert err == []
