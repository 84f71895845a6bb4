"""check.py's messages (one process: the explain step is pure) and its single-rank behaviour."""
import pytest
from mpi4py import MPI

from mpitrain.comm import check


def test_explain_names_field_values_and_ranks():
    descs = [("allreduce", {"shape": (4,), "dtype": "<f4"}, None),
             ("allreduce", {"shape": (2, 2), "dtype": "<f4"}, None),
             ("allreduce", {"shape": (4,), "dtype": "<f8"}, None)]
    msg = check.explain(descs)
    assert msg == ("allreduce: shape differs across ranks: (4,) on ranks [0, 2], "
                   "(2, 2) on ranks [1]; dtype differs across ranks: '<f4' on ranks [0, 1], "
                   "'<f8' on ranks [2]")


def test_explain_kinds_and_local_errors():
    kinds = [("allreduce", {}, None), ("broadcast", {}, None)]
    assert "ranks called different collectives" in check.explain(kinds)
    errs = [("broadcast", {"root_rank": 0}, None), ("broadcast", {"root_rank": None}, "bad root")]
    assert check.explain(errs) == "broadcast: invalid arguments on some ranks (rank 1: bad root)"


def test_single_rank_raises_local_error_as_valueerror():
    agree = check.Agreement(MPI.COMM_SELF)
    assert agree("allreduce", {"shape": (1,)}) is None and not agree.usable
    with pytest.raises(ValueError, match="bad op"):
        agree("allreduce", {}, "bad op")
    assert issubclass(check.CollectiveError, RuntimeError)
