"""The CPU backend meets kernels/contract.py (the CUDA backends: tests/cudasim)."""
import types

from mpitrain.kernels import contract, cpu


def test_cpu_backend_meets_the_contract():
    assert contract.violations(cpu) == []


def test_the_check_catches_a_missing_or_misspelt_kernel():
    fake = types.SimpleNamespace(name="fake", **{k: getattr(cpu, k) for k in contract.KERNELS})
    fake.relu = lambda x, y: None
    del fake.total
    assert contract.violations(fake) == ["total: missing",
                                        "relu('x', 'y'): expected relu('x', 'out')"]
