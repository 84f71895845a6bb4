"""Learning-rate schedules: the lr of a step as a pure function of the step's position in the run.

    lr(t) = lr * warmup(t) * decay(t)              t = optimizer steps already taken (0, 1, ...)

    warmup(t)   = min(1, (t + 1) / warmup_steps)   (1 without warm-up): lr/w, 2lr/w, ..., lr
    constant    = 1
    step        = gamma ** (number of milestones m <= t // steps_per_epoch)   (milestones in epochs)
    cosine      = f + (1 - f) * (1 + cos(pi * t / total_steps)) / 2           (to min_lr)
                  f = min_lr / lr, the floor (0 by default: annealed to 0)

Worked example: lr 0.1, 4 steps per epoch, 12 steps in all.

    t          0     1     2     3   | 4 ...  7 | 8 ... 11
    step [1,2] 0.1   0.1   0.1   0.1 | 0.01     | 0.001          (gamma 0.1: after epoch 1, 2)
    cosine     0.1   0.0983 0.0933 0.0854 ...        t=11: 0.0017   (t = 12 would give 0)
    cosine, min_lr 0.01:
               0.1   0.0985 0.0940 0.0868 ...        t=11: 0.0115   (t >= 12: 0.01)

With a floor the cosine part is nanoGPT's ``min_lr + (lr - min_lr) * (1 + cos(pi * t / T)) / 2``
(its ``lr_decay_iters`` is ``total_steps``; e.g. t=1 above: 0.01 + 0.09 * 0.9830 = 0.0985), and
past ``total_steps`` it stays at min_lr. The warm-up multiplies the whole of it, floor included,
and the cosine's progress counts from step 0 through the warm-up, as without a floor. (nanoGPT
instead ramps (t + 1) / (warmup + 1) and starts the cosine after the warm-up; with no warm-up
the two are the same.)

These are PyTorch's formulas: ``MultiStepLR(milestones, gamma)`` stepped once per epoch, and
``CosineAnnealingLR(T_max=total_steps, eta_min=min_lr)`` stepped once per optimizer step (its
closed form; PyTorch's recursive update agrees to float rounding). The warm-up factor multiplies
the decay (the Goyal et al. recipe); it is the trainer's existing ``--warmup-epochs`` ramp in
steps.

Nothing here has state: ``lr_at(t)`` for a resumed job is the lr the uninterrupted job had at t,
so resuming continues the schedule exactly. ``t`` may be fractional (the trainer measures a
resumed job's position in samples when the number of ranks, hence steps per epoch, changed).
"""
import bisect
import math

__all__ = ["LRSchedule", "SCHEDULES"]

SCHEDULES = ("constant", "step", "cosine")


class LRSchedule:
    """``LRSchedule(lr, "cosine", total_steps=T, min_lr=0)`` / ``("step", steps_per_epoch=S,
    milestones=(E1, E2), gamma=0.1)``; ``lr_at(t)`` the lr of the step that follows t steps.

    In your own loop: ``opt.lr = sched.lr_at(step)`` before ``opt.step()``.
    """

    def __init__(self, lr, schedule="constant", total_steps=None, steps_per_epoch=None,
                 milestones=(), gamma=0.1, warmup_steps=0.0, min_lr=0.0):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if not warmup_steps >= 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        if not 0 <= min_lr <= lr:
            raise ValueError(f"min_lr must be in [0, lr={lr!r}], got {min_lr!r}")
        if min_lr and schedule != "cosine":
            raise ValueError(f"min_lr {min_lr!r} is only for the 'cosine' schedule, "
                             f"not {schedule!r}")
        milestones = tuple(int(m) for m in milestones)
        if milestones and schedule != "step":
            raise ValueError(f"milestones {milestones} are only for the 'step' schedule, "
                             f"not {schedule!r}")
        check_milestones(milestones)
        if schedule == "step":
            if steps_per_epoch is None or not steps_per_epoch > 0:
                raise ValueError(f"the 'step' schedule needs steps_per_epoch > 0, "
                                 f"got {steps_per_epoch!r}")
            if not gamma > 0:
                raise ValueError(f"gamma must be > 0, got {gamma!r}")
        if schedule == "cosine" and (total_steps is None or not total_steps > 0):
            raise ValueError(f"the 'cosine' schedule needs total_steps > 0, got {total_steps!r}")
        self.lr, self.schedule = float(lr), schedule
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.milestones, self.gamma = milestones, float(gamma)
        self.warmup_steps = float(warmup_steps)
        self.min_lr = float(min_lr)

    def warmup(self, t):
        """The warm-up factor of step t: (t + 1) / warmup_steps, capped at 1."""
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (t + 1) / self.warmup_steps)

    def decay(self, t):
        """The schedule's factor of step t (1 for 'constant'; min_lr / lr at the cosine's end)."""
        if self.schedule == "step":
            epoch = math.floor(t / self.steps_per_epoch)
            return self.gamma ** bisect.bisect_right(self.milestones, epoch)
        if self.schedule == "cosine":
            fraction = min(max(t, 0) / self.total_steps, 1.0)  # past the end: stay there
            cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
            if self.min_lr == 0:
                return cosine
            floor = self.min_lr / self.lr
            return floor + (1.0 - floor) * cosine
        return 1.0

    def lr_at(self, t):
        """The learning rate of the step taken after ``t`` steps."""
        return self.lr * self.warmup(t) * self.decay(t)

    def __repr__(self):
        return (f"LRSchedule(lr={self.lr}, schedule={self.schedule!r}, "
                f"total_steps={self.total_steps}, steps_per_epoch={self.steps_per_epoch}, "
                f"milestones={self.milestones}, gamma={self.gamma}, "
                f"warmup_steps={self.warmup_steps}, min_lr={self.min_lr})")


def check_milestones(milestones):
    """Raise ValueError unless the epochs are positive and strictly increasing."""
    for m in milestones:
        if m < 1:
            raise ValueError(f"milestone {m}: epochs must be >= 1")
    for a, b in zip(milestones, milestones[1:]):
        if b <= a:
            raise ValueError(f"milestones {', '.join(map(str, milestones))}: must be strictly "
                             f"increasing ({b} after {a})")
