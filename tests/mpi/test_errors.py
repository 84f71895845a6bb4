"""Mismatched or invalid collective calls raise on every rank, and the communicator survives.

Each case makes only rank 0 (or only the last rank) differ, then checks that every rank raised
CollectiveError naming the field and the ranks, and that a normal collective still works after.
With one process there is nobody to disagree with, so the mismatch cases are skipped there (the
local-validation cases still run).
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()
multi = pytest.mark.skipif(N == 1, reason="a mismatch needs two ranks")


def still_works():
    np.testing.assert_array_equal(mt.allreduce(np.ones(3), op=mt.Sum), np.full(3, N))


def raises_everywhere(fn, *patterns):
    with pytest.raises(mt.CollectiveError) as info:
        fn()
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)
    still_works()
    return str(info.value)


def others():
    return list(range(1, N))


@multi
@pytest.mark.parametrize("path", ["ring", "mpi"])
def test_shape_mismatch_same_count(path, use_settings):
    use_settings(algorithm=path)
    x = np.zeros((4,) if R == 0 else (2, 2), np.float32)
    raises_everywhere(lambda: mt.allreduce(x), "shape differs", "(4,) on ranks [0]",
                      f"(2, 2) on ranks {others()}")


@multi
def test_length_dtype_op_scale_mismatch():
    raises_everywhere(lambda: mt.allreduce(np.zeros(5 if R == 0 else 6)), "shape differs")
    raises_everywhere(lambda: mt.allreduce_(np.zeros(3, np.float32 if R else np.float64)),
                      "dtype differs", "'<f8' on ranks [0]")
    raises_everywhere(lambda: mt.allreduce(np.zeros(3), op=mt.Max if R == 0 else mt.Sum),
                      "op differs", "mt.Max on ranks [0]")
    raises_everywhere(lambda: mt.allreduce(np.zeros(3), prescale_factor=2.0 if R == 0 else 1.0),
                      "prescale_factor differs")
    raises_everywhere(lambda: mt.allreduce(np.zeros(3), postscale_factor=R + 1.0),
                      "postscale_factor differs")
    raises_everywhere(lambda: mt.allreduce(np.zeros(3), name="a" if R == 0 else "b"),
                      "name differs")


@multi
def test_settings_env_mismatch_at_init(monkeypatch):
    """Ranks launched with different MPITRAIN_ALLREDUCE would take different paths: init says so,
    on every rank, and leaves nothing half-initialised."""
    mt.shutdown()
    monkeypatch.setenv("MPITRAIN_ALLREDUCE", "mpi" if R == 0 else "ring")
    monkeypatch.setenv("MPITRAIN_RING_SUBCHUNK", "4096")
    with pytest.raises(mt.CollectiveError) as info:
        mt.init(threads=None)
    text = str(info.value)
    assert "mt.init: MPITRAIN_ALLREDUCE differs across ranks" in text
    assert "'mpi' on ranks [0]" in text and f"'ring' on ranks {others()}" in text
    assert "SUBCHUNK" not in text and not mt.is_initialized()
    monkeypatch.delenv("MPITRAIN_ALLREDUCE")
    monkeypatch.delenv("MPITRAIN_RING_SUBCHUNK")
    still_works()


def test_settings_bad_value_at_init(monkeypatch):
    mt.shutdown()
    monkeypatch.setenv("MPITRAIN_RING_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="MPITRAIN_RING_THRESHOLD='lots' is not an integer"):
        mt.init(threads=None)
    assert not mt.is_initialized()
    monkeypatch.setenv("MPITRAIN_RING_THRESHOLD", "1024")
    monkeypatch.setenv("MPITRAIN_ALLREDUCE", "RING")
    mt.init(threads=None)
    try:
        settings = world.current().settings
        assert (settings.algorithm, settings.ring_threshold_bytes) == ("ring", 1024)
    finally:
        mt.shutdown()
        monkeypatch.delenv("MPITRAIN_RING_THRESHOLD")
        monkeypatch.delenv("MPITRAIN_ALLREDUCE")
    assert world.current().settings == mt.CommSettings()         # read again at the next init
    still_works()


@multi
def test_explicit_settings_that_differ_are_a_collective_error():
    mt.shutdown()
    with pytest.raises(mt.CollectiveError, match="ring_subchunk_bytes differs across ranks"):
        mt.init(threads=None, settings=mt.CommSettings(ring_subchunk_bytes=1024 * (R + 1)))
    assert not mt.is_initialized()
    still_works()


@multi
def test_broadcast_root_and_shape_mismatch():
    raises_everywhere(lambda: mt.broadcast(np.zeros(2), root_rank=0 if R == 0 else 1),
                      "root_rank differs", "0 on ranks [0]")
    raises_everywhere(lambda: mt.broadcast_(np.zeros(2 + (R == 0)), 0), "shape differs")
    raises_everywhere(lambda: mt.broadcast_object(R, root_rank=R), "root_rank differs")


@multi
def test_other_collectives_mismatch():
    raises_everywhere(lambda: mt.allgather(np.zeros((1, 2 + (R == 0)))), "shape[1:] differs")
    raises_everywhere(lambda: mt.allgather(np.zeros((1, 2), np.int32 if R else np.int64)),
                      "dtype differs")
    raises_everywhere(lambda: mt.reducescatter(np.zeros(N + (R == 0))), "shape differs")
    raises_everywhere(lambda: mt.alltoall(np.zeros((N, 1 + (R == 0)))), "shape[1:] differs")
    raises_everywhere(lambda: mt.grouped_allreduce([np.zeros(2), np.zeros(3 + (R == 0))]),
                      "arrays differs")


@multi
def test_bad_fusion_threshold_on_one_rank_raises_everywhere():
    bad = -1 if R == 0 else None  # found locally on rank 0 only, before any data moves
    raises_everywhere(lambda: mt.grouped_allreduce([np.zeros(2)], fusion_threshold_bytes=bad),
                      "fusion_threshold_bytes -1")


@multi
def test_different_collectives_on_different_ranks():
    x = np.zeros(4)
    msg = raises_everywhere(lambda: mt.allreduce(x) if R == 0 else mt.broadcast(x, 0),
                            "different collectives")
    assert "'allreduce' on ranks [0]" in msg


@multi
def test_invalid_argument_on_one_rank_only():
    root = N if R == N - 1 else 0                                      # out of range on one rank
    raises_everywhere(lambda: mt.broadcast(np.zeros(2), root), "invalid arguments",
                      f"rank {N - 1}", "out of range")
    raises_everywhere(lambda: mt.allreduce(np.zeros(2, np.complex64 if R == 0 else np.float32)),
                      "rank 0", "complex64 is not supported")


def test_same_invalid_argument_everywhere_is_valueerror():
    with pytest.raises(ValueError, match="root_rank=-1 is out of range"):
        mt.broadcast(np.zeros(2), -1)
    with pytest.raises(ValueError, match="unknown op 'median'"):
        mt.allreduce(np.zeros(2), op="median")
    with pytest.raises(ValueError, match="prescale_factor=nan is not finite"):
        mt.allreduce(np.zeros(2), prescale_factor=float("nan"))
    if N > 1:
        with pytest.raises(ValueError, match="does not divide"):
            mt.alltoall(np.zeros(N + 1))
    with pytest.raises(ValueError, match="splits="):
        mt.alltoall(np.zeros(4), splits=[5] + [0] * (N - 1))
    with pytest.raises(ValueError, match="in-place needs a numpy.ndarray"):
        mt.allreduce_([1.0, 2.0])
    with pytest.raises(ValueError, match="bool is not supported"):
        mt.allreduce(np.zeros(2, bool))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        mt.allgather(np.float32(1))
    still_works()


def test_unpicklable_object_raises_on_every_rank():
    with pytest.raises(ValueError, match="cannot pickle function"):
        mt.broadcast_object(lambda: 0 if R == 0 else 1, root_rank=0)
    with pytest.raises(ValueError, match=f"rank {N - 1}: allgather_object: cannot pickle"):
        mt.allgather_object((lambda: 0) if R == N - 1 else R)
    assert mt.allgather_object(R) == list(range(N))


def test_collective_error_is_runtime_error():
    assert issubclass(mt.CollectiveError, RuntimeError)


def test_device_arrays_have_one_clear_dispatch_point(monkeypatch):
    """Arrays with __cuda_array_interface__ go to comm/device.py; without it, one clear error."""
    import sys
    from mpitrain.comm import collectives

    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    seen = []

    class FakeDevice:
        def __getattr__(self, name):
            return lambda *a, **k: seen.append(name) or "routed"
    monkeypatch.setattr(collectives, "_device", FakeDevice)
    x = FakeDeviceArray()
    assert mt.allreduce(x) == "routed" and mt.grouped_allreduce_([x]) == "routed"
    assert mt.broadcast_(x, 0) == "routed"
    assert seen == ["allreduce", "grouped_allreduce_", "broadcast_"]
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "mpitrain.comm.device", None)     # import fails
    with pytest.raises(NotImplementedError, match="device array"):
        mt.allreduce(FakeDeviceArray())
