"""What every averaging strategy of DistributedOptimizer shares: the count of backward passes
(accumulation.py) and the step that synchronizes, then updates.

A strategy is made once, by the facade (optimizer.py), from its validated arguments (``opt``);
it owns ``synchronize``, ``step``, the backward hook and what ``zero_grad`` must undo, and
reads the facade's settings (``params``, ``process_set``, ``fusion_threshold_bytes``, ``op``)
and adds the seconds it spends averaging to ``opt.comm_time_s``.

Step flags: ``step(flags=...)`` hands a few bits of this rank's (a stop request, ...) to the
step's own agreement -- the message every rank already exchanges to check the step -- as its
inline payload, so every rank learns the OR of them with no MPI call of its own. They travel as
arguments (``step`` -> ``synchronize`` -> ``agree``) and come back as return values; so does the
update a caller runs instead of the inner optimizer's ``step`` (mpitrain.torch's closure).
"""
import contextlib

from mpitrain import comm
from mpitrain.nn.clip import clip_grad_norm_
from mpitrain.parallel import report
from mpitrain.parallel.accumulation import PassCount


class Strategy:
    """Counts the passes; ``synchronize`` averages nothing (the strategies override it)."""

    buckets = None      # the overlapping bucket allreduce, where a strategy has one

    def __init__(self, opt):
        self.opt = opt
        self.synchronized = False
        params = opt.params
        n = len(params)
        # submission slot of each parameter: the reverse of optimizer order, which for a
        # Sequential is the order backward finishes them
        self.slot = {id(p): n - 1 - i for i, p in enumerate(params)}
        self.passes = PassCount(n, opt.backward_passes_per_step)

    def bucket_allreduce(self):
        """The overlapping bucket allreduce, or None where it does not apply."""
        return None

    def pending(self):
        """True while bucket allreduces started by the hook have not finished."""
        return self.buckets is not None and self.buckets.pending()

    def hook(self, params):
        buckets = self.bucket_allreduce()
        if self.synchronized and not self.passes.quiet_mode:
            self.synchronized = False    # a pass after the average: step() averages again
        for p in params:
            slot = self.slot.get(id(p))
            if slot is not None and self.passes.report(slot) and buckets is not None:
                buckets.ready(slot, p.grad)

    def no_sync(self):
        return self.passes.no_sync()

    def zero_grad(self):
        if self.pending():
            # averages already running (the k-th pass happened, no step): let them finish, as
            # every rank's do, before the gradients they write into are zeroed
            self.buckets.finish([p.grad for p in reversed(self.opt.params)])
        self.passes.reset()
        self.synchronized = False

    def set_fusion_threshold(self, threshold_bytes):
        """DistributedOptimizer.set_fusion_threshold: the bucket plan is rebuilt (and agreed)
        when next used."""
        if self.pending():
            raise RuntimeError("set_fusion_threshold() while gradient allreduces are pending: "
                               "call it between step() and the next backward")
        self.opt.fusion_threshold_bytes = comm.check_threshold(threshold_bytes)
        self.buckets = None

    def synchronize(self, flags=None):
        """Average (the strategies override it); the OR of the ranks' ``flags`` where the
        average's agreement carried them, else None."""
        return None

    def clip(self):
        """After the average: scale the averaged gradients to global 2-norm at most
        ``opt.clip_grad_norm`` (when set), the same on every rank, and keep the norm before
        clipping in ``opt.grad_norm``."""
        max_norm = self.opt.clip_grad_norm
        if max_norm is not None:
            self.opt.grad_norm = clip_grad_norm_(self.opt.params, max_norm)

    def settle(self):
        """Make the replicas one model (gradient averaging keeps them one: nothing to do)."""

    def checkpoint_state(self):
        """The one optimizer state a checkpoint holds (collective where ranks differ)."""
        return self.opt.optimizer.state_dict()

    def load_checkpoint_state(self, state):
        """Load a state ``checkpoint_state`` returned (at any N) into the inner optimizer."""
        self.opt.optimizer.load_state_dict(state)

    reads_pieces = False    # load_checkpoint_state takes a sharded checkpoint's reader

    def full_parameters(self):
        """A context in which every parameter's ``.data`` is whole: they always are, but
        under sharded parameters (parameter_sharding.py)."""
        return contextlib.nullcontext()

    def checkpoint_pieces(self):
        """None: a checkpoint holds ``checkpoint_state()`` (sharded.py: each rank's piece)."""
        return None

    def step_fields(self):
        """What every rank's step agrees on, beside the step's report (gradients.py)."""
        return {"backward_passes_per_step": self.opt.backward_passes_per_step}

    def memory_bytes(self):
        """The bytes this rank holds for the parameters, their gradients (one of each
        parameter's size) and the inner optimizer's state (host or device arrays alike)."""
        params = self.opt.params
        state = getattr(self.opt.optimizer, "state", {})
        held = sum(int(p.data.nbytes) for p in params if getattr(p, "holds_data", True))
        return {"parameters": held, "gradients": held,
                "optimizer_state": sum(int(a.nbytes) for arrays in state.values()
                                       for a in arrays)}

    def agree(self, kind, fields, error, ordered=False, flags=None, digest=None, used=None):
        """The step's agreement (comm.agree), carrying the step's report (report.py): the
        ``flags``, the parameters' ``digest`` (CollectiveError on every rank where replicas
        differ) and which parameters had a gradient (``used``). Returns (the flags' OR over
        the ranks, per parameter whether any rank had a gradient), each None where not carried
        or nothing was exchanged (one rank, MPITRAIN_CHECK=0). Where it raises (an ``error``
        or a difference on some rank), the step's gradients are dropped first
        (``zero_grad``): a wrong count summed the wrong gradients."""
        step_report = report.StepReport(flags, digest, used)
        payload = step_report.payload()
        try:
            rows = comm.agree(self.opt.process_set, kind, {**fields, **step_report.fields()},
                              error, ordered=ordered, payload=payload)
            if rows is None or payload is None:
                return None, None
            return step_report.read(rows, kind)
        except (ValueError, comm.CollectiveError):
            self.opt.zero_grad()
            raise

    def step(self, skip, flags=None, update=None):
        """Synchronize (unless ``skip`` or done already), then ``update`` (default the inner
        optimizer's step); the OR of every rank's ``flags`` when the step's agreement carried
        them, else None."""
        if skip and self.pending():
            # The comm thread may still be reducing these gradients (and owns MPI).
            raise RuntimeError("step() inside skip_synchronize() while backward_hook's "
                               "allreduces are pending: call opt.synchronize() first")
        agreed = None
        if not (skip or self.synchronized):
            agreed = self.synchronize(flags)
            self.clip()
        (update or self.opt.optimizer.step)()
        self.synchronized = False
        return agreed
