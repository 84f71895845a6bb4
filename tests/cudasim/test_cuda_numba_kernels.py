"""Every Numba CUDA kernel against the CPU kernel of the same name (see kernel_cases.py)."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.support.kernel_cases import CASES, KERNEL_NAMES, run_case
from mpitrain.kernels import contract

CONTRACT = ["empty", "zeros", "to_device", "to_host", "synchronize"] + KERNEL_NAMES


@pytest.mark.parametrize("name, build, tol", CASES)
def test_kernel_matches_cpu(cpu, dev, name, build, tol):
    run_case(cpu, dev, name, build, tol)


def test_backend_has_every_contract_name(dev):
    missing = [n for n in CONTRACT if not hasattr(dev, n)]
    assert not missing, f"cuda_numba lacks {missing}"
    # names and parameters of every contract kernel; CPU-only fast paths outside the contract
    # (kernels/cpu/conv.py's conv2d_*, which Conv2D takes only where they exist) are not required
    assert contract.violations(dev) == []
    assert dev.name == "cuda-numba"


def test_memory_helpers_round_trip(dev):
    host = np.arange(12, dtype=np.float64).reshape(3, 4)       # (3, 4)
    d = dev.to_device(host)
    host[0, 0] = -1                                             # the device copy must not alias
    assert d.shape == (3, 4) and d.dtype == np.float64
    np.testing.assert_array_equal(dev.to_host(d)[0], [0, 1, 2, 3])
    z = dev.zeros((2, 5), np.int64)
    assert dev.to_host(z).tolist() == [[0] * 5] * 2
    e = dev.empty((4,), np.float32)
    assert e.shape == (4,) and e.dtype == np.float32
    # the layer-facing array API of the contract: reshape and axis-0 slices
    np.testing.assert_array_equal(dev.to_host(d.reshape(12)[:5]), [0, 1, 2, 3, 4])
    assert dev.total(d[:2]) == 0 + 1 + 2 + 3 + 4 + 5 + 6 + 7


def test_sgd_without_momentum_needs_no_buffer(cpu, dev):
    rng = np.random.default_rng(3)
    p, g = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    want = p.copy()
    cpu.sgd_update(want, g, None, 0.5, 0.0, False, 0.0)
    d = dev.to_device(p)
    dev.sgd_update(d, dev.to_device(g), None, 0.5, 0.0, False, 0.0)
    np.testing.assert_allclose(dev.to_host(d), want, rtol=1e-6)


def test_host_arrays_are_refused(dev):
    with pytest.raises(TypeError, match="to_device"):
        dev.fill(np.zeros(3, np.float32), 1.0)


@pytest.mark.parametrize("call, match", [
    (lambda k: k.reduce_into(k.zeros(3), k.zeros(3), "mean"), "'mean'"),
    (lambda k: k.gemm(k.zeros((2, 3)), k.zeros((2, 3)), k.zeros((2, 3))), r"\(2, 3\)"),
    (lambda k: k.add(k.zeros(3), k.zeros(4)), "3 vs 4"),
    (lambda k: k.dropout_forward(k.zeros(3), k.zeros(3), k.zeros(3), 1.0, 0), "1.0"),
    (lambda k: k.adam_update(*[k.zeros(2)] * 4, 1e-3, 0.9, 0.999, 1e-8, 0, 0), "step"),
])
def test_bad_input_names_the_value(dev, call, match):
    with pytest.raises(ValueError, match=match):
        call(dev)


def _ptx_check(*args):
    """Run tests/cudasim/ptx_check.py (no simulator) with ``args``; the finished process."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if "CUDA_HOME" not in env:
        try:                                     # the pip wheel nvidia-cuda-nvcc-cu12
            spec = importlib.util.find_spec("nvidia.cuda_nvcc")
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            env["CUDA_HOME"] = list(spec.submodule_search_locations)[0]
    repo = pathlib.Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.cudasim.ptx_check",
                           *args], env=env, cwd=repo, capture_output=True, text=True,
                          timeout=280)


@pytest.fixture(scope="module")
def ptx():
    """ptx_check.py's run: NVVM type-checks and compiles each kernel (no GPU, only libnvvm)."""
    res = _ptx_check()
    if res.returncode == 2 and "libnvvm not found" in res.stdout:
        pytest.skip("no libnvvm (CUDA toolkit or pip nvidia-cuda-nvcc-cu12) to compile PTX")
    return res


def test_every_kernel_compiles_for_the_real_cuda_target(ptx):
    assert " 0 cases failed" in ptx.stdout, ptx.stdout[-4000:] + ptx.stderr[-2000:]


def test_float32_kernels_compute_in_float32(ptx):
    """No float64 instruction in a float32 kernel's PTX: a Python literal (``v = 0``,
    ``1 - beta1``, ``x * 0``) or an integer divisor would promote its arithmetic to float64,
    which an H100 runs at half the float32 rate (or far less on other GPUs). The kernels that
    accumulate in float64 on purpose are listed in ptx_check.FLOAT64_BY_DESIGN."""
    found = [line for line in ptx.stdout.splitlines() if line.startswith("FLOAT64 ")]
    assert not found, "\n".join(found)
    assert " 0 float32 specialisations with float64 instructions" in ptx.stdout, ptx.stdout[-2000:]


def test_float16_launches_never_use_the_disk_cache():
    """A disk-cached kernel launched on float16 arrays fails on a GPU at its first launch: the
    float16 arithmetic links CUDA's fp16 library, and Numba raises "Cannot pickle
    CUDACodeLibrary with linking files" when it saves the kernel. Every kernel case runs through
    the real dispatchers here (nothing is compiled, so no libnvvm is needed); the float16 ones
    (scale, add, fill, copy/cast, total) must reach uncached dispatchers."""
    res = _ptx_check("--launches-only")
    found = [line for line in res.stdout.splitlines() if line.startswith("CACHED-FLOAT16 ")]
    assert not found, "\n".join(found)
    assert res.returncode == 0 and " 0 float16 specialisations of disk-cached kernels" \
        in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]
