"""kernels/cuda_cupy/ against the CPU kernels, its CUDA C run on the CPU (see fake_cupy.py).

There is no GPU and no CuPy in CI, so the CuPy flavour's kernel sources are compiled with the
host C++ compiler and executed with CuPy's calling rules; the same kernel cases as the Numba
flavour then check every kernel against kernels/cpu/. This covers the index arithmetic and
semantics of every ElementwiseKernel/RawKernel body and the Python glue; CuPy itself, cuBLAS and
the GPU are covered by tests/gpu only.
"""
import importlib.util

import numpy as np
import pytest

from tests.support import fake_cupy
from tests.support import training_cases as training
from tests.support.kernel_cases import CASES, KERNEL_NAMES, run_case
from mpitrain.kernels import contract


@pytest.mark.parametrize("name, build, tol", CASES)
def test_kernel_matches_cpu(cpu, emulated, name, build, tol):
    run_case(cpu, emulated, name, build, tol)


def test_every_contract_name(emulated):
    missing = [n for n in KERNEL_NAMES + ["empty", "zeros", "to_device", "to_host",
                                          "synchronize"] if not hasattr(emulated, n)]
    assert not missing and emulated.name == "cuda-cupy"
    assert contract.violations(emulated) == []               # names and parameters


def test_bad_input_names_the_value(emulated):
    with pytest.raises(ValueError, match="'mean'"):
        emulated.reduce_into(np.zeros(3), np.zeros(3), "mean")
    with pytest.raises(ValueError, match="1.0"):
        emulated.dropout_forward(*[np.zeros(3, np.float32)] * 3, 1.0, 0)


def test_missing_cupy_is_one_clear_import_error():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[cuda\]'") as info:
        importlib.import_module("mpitrain.kernels.cuda_cupy")
    assert "\n" not in str(info.value)



@pytest.mark.parametrize("case", sorted(training.CASES))
def test_two_training_steps_match_cpu(cpu, emulated, case):
    """The unchanged layers and optimizers on the (emulated) CuPy kernels."""
    training.check_two_steps(cpu, emulated, *training.CASES[case])


def test_kernel_sources_compile_as_cuda(cpu, emulated):
    """Every ElementwiseKernel/RawKernel body, compiled by nvcc as device code (sm_80)."""
    if fake_cupy.nvcc() is None:
        pytest.skip("no nvcc (CUDA toolkit) to compile the kernel sources as device code")
    for param in CASES:                      # run every case so that every body is recorded
        run_case(cpu, emulated, *param.values)
    ok, messages = fake_cupy.nvcc_check()
    assert ok, messages[-4000:]
    assert len(fake_cupy.DEVICE_SOURCES) >= 15
