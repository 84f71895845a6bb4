"""LRSchedule against PyTorch's formulas (MultiStepLR per epoch, CosineAnnealingLR per step), and
the cosine's floor min_lr against nanoGPT's formula."""
import math

import pytest

import mpitrain as mt


def torch_cosine(lr, total, eta_min=0.0):
    """CosineAnnealingLR(T_max=total, eta_min)'s recursive update, as in torch/optim."""
    lrs, cur = [lr], lr
    for t in range(1, total):
        if (t - 1 - total) % (2 * total) == 0:
            cur = cur + (lr - eta_min) * (1 - math.cos(math.pi / total)) / 2
        else:
            cur = ((1 + math.cos(math.pi * t / total)) / (1 + math.cos(math.pi * (t - 1) / total))
                   * (cur - eta_min) + eta_min)
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


def nanogpt_lr(it, lr, min_lr, warmup_iters, lr_decay_iters):
    """nanoGPT's get_lr (train.py), transcribed."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (lr - min_lr)


def test_cosine_floor_is_nanogpts_formula_and_pytorchs_eta_min():
    sched = mt.optim.LRSchedule(6e-4, "cosine", total_steps=40, min_lr=6e-5)
    want = torch_cosine(6e-4, 40, eta_min=6e-5)
    for t in range(60):
        assert sched.lr_at(t) == pytest.approx(nanogpt_lr(t, 6e-4, 6e-5, 0, 40), rel=1e-12)
        if t < 40:
            assert sched.lr_at(t) == pytest.approx(want[t], rel=1e-12)
    assert sched.lr_at(0) == pytest.approx(6e-4, rel=1e-15)
    assert sched.lr_at(40) == pytest.approx(6e-5, rel=1e-12)
    assert sched.lr_at(500) == sched.lr_at(40)                 # past the end: stays at the floor
    assert min(sched.lr_at(t) for t in range(60)) >= 6e-5 * (1 - 1e-12)


def test_min_lr_docstring_example():
    sched = mt.optim.LRSchedule(0.1, "cosine", total_steps=12, min_lr=0.01)
    assert [round(sched.lr_at(t), 4) for t in (0, 1, 2, 3, 11, 12, 30)] == [
        0.1, 0.0985, 0.094, 0.0868, 0.0115, 0.01, 0.01]


def test_warmup_multiplies_the_floored_cosine():
    sched = mt.optim.LRSchedule(0.2, "cosine", total_steps=100, warmup_steps=10, min_lr=0.05)
    for t in (0, 4, 9, 10, 60, 99, 100, 150):
        cosine = 0.5 * (1 + math.cos(math.pi * min(t, 100) / 100))
        want = min(1, (t + 1) / 10) * (0.05 + (0.2 - 0.05) * cosine)
        assert sched.lr_at(t) == pytest.approx(want, rel=1e-12)
    assert sched.lr_at(0) == pytest.approx(0.02 * (0.05 + 0.15 * 1.0) / 0.2)
    # with the warm-up done, nanoGPT's floor formula over the whole run (progress from step 0)
    assert sched.lr_at(70) == pytest.approx(nanogpt_lr(70, 0.2, 0.05, 0, 100), rel=1e-12)


def test_zero_floor_keeps_the_old_values_bit_for_bit():
    with_floor = mt.optim.LRSchedule(0.2, "cosine", total_steps=100, warmup_steps=10, min_lr=0.0)
    for t in (0, 3, 9.5, 10, 37, 99, 100, 120):
        old = 0.2 * min(1.0, (t + 1) / 10) * (0.5 * (1.0 + math.cos(math.pi * min(t / 100, 1))))
        assert with_floor.lr_at(t) == old
    assert with_floor.min_lr == 0.0 and "min_lr=0.0" in repr(with_floor)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="cosine", total_steps=5, min_lr=-0.01), r"min_lr must be in \[0, lr=0.1\]"),
    (dict(schedule="cosine", total_steps=5, min_lr=0.2), r"got 0.2"),
    (dict(schedule="step", steps_per_epoch=3, min_lr=0.01), "only for the 'cosine'"),
    (dict(min_lr=0.05), "only for the 'cosine'"),
])
def test_bad_min_lr(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.optim.LRSchedule(0.1, **kwargs)
    assert mt.optim.LRSchedule(0.1, "cosine", total_steps=5, min_lr=0.1).lr_at(3) == 0.1
