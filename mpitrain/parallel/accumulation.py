"""Gradient accumulation's bookkeeping: backward passes counted per gradient since the last step.

``DistributedOptimizer(..., backward_passes_per_step=k)`` sums the gradients of k backward passes
locally (layers add into ``Parameter.grad``) and averages them across ranks once, during the k-th
pass: ``backward_hook`` reports each gradient as its layer finishes, and the k-th report of a
gradient is the moment its bucket may start its allreduce (comm/overlap.py). This file only
counts; it has no MPI and no arrays.

    k = 3, with the hook            pass 1    pass 2    pass 3          step()
    reports of each gradient          1         2         3 -> average   3 == k: update
    inside ``with opt.no_sync():``    not counted, never averaged (PyTorch's idiom: the next
                                      pass outside no_sync averages what all of them summed)

The count belongs to the optimizer step, not to the data: nothing here knows about epochs, so a
loop whose steps straddle an epoch's end works as any other. The one error is a step at the
wrong count -- ``step()`` after a number of counted passes other than k -- raised by
``step()``/``synchronize()`` (Horovod raises inside backward instead, at whichever pass happens to
exceed k: its issues 2466/2497, where a partial accumulation at an epoch's end carried over).
``zero_grad()`` drops a partial accumulation and starts counting again.
"""
import contextlib


class PassCount:
    """Reports per gradient slot since the last step, split into counted and ``no_sync`` ones.

    report(slot) -> True on the k-th counted report of ``slot`` (its sum is final: average it).
    error() -> why a step now would be wrong, or None; reset() after the step (or zero_grad).
    """

    def __init__(self, slots, passes_per_step):
        self.passes_per_step = passes_per_step
        self.counted = [0] * slots
        self.quiet = [0] * slots
        self.quiet_mode = False
        self.late = False        # a no_sync pass changed gradients already being averaged

    def report(self, slot):
        if self.quiet_mode:
            if self.counted[slot] >= self.passes_per_step:
                self.late = True
            self.quiet[slot] += 1
            return False
        self.counted[slot] += 1
        return self.counted[slot] == self.passes_per_step

    def complete(self):
        """True when every counted pass of the step has been reported (``passes() == k``), so
        the average may finish now."""
        return not self.quiet_mode and self.passes() == self.passes_per_step

    def passes(self):
        """Counted passes since the last step: the most reports any gradient has had."""
        return max(self.counted, default=0)

    def error(self):
        """Why ``step()`` now would be wrong, or None."""
        k, passes, quiet = self.passes_per_step, self.passes(), max(self.quiet, default=0)
        if self.late:
            return (f"a backward pass inside no_sync() came after counted pass {k} of {k}, "
                    f"whose gradients were already being averaged; call step() right after it")
        if passes == k:
            return None
        if passes == 0:
            if quiet:
                return (f"step() after {quiet} backward pass(es), all inside no_sync(): the "
                        f"last pass before step() must run outside it (that pass averages the "
                        f"gradients across ranks)")
            if k == 1:
                return None      # no hook: synchronize() averages every gradient, as always
            return (f"backward_passes_per_step={k} counts the passes through the backward "
                    f"hook, which was not called: model.backward(grad, "
                    f"on_layer_done=opt.backward_hook)")
        return (f"step() after {passes} backward passes; backward_passes_per_step={k} takes "
                f"exactly {k} per step (count passes over the whole run, not batch indices "
                f"within an epoch: a partial accumulation at an epoch's end carries into the "
                f"next; opt.zero_grad() drops one)")

    def reset(self):
        self.counted = [0] * len(self.counted)
        self.quiet = [0] * len(self.quiet)
        self.late = False

    @contextlib.contextmanager
    def no_sync(self):
        """Passes inside accumulate without being counted or averaged."""
        if self.quiet_mode:
            raise RuntimeError("no_sync() is already active (it does not nest)")
        self.quiet_mode = True
        try:
            yield
        finally:
            self.quiet_mode = False
