"""Weight averaging (PNNL's mode, the seed design): every rank steps on its own gradients, and
every ``average_every`` steps the parameters are averaged across ranks.

With plain SGD and ``average_every=1`` this is the same update as gradient averaging (the mean of
``w - lr*g_r`` is ``w - lr*mean(g_r)``). Optimizer state (momentum, Adam moments) stays per rank,
as in PNNL. Backward passes (``backward_passes_per_step``) make one local step; their count is
checked on each rank alone, since nothing is sent per pass.
"""
import time

from mpitrain.comm import collectives
from mpitrain.comm.handles import current_timeline
from mpitrain.parallel.strategy import Strategy


def average_weights(opt):
    """Average every parameter's ``.data`` of DistributedOptimizer ``opt`` across its ranks now,
    adding the seconds to ``opt.comm_time_s``."""
    if opt.process_set.size() == 1:
        return
    start = time.perf_counter()
    with current_timeline().span("average_weights", cat="comm"):
        collectives.grouped_allreduce_([p.data for p in opt.params], op=collectives.Average,
                                       name="DistributedOptimizer.weights",
                                       fusion_threshold_bytes=opt.fusion_threshold_bytes,
                                       process_set=opt.process_set)
    opt.comm_time_s += time.perf_counter() - start


class WeightAveraging(Strategy):
    """``average="weights"``: ``synchronize()`` does nothing; ``step()`` updates locally and
    averages the weights on every ``average_every``-th step of the inner optimizer."""

    def step(self, skip):
        opt = self.opt
        error = self.passes.error()
        self.passes.reset()
        if error is not None:       # each rank checks its own count
            opt.optimizer.zero_grad()
            raise ValueError(error)
        opt.optimizer.step()
        # The inner optimizer's step count travels in its state_dict, so a resumed job keeps
        # averaging on the same global steps as an uninterrupted one.
        if opt.optimizer.steps % opt.average_every == 0:
            average_weights(opt)
