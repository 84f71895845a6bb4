"""Every collective kind, and what a rank that has joined (``mt.join``, join.py) does with it.

A collective describes itself to the cross-rank check (check.py) as ``(kind, fields, error)``;
handles, timeline spans and error messages name it by the same kind. ``Kind`` is the one list:
a ``str`` enum whose members print as their names ("allreduce"), so messages read as before,
and whose lookup raises at once on a name that is not a member (``as_kind``) -- a misspelled
kind is an error, never a collective silently refused while a rank has joined.

A joined rank has no data of its own left; it learns each collective the others start from its
description and runs it with a neutral contribution. Each kind declares how (``Joined``), and
the one policy below is read by both sides -- the active ranks (check.py, to raise the same
CollectiveError on every one of them) and the joined ones (join.py, to skip what is refused) --
so they always take the same decision from the same description.

Served, as in Horovod: reductions of host arrays (allreduce, grouped, reducescatter, the gradient
buckets and step check of DistributedOptimizer) with the op's identity (zeros for Sum and
Average, +inf / the largest integer for Min, ...), and the barrier. Also a sharded optimizer's
allgather of its shares, where the joined rank holds a share of its own (join.py's hooks).

Refused (a CollectiveError -- a RuntimeError -- on every active rank; the joined ranks go on
waiting): what has no neutral contribution. Horovod refuses allgather, alltoall and broadcast
while a rank has joined ("... is not supported with Join at this time"), and so do we, with the
object collectives; also process set changes, the timeline, the deterministic tree, and
reductions of device arrays, which move through the device's own transport (NCCL, CUDA-aware
MPI) that a joined rank holds no buffer for.
"""
import enum

if hasattr(enum, "StrEnum"):             # Python 3.11 on
    _StrEnum = enum.StrEnum
else:                                    # Python 3.10: the same behaviour spelled out
    class _StrEnum(str, enum.Enum):
        __str__ = str.__str__
        __format__ = str.__format__


class Joined(enum.Enum):
    """What a rank that has joined does when the active ranks start a collective of a kind."""

    REPLAY = "replays it with a neutral contribution"
    AGREE = "takes part in its agreement alone (its data, if any, moves in a later collective)"
    REFUSE = "nothing: every active rank raises CollectiveError"
    JOIN = "the join itself: the rank joins too"


class Kind(_StrEnum):
    """A collective kind: its name (the member's value) and its ``joined`` behaviour.

    In-place forms (a trailing underscore) and a bucket of the gradient buckets name handles and
    messages; their description carries the kind without the underscore (allreduce_ is agreed
    as allreduce) or the step's (allreduce buckets), so they declare the same behaviour.
    """

    def __new__(cls, name, joined):
        member = str.__new__(cls, name)
        member._value_ = name
        member.joined = joined
        return member

    ALLREDUCE = "allreduce", Joined.REPLAY
    ALLREDUCE_ = "allreduce_", Joined.REPLAY
    GROUPED_ALLREDUCE = "grouped_allreduce", Joined.REPLAY
    GROUPED_ALLREDUCE_ = "grouped_allreduce_", Joined.REPLAY
    REDUCESCATTER = "reducescatter", Joined.REPLAY
    BARRIER = "barrier", Joined.REPLAY
    ALLREDUCE_BUCKETS = "allreduce buckets", Joined.REPLAY       # one step of overlap.py's
    ALLREDUCE_BUCKET = "allreduce bucket", Joined.REPLAY         # one bucket of that step
    OPTIMIZER_STEP = "DistributedOptimizer.step", Joined.AGREE   # the backward pass count
    REDUCESCATTER_DEVICE = "reducescatter (device)", Joined.AGREE   # then a host reducescatter
    # a front end's own dtypes, where its tensors travel as another dtype (mpitrain.torch's
    # bfloat16 and bool), checked before the collective that moves them
    DTYPES = "dtype check (bfloat16 or bool)", Joined.AGREE
    ALLGATHER = "allgather", Joined.REFUSE
    # a sharded optimizer's shares of its parameters (its step's allgather, a layer's
    # parameters): a joined rank given that optimizer (mt.join(optimizers=...)) sends its own
    ALLGATHER_SHARES = "allgather_shares", Joined.REPLAY
    BROADCAST = "broadcast", Joined.REFUSE
    BROADCAST_ = "broadcast_", Joined.REFUSE
    ALLTOALL = "alltoall", Joined.REFUSE
    BROADCAST_OBJECT = "broadcast_object", Joined.REFUSE
    ALLGATHER_OBJECT = "allgather_object", Joined.REFUSE
    ALLGATHER_DEVICE = "allgather (device)", Joined.REFUSE
    BROADCAST_DEVICE = "broadcast (device)", Joined.REFUSE
    BROADCAST__DEVICE = "broadcast_ (device)", Joined.REFUSE
    ALLTOALL_DEVICE = "alltoall (device)", Joined.REFUSE
    ADD_PROCESS_SET = "add_process_set", Joined.REFUSE
    REMOVE_PROCESS_SET = "remove_process_set", Joined.REFUSE
    START_TIMELINE = "start_timeline", Joined.REFUSE
    OPTIMIZER_DETERMINISTIC = "DistributedOptimizer.deterministic", Joined.REFUSE   # the tree
    JOIN = "join", Joined.JOIN

    @property
    def on_device(self):
        """The kind of this collective's agreement on device arrays (allgather (device), ...)."""
        return as_kind(f"{self._value_} (device)")


def as_kind(kind):
    """``kind`` as a Kind: a member, or a member's exact name; ValueError for anything else."""
    if kind.__class__ is Kind:
        return kind
    try:
        return Kind(kind)
    except ValueError:
        raise ValueError(f"{kind!r} is not a collective kind; the kinds are "
                         f"{', '.join(repr(k._value_) for k in Kind)}") from None


def check_only(desc):
    """True when a joined rank takes part in ``desc`` by its agreement alone: a kind that moves
    no data, the plan check of overlapped gradient buckets (their steps are described
    separately, overlap.py), or a description with an error (every rank raises it there)."""
    kind, fields, error = desc
    kind = as_kind(kind)
    return (error is not None or kind.joined is Joined.AGREE
            or (kind is Kind.GROUPED_ALLREDUCE and bool(fields.get("overlap"))))


def refusal(desc, joined):
    """Why the collective ``desc`` cannot run while the ranks ``joined`` (communicator ranks)
    have joined, or None when they can take part."""
    kind, fields, _ = desc
    kind = as_kind(kind)
    who = f"rank{'s' if len(joined) > 1 else ''} {list(joined)} joined (mt.join)"
    if kind.joined is not Joined.REPLAY and kind.joined is not Joined.AGREE:
        return (f"{kind}: not supported while {who}, as in Horovod; call it before mt.join() "
                f"or after it returns")
    if fields.get("device"):
        return (f"{kind} of device arrays: not supported while {who} (a joined rank takes "
                f"part in host reductions only)")
    return None
