"""A joined rank's part in a sharded optimizer's steps: ``mt.join(optimizers=[opt])``.

With uneven data a rank runs out of batches and joins (comm/join.py) while the others go on
stepping. Unsharded, it only lends zeros to their averages: every rank holds every parameter
and steps it. Sharded, its share of the parameters and of the optimizer state (sharded.py,
parameter_sharding.py) lives on it alone, so it must still step that share -- PyTorch's
``ZeroRedundancyOptimizer`` join hook does the same. ``ShareServer`` is the join hook that
``DistributedOptimizer.join_hook()`` gives for a sharded strategy; comm/join.py shows it every
collective the active ranks start, and it serves these with the joined rank's own data:

    the gradients' buckets / fused allreduce   zeros sent; the averaged result kept: this
                                               rank's chunks (sharded gradients) or every
                                               gradient (sharded optimizer state)
    the step's agreement                       read for the learning rate the step uses
    the clipping norm's allreduce              this rank's exact sum of squares of its chunks
    allgather_shares (the step's, a layer's)   first the pending step of this rank's share,
                                               then the share itself

So the active ranks take the step they would take if the joined rank had a batch of zero
gradients, bit for bit the unsharded run's with the same join; and the joined rank's share, and
with sharded optimizer state or gradients every parameter, stay the active ranks'.
"""
from mpitrain.parallel import parameter_sharding, sharded
from mpitrain.parallel.gradients import GRADIENTS
from mpitrain.parallel.sharded import CLIP, STEP_SHARES

# the collectives' kinds (comm's Kind values)
STEP, BUCKETS, BUCKET, GROUPED, ALLREDUCE, SHARES = (
    "DistributedOptimizer.step", "allreduce buckets", "allreduce bucket", "grouped_allreduce",
    "allreduce", "allgather_shares")


class ShareServer:
    """The join hook of one sharded strategy (see the module docstring)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.lr = None              # the learning rate of the step being served
        self.received = False       # this step's averaged gradients (some of them) are in
        self.pending = False        # the step agreed on, the share not yet stepped
        self.round = 0              # the next round of the step's allgather of shares

    def serve(self, kind, fields, run):
        s, name = self.strategy, fields.get("name")
        if kind == STEP:            # after the average: the step is complete (but its clip)
            self.lr = fields.get("lr")
            self.pending, self.received = self.received, False
            return False            # its agreement is the join's usual one
        if run is None:
            return False
        if name == GRADIENTS and kind in (BUCKETS, BUCKET, GROUPED):
            s.receive_average(kind, fields, run())
            self.received = True
            return True
        if name == CLIP and kind == ALLREDUCE and isinstance(s, sharded.GradientSharding):
            s.clip_from(run(s.clip_partial()))
            return True
        if kind != SHARES:
            return False
        self.step_share()
        if name == STEP_SHARES:         # the step's rounds (or full_parameters')
            every = run(s.round_share(self.round))
            if not getattr(s, "parameters_sharded", False):
                s.place_round(self.round, every)
            self.round += 1
            if self.round == len(s.share_rounds()):
                self.round = 0
                if isinstance(s, parameter_sharding.ShardedParameters):
                    s.keep_share()      # the active ranks' first step ends the same way
            return True
        key = parameter_sharding.group_of(name)
        if key is None or s.gate is None:
            return False
        run(s.gate.mine(key))           # a layer's parameters, gathered by the others
        return True

    def step_share(self):
        """This rank's share of the step the active ranks took (once per step)."""
        if not self.pending:
            return
        self.pending = False
        s = self.strategy
        if self.lr is not None:
            s.opt.lr = self.lr
        s.clip_joined()
        s.opt.optimizer.step()

    def joined_all(self):
        self.step_share()           # the last step's share: nothing gathers it any more
