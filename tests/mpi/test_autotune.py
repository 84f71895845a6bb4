"""MPITRAIN_AUTOTUNE on a real training loop under 1..4 ranks (mpitrain/autotune.py).

A small MLP trains with DistributedOptimizer and the backward hook (overlapped buckets), with
autotune switched on through the comm settings (tests/support/comm.py). Every trial changes the
fusion threshold and the allreduce path on every rank at the same step, so the replicas must stay
identical and the run must still equal one rank on the global batch; afterwards every rank has
the same choice, applied, and rank 0 has written the CSV.
"""
import csv

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world
from mpitrain.parallel.optimizer import DistributedOptimizer

COMM = MPI.COMM_WORLD
N, R = COMM.Get_size(), COMM.Get_rank()


def _train(world_size, rank, steps, per_rank=4):
    model = mt.models.mlp(in_features=20, hidden=(16, 12), seed=0, dtype=np.float64)
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if world_size > 1:
        opt = DistributedOptimizer(opt, model.named_parameters())
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(steps):
        rng = np.random.default_rng(1000 + t)
        x = rng.standard_normal((world_size * per_rank, 20))      # (global batch, 20)
        y = rng.integers(0, 10, world_size * per_rank)            # (global batch,)
        opt.zero_grad()
        loss_fn.forward(model.forward(np.ascontiguousarray(x[rank::world_size])),
                        np.ascontiguousarray(y[rank::world_size]))
        hook = opt.backward_hook if world_size > 1 else None
        model.backward(loss_fn.backward(), on_layer_done=hook)
        opt.step()
    return model.state_dict(copy=True), opt


def test_autotune_agrees_on_every_rank_keeps_replicas_identical_and_logs(use_settings, tmp_path):
    log = COMM.bcast(str(tmp_path / "autotune.csv"), root=0)       # one path: settings agree
    use_settings(autotune=True, autotune_log=log, autotune_steps=2, autotune_warmup_steps=1)
    state, opt = _train(N, R, steps=22)      # 5 settle + 5 trials x (1 + 2) steps + 2 kept
    ref, _ = _train(1, 0, steps=22, per_rank=4 * N)
    for k in ref:
        np.testing.assert_allclose(state[k], ref[k], rtol=1e-9, atol=1e-12)
    gathered = mt.allgather_object(state)
    assert all(all(np.array_equal(g[k], state[k]) for k in state) for g in gathered)
    if N == 1:
        assert not hasattr(opt, "autotuner")          # one rank: no DistributedOptimizer, no tuning
        return
    tuner = opt.autotuner
    assert tuner.chosen is not None, f"{len(tuner.scores)} of {len(tuner.trials)} trials ran"
    assert mt.allgather_object((tuner.chosen, tuner.scores)) == [(tuner.chosen, tuner.scores)] * N
    assert opt.fusion_threshold_bytes == tuner.chosen.threshold_bytes
    assert world.current().settings.algorithm == tuner.chosen.algorithm
    if R == 0:
        rows = list(csv.DictReader(open(log)))
        assert len(rows) == len(tuner.trials) >= 3
        assert [int(r["chosen"]) for r in rows].count(1) == 1
        best = min(rows, key=lambda r: float(r["step_ms_slowest_rank"]))
        assert (int(best["fusion_threshold_bytes"]), best["algorithm"]) == \
            (tuner.chosen.threshold_bytes, tuner.chosen.algorithm) and best["chosen"] == "1"
    COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="autotune needs two ranks")
def test_pinned_values_rerun_bitwise(use_settings):
    """What the tuner prints to pin (MPITRAIN_FUSION_THRESHOLD, MPITRAIN_ALLREDUCE): two runs
    with those settings are bitwise identical."""
    use_settings(fusion_threshold_bytes=0, algorithm="ring")
    a, _ = _train(N, R, steps=4)
    b, _ = _train(N, R, steps=4)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_bad_autotune_env_is_one_clear_error_at_init_on_every_rank(monkeypatch):
    mt.shutdown()
    try:
        for key, value, message in (("MPITRAIN_AUTOTUNE", "maybe", "expected 1/0, true/false"),
                                    ("MPITRAIN_AUTOTUNE_STEPS", "0", "must be >= 1")):
            monkeypatch.setenv(key, value)
            with pytest.raises(ValueError, match=f"{key}=.*{message}"):
                mt.init(threads=None)
            monkeypatch.delenv(key)
    finally:
        mt.init(threads=None)


@pytest.mark.skipif(N < 2, reason="autotune needs two ranks")
def test_unwritable_log_is_a_value_error_on_every_rank(use_settings):
    use_settings(autotune=True, autotune_log="/nonexistent-dir/autotune.csv")
    model = mt.models.mlp(in_features=20, hidden=(16,), seed=0, dtype=np.float64)
    with pytest.raises(ValueError, match="MPITRAIN_AUTOTUNE_LOG='/nonexistent-dir/autotune.csv'"):
        DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
