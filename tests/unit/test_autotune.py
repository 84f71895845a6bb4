"""The autotuner's schedule and choice (mpitrain/autotune.py), on one process with a fake World.

The cross-rank part is a ``gather`` callable: here it returns this rank's value and a made-up
slower rank's, so the scores -- and hence the choice -- are known in advance, whatever the clock.
"""
import csv
import dataclasses

import pytest

from mpitrain.parallel import autotune
from mpitrain.parallel.autotune import Trial
from mpitrain.comm.settings import CommSettings


@dataclasses.dataclass
class FakeWorld:
    settings: CommSettings
    rank: int = 0
    size: int = 2
    plans: dict = dataclasses.field(default_factory=dict)


def test_candidates_start_with_the_default_and_try_one_threshold_above_the_model():
    trials = autotune.candidates(Trial(4 << 20, "auto"), gradient_bytes=600 << 10)
    assert trials[0] == Trial(4 << 20, "auto")
    # below 600 KiB: 0 and 256 KiB; at or above: only 1 MiB (larger ones plan alike)
    assert trials[1:] == [Trial(t, a) for t in (0, 256 << 10, 1 << 20) for a in ("mpi", "ring")]
    # the default is not tried twice
    again = autotune.candidates(Trial(0, "mpi"), gradient_bytes=100)
    assert again == [Trial(0, "mpi"), Trial(0, "ring"), Trial(256 << 10, "mpi"),
                     Trial(256 << 10, "ring")]


def test_trials_switch_after_warmup_plus_timed_steps_and_keep_the_slowest_ranks_best(tmp_path):
    log = tmp_path / "trials.csv"
    settings = CommSettings(autotune=True, autotune_log=str(log), autotune_steps=2,
                            autotune_warmup_steps=1)
    state = FakeWorld(settings)
    state.plans["x"] = object()
    # the other rank's median per trial: trial 2 is the fastest slowest-rank time
    other = iter([9.0, 8.0, 1.0, 7.0, 6.0])
    gathered = []

    def gather(obj):
        gathered.append(obj)
        if obj is None:                               # the log path check at construction
            return [None, None]
        return [obj, next(other)]

    applied = []
    tuner = autotune.for_optimizer(state, gather, 4 << 20, 300 << 10, applied.append)
    assert tuner.trials == [Trial(4 << 20, "auto"), Trial(0, "mpi"), Trial(0, "ring"),
                            Trial(256 << 10, "mpi"), Trial(256 << 10, "ring"),
                            Trial(1 << 20, "mpi"), Trial(1 << 20, "ring")]
    tuner.trials = tuner.trials[:5]                   # five trials are enough here
    assert applied == [4 << 20] and state.settings.algorithm == "auto"
    steps_per_trial = 1 + 2
    for _ in range(autotune.SETTLE_STEPS):            # JIT, first touches: no trial
        tuner.step_done()
        assert tuner.current == tuner.trials[0] and not gathered[1:]
    for trial in range(5):
        for step in range(steps_per_trial):
            assert tuner.chosen is None and len(tuner.scores) == trial
            tuner.step_done()
        if trial < 4:
            assert tuner.current == tuner.trials[trial + 1]
            assert state.settings.algorithm == tuner.trials[trial + 1].algorithm
            assert applied[-1] == tuner.trials[trial + 1].threshold_bytes
    assert tuner.scores == [9.0, 8.0, 1.0, 7.0, 6.0]
    assert tuner.chosen == Trial(0, "ring") == tuner.current
    assert state.settings.algorithm == "ring" and applied[-1] == 0 and state.plans == {}
    tuner.step_done()                                 # chosen: no more trials, no more gathers
    assert len(gathered) == 1 + 5
    rows = list(csv.DictReader(log.open()))
    assert [r["chosen"] for r in rows] == ["0", "0", "1", "0", "0"]
    assert rows[2] == {"trial": "2", "fusion_threshold_bytes": "0", "algorithm": "ring",
                       "warmup_steps": "1", "timed_steps": "2",
                       "step_ms_slowest_rank": "1000.0000", "chosen": "1"}
    assert Trial(0, "ring").pin() == ("MPITRAIN_AUTOTUNE=0 MPITRAIN_FUSION_THRESHOLD=0 "
                                      "MPITRAIN_ALLREDUCE=ring")


def test_off_or_one_rank_is_no_tuner():
    assert autotune.for_optimizer(FakeWorld(CommSettings()), None, 0, 1, None) is None
    assert autotune.for_optimizer(FakeWorld(CommSettings(autotune=True), size=1), None, 0, 1,
                                  None) is None


def test_an_unwritable_log_is_a_value_error_before_any_trial(tmp_path):
    settings = CommSettings(autotune=True, autotune_log=str(tmp_path / "no" / "such.csv"))
    with pytest.raises(ValueError, match="MPITRAIN_AUTOTUNE_LOG=.*cannot write it"):
        autotune.for_optimizer(FakeWorld(settings), lambda obj: [obj, None], 0, 1, print)


@pytest.mark.parametrize("env, message", [
    ({"MPITRAIN_AUTOTUNE": "maybe"}, "MPITRAIN_AUTOTUNE='maybe': expected 1/0, true/false"),
    ({"MPITRAIN_AUTOTUNE_STEPS": "0"}, "MPITRAIN_AUTOTUNE_STEPS=0 must be >= 1"),
    ({"MPITRAIN_AUTOTUNE_WARMUP_STEPS": "-1"}, "MPITRAIN_AUTOTUNE_WARMUP_STEPS=-1 must be >= 0"),
    ({"MPITRAIN_AUTOTUNE_STEPS": "many"}, "MPITRAIN_AUTOTUNE_STEPS='many' is not an integer")])
def test_bad_settings_are_one_clear_line(env, message):
    with pytest.raises(ValueError, match=message):
        CommSettings.from_env(env)
