"""Shared memory under the simulator: every thread of a launch gets the same array, whatever the
thread interleaving (regression: the flaky test_two_simulated_gpus_match_one_cpu_rank...).

Numba's simulator creates a launch's ``cuda.shared.array`` on first use with check-then-set; a
GIL switch between the check and the set gave two threads two arrays, and the GEMM read garbage.
These tests force the worst interleaving deterministically instead of waiting for it: every
simulator allocation of shared memory is held until all threads of the block are inside it (all
of them have then seen "not allocated yet"), and the arrays it returns are filled with NaN, so a
thread reading memory that no thread of its block wrote (an orphaned array, or an uninitialised
one) makes the result NaN or wrong. kernels/cuda_numba/arrays.py installs the race-free allocator.
"""
import sys
import threading

import numpy as np
import pytest
from numba import cuda, float32


class _Gate:
    """Holds callers until ``parties`` of them have arrived (or ``timeout_s`` has passed)."""

    def __init__(self, parties, timeout_s=10.0):
        self.parties, self.timeout_s = parties, timeout_s
        self.arrived = 0
        self.cond = threading.Condition()

    def wait(self):
        with self.cond:
            self.arrived += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.arrived >= self.parties, timeout=self.timeout_s)


@pytest.fixture
def crowded_shared_alloc(dev, monkeypatch):
    """``arm(threads_per_block)``: the next launch's shared-array allocations all meet at once."""
    if not dev.arrays.SIM:
        pytest.skip("simulator only: a GPU allocates shared memory per block before threads run")
    from numba.cuda.simulator import kernelapi
    empty = np.empty
    state = {"gate": None}

    def gated_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, kernelapi.FakeCUDAShared) and state["gate"] is not None:
            out.fill(np.nan if out.dtype.kind == "f" else -1)       # poison: never read unwritten
            state["gate"].wait()
        return out

    monkeypatch.setattr(np, "empty", gated_empty)

    def arm(threads_per_block):
        state["gate"] = _Gate(threads_per_block)
        return state["gate"]
    return arm


@pytest.mark.parametrize("m, n, k, trans_a, trans_b", [
    (8, 784, 4, True, False),        # the MLP's first-layer weight gradient (784-8-10, batch 4)
    (11, 37, 9, False, False),       # partial tiles on every edge, several K-stages
    (13, 21, 6, False, True),
])
def test_gemm_threads_share_one_tile_buffer(dev, crowded_shared_alloc, m, n, k, trans_a, trans_b):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    want = (a.T if trans_a else a) @ (b.T if trans_b else b)                # (m, n)
    da, db, out = dev.to_device(a), dev.to_device(b), dev.zeros((m, n))
    gate = crowded_shared_alloc(dev.dense.TILE ** 2)
    dev.gemm(da, db, out, trans_a=trans_a, trans_b=trans_b)
    assert gate.arrived >= dev.dense.TILE ** 2, "the allocations did not all meet in the window"
    np.testing.assert_allclose(dev.to_host(out), want, rtol=1e-5, atol=1e-5)


def test_block_reductions_share_one_buffer(dev, crowded_shared_alloc):
    x = np.arange(1, 101, dtype=np.float32)
    gate = crowded_shared_alloc(dev.arrays.TPB)
    assert dev.total(dev.to_device(x)) == 5050.0
    assert gate.arrived >= dev.arrays.TPB
    logits = np.eye(5, dtype=np.float32)[[0, 1, 2, 3, 4, 0, 1]]            # (7, 5)
    labels = np.array([0, 1, 2, 0, 4, 0, 3], np.int64)
    crowded_shared_alloc(dev.arrays.TPB)
    assert dev.count_correct(dev.to_device(logits), dev.to_device(labels)) == 5


@cuda.jit
def _two_arrays_k(out):
    s = cuda.shared.array(4, float32)
    t = cuda.shared.array(4, float32)
    i = cuda.threadIdx.x
    s[i] = i
    t[i] = 10 + i
    cuda.syncthreads()
    out[i] = s[3 - i] + t[i]


def test_distinct_lines_still_get_distinct_arrays(dev):
    """The allocator keys by (file, line) like Numba's own: two arrays, two buffers."""
    if not dev.arrays.SIM:
        pytest.skip("simulator only")
    out = dev.zeros(4)
    _two_arrays_k[1, 4](out)
    np.testing.assert_array_equal(dev.to_host(out), [13, 13, 13, 13])
