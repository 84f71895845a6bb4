"""Weight averaging (PNNL's mode, the seed design): every rank steps on its own gradients, and
every ``average_every`` steps the parameters are averaged across ranks.

With plain SGD and ``average_every=1`` this is the same update as gradient averaging (the mean of
``w - lr*g_r`` is ``w - lr*mean(g_r)``). Optimizer state (momentum, Adam moments) stays per rank,
as in PNNL. Backward passes (``backward_passes_per_step``) make one local step; their count is
checked on each rank alone, since nothing is sent per pass.
"""
import time

import numpy as np

from mpitrain import comm
from mpitrain.timeline import current as current_timeline
from mpitrain.parallel.strategy import Strategy


def average_weights(opt):
    """Average every parameter's ``.data`` of DistributedOptimizer ``opt`` across its ranks now,
    adding the seconds to ``opt.comm_time_s``."""
    if opt.process_set.size() == 1:
        return
    start = time.perf_counter()
    with current_timeline().span("average_weights", cat="comm"):
        comm.grouped_allreduce_([p.data for p in opt.params], op=comm.Average,
                                       name="DistributedOptimizer.weights",
                                       fusion_threshold_bytes=opt.fusion_threshold_bytes,
                                       process_set=opt.process_set)
    opt.comm_time_s += time.perf_counter() - start


class WeightAveraging(Strategy):
    """``average="weights"``: ``synchronize()`` does nothing; ``step()`` updates locally and
    averages the weights on every ``average_every``-th step of the inner optimizer."""

    def step(self, skip, flags=None, update=None):
        """No agreement per step to carry ``flags`` in: None (the caller exchanges them)."""
        opt = self.opt
        error = self.passes.error()
        self.passes.reset()
        if error is not None:       # each rank checks its own count
            opt.optimizer.zero_grad()
            raise ValueError(error)
        (update or opt.optimizer.step)()
        # The inner optimizer's step count travels in its state_dict, so a resumed job keeps
        # averaging on the same global steps as an uninterrupted one.
        if opt.optimizer.steps % opt.average_every == 0:
            average_weights(opt)

    def settle(self):
        """Average the weights now unless the last step did, so the ranks end on one model."""
        if self.opt.optimizer.steps % self.opt.average_every:
            average_weights(self.opt)

    def checkpoint_state(self):
        """Momentum / Adam moments stay per rank (PNNL); a checkpoint holds one state: their
        mean over the ranks (a collective: every rank calls it)."""
        state = self.opt.optimizer.state_dict()
        if self.opt.process_set.size() > 1:
            for key, value in state.items():
                if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                    state[key] = comm.allreduce(value, op=comm.Average,
                                                process_set=self.opt.process_set)
        return state
