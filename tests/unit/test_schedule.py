"""LRSchedule against PyTorch's formulas (MultiStepLR per epoch, CosineAnnealingLR per step)."""
import math

import pytest

import mpitrain as mt


def torch_cosine(lr, total):
    """CosineAnnealingLR(T_max=total, eta_min=0)'s recursive update, as in torch/optim."""
    lrs, cur = [lr], lr
    for t in range(1, total):
        if (t - 1 - total) % (2 * total) == 0:
            cur = cur + lr * (1 - math.cos(math.pi / total)) / 2
        else:
            cur = ((1 + math.cos(math.pi * t / total)) / (1 + math.cos(math.pi * (t - 1) / total))
                   * cur)
        lrs.append(cur)
    return lrs


def torch_multistep(lr, milestones, gamma, epochs):
    """MultiStepLR stepped once per epoch: the lr used in each epoch."""
    lrs, cur = [], lr
    for epoch in range(epochs):
        if epoch in milestones:
            cur *= gamma ** milestones.count(epoch)
        lrs.append(cur)
    return lrs


def test_cosine_matches_pytorch_per_step():
    sched = mt.optim.LRSchedule(0.1, "cosine", total_steps=50)
    want = torch_cosine(0.1, 50)
    for t in range(50):
        assert sched.lr_at(t) == pytest.approx(want[t], rel=1e-12, abs=1e-15)
    assert sched.lr_at(0) == 0.1
    assert sched.lr_at(25) == pytest.approx(0.05, rel=1e-12)
    assert sched.lr_at(50) == pytest.approx(0.0, abs=1e-18)
    assert sched.lr_at(70) == sched.lr_at(50)              # past the end: stays at 0


def test_docstring_example():
    sched = mt.optim.LRSchedule(0.1, "cosine", total_steps=12)
    assert [round(sched.lr_at(t), 4) for t in (0, 1, 2, 3, 11)] == [0.1, 0.0983, 0.0933,
                                                                    0.0854, 0.0017]
    step = mt.optim.LRSchedule(0.1, "step", steps_per_epoch=4, milestones=(1, 2))
    assert [round(step.lr_at(t), 6) for t in (0, 3, 4, 7, 8, 11)] == [0.1, 0.1, 0.01, 0.01,
                                                                      0.001, 0.001]


@pytest.mark.parametrize("milestones,gamma", [((2, 5), 0.1), ((1,), 0.5), ((3, 4, 8), 0.2)])
def test_step_matches_pytorch_multistep(milestones, gamma):
    spe, epochs = 7, 10
    sched = mt.optim.LRSchedule(0.4, "step", steps_per_epoch=spe, milestones=milestones,
                                gamma=gamma)
    want = torch_multistep(0.4, list(milestones), gamma, epochs)
    for t in range(spe * epochs):
        assert sched.lr_at(t) == pytest.approx(want[t // spe], rel=1e-12)


def test_constant_and_warmup_composition():
    assert mt.optim.LRSchedule(0.3).lr_at(1000) == 0.3
    sched = mt.optim.LRSchedule(0.2, "cosine", total_steps=100, warmup_steps=10)
    for t in (0, 4, 9, 10, 60, 99):
        cosine = 0.5 * (1 + math.cos(math.pi * t / 100))
        assert sched.lr_at(t) == pytest.approx(0.2 * min(1, (t + 1) / 10) * cosine, rel=1e-12)
    assert sched.lr_at(0) == pytest.approx(0.02)            # lr / warmup_steps on the first step


def test_fractional_steps_are_continuous():
    sched = mt.optim.LRSchedule(1.0, "cosine", total_steps=10)
    assert sched.lr_at(2) > sched.lr_at(2.5) > sched.lr_at(3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="poly"), "unknown lr schedule 'poly'"),
    (dict(schedule="cosine"), "total_steps > 0"),
    (dict(schedule="step", milestones=(2,)), "steps_per_epoch"),
    (dict(schedule="step", steps_per_epoch=3, milestones=(2, 2)), "strictly increasing"),
    (dict(schedule="step", steps_per_epoch=3, milestones=(0, 2)), "must be >= 1"),
    (dict(schedule="step", steps_per_epoch=3, milestones=(2,), gamma=0), "gamma"),
    (dict(schedule="cosine", total_steps=5, milestones=(2,)), "only for the 'step'"),
    (dict(warmup_steps=-1), "warmup_steps"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.optim.LRSchedule(0.1, **kwargs)
