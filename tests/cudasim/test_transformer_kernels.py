"""The transformer kernels of both GPU flavours against kernels/cpu/: the Numba CUDA kernels
under the simulator (``dev``) and the CuPy kernels' CUDA C run on the host (``emulated``,
tests/support/fake_cupy.py), on the cases of tests/support/transformer_cases.py."""
import numpy as np
import pytest

from mpitrain.kernels import contract
from tests.support import fake_cupy
from tests.support.transformer_cases import CASES, EMULATED_CASES, run_case


@pytest.mark.parametrize("name, build, tol", CASES)
def test_numba_kernel_matches_cpu(cpu, dev, name, build, tol):
    run_case(cpu, dev, name, build, tol)


@pytest.mark.parametrize("name, build, tol", EMULATED_CASES)
def test_cupy_kernel_matches_cpu(cpu, emulated, name, build, tol):
    run_case(cpu, emulated, name, build, tol)


def test_contract(dev, emulated):
    assert contract.violations(dev) == []
    assert contract.violations(emulated) == []


@pytest.mark.parametrize("flavour", ["dev", "emulated"])
def test_embedding_backward_is_deterministic(request, flavour):
    """Every run adds the same rows in the same order: the same bits, twice over."""
    k = request.getfixturevalue(flavour)
    rng = np.random.default_rng(3)
    ids = k.to_device(rng.integers(0, 3, size=40).astype(np.int32))
    grad_out = k.to_device(rng.standard_normal((40, 9)).astype(np.float32) * 1e3)
    runs = []
    for _ in range(2):
        grad_weight = k.zeros((3, 9), np.float32)
        k.embedding_backward(ids, grad_out, grad_weight)
        runs.append(k.to_host(grad_weight))
    np.testing.assert_array_equal(runs[0], runs[1])
    host = np.zeros((3, 9), np.float32)
    for i, t in enumerate(k.to_host(ids)):      # the contract's order: increasing n
        host[t] += k.to_host(grad_out)[i]
    np.testing.assert_array_equal(runs[0], host)


@pytest.mark.parametrize("flavour", ["cpu", "dev", "emulated"])
def test_bad_shapes_name_the_values(request, flavour):
    """Every backend words a bad argument alike (kernels/checks.py); only the CPU takes token
    ids of any integer dtype."""
    k = request.getfixturevalue(flavour)
    f32 = lambda *shape: k.zeros(shape, np.float32)  # noqa: E731
    with pytest.raises(ValueError, match=r"batched_gemm shapes do not agree.*\(2, 3, 5\)"):
        k.batched_gemm(f32(2, 3, 4), f32(2, 4, 5), f32(2, 3, 5), trans_b=True)
    with pytest.raises(ValueError, match=r"causal_softmax: scores must be \(G, T, T\), got "
                                         r"\(2, 3, 4\)"):
        k.causal_softmax(f32(2, 3, 4), f32(2, 3, 4), 1.0)
    with pytest.raises(ValueError, match=r"to_heads: out \(3, 2, 2, 5, 4\) != "
                                         r"\(3, 2, 2, 4, 5\)"):
        k.to_heads(f32(2, 4, 3, 2, 5), f32(3, 2, 2, 5, 4))
    with pytest.raises(ValueError, match=r"layernorm_forward: mean must have 6 elements, got 5"):
        k.layernorm_forward(f32(2, 3, 4), f32(4), f32(4), f32(2, 3, 4), f32(5), f32(6), 1e-5)
    ids = "integers" if flavour == "cpu" else "int32 or int64"
    with pytest.raises(ValueError, match=f"embedding_forward: ids must be {ids}, got dtype "
                                         "float32"):
        k.embedding_forward(f32(6), f32(7, 4), f32(6, 4))
    with pytest.raises(ValueError, match="gelu_backward: grad_in has 5 elements, x 6"):
        k.gelu_backward(f32(6), f32(6), f32(5))


def test_embedding_forward_out_of_range_gives_nan(dev, emulated):
    """No host check on the device (it would synchronise): a bad id reads no memory and gives
    a row of NaN, which the loss then shows."""
    for k in (dev, emulated):
        out = k.zeros((3, 2), np.float32)
        k.embedding_forward(k.to_device(np.array([0, 7, -1], np.int64)),
                            k.to_device(np.ones((7, 2), np.float32)), out)
        got = k.to_host(out)
        assert (got[0] == 1).all() and np.isnan(got[1:]).all()


def test_cupy_kernel_sources_compile_as_cuda(cpu, emulated):
    """The CuPy flavour's transformer RawKernels (shared memory, barriers) as device code."""
    if fake_cupy.nvcc() is None:
        pytest.skip("no nvcc (CUDA toolkit) to compile the kernel sources as device code")
    for param in EMULATED_CASES:
        if param.values[0] in ("layernorm_backward", "causal_softmax_backward",
                               "embedding_backward", "gelu_backward"):
            run_case(cpu, emulated, *param.values)
    ok, messages = fake_cupy.nvcc_check()
    assert ok, messages
