"""comm/kinds.py: every collective kind used in mpitrain/ is a Kind, a misspelled one raises at
once, and what a rank that has joined does with each kind (one process: no MPI exchange)."""
import ast
import importlib
import pathlib

import pytest
from mpi4py import MPI

from mpitrain.comm import check, handles, kinds

join = importlib.import_module("mpitrain.comm.join")   # the module; mpitrain.comm.join is mt.join
from mpitrain.comm.kinds import Joined, Kind, as_kind

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpitrain"


def _name(func):
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _kind_arguments(call):
    """The expressions ``call`` passes as a collective kind (empty for other calls)."""
    name = _name(call.func)
    found = [k.value for k in call.keywords if k.arg == "kind"]
    position = {"agreement": 0, "agree": 1, "Prepared": 1}.get(name)
    if name == "ordered" and call.args and _name(call.args[0]) == "agreement":
        position = 1            # handles.ordered(state.agreement, kind, fields, ...)
    if name in ("_run", "_submit") and call.args:
        position = 1            # collectives.py: _run(impl, kind, ...)
    if position is not None and len(call.args) > position:
        found.append(call.args[position])
    return found


def _scan():
    """(string kinds [(file:line, text)], Kind.<attr> uses [(file:line, attr)], kinds found
    in an agreement position) over every module of mpitrain/."""
    strings, members, agreed = [], [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "Kind"):
                members.append((f"{where}:{node.lineno}", node.attr))
            if not isinstance(node, ast.Call):
                continue
            for arg in _kind_arguments(node):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    strings.append((f"{where}:{node.lineno}", arg.value))
                    text = arg.value
                elif isinstance(arg, ast.JoinedStr):
                    strings.append((f"{where}:{node.lineno}", ast.unparse(arg)))
                    continue
                elif isinstance(arg, ast.Attribute) and _name(arg.value) == "Kind":
                    text = getattr(Kind, arg.attr, None)
                else:
                    continue
                if _name(node.func) in ("agreement", "agree", "Prepared", "ordered"):
                    agreed.add(text)
    return strings, members, agreed


STRINGS, MEMBERS, AGREED = _scan()


def test_the_scan_sees_the_collectives():
    assert len(MEMBERS) > 40 and {Kind.ALLREDUCE, Kind.ALLREDUCE_BUCKETS} <= AGREED


def test_every_kind_used_in_the_package_is_a_member():
    names = {k.value for k in Kind}
    unknown = [f"{where}: {text!r}" for where, text in STRINGS if text not in names]
    assert unknown == []
    missing = [f"{where}: Kind.{attr}" for where, attr in MEMBERS
               if attr not in Kind.__members__ and not isinstance(getattr(Kind, attr, None),
                                                                  property)]
    assert missing == []


def test_the_comm_layer_names_kinds_by_member():
    """Strings stay only outside comm/ (accepted there by their exact name)."""
    inside = [f"{where}: {text!r}" for where, text in STRINGS
              if where.startswith("mpitrain/comm/")]
    assert inside == []


@pytest.mark.parametrize("typo", ["allreduc", "Allreduce", "allreduce ", "allreduce_buckets",
                                  "DistributedOptimizer.Step", "", 3])
def test_a_misspelled_kind_raises_at_once(typo):
    with pytest.raises(ValueError, match="is not a collective kind"):
        as_kind(typo)
    agreement = check.Agreement(MPI.COMM_SELF)           # one rank: nothing is exchanged
    with pytest.raises(ValueError, match="is not a collective kind"):
        agreement(typo, {})
    with pytest.raises(ValueError, match="is not a collective kind"):
        check.Prepared(agreement, typo, {})
    with pytest.raises(ValueError, match="is not a collective kind"):
        handles.submit(lambda: None, kind=typo)
    with pytest.raises(ValueError, match="is not a collective kind"):
        kinds.refusal((typo, {}, None), [1])


def test_names_and_members_are_one_kind():
    assert as_kind("allreduce") is Kind.ALLREDUCE and as_kind(Kind.BARRIER) is Kind.BARRIER
    assert Kind.ALLREDUCE == "allreduce" and f"{Kind.ALLREDUCE_BUCKETS}:" == "allreduce buckets:"
    assert check.Prepared(check.Agreement(MPI.COMM_SELF), "barrier", {}).desc[0] is Kind.BARRIER
    assert Kind.ALLGATHER.on_device is Kind.ALLGATHER_DEVICE
    with pytest.raises(ValueError, match="is not a collective kind"):
        Kind.BARRIER.on_device                                   # no device form


def test_join_behaviour_of_each_kind():
    by = {j: {k.value for k in Kind if k.joined is j} for j in Joined}
    assert by[Joined.REPLAY] == {"allreduce", "allreduce_", "grouped_allreduce",
                                 "grouped_allreduce_", "reducescatter", "barrier",
                                 "allreduce buckets", "allreduce bucket", "allgather_shares"}
    assert by[Joined.AGREE] == {"DistributedOptimizer.step", "reducescatter (device)",
                                 "dtype check (bfloat16 or bool)"}
    assert by[Joined.JOIN] == {"join"}
    # every kind an agreement carries that a joined rank replays has its replay in join.py
    assert {as_kind(k) for k in AGREED if as_kind(k).joined is Joined.REPLAY} == set(join.REPLAYS)
    assert all(k.joined is Joined.REPLAY for k in join.REPLAYS)


def test_refusals_and_check_only_read_as_before():
    assert kinds.refusal(("allgather", {}, None), [1]) == (
        "allgather: not supported while rank [1] joined (mt.join), as in Horovod; call it "
        "before mt.join() or after it returns")
    assert kinds.refusal((Kind.ALLREDUCE, {"device": True}, None), [1, 2]) == (
        "allreduce of device arrays: not supported while ranks [1, 2] joined (mt.join) (a "
        "joined rank takes part in host reductions only)")
    assert kinds.refusal((Kind.ALLREDUCE, {}, None), [1]) is None
    assert kinds.check_only((Kind.OPTIMIZER_STEP, {}, None))
    assert kinds.check_only(("grouped_allreduce", {"overlap": True}, None))
    assert not kinds.check_only((Kind.GROUPED_ALLREDUCE, {}, None))
    assert kinds.check_only((Kind.ALLREDUCE, {}, "bad op"))


def test_explain_prints_kind_names():
    descs = [(Kind.ALLREDUCE, {}, None), (Kind.BROADCAST, {}, None)]
    assert check.explain(descs) == ("ranks called different collectives: 'allreduce' on ranks "
                                    "[0], 'broadcast' on ranks [1]")
    assert check.explain([(Kind.BROADCAST, {}, None), (Kind.BROADCAST, {}, "bad root")]) == (
        "broadcast: invalid arguments on some ranks (rank 1: bad root)")
